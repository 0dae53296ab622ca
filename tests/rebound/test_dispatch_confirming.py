"""A work that lets go of its slot and its key's lane while its writes become durable (:meth:`Dispatch.let_go`):
what starts meanwhile, and that its offset is acknowledged only once it is finished, in offset order, through a
revocation too."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rebound.dispatch import State, Step, Work
from tests.rebound.test_dispatch import Harness, offsets


class ConfirmingHarness(Harness):
    def __init__(self, limit: int = 4, partition_buffer: int = 100) -> None:
        super().__init__(limit, partition_buffer)
        self.confirming: list[Work[str]] = []

    def let_go(self, offset: int, partition: Hashable = 0) -> Step[str]:
        work = next(w for w in self.running if w.offset == offset and w.partition == partition)
        self.running.remove(work)
        self.confirming.append(work)
        return self.apply(self.dispatch.let_go(work))

    def confirmed(self, offset: int, partition: Hashable = 0, *, completed: bool = True) -> Step[str]:
        work = next(w for w in self.confirming if w.offset == offset and w.partition == partition)
        self.confirming.remove(work)
        return self.apply(self.dispatch.finish(work, completed=completed))


def test_a_work_that_lets_go_frees_its_slot_and_its_lane_and_is_acknowledged_only_once_finished() -> None:
    h = ConfirmingHarness(limit=1)
    h.offer(0, 0, lane="k")
    h.offer(0, 1, lane="k")
    step = h.let_go(0)
    assert offsets(step.start) == [1], "the key's next record waits only for the state in memory"
    assert step.ack == [] and h.dispatch.running == 1
    assert h.confirming[0].state is State.CONFIRMING
    assert offsets(h.offer(0, 2, lane="j").start) == [], "the slot is taken again"
    h.finish(1)
    assert offsets(h.running) == [2]
    assert h.acked == [], "1 is done but 0's writes are not durable yet"
    h.confirmed(0)
    assert offsets(h.acked) == [0, 1]
    h.finish(2)
    assert offsets(h.acked) == [0, 1, 2]


def test_only_running_work_lets_go() -> None:
    h = ConfirmingHarness()
    h.offer(0, 0, lane="a")
    h.let_go(0)
    with pytest.raises(ValueError, match="not running"):
        h.dispatch.let_go(h.confirming[0])


def test_a_revocation_leaves_confirming_work_to_finish_and_acknowledges_it_then() -> None:
    h = ConfirmingHarness(limit=1)
    h.offer(0, 0, lane="k")
    h.offer(0, 1, lane="k")
    h.let_go(0)
    h.offer(0, 2, lane="j")
    h.revoke()  # 1 runs (it started when 0 let go), 2 was queued: dropped
    assert offsets(h.abandoned) == [2]
    h.confirmed(0)
    assert offsets(h.acked) == [0]
    h.finish(1)
    assert offsets(h.acked) == [0, 1]
    assert not list(h.dispatch.works())


def test_confirming_work_cut_short_is_never_acknowledged_nor_anything_after_it() -> None:
    h = ConfirmingHarness(limit=2)
    h.offer(0, 0, lane="k")
    h.offer(0, 1, lane="j")
    h.let_go(0)
    h.finish(1)
    h.revoke()
    h.confirmed(0, completed=False)  # a shutdown cut its wait short: its writes may not be durable
    assert h.acked == []
    assert sorted(offsets(h.abandoned)) == [0, 1]


def test_confirming_work_behind_a_dropped_offset_is_abandoned_when_it_finishes() -> None:
    h = ConfirmingHarness(limit=2)
    h.offer(0, 0, lane="k")
    h.offer(0, 1, lane="j")
    h.let_go(1)
    h.finish(0, completed=False)
    assert offsets(h.abandoned) == [0]
    h.confirmed(1)
    assert h.acked == [] and sorted(offsets(h.abandoned)) == [0, 1]


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(1, 3),
    script=st.lists(
        st.tuples(st.sampled_from(["offer", "finish", "let_go", "confirmed", "revoke"]), st.integers(0, 5)), max_size=60
    ),
)
def test_keys_run_one_at_a_time_and_acks_stay_contiguous_whatever_lets_go_when(
    limit: int, script: list[tuple[str, int]]
) -> None:
    h = ConfirmingHarness(limit=limit)
    offered = 0
    finished: set[int] = set()  # ids of works finished as completed
    for action, pick in script:
        if action == "offer":
            h.offer(0, offered, lane=f"k{pick % 3}")
            offered += 1
        elif action == "revoke":
            h.revoke()
        else:
            pool = h.running if action in ("finish", "let_go") else h.confirming
            if not pool:
                continue
            work = pool[pick % len(pool)]
            if action == "let_go":
                h.let_go(work.offset)
            else:
                finished.add(id(work))
                (h.finish if action == "finish" else h.confirmed)(work.offset)
        running_lanes = [work.lane for work in h.running]
        assert len(running_lanes) == len(set(running_lanes)) <= limit
        assert h.dispatch.running == len(h.running)
    assert all(id(work) in finished for work in h.acked), "acknowledged before it finished"
    by_generation: dict[int, list[int]] = {}
    for work in h.acked:
        by_generation.setdefault(work.generation, []).append(work.offset)
    assert all(acked == sorted(acked) for acked in by_generation.values())


def test_at_most_limit_works_wait_for_durability_without_a_slot() -> None:
    """Works that let go are bounded too: no more than ``limit`` at once (unconfirmed work at most twice the limit).
    Unbounded, a slow changelog let the whole partition buffer run ahead of its confirms, and every commit, revocation
    flush and ``wait_empty`` waited behind all of them (a chaos run's revocations took up to 19 s)."""
    h = ConfirmingHarness(limit=1)
    for offset in range(4):
        h.offer(0, offset, lane=f"k{offset}")
    assert h.dispatch.may_let_go()
    h.let_go(0)
    assert offsets(h.running) == [1]
    assert not h.dispatch.may_let_go(), "one work already waits without a slot: the next keeps its slot"
    h.confirmed(0)
    assert h.dispatch.may_let_go()
    h.let_go(1)
    assert offsets(h.running) == [2] and h.dispatch.confirming == 1
    h.confirmed(1, completed=False)
    assert h.dispatch.confirming == 0
