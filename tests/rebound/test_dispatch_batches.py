"""A record that carries several works (a batch of release requests, ``Dispatch.offer_batch``), step by step: each
work runs in its own lane within the limit, concurrently with the others, and the record is one offset: acknowledged
once, after all of its works; abandoned whole on a second delivery; and never acknowledged if one of them is cut
short, the others dropped with it and the record abandoned once, when the last of them has ended."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rebound.dispatch import Dispatch, State, Step, Work


class Harness:
    """Feeds a :class:`Dispatch` and keeps what the dispatcher would: running works, acknowledged and abandoned
    records (each as the ``(partition, offset)`` the consumer is told of, once per step entry)."""

    def __init__(self, limit: int = 8, partition_buffer: int = 100) -> None:
        self.dispatch: Dispatch[str] = Dispatch(limit=limit, partition_buffer=partition_buffer)
        self.running: list[Work[str]] = []
        self.acked: list[tuple[Hashable, int]] = []
        self.abandoned: list[tuple[Hashable, int]] = []

    def apply(self, step: Step[str]) -> Step[str]:
        queued = [work for work in self.dispatch.works() if work.state is State.QUEUED]
        assert self.dispatch.queued == len(queued)
        self.acked += [(w.partition, w.offset) for w in step.ack]
        self.abandoned += [(w.partition, w.offset) for w in step.abandon]
        self.running += step.start
        return step

    def offer(self, offset: int, lane: Hashable, partition: Hashable = 0) -> Step[str]:
        return self.apply(self.dispatch.offer(partition, offset, lane, f"{partition}@{offset}"))

    def offer_batch(self, offset: int, lanes: list[Hashable], partition: Hashable = 0) -> Step[str]:
        parts = [(lane, f"{partition}@{offset}/{index}") for index, lane in enumerate(lanes)]
        return self.apply(self.dispatch.offer_batch(partition, offset, parts))

    def work(self, offset: int, lane: Hashable) -> Work[str]:
        return next(w for w in self.running if w.offset == offset and w.lane == lane)

    def finish(self, offset: int, lane: Hashable, *, completed: bool = True) -> Step[str]:
        work = self.work(offset, lane)
        self.running.remove(work)
        return self.apply(self.dispatch.finish(work, completed=completed))

    def running_as(self) -> list[tuple[int, Hashable]]:
        return [(w.offset, w.lane) for w in self.running]


def test_a_batchs_works_run_at_once_each_in_its_own_lane() -> None:
    h = Harness()
    h.offer_batch(0, ["a", "b", "c"])
    assert h.running_as() == [(0, "a"), (0, "b"), (0, "c")]


def test_a_batch_is_acknowledged_once_after_its_last_work() -> None:
    h = Harness()
    h.offer_batch(0, ["a", "b", "c"])
    h.finish(0, "a")
    h.finish(0, "c")
    assert h.acked == []  # b still runs
    step = h.finish(0, "b")
    assert h.acked == [(0, 0)]
    assert len(step.ack) == 1  # one acknowledgement for the record, not one per work
    assert h.dispatch.tracked(0) == 0


def test_a_batchs_work_waits_behind_its_keys_running_work() -> None:
    """One key's first tries and releases never run at once: a release of a batch queues behind its key's lane."""
    h = Harness()
    h.offer(0, "a", partition="main")
    h.offer_batch(0, ["a", "b"], partition="release")
    assert h.running_as() == [(0, "a"), (0, "b")]
    assert h.work(0, "a").partition == "main"
    h.finish(0, "b")
    assert h.acked == []
    h.running.remove(main := next(w for w in h.running if w.partition == "main"))
    h.apply(h.dispatch.finish(main))
    assert [(w.partition, w.lane) for w in h.running] == [("release", "a")]
    h.finish(0, "a")
    assert h.acked == [("main", 0), ("release", 0)]


def test_two_releases_of_one_key_in_a_batch_run_one_after_the_other() -> None:
    h = Harness()
    h.offer_batch(0, ["a", "a", "b"])
    assert h.running_as() == [(0, "a"), (0, "b")]
    first = h.work(0, "a")
    h.finish(0, "a")
    assert h.work(0, "a") is not first  # the second of key a, started as the first ended
    h.finish(0, "a")
    h.finish(0, "b")
    assert h.acked == [(0, 0)]


def test_the_limit_bounds_a_batchs_works_too() -> None:
    h = Harness(limit=2)
    h.offer_batch(0, ["a", "b", "c"])
    assert h.running_as() == [(0, "a"), (0, "b")]
    h.finish(0, "a")
    assert h.running_as() == [(0, "b"), (0, "c")]


def test_offsets_after_a_batch_wait_for_all_of_it_and_before_it_go_first() -> None:
    h = Harness()
    h.offer(0, "x")
    h.offer_batch(1, ["a", "b"])
    h.offer(2, "y")
    h.finish(2, "y")
    h.finish(1, "a")
    h.finish(1, "b")
    assert h.acked == []  # offset 0 runs
    h.finish(0, "x")
    assert h.acked == [(0, 0), (0, 1), (0, 2)]


def test_a_second_delivery_of_a_batch_is_abandoned_whole() -> None:
    h = Harness()
    h.offer_batch(5, ["a", "b"])
    step = h.offer_batch(5, ["a", "b"])
    assert step.start == [] and len(step.abandon) == 1
    assert h.abandoned == [(0, 5)]
    h.finish(5, "a")
    h.finish(5, "b")
    assert h.acked == [(0, 5)]
    assert h.offer_batch(5, ["a", "b"]).abandon  # acknowledged already: a duplicate too
    assert h.abandoned == [(0, 5), (0, 5)]


def test_a_work_cut_short_leaves_its_batch_unacknowledged_and_abandons_it_once_all_ended() -> None:
    h = Harness(limit=2)
    h.offer_batch(0, ["a", "b", "c"])  # c queued: no slot
    h.offer(1, "d")
    h.finish(0, "a")  # done, c starts
    assert h.running_as() == [(0, "b"), (0, "c")]
    h.finish(0, "b", completed=False)  # cut short
    assert h.acked == []
    # d, queued after it, is dropped at once; the batch is abandoned once nothing of it runs, and c still does.
    assert h.abandoned == [(0, 1)]
    assert h.running_as() == [(0, "c")]
    h.finish(0, "c")
    assert h.acked == []
    assert h.abandoned == [(0, 1), (0, 0)]  # each record once
    assert h.offer_batch(0, ["a", "b", "c"]).abandon  # the partition is broken until the next generation


def test_a_work_cut_short_when_its_siblings_are_queued_drops_them_at_once() -> None:
    h = Harness(limit=1)
    h.offer_batch(0, ["a", "b", "c"])
    h.finish(0, "a", completed=False)
    assert h.running == [] and h.dispatch.queued == 0
    assert h.abandoned == [(0, 0)]
    assert list(h.dispatch.works()) == []


def test_a_revocation_that_drops_a_queued_part_drops_its_whole_batch() -> None:
    h = Harness(limit=1)
    h.offer_batch(0, ["a", "b"])  # b queued
    step = h.apply(h.dispatch.revoke())
    assert step.abandon == []  # a still runs: abandoned with it when it ends
    h.finish(0, "a")
    assert h.acked == [] and h.abandoned == [(0, 0)]
    assert list(h.dispatch.works()) == []


def test_a_drained_batch_is_acknowledged_as_its_works_end() -> None:
    h = Harness(limit=1)
    h.offer_batch(0, ["a", "b"])
    h.apply(h.dispatch.revoke(drain=True))
    h.finish(0, "a")
    assert h.running_as() == [(0, "b")]
    h.finish(0, "b")
    assert h.acked == [(0, 0)]


def test_a_batchs_works_may_let_go_and_are_acknowledged_once_confirmed() -> None:
    h = Harness()
    h.offer_batch(0, ["a", "b"])
    a = h.work(0, "a")
    h.apply(h.dispatch.let_go(a))
    h.running.remove(a)
    h.finish(0, "b")
    assert h.acked == []
    h.apply(h.dispatch.finish(a))
    assert h.acked == [(0, 0)]


def test_a_batch_offered_late_takes_its_place_in_offset_order() -> None:
    h = Harness()
    h.offer(0, "x")
    h.offer(3, "y")
    h.offer_batch(1, ["a", "b"])  # read again after a seek back
    assert [w.offset for w in h.dispatch.works()] == [0, 1, 1, 3]
    h.finish(3, "y")
    h.finish(0, "x")
    assert h.acked == [(0, 0)]
    h.finish(1, "b")
    h.finish(1, "a")
    assert h.acked == [(0, 0), (0, 1), (0, 3)]


def test_a_batch_of_one_is_an_ordinary_record_and_of_none_is_refused() -> None:
    h = Harness()
    h.offer_batch(0, ["a"])
    assert h.work(0, "a").batch is None
    with pytest.raises(ValueError):
        h.dispatch.offer_batch(0, 1, [])


actions = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "offer",
                "offer",
                "skip",
                "reoffer",
                "finish",
                "finish",
                "finish",
                "let_go",
                "revoke",
                "drop_drained",
                "cut",
                "tick",
            ]
        ),
        st.integers(0, 7),
        st.integers(0, 7),
        st.booleans(),
    ),
    max_size=60,
)


def lowest_queued(d: Dispatch[str], work: Work[str], queued: Callable[[Work[str]], bool]) -> Work[str] | None:
    """The first work of ``work``'s partition (and generation), in offset order, that is ``queued``."""
    return next(
        (w for w in d.works() if (w.generation, w.partition) == (work.generation, work.partition) and queued(w)), None
    )


