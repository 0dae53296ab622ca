"""The dispatcher's rules, step by step: per-key order, the bound on running work, acknowledgements only in offset
order, back-pressure, and what a revocation or a work cut short leaves acknowledgeable."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rebound.dispatch import Dispatch, State, Step, Work


def offsets(works: list[Work[str]]) -> list[int]:
    return [work.offset for work in works]


class Harness:
    """Feeds a :class:`Dispatch` and keeps what a caller would: running works, acknowledged and abandoned offsets."""

    def __init__(self, limit: int = 4, partition_buffer: int = 100) -> None:
        self.now = 0.0
        """The dispatch's clock: a drain holds back from its ``hold_back_at`` on."""
        self.hold_back_at: float | None = None
        self.dispatch: Dispatch[str] = Dispatch(limit=limit, partition_buffer=partition_buffer, clock=lambda: self.now)
        self.running: list[Work[str]] = []
        self.acked: list[Work[str]] = []
        self.abandoned: list[Work[str]] = []
        self.paused: set[Hashable] = set()
        self.started: list[Work[str]] = []
        self.offered: list[Work[str]] = []

    def apply(self, step: Step[str]) -> Step[str]:
        queued = [work for work in self.dispatch.works() if work.state is State.QUEUED]
        assert self.dispatch.queued == len(queued)  # the kept count, after every step
        self.abandoned += step.abandon
        self.acked += step.ack
        self.paused |= set(step.pause)
        self.paused -= set(step.resume)
        holding_back = self.hold_back_at is None or self.now >= self.hold_back_at
        for work in step.start:
            if holding_back and work.generation < self.dispatch.generation:  # a drain holding back: none queued below
                works = [
                    w for w in self.dispatch.works() if (w.generation, w.partition) == (work.generation, work.partition)
                ]
                below = works[: works.index(work)]
                assert all(w.state is not State.QUEUED for w in below), ("started above a queued record", work, below)
        self.running += step.start
        self.started += step.start
        return step

    def offer(self, partition: Hashable, offset: int, lane: Hashable) -> Step[str]:
        generation = self.dispatch.generation
        step = self.apply(self.dispatch.offer(partition, offset, lane, f"{partition}@{offset}"))
        self.offered.append(
            next(
                w
                for w in [*step.start, *step.abandon, *self.dispatch.works()]
                if (w.partition, w.offset, w.generation) == (partition, offset, generation)
            )
        )
        return step

    def finish(self, offset: int, partition: Hashable = 0, *, completed: bool = True) -> Step[str]:
        work = next(w for w in self.running if w.offset == offset and w.partition == partition)
        self.running.remove(work)
        return self.apply(self.dispatch.finish(work, completed=completed))

    def revoke(self, *, drain: bool = False, hold_back_at: float | None = None) -> Step[str]:
        self.hold_back_at = hold_back_at
        return self.apply(self.dispatch.revoke(drain=drain, hold_back_at=hold_back_at))

    def set_limit(self, limit: int) -> Step[str]:
        return self.apply(self.dispatch.set_limit(limit))

    def drop_drained(self) -> Step[str]:
        return self.apply(self.dispatch.drop_drained())


def test_one_key_runs_one_message_at_a_time_in_offset_order() -> None:
    h = Harness(limit=8)
    for offset in range(3):
        h.offer(0, offset, lane="k")
    assert offsets(h.running) == [0]
    h.finish(0)
    assert offsets(h.running) == [1]
    h.finish(1)
    h.finish(2)
    assert offsets(h.started) == [0, 1, 2]
    assert offsets(h.acked) == [0, 1, 2]


def test_different_keys_run_at_once_up_to_the_limit() -> None:
    h = Harness(limit=3)
    for offset in range(5):
        h.offer(offset % 2, offset, lane=f"k{offset}")
    assert offsets(h.running) == [0, 1, 2]
    assert h.dispatch.queued == 2
    h.finish(1, partition=1)
    assert offsets(h.running) == [0, 2, 3]


