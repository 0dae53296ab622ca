"""The dispatcher against a model of its lanes while partitions are read again from lower offsets.

A consumer reads each partition with a cursor. Some records are lost on their way to the dispatcher (a stream queue
cleared when Faust resumes the flow, a hand-over cut short), and the consumer then seeks back and reads again: the
records the dispatcher took already come again (second deliveries), the lost ones come for the first time, below
offsets already taken. The model keeps, for every lane, the offsets it took and has not started, per partition in
offset order, and at most one running work per lane; every step of the dispatcher is checked against it: a work
starts only if no lower offset of its partition waits on its lane, and an offset is acknowledged only once every
lower offset of its partition taken so far is acknowledged.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rebound.dispatch import Dispatch, State, Step, Work

PARTITIONS = ("main", "release")
"""Two partitions whose records share lanes (a key's main records and its release requests do)."""
KEYS = st.integers(0, 2)


class ReReadsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dispatch: Dispatch[str] = Dispatch(limit=1, partition_buffer=1)
        self.log: dict[str, list[int]] = {partition: [] for partition in PARTITIONS}
        """The key of every offset of each partition, drawn when the offset is first read."""
        self.cursor: dict[str, int] = dict.fromkeys(PARTITIONS, 0)
        self.queued: dict[tuple[int, str], list[int]] = defaultdict(list)
        """Model: offsets taken and not started, per lane and partition, in offset order."""
        self.running: dict[int, Work[str]] = {}
        """Model: the running work of each lane."""
        self.taken: dict[str, set[int]] = defaultdict(set)
        self.acked: dict[str, list[int]] = defaultdict(list)

    @initialize(limit=st.integers(1, 4))
    def start(self, limit: int) -> None:
        self.dispatch = Dispatch(limit=limit, partition_buffer=10_000)  # back-pressure is not what this checks

    # -- the consumer ------------------------------------------------------------------------------------------------

    def _next_record(self, partition: str, key: int) -> tuple[int, int]:
        offset = self.cursor[partition]
        log = self.log[partition]
        if offset == len(log):
            log.append(key)  # a new record at the end of the partition
        self.cursor[partition] = offset + 1
        return offset, log[offset]

    @rule(partition=st.sampled_from(PARTITIONS), key=KEYS)
    def read(self, partition: str, key: int) -> None:
        """The next record reaches the dispatcher."""
        offset, lane = self._next_record(partition, key)
        again = offset in self.taken[partition]
        step = self.dispatch.offer(partition, offset, lane, f"{partition}@{offset}")
        if again:
            assert [(w.partition, w.offset) for w in step.abandon] == [(partition, offset)], "a second delivery"
        else:
            assert step.abandon == [], f"{partition}@{offset} read for the first time was not taken"
            self.taken[partition].add(offset)
            bisect.insort(self.queued[(lane, partition)], offset)
        self._apply(step)

    @rule(partition=st.sampled_from(PARTITIONS), key=KEYS)
    def lose(self, partition: str, key: int) -> None:
        """The next record is read but lost on its way to the dispatcher."""
        self._next_record(partition, key)

    @rule(partition=st.sampled_from(PARTITIONS), back=st.integers(1, 6))
    def seek_back(self, partition: str, back: int) -> None:
        """The consumer reads the partition again from an earlier offset."""
        self.cursor[partition] = max(0, self.cursor[partition] - back)

    # -- the handler -------------------------------------------------------------------------------------------------

    @precondition(lambda self: bool(self.running))
    @rule(pick=st.integers(0, 20))
    def finish(self, pick: int) -> None:
        lanes = sorted(self.running)
        work = self.running.pop(lanes[pick % len(lanes)])
        self._apply(self.dispatch.finish(work))

    # -- the checks --------------------------------------------------------------------------------------------------

    def _apply(self, step: Step[str]) -> None:
        for work in step.ack:
            assert work.state is State.DONE
            partition = str(work.partition)
            below = sorted(offset for offset in self.taken[partition] if offset < work.offset)
            missing = set(below) - set(self.acked[partition])
            assert not missing, f"{work!r} acknowledged before {sorted(missing)}"
            assert work.offset not in self.acked[partition], f"{work!r} acknowledged twice"
            self.acked[partition].append(work.offset)
        for work in step.start:
            lane = work.lane
            assert isinstance(lane, int)
            assert lane not in self.running, f"{work!r} started while {self.running[lane]!r} runs on its lane"
            waiting = self.queued[(lane, str(work.partition))]
            assert waiting and waiting[0] == work.offset, (
                f"{work!r} started while {waiting} of its partition wait on its lane: not in offset order"
            )
            waiting.pop(0)
            self.running[lane] = work
        assert not step.pause and not step.resume

    @invariant()
    def bounded(self) -> None:
        assert self.dispatch.running == len(self.running) <= self.dispatch.limit

    @invariant()
    def queued_is_counted(self) -> None:
        assert self.dispatch.queued == sum(1 for work in self.dispatch.works() if work.state is State.QUEUED)

    @invariant()
    def a_lane_waits_only_for_a_free_slot(self) -> None:
        """A lane with taken work and nothing running is waiting for a slot, never stuck."""
        if len(self.running) < self.dispatch.limit:
            idle = [key for key, waiting in self.queued.items() if waiting and key[0] not in self.running]
            assert not idle, f"lanes {idle} wait with free slots"

    def teardown(self) -> None:
        """Everything taken runs to its end and is acknowledged, exactly once, and the dispatcher is left empty."""
        while self.running:
            self.finish(0)
        for partition in PARTITIONS:
            assert sorted(self.acked[partition]) == sorted(self.taken[partition])
        assert list(self.dispatch.works()) == []


ReReadsMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_lanes_keep_offset_order_when_lower_offsets_are_read_again = ReReadsMachine.TestCase