def waits_for_itself(d: Dispatch[str], start: Work[str], queued: Callable[[Work[str]], bool]) -> bool:
    """Whether drained ``start`` waits for itself: its partition's first queued work is on a lane whose head waits for
    the first queued work of its own partition, and so on back to ``start`` (lanes shared across partitions, records
    read again late). Such a head starts, though above a queued work, rather than stall the drain."""
    work, seen = start, set()
    while (lowest := lowest_queued(d, work, queued)) not in (None, work):
        blocker = d._lanes[lowest.lane][0]  # (lane order: the core's own)
        if blocker is start:
            return True
        if not queued(blocker) or blocker.generation == d.generation or id(blocker) in seen:
            return False
        seen.add(id(blocker))
        work = blocker
    return False


def check_drain_order(d: Dispatch[str], started: list[Work[str]], holding_back: bool) -> None:
    """While a drain holds back, each drained work a step started had, as it started (the works started after it in
    the step still queued), no lower queued work in its partition, or waited for itself."""
    for index, work in enumerate(started):
        if holding_back and work.generation < d.generation:
            later = {id(w) for w in started[index:]}

            def queued(w: Work[str], later: set[int] = later) -> bool:
                return w.state is State.QUEUED or id(w) in later

            lowest = lowest_queued(d, work, queued)
            assert lowest is work or waits_for_itself(d, work, queued), ("started above a queued work", work, lowest)