def test_an_offset_is_acknowledged_only_when_every_earlier_offset_of_its_partition_is_done() -> None:
    h = Harness(limit=8)
    for offset in range(4):
        h.offer(0, offset, lane=f"k{offset}")
    h.finish(2)
    h.finish(1)
    assert h.acked == []  # offset 0 is still running
    h.finish(0)
    assert offsets(h.acked) == [0, 1, 2]
    h.finish(3)
    assert offsets(h.acked) == [0, 1, 2, 3]


def test_partitions_are_acknowledged_independently() -> None:
    h = Harness(limit=8)
    h.offer("a", 10, lane="x")
    h.offer("b", 20, lane="y")
    h.finish(20, partition="b")
    assert [(w.partition, w.offset) for w in h.acked] == [("b", 20)]


def test_a_partition_is_paused_when_its_buffer_is_full_and_resumed_when_half_has_drained() -> None:
    h = Harness(limit=1, partition_buffer=4)
    for offset in range(3):
        assert h.offer(0, offset, lane="slow").pause == []
    assert h.offer(0, 3, lane="slow").pause == [0]
    assert h.paused == {0}
    h.finish(0)
    assert h.paused == {0}  # 3 still taken
    h.finish(1)
    assert h.paused == set()  # 2 = half the buffer


def test_a_hot_key_does_not_starve_the_others() -> None:
    h = Harness(limit=1)
    for offset in range(3):
        h.offer(0, offset, lane="hot")
    h.offer(1, 0, lane="cold")
    h.finish(0)
    assert [(w.partition, w.offset) for w in h.running] == [(1, 0)]  # cold was ready before hot's second message


def test_revocation_drops_queued_work_and_lets_running_work_finish() -> None:
    h = Harness(limit=2)
    h.offer(0, 0, lane="a")
    h.offer(0, 1, lane="b")
    h.offer(0, 2, lane="a")  # queued behind 0
    h.offer(0, 3, lane="c")  # queued: no slot
    step = h.revoke()
    assert offsets(step.abandon) == [2, 3]
    assert h.dispatch.queued == 0
    h.finish(1)
    h.finish(0)
    assert offsets(h.acked) == [0, 1]
    assert list(h.dispatch.works()) == []


def test_a_draining_revocation_keeps_queued_work_running_and_acknowledged_in_order() -> None:
    """Done before Faust's commit at the revocation, it is not done again by the partition's next owner."""
    h = Harness(limit=2)
    h.offer(0, 0, lane="a")
    h.offer(0, 1, lane="b")
    h.offer(0, 2, lane="a")  # queued behind 0
    h.offer(0, 3, lane="c")  # queued: no slot
    step = h.revoke(drain=True)
    assert step.abandon == [] and h.dispatch.queued == 2 and h.dispatch.draining
    h.finish(1)  # a slot is free, but 3 waits: 2, below it, is still queued (behind 0)
    assert offsets(h.running) == [0]
    h.finish(0)  # 2 starts on its lane, then 3
    assert offsets(h.running) == [2, 3]
    h.finish(3)
    h.finish(2)
    assert offsets(h.acked) == [0, 1, 2, 3]
    assert not h.dispatch.draining and list(h.dispatch.works()) == []


def test_a_long_drain_starts_work_across_keys_as_slots_free_until_it_holds_back() -> None:
    """A 10 s drain whose works may take 7 s (A@0 and B@2 take 6 s): A@0 runs, A@1 waits behind it, B@2 and B@3 wait
    for a slot. Holding B@2 back until A@1 starts (at 6 s) would end it at 12 s, past the drop at 10 s, and drop B@3:
    the waits of two keys would add up. Before 3 s (10 less 7) it starts as a slot frees, above A@1, which starts in
    time anyway: everything is committed with the revocation, by 6 s."""
    h = Harness(limit=1)
    h.offer(0, 0, lane="A")
    h.offer(0, 1, lane="A")
    h.offer(0, 2, lane="B")
    h.offer(0, 3, lane="B")
    h.revoke(drain=True, hold_back_at=10.0 - 7.0)
    h.set_limit(4)  # a slot frees at 0 s
    assert offsets(h.running) == [0, 2]
    h.now = 6.0
    h.finish(0)  # A@1 starts
    h.finish(2)  # B@3 starts: nothing below it queued any more
    assert offsets(h.running) == [1, 3]
    h.now = 6.1
    h.finish(1)
    h.finish(3)
    assert offsets(h.acked) == [0, 1, 2, 3] and not h.dispatch.draining


def test_near_its_drop_a_drain_starts_nothing_above_a_lower_queued_work_of_its_partition() -> None:
    """From ``hold_back_at`` on, a work started above a queued one would likely run for nothing (the queued one
    dropped, and its partition read again from it): L@3 waits until K@1, queued behind K@0, has started."""
    h = Harness(limit=1)
    for offset, lane in ((0, "K"), (1, "K"), (2, "J"), (3, "L")):
        h.offer(0, offset, lane=lane)
    h.revoke(drain=True, hold_back_at=5.0)
    h.set_limit(2)  # at 0 s: J@2 starts in the free slot, above K@1
    assert offsets(h.running) == [0, 2]
    h.now = 5.0
    h.finish(2)  # a slot frees, but L@3 is held back: K@1, below it, is still queued
    assert offsets(h.running) == [0]
    h.finish(0)  # K@1 starts, then L@3
    assert offsets(h.running) == [1, 3]
    h.finish(1)
    h.finish(3)
    assert offsets(h.acked) == [0, 1, 2, 3]


def test_a_second_drain_holding_back_later_starts_at_once_what_the_first_one_held_back() -> None:
    """A drain holding back from its start holds J@3 above K@2 (queued behind K@0) as a slot frees; a second drain
    that holds back only from 10 s on starts J@3 at once, in its own step, not at the next work's end."""
    h = Harness(limit=2)
    for offset, lane in ((0, "K"), (1, "other"), (2, "K"), (3, "J")):
        h.offer(0, offset, lane=lane)
    h.revoke(drain=True)
    h.finish(1)
    assert offsets(h.running) == [0]
    step = h.revoke(drain=True, hold_back_at=10.0)
    assert offsets(step.start) == [3] and offsets(h.running) == [0, 3]
    h.finish(3)
    h.finish(0)
    h.finish(2)
    assert offsets(h.acked) == [0, 1, 2, 3] and not h.dispatch.draining


def test_a_hold_back_time_needs_a_clock() -> None:
    with pytest.raises(ValueError, match="clock"):
        Dispatch[str](limit=1, partition_buffer=1).revoke(drain=True, hold_back_at=1.0)


def test_a_held_back_head_that_comes_to_wait_for_itself_as_its_partition_s_first_queued_work_starts_goes_on() -> None:
    """Lanes shared across partitions (a key's main records and its release requests), records read again late:
    X=Q@20 waits for Y=Q@10 behind Z=P@3, which waits for S=P@1; both are held back. S starts, and P's first queued
    work is now F=P@2, behind X on X's lane: X waits for itself. It must start (as every drained work did before the
    hold-back) rather than leave the drain with nothing running and nothing ready until its time is up."""
    d: Dispatch[str] = Dispatch(limit=1, partition_buffer=100)
    running: list[Work[str]] = []
    acked: list[tuple[Hashable, int]] = []

    def apply(step: Step[str]) -> None:
        running.extend(step.start)
        acked.extend((w.partition, w.offset) for w in step.ack)
        assert step.abandon == []

    def finish(partition: Hashable, offset: int) -> None:
        work = next(w for w in running if (w.partition, w.offset) == (partition, offset))
        running.remove(work)
        apply(d.finish(work))

    apply(d.offer("other", 0, "Z0", "other@0"))  # takes the one slot
    for partition, offset, lane in (("Q", 20, "L1"), ("P", 2, "L1"), ("P", 3, "L2"), ("Q", 10, "L2"), ("P", 1, "L3")):
        apply(d.offer(partition, offset, lane, f"{partition}@{offset}"))  # Q@10 and P@1: read again late
    apply(d.revoke(drain=True))
    finish("other", 0)  # X and Z are held back, S starts
    assert [(w.partition, w.offset) for w in running] == [("P", 1)]
    finish("P", 1)
    assert [(w.partition, w.offset) for w in running] == [("Q", 20)], "the drain stalled: nothing runs"
    for partition, offset in (("Q", 20), ("P", 2), ("P", 3), ("Q", 10)):
        finish(partition, offset)
    assert sorted(acked, key=str) == [("P", 1), ("P", 2), ("P", 3), ("Q", 10), ("Q", 20), ("other", 0)]
    assert not d.draining and d.queued == 0