def check_nothing_left_waiting(d: Dispatch[str], limit: int, holding_back: bool) -> None:
    """With a slot free, a lane's queued head is one a drain holds back: holding back, above a queued work of its
    partition that waits on a lane whose head is not, in turn, waiting back to it (it would start)."""
    if d.running >= limit:
        return
    heads = [lane[0] for lane in d._lanes.values() if lane[0].state is State.QUEUED]

    def queued(w: Work[str]) -> bool:
        return w.state is State.QUEUED

    for head in heads:
        assert head.generation < d.generation, ("a slot is free and a current work waits", head)
        assert holding_back, ("a slot is free and a drained work waits before the drain holds back", head)
        assert lowest_queued(d, head, queued) is not head, (
            "a slot is free and a drain's first queued work waits",
            head,
        )
        assert not waits_for_itself(d, head, queued), ("a slot is free and a held work waits for itself", head)


@settings(max_examples=1000, deadline=None)
@given(limit=st.integers(1, 4), buffer=st.integers(1, 6), script=actions)
@example(  # a drain holding back from its start holds 0@3 above 0@2 (behind 0@0); a second one, from 1 s on, starts it
    limit=2,
    buffer=6,
    script=[
        ("offer", 0, 0, False),
        ("offer", 4, 0, False),
        ("offer", 0, 0, False),
        ("offer", 2, 0, False),
        ("revoke", 0, 0, True),
        ("finish", 1, 0, True),
        ("revoke", 0, 2, True),
    ],
)
def test_batches_keep_the_rules_whatever_the_interleaving(  # noqa: PLR0915 (one script, its checks inline)
    limit: int, buffer: int, script: list[tuple[str, int, int, bool]]
) -> None:
    """Records of one to three works (keys may repeat) on two partitions, offered in order, past a hole, again below
    what was taken (a seek back: a late record or a duplicate), completions in any order (some cut short, some after
    a let-go), revocations with and without a drain (holding back from its start or later) or with every running work
    cut short. Each record is acknowledged only once all its works are done and every earlier record of its partition
    was, or abandoned (a first delivery only once all its works are dropped); never both, each once, and once
    everything has ended every record offered was one or the other and nothing is left. A key never runs twice at
    once; a partition holding ``buffer`` works is paused, and pauses and resumes alternate; nothing stays queued while
    nothing runs (a drain holding back never stalls). While a drain holds back, no drained work starts above a queued
    one of its partition unless it waits for itself (:func:`check_drain_order`), and with a slot free no queued head
    that may start is left waiting (:func:`check_nothing_left_waiting`)."""
    now = [0.0]
    d: Dispatch[str] = Dispatch(limit=limit, partition_buffer=buffer, clock=lambda: now[0])
    running: list[Work[str]] = []
    confirming: list[Work[str]] = []
    next_offset: dict[int, int] = defaultdict(int)
    offered: dict[tuple[int, Hashable, int], list[Work[str]]] = {}  # first delivery's works
    acked: list[tuple[int, Hashable, int]] = []
    abandoned: list[tuple[int, Hashable, int]] = []
    paused: set[Hashable] = set()
    hold_back_at: list[float | None] = [None]  # the latest drain's

    def apply(step: Step[str]) -> None:
        holding_back = hold_back_at[0] is None or now[0] >= hold_back_at[0]
        check_drain_order(d, step.start, holding_back)
        check_nothing_left_waiting(d, limit, holding_back)
        for work in step.ack:
            key = (work.generation, work.partition, work.offset)
            assert all(part.state is State.DONE for part in work.batch or [work]), key
            earlier = [k for k in offered if k[:2] == key[:2] and k[2] < key[2]]
            assert all(k in acked for k in earlier), ("acknowledged before an earlier offset", key)
            acked.append(key)
        for work in step.abandon:
            key = (work.generation, work.partition, work.offset)
            if any(part is work for part in offered.get(key, [])):
                assert all(part.state is State.DROPPED for part in work.batch or [work])
                abandoned.append(key)
        for partition in step.pause:
            assert partition not in paused
            paused.add(partition)
        for partition in step.resume:
            assert partition in paused
            paused.discard(partition)
        running.extend(step.start)
        assert len({w.lane for w in running}) == len(running)
        assert d.queued == sum(1 for w in d.works() if w.state is State.QUEUED)

    def read_again() -> None:
        paused.clear()
        next_offset.clear()  # read again from what was acknowledged
        for _, partition, offset in acked:
            next_offset[partition] = max(next_offset[partition], offset + 1)

    for action, a, b, flag in script:
        partition = a % 2
        if action == "skip":
            next_offset[partition] += 1  # a hole, filled (or not) by a later re-offer
        elif action in ("offer", "reoffer"):
            if action == "offer":
                offset = next_offset[partition]
                next_offset[partition] += 1
            elif next_offset[partition]:
                holes = [o for o in range(next_offset[partition]) if (d.generation, partition, o) not in offered]
                offset = holes[b % len(holes)] if holes and a < 6 else b % next_offset[partition]  # (mostly late)
            else:
                continue
            parts = [((a + i * flag) % 3, f"{partition}@{offset}/{i}") for i in range(1 + b % 3)]
            key = (d.generation, partition, offset)
            step = d.offer_batch(partition, offset, parts)
            new = [w for w in d.works() if (w.generation, w.partition, w.offset) == key]
            if key not in offered and new:
                offered[key] = new
            apply(step)
            if d.tracked(partition) >= buffer:
                assert partition in paused
        elif action == "finish" and (running or confirming):
            pool = running + confirming
            work = pool[a % len(pool)]
            (running if work in running else confirming).remove(work)
            apply(d.finish(work, completed=flag or b > 1))
        elif action == "let_go" and running:
            work = running.pop(a % len(running))
            confirming.append(work)
            apply(d.let_go(work))
        elif action == "revoke":  # a drain holding back from its start, or from now or a second later
            if flag:
                hold_back_at[0] = None if b % 3 == 0 else now[0] + b % 3 - 1
            apply(d.revoke(drain=flag, hold_back_at=hold_back_at[0]))
            read_again()
        elif action == "tick":
            now[0] += 1
        elif action == "drop_drained":
            apply(d.drop_drained())
        elif action == "cut":
            apply(d.revoke(drain=False))
            cut, running[:], confirming[:] = running + confirming, [], []
            for work in cut:
                apply(d.finish(work, completed=False))
            read_again()
        assert d.running == len(running) <= limit
        assert d.running or not d.queued, "queued works and none running: a drain holding back stalled"
    while running or confirming:
        work = (running or confirming).pop(0)
        apply(d.finish(work))
    assert len(acked) == len(set(acked)) and len(abandoned) == len(set(abandoned))
    assert not set(acked) & set(abandoned)
    assert set(acked) | set(abandoned) == set(offered)
    assert list(d.works()) == [] and d.queued == d.running == 0
    assert not paused