def test_when_the_drain_time_is_up_what_is_still_queued_is_dropped_and_nothing_after_it_acknowledged() -> None:
    h = Harness(limit=1)
    h.offer(0, 0, lane="a")
    h.offer(0, 1, lane="b")  # queued
    h.offer(0, 2, lane="c")  # queued
    h.revoke(drain=True)
    h.finish(0)  # 1 starts
    step = h.drop_drained()
    assert offsets(step.abandon) == [2] and h.dispatch.queued == 0 and not h.dispatch.draining
    h.finish(1)
    assert offsets(h.acked) == [0, 1]
    assert list(h.dispatch.works()) == []


def test_dropping_the_drained_work_leaves_the_new_generation_s_work_alone() -> None:
    h = Harness(limit=1)
    h.offer(0, 0, lane="a")
    h.offer(0, 1, lane="a")  # queued behind 0
    h.revoke(drain=True)
    h.offer(1, 0, lane="b")  # the new generation's, queued: no slot
    step = h.drop_drained()
    assert offsets(step.abandon) == [1]
    h.finish(0)
    assert [(w.partition, w.offset) for w in h.running] == [(1, 0)]
    h.finish(0, partition=1)
    assert [(w.partition, w.offset, w.generation) for w in h.acked] == [(0, 0, 0), (1, 0, 1)]


def test_running_work_after_a_dropped_offset_is_never_acknowledged() -> None:
    h = Harness(limit=2)
    h.offer(0, 0, lane="a")
    h.offer(0, 1, lane="a")  # queued behind 0
    h.offer(0, 2, lane="b")  # running
    h.revoke()
    h.finish(2)
    h.finish(0)
    assert offsets(h.acked) == [0]
    assert sorted(offsets(h.abandoned)) == [1, 2]


def test_done_work_waiting_behind_a_dropped_offset_is_abandoned_at_revocation() -> None:
    h = Harness(limit=1)
    h.offer(0, 0, lane="a")
    h.offer(0, 1, lane="b")  # queued: no slot
    h.finish(0)  # 1 starts
    h.offer(0, 2, lane="c")  # queued
    h.finish(1)
    h.offer(0, 3, lane="d")
    assert offsets(h.acked) == [0, 1]
    step = h.revoke()
    assert offsets(step.abandon) == [3]  # 2 is running
    h.finish(2)
    assert offsets(h.acked) == [0, 1, 2]


def test_a_new_generation_reads_the_same_offsets_again_behind_the_running_work_of_their_key() -> None:
    h = Harness(limit=4)
    h.offer(0, 0, lane="k")
    h.offer(0, 1, lane="k")
    h.revoke()
    h.offer(0, 1, lane="k")  # read again after the seek to the committed offset
    assert offsets(h.running) == [0]  # behind the old generation's offset 0 on the same key
    h.finish(0)
    assert offsets(h.running) == [1]
    h.finish(1)
    assert offsets(h.acked) == [0, 1]
    assert h.acked[1].generation == 1


def test_a_second_delivery_of_an_offset_is_abandoned() -> None:
    h = Harness()
    h.offer(0, 5, lane="k")
    step = h.offer(0, 5, lane="k")
    assert offsets(step.abandon) == [5]
    assert step.abandon[0].state is State.DROPPED
    assert offsets(h.running) == [5]


def test_records_dropped_before_they_reached_the_dispatcher_are_taken_when_read_again() -> None:
    """Faust's stream queue can drop records after the consumer handed them over (a flow resumed at recovery); the
    consumer then seeks back and reads them again, together with records the dispatcher already took."""
    h = Harness(limit=8)
    for offset in [100, 101, 102, 103, 106, 107]:  # 104 and 105 were dropped on the way
        h.offer(0, offset, lane=f"k{offset}")
    for offset in [100, 101, 102, 103]:
        h.finish(offset)
    assert offsets(h.acked) == [100, 101, 102, 103]
    for offset in range(100, 108):  # read again from 100 after the seek back
        h.offer(0, offset, lane=f"k{offset}")
    # acknowledged (100-103) or still tracked (106, 107): second deliveries; 104 and 105 are new
    assert sorted(w.offset for w in h.abandoned) == [100, 101, 102, 103, 106, 107]
    assert sorted(offsets(h.running)) == [104, 105, 106, 107]
    h.finish(106)
    h.finish(107)
    assert offsets(h.acked) == [100, 101, 102, 103]  # 106 and 107 wait for 104 and 105
    for offset in [104, 105]:
        h.finish(offset)
    assert offsets(h.acked) == [100, 101, 102, 103, 104, 105, 106, 107]


def test_acknowledged_offsets_are_remembered_only_as_far_back_as_the_kept_runs() -> None:
    from rebound.dispatch import ACKED_RUNS_KEPT, AckedRuns

    runs = AckedRuns()
    for offset in range(0, 4 * (ACKED_RUNS_KEPT + 10), 2):  # every other offset: one run each
        runs.add(offset)
    assert 0 not in runs  # forgotten: read again from there, it runs again (at-least-once)
    assert 4 * (ACKED_RUNS_KEPT + 10) - 2 in runs
    assert 4 * (ACKED_RUNS_KEPT + 10) - 1 not in runs
    runs.add(1)  # below every kept run: kept only while the bound allows, so forgotten at once
    assert 1 not in runs
    runs.add(4 * (ACKED_RUNS_KEPT + 10) - 5)  # inside the kept range, below the latest run: remembered
    assert 4 * (ACKED_RUNS_KEPT + 10) - 5 in runs
    contiguous = AckedRuns()
    for offset in range(10_000):
        contiguous.add(offset)
    assert 0 in contiguous and 9_999 in contiguous and 10_000 not in contiguous


def test_an_offset_discarded_from_its_run_splits_it() -> None:
    from rebound.dispatch import AckedRuns

    runs = AckedRuns()
    for offset in range(10, 20):
        runs.add(offset)
    runs.discard(15)
    assert [offset for offset in range(8, 22) if offset in runs] == [10, 11, 12, 13, 14, 16, 17, 18, 19]
    runs.discard(10)
    runs.discard(19)
    runs.discard(42)  # not there: nothing happens
    assert [offset for offset in range(8, 22) if offset in runs] == [11, 12, 13, 14, 16, 17, 18]
    runs.add(20)  # appends to the latest run as before
    assert 20 in runs and 19 not in runs
    runs.add(15)  # added back between two runs: they become one again
    assert runs._firsts == [11, 20] and runs._lasts == [18, 20]


def test_an_acknowledgement_the_consumer_did_not_take_lets_the_offset_run_again_when_read_again() -> None:
    """Deduplicated as acknowledged, the offset would hold its partition's commits for the whole generation, read
    again every commit interval and dropped every time (a chaos run: one partition, 100 seconds)."""
    h = Harness()
    h.offer(0, 0, lane="a")
    h.finish(0)
    h.dispatch.not_taken(h.acked[0])
    again = h.offer(0, 0, lane="a")
    assert offsets(again.start) == [0] and again.abandon == []


def test_work_cut_short_stops_acknowledgements_of_its_partition_until_the_next_generation() -> None:
    h = Harness(limit=4)
    h.offer(0, 0, lane="a")
    h.offer(0, 1, lane="b")
    h.finish(0, completed=False)
    assert h.acked == []
    later = h.offer(0, 2, lane="c")
    assert offsets(later.abandon) == [2]
    h.finish(1)
    assert h.acked == []
    assert sorted(offsets(h.abandoned)) == [0, 1, 2]
    h.revoke()
    h.offer(0, 0, lane="a")
    h.finish(0)
    assert offsets(h.acked) == [0]