def test_a_batch_that_fills_the_partitions_buffer_pauses_it() -> None:
    """The buffer counts works: a batch's releases fill it as single records do, and pause its partition."""
    h = Harness(partition_buffer=3)
    assert h.offer_batch(0, ["a", "b"]).pause == []
    assert h.offer_batch(1, ["c", "d"]).pause == [0]
    h.finish(0, "a")
    h.finish(0, "b")
    h.finish(1, "c")
    assert h.finish(1, "d").resume == [0]


def test_a_late_batch_cut_short_drops_all_of_its_works() -> None:
    """A batch read again below offsets already taken keeps its works together, its first one first: one of them cut
    short drops the others with it (and every later offset), and the record is abandoned once all have ended."""
    h = Harness()
    h.offer(0, "x")
    h.offer(3, "y")
    h.offer_batch(1, ["a", "b"])  # after a seek back
    h.finish(1, "a", completed=False)
    h.finish(1, "b")
    h.finish(3, "y")
    h.finish(0, "x")
    assert h.acked == [(0, 0)]
    assert sorted(h.abandoned) == [(0, 1), (0, 3)]
    assert list(h.dispatch.works()) == []


def test_a_late_batch_is_acknowledged_whichever_of_its_works_ends_first() -> None:
    h = Harness()
    h.offer(0, "x")
    h.offer(3, "y")
    h.offer_batch(1, ["a", "b", "c"])
    h.finish(0, "x")
    h.finish(1, "c")
    h.finish(3, "y")
    h.finish(1, "a")
    assert h.acked == [(0, 0)]
    h.finish(1, "b")
    assert h.acked == [(0, 0), (0, 1), (0, 3)]
    assert list(h.dispatch.works()) == [] and h.dispatch.tracked(0) == 0