def test_finishing_work_that_is_not_running_is_refused() -> None:
    h = Harness()
    h.offer(0, 0, lane="a")
    work = h.running[0]
    h.finish(0)
    with pytest.raises(ValueError, match="not running"):
        h.dispatch.finish(work)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="limit"):
        Dispatch(limit=0, partition_buffer=1)
    with pytest.raises(ValueError, match="partition_buffer"):
        Dispatch(limit=1, partition_buffer=0)


actions = st.lists(
    st.one_of(
        st.tuples(st.just("offer"), st.integers(0, 2), st.integers(0, 5)),
        st.tuples(st.just("finish"), st.integers(0, 50), st.booleans()),
        st.tuples(st.just("revoke"), st.just(0), st.booleans()),
        st.tuples(st.just("drop_drained"), st.just(0), st.just(0)),
    ),
    max_size=120,
)


@settings(max_examples=400, deadline=None)
@given(limit=st.integers(1, 5), buffer=st.integers(1, 8), script=actions)
def test_the_rules_hold_whatever_the_interleaving(limit: int, buffer: int, script: list[tuple[str, int, int]]) -> None:
    """Any interleaving of records, completions (in any order, some cut short) and revocations."""
    h = Harness(limit=limit, partition_buffer=buffer)
    next_offset: dict[int, int] = defaultdict(int)
    for action, a, b in script:
        if action == "offer":
            partition, lane = a, (a, b)  # a key lives in one partition
            h.offer(partition, next_offset[partition], lane)
            next_offset[partition] += 1
        elif action == "finish" and h.running:
            h.finish(h.running[a % len(h.running)].offset, h.running[a % len(h.running)].partition, completed=b)
        elif action == "drop_drained":
            h.drop_drained()
        elif action == "revoke":
            h.revoke(drain=bool(b))
            next_offset.clear()  # read again from the committed offset
            for partition in {w.partition for w in h.acked}:
                next_offset[partition] = max(w.offset for w in h.acked if w.partition == partition) + 1
        # never more running than the limit, never two of one lane
        assert len(h.running) == h.dispatch.running <= limit
        lanes = [w.lane for w in h.running]
        assert len(lanes) == len(set(lanes))
    while h.running:
        h.finish(h.running[0].offset, h.running[0].partition)
    # every acknowledged work was done, acknowledged once, and in offset order within its generation and partition
    assert all(w.state is State.DONE for w in h.acked)
    assert len(set(map(id, h.acked))) == len(h.acked)
    assert not {id(w) for w in h.acked} & {id(w) for w in h.abandoned}
    by_partition: dict[tuple[int, Hashable], list[int]] = defaultdict(list)
    for w in h.acked:
        by_partition[(w.generation, w.partition)].append(w.offset)
    for acked_offsets in by_partition.values():
        assert acked_offsets == sorted(acked_offsets)
    # within a lane and a generation, work started in offset order
    started: dict[tuple[int, Hashable], list[int]] = defaultdict(list)
    for w in h.started:
        started[(w.generation, w.lane)].append(w.offset)
    for lane_offsets in started.values():
        assert lane_offsets == sorted(lane_offsets)
    # an acknowledged offset never follows an unacknowledged one of its partition and generation
    offered: dict[tuple[int, Hashable], list[int]] = defaultdict(list)
    for w in h.offered:
        offered[(w.generation, w.partition)].append(w.offset)
    for key, acked_offsets in by_partition.items():
        assert acked_offsets == sorted(offered[key])[: len(acked_offsets)]
    # every offered work ended acknowledged or abandoned, exactly once
    assert sorted(map(id, h.offered)) == sorted(map(id, [*h.acked, *h.abandoned]))
    assert list(h.dispatch.works()) == []


# -- a lower offset read again (a seek back after records were dropped on the way) takes its place in its key's lane


def test_a_re_read_lower_offset_runs_before_the_later_queued_records_of_its_key() -> None:
    """K@100 running, K@107 queued: K@105, read again after it was dropped on the way, runs before 107."""
    h = Harness(limit=8)
    h.offer(0, 100, lane="k")
    h.offer(0, 107, lane="k")
    h.offer(0, 105, lane="k")  # read again
    assert offsets(h.running) == [100]
    h.finish(100)
    assert offsets(h.running) == [105]
    h.finish(105)
    h.finish(107)
    assert offsets(h.started) == [100, 105, 107]
    assert offsets(h.acked) == [100, 105, 107]


def test_a_re_read_lower_offset_starts_first_when_its_key_waits_for_a_slot() -> None:
    """A lane whose head has not started yet: the re-read record becomes its head, and the lane stays ready."""
    h = Harness(limit=1)
    h.offer(0, 1, lane="other")  # takes the only slot
    h.offer(0, 107, lane="k")
    h.offer(0, 110, lane="k")
    h.offer(0, 105, lane="k")
    h.finish(1)
    assert offsets(h.running) == [105]
    h.finish(105)
    h.finish(107)
    h.finish(110)
    assert offsets(h.started) == [1, 105, 107, 110]
    assert offsets(h.acked) == [1, 105, 107, 110]


def test_a_re_read_offset_below_a_running_one_of_its_key_runs_next_and_holds_its_acknowledgement() -> None:
    """It cannot run before the later record already running: it runs right after it, ahead of every later queued
    record of its key, and nothing from it on is acknowledged before it is done (commits stay contiguous)."""
    h = Harness(limit=8)
    h.offer(0, 107, lane="k")
    h.offer(0, 110, lane="k")
    h.offer(0, 105, lane="k")  # read again: 107 is running already
    assert offsets(h.running) == [107]
    h.finish(107)
    assert h.acked == []  # 105 is before it and not done
    assert offsets(h.running) == [105]
    h.finish(105)
    assert offsets(h.acked) == [105, 107]
    h.finish(110)
    assert offsets(h.started) == [107, 105, 110]
    assert offsets(h.acked) == [105, 107, 110]


def test_a_re_read_offset_keeps_its_place_only_among_its_own_partition_s_records_in_a_shared_lane() -> None:
    """A main record and the release requests of its key share a lane; their offsets are not comparable."""
    h = Harness(limit=8)
    h.offer("main", 100, lane="k")
    h.offer("release", 3, lane="k")
    h.offer("main", 107, lane="k")
    h.offer("release", 200, lane="k")
    h.offer("main", 105, lane="k")  # read again
    while h.running:
        h.finish(h.running[0].offset, h.running[0].partition)
    assert [(w.partition, w.offset) for w in h.started] == [
        ("main", 100),
        ("release", 3),
        ("main", 105),
        ("main", 107),
        ("release", 200),
    ]


def test_a_new_generation_s_lower_offsets_run_before_the_drained_generation_s_later_queued_ones() -> None:
    """Read again from the committed offset while a revocation still drains: one key's records keep offset order
    across both generations (the later one runs twice: at-least-once)."""
    h = Harness(limit=8)
    h.offer(0, 100, lane="k")
    h.offer(0, 107, lane="k")
    h.revoke(drain=True)
    for offset in (100, 105, 107):  # the next generation reads again from the committed offset
        h.offer(0, offset, lane="k")
    while h.running:
        h.finish(h.running[0].offset)
    assert [(w.offset, w.generation) for w in h.started] == [(100, 0), (100, 1), (105, 1), (107, 0), (107, 1)]
    assert [(w.offset, w.generation) for w in h.acked] == [(100, 0), (100, 1), (105, 1), (107, 0), (107, 1)]


# -- a limit that changes while work runs (adaptive concurrency) ------------------------------------------------


def test_raising_the_limit_starts_queued_work_at_once() -> None:
    h = Harness(limit=1)
    for offset in range(4):
        h.offer(0, offset, lane=f"k{offset}")
    assert offsets(h.running) == [0]
    step = h.apply(h.dispatch.set_limit(3))
    assert offsets(step.start) == [1, 2]
    assert h.dispatch.running == 3


def test_lowering_the_limit_cancels_nothing_and_starts_nothing_until_below_it() -> None:
    h = Harness(limit=4)
    for offset in range(8):
        h.offer(0, offset, lane=f"k{offset}")
    step = h.apply(h.dispatch.set_limit(2))
    assert not step.start and not step.abandon
    assert offsets(h.running) == [0, 1, 2, 3]
    assert not h.finish(0).start  # 3 running, limit 2
    assert not h.finish(1).start  # 2 running
    assert offsets(h.finish(2).start) == [4]  # 1 running: one may start
    assert h.dispatch.running == 2
    assert offsets(h.acked) == [0, 1, 2]


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        Harness().dispatch.set_limit(0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["offer", "finish", "limit"]), st.integers(0, 7)), max_size=120))
def test_under_a_changing_limit_keys_run_in_order_and_acknowledgements_stay_contiguous(
    actions: list[tuple[str, int]],
) -> None:
    """Whatever the limit does, at most one work per key runs, a key's works start in offset order, nothing starts
    while the limit is reached, and acknowledgements come in offset order without a gap."""
    h = Harness(limit=2)
    next_offset = 0
    for action, value in actions:
        if action == "offer":
            step = h.offer(0, next_offset, lane=f"k{value % 3}")
            next_offset += 1
        elif action == "finish" and h.running:
            step = h.finish(h.running[value % len(h.running)].offset)
        elif action == "limit":
            step = h.apply(h.dispatch.set_limit(value + 1))
        else:
            continue
        if step.start:
            assert h.dispatch.running <= h.dispatch.limit
        assert h.dispatch.running == len(h.running)
        assert len({w.lane for w in h.running}) == len(h.running)
        if h.dispatch.running < h.dispatch.limit:
            assert h.dispatch.queued == 0 or all(
                any(r.lane == w.lane for r in h.running) for w in h.dispatch.works() if w.state is State.QUEUED
            ), "a free slot and a queued work whose key runs nothing"
    assert offsets(h.acked) == list(range(len(h.acked)))
    by_lane: dict[Hashable, list[int]] = defaultdict(list)
    for work in h.started:
        by_lane[work.lane].append(work.offset)
    assert all(lane == sorted(lane) for lane in by_lane.values())


def test_work_abandoned_behind_a_dropped_offset_says_whether_it_was_finished() -> None:
    """The consumer does not run again, when it reads them again, the records finished here that the dispatcher could
    not acknowledge (a slow head, then a revocation): only those. A cut-short one, or one still queued, was not."""
    from rebound.dispatch import finished

    h = Harness(limit=3)
    h.offer(0, 0, lane="slow")  # running, holds every later acknowledgement
    h.offer(0, 1, lane="b")  # running, finished behind 0
    h.offer(0, 2, lane="slow")  # queued behind 0
    h.offer(0, 3, lane="c")  # running, finished behind 0
    h.offer(0, 4, lane="d")  # queued: no slot... until 1 ends
    h.finish(1)
    h.finish(3)  # 4 starts
    h.revoke()  # 2 dropped: 3 is abandoned now, 4 when it ends
    h.finish(4)
    h.finish(0, completed=False)  # the slow head cut short (a lapsed lease): 1, finished behind it, abandoned too
    assert h.acked == []
    assert {work.offset: finished(work) for work in h.abandoned} == {0: False, 1: True, 2: False, 3: True, 4: True}


def test_a_record_of_several_works_is_finished_only_if_every_one_of_them_completed() -> None:
    """A batch of release requests behind a slow head: one part completed, the other dropped before it ran. The
    record is abandoned once, naming its last work to end (the completed one): not finished, it is run again."""
    from rebound.dispatch import finished

    h = Harness(limit=4)
    h.offer(0, 0, lane="slow")  # running, holds every later acknowledgement
    h.apply(h.dispatch.offer_batch(0, 1, [("slow", "0@1 slow"), ("x", "0@1 x")]))  # one part queued, one running
    h.revoke()  # the queued part dropped; the running one orphaned
    h.finish(1)  # completed: the record's last work ends, and it is abandoned
    assert [(work.offset, work.lane, work.completed) for work in h.abandoned] == [(1, "x", True)]
    assert finished(h.abandoned[0]) is False
