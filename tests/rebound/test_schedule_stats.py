"""The schedule's backlog figures (``tier_stats``) kept up to date as slots come and go, against the walk that computed
them from the heaps before: the same figures after any sequence of schedule operations, and no walk of what is
overdue when nothing came due since the last call."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rebound.schedule as schedule_module
from rebound.schedule import ReleaseSchedule, Slot
from rebound.state import HELD_TIER
from tests.rebound.schedule_oracle import WalkedSchedule

PARTITIONS = (0, 1, 2)
T0 = 1_700_000_000_000


def waiting_slots(oracle: WalkedSchedule, partition: int) -> list[Slot]:
    return sorted(slot for heap in oracle._heaps.get(partition, {}).values() for slot in heap)


def tiered(slots: Iterable[tuple[int, Slot]]) -> list[tuple[int, Slot, str]]:
    """``(partition, slot)`` pairs with each slot's tier, which slots leave out of their comparisons."""
    return [(partition, slot, slot.tier) for partition, slot in slots]


def held(schedule: ReleaseSchedule | WalkedSchedule) -> list[tuple[int, Slot, str]]:
    return sorted(tiered(schedule.slots()))


# A slot as drawn: (due relative to now, in 100 ms steps so that a slot due exactly at a split time or at now turns
# up often, topic, tier, offset, attempt). Offsets and keys from a small range, so that a slot of an identity already
# held (waiting or in flight) turns up now and then.
slot_specs = st.tuples(
    st.integers(-30, 60).map(lambda steps: steps * 100),
    st.sampled_from(("items", "orders")),
    st.sampled_from(("5m", "30m")),
    st.integers(0, 40),
    st.sampled_from((1, 1, 1, 2, -1)),
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from(PARTITIONS), slot_specs),
        st.tuples(st.just("adopt"), st.sampled_from(PARTITIONS), st.lists(slot_specs, max_size=30)),
        st.tuples(st.just("pop"), st.just(0), st.integers(0, 8)),
        st.tuples(st.just("pop"), st.just(0), st.integers(0, 8)),
        st.tuples(st.just("confirm"), st.sampled_from(PARTITIONS), st.integers(0, 10)),
        st.tuples(st.just("confirm"), st.sampled_from(PARTITIONS), st.integers(0, 10)),
        st.tuples(st.just("take"), st.sampled_from(PARTITIONS), st.integers(0, 30)),
        st.tuples(st.just("probe"), st.just(0), st.integers(0, 5)),
        st.tuples(st.just("discard"), st.sampled_from(PARTITIONS), st.integers(0, 30)),
        st.tuples(st.just("suspend"), st.sampled_from(PARTITIONS), st.just(0)),
        st.tuples(st.just("resume"), st.sampled_from(PARTITIONS), st.just(0)),
        st.tuples(st.just("bounce"), st.sampled_from(PARTITIONS), st.integers(0, 10)),
        st.tuples(st.just("readd"), st.sampled_from(PARTITIONS), st.tuples(st.integers(0, 10), st.integers(-30, 60))),
        st.tuples(st.just("drop"), st.sampled_from(PARTITIONS), st.just(0)),
        st.tuples(st.just("postpone"), st.just(0), st.tuples(st.integers(-40, 0), st.integers(0, 40))),
        st.tuples(st.just("received"), st.sampled_from(PARTITIONS), st.integers(-1, 10)),
        st.tuples(st.just("lost"), st.sampled_from(PARTITIONS), st.just(0)),
        st.tuples(st.just("advance"), st.just(0), st.integers(-5, 40)),  # now and then the clock goes back
        st.tuples(st.just("stats"), st.just(0), st.just(0)),
        st.tuples(st.just("stats"), st.just(0), st.just(0)),
    ),
    min_size=10,
    max_size=120,
)
# With a wide window: ~100 slots at once into one lane, due from long overdue to minutes ahead, the clock moving on in
# small steps, and most of the window confirmed out of due order, so that every path of the split's advance (a few
# popped across or one pass splitting ``later``; pushed onto ``due`` or ``due`` re-sorted) and the in-flight heap's
# cleanup run (a window of 3 with 30 slots at a time takes only the pass and the re-sort).
wide_ops = st.lists(
    st.one_of(
        st.tuples(st.just("bulk"), st.sampled_from(PARTITIONS), st.tuples(st.booleans(), st.integers(0, 2**32))),
        st.tuples(st.just("add"), st.sampled_from(PARTITIONS), slot_specs),
        st.tuples(st.just("pop"), st.just(0), st.sampled_from((5, 40, 200))),
        st.tuples(st.just("pop"), st.just(0), st.sampled_from((5, 40, 200))),
        st.tuples(st.just("confirms"), st.sampled_from(PARTITIONS), st.integers(0, 4)),
        st.tuples(st.just("confirm"), st.sampled_from(PARTITIONS), st.integers(0, 100)),
        st.tuples(st.just("received"), st.sampled_from(PARTITIONS), st.integers(-1, 100)),
        st.tuples(st.just("lost"), st.sampled_from(PARTITIONS), st.just(0)),
        st.tuples(st.just("take"), st.sampled_from(PARTITIONS), st.integers(0, 100)),
        st.tuples(st.just("suspend"), st.sampled_from(PARTITIONS), st.just(0)),
        st.tuples(st.just("resume"), st.sampled_from(PARTITIONS), st.just(0)),
        st.tuples(st.just("advance"), st.just(0), st.integers(-2, 3)),
        st.tuples(st.just("advance"), st.just(0), st.integers(0, 3)),
        st.tuples(st.just("advance"), st.just(0), st.integers(0, 3)),
        st.tuples(st.just("advance"), st.just(0), st.integers(10, 60)),
        st.tuples(st.just("stats"), st.just(0), st.just(0)),
        st.tuples(st.just("stats"), st.just(0), st.just(0)),
        st.tuples(st.just("stats"), st.just(0), st.just(0)),
    ),
    min_size=10,
    max_size=80,
)


def make_slot(partition: int, now: int, spec: tuple[int, str, str, int, int]) -> Slot:
    due, topic, tier, offset, attempt = spec
    if attempt < 0:  # key-ordered mode's held message: in no tier, due at once
        return Slot(0, b"k%d" % (offset % 5), f"{topic}/{partition}/{offset}", attempt, HELD_TIER)
    return Slot(now + due, b"k%d" % (offset % 5), f"{topic}/{partition}/{offset}", attempt, tier)


def assert_alike(schedule: ReleaseSchedule, oracle: WalkedSchedule, spaced: list[int], now: int) -> None:
    """Every observable but the figures (which move the lanes' split: asked only by the "stats" operation)."""
    assert held(schedule) == held(oracle)
    assert schedule._in_flight == oracle._in_flight
    assert schedule.waiting() == oracle.waiting()
    assert schedule.partitions == oracle.partitions and schedule.suspended == oracle.suspended
    assert schedule.next_due_ms() == oracle.next_due_ms()
    assert spaced[0] == spaced[1]


class Pair:
    """The real schedule and the oracle (its version with one heap per tier and the figures walked), given the same
    operations (one method each, ``op_<name>``) and compared."""

    def __init__(self, window: int = 3) -> None:
        self.spaced = [0, 0]
        self.schedule = ReleaseSchedule(resend_after_ms=5_000, max_in_flight=window, on_space=self._space(0))
        self.oracle = WalkedSchedule(resend_after_ms=5_000, max_in_flight=window, on_space=self._space(1))
        self.both = (self.schedule, self.oracle)
        self.now = T0
        for partition in PARTITIONS:
            for each in self.both:
                each.adopt(partition, [])

    def _space(self, which: int) -> Callable[[], None]:
        return lambda: self.spaced.__setitem__(which, self.spaced[which] + 1)

    def waiting(self, partition: int) -> list[Slot]:
        return waiting_slots(self.oracle, partition)

    def op_add(self, partition: int, spec: tuple[int, str, str, int, int]) -> None:
        for each in self.both:
            each.add(partition, make_slot(partition, self.now, spec))

    def op_adopt(self, partition: int, specs: list[tuple[int, str, str, int, int]]) -> None:
        for each in self.both:
            each.adopt(partition, [make_slot(partition, self.now, spec) for spec in specs])

    def op_bulk(self, partition: int, value: tuple[bool, int]) -> None:
        """~100 slots of one tier topic adopted (replacing the partition's) or added, due from 10 s overdue to 40 s
        ahead (drawn from a seed: a hundred drawn specs would slow every example)."""
        adopt, seed = value
        draw = random.Random(seed)
        slots = [
            Slot(
                self.now + draw.randint(-100, 400) * 100, b"k%d" % (offset % 5), f"items/{partition}/{offset}", 1, "5m"
            )
            for offset in draw.sample(range(300), draw.randint(80, 120))
        ]
        for each in self.both:
            if adopt:
                each.adopt(partition, slots)
            else:
                for slot in slots:
                    each.add(partition, slot)

    def op_pop(self, partition: int, limit: int) -> None:
        popped, expected = (each.pop_due(self.now, limit=limit) for each in self.both)
        assert tiered(popped) == tiered(expected)
        assert tiered(popped.new) == tiered(expected.new) and tiered(popped.resent) == tiered(expected.resent)

    def op_confirm(self, partition: int, index: int) -> None:
        in_flight = list(self.oracle._in_flight.get(partition, {}).values())
        if in_flight:
            slot = in_flight[index % len(in_flight)]
            for each in self.both:
                each.confirm(partition, slot.table_key, slot.origin, slot.attempt)

    def op_confirms(self, partition: int, kept: int) -> None:
        """Everything in flight confirmed but the ``kept`` due first, latest due first: out of due order, so the
        in-flight heap keeps stale entries under its live top."""
        in_flight = sorted(self.oracle._in_flight.get(partition, {}).values(), reverse=True)
        for slot in in_flight[: max(0, len(in_flight) - kept)]:
            for each in self.both:
                each.confirm(partition, slot.table_key, slot.origin, slot.attempt)

    def op_take(self, partition: int, index: int) -> None:
        """A probe's take of any waiting slot, due or not (the early one is what the lanes must catch)."""
        waiting = self.waiting(partition)
        if waiting:
            slot = waiting[index % len(waiting)]
            for each in self.both:
                each.take(partition, slot, self.now)
            assert self.schedule._in_flight[partition].get(slot.ident) == slot

    def op_probe(self, partition: int, refused: int) -> None:
        """A breaker's probe: the first due slot it accepts (not of one key), then taken."""
        key = b"k%d" % refused
        found, expected = (each.first_due(self.now, lambda slot: slot.table_key != key) for each in self.both)
        assert found == expected
        if found is not None:
            for each in self.both:
                each.take(found[0], found[1], self.now)

    def op_discard(self, partition: int, index: int) -> None:
        waiting = self.waiting(partition)
        if waiting:
            ident = waiting[index % len(waiting)].ident
            for each in self.both:
                each.discard(partition, {ident})

    def op_suspend(self, partition: int, _: int) -> None:
        for each in self.both:
            each.suspend(partition)

    def op_resume(self, partition: int, _: int) -> None:
        assert self.schedule.resume(partition) == self.oracle.resume(partition)

    def op_bounce(self, partition: int, index: int) -> None:
        """A rebalance that gives the partition straight back: suspended, a slot it had in flight added again
        meanwhile (a release revoked and tried again), resumed."""
        self.op_suspend(partition, 0)
        self.check()
        self.op_readd(partition, (index, index - 3))
        self.check()
        self.op_resume(partition, 0)

    def op_readd(self, partition: int, value: tuple[int, int]) -> None:
        """A slot of an identity in flight, or kept by a suspended partition, added again (a release revoked and
        tried again, a deferral): for a suspended partition, the add to it that :meth:`resume` must put back."""
        index, steps = value
        held = sorted({**self.oracle._in_flight.get(partition, {}), **self.oracle._kept.get(partition, {})}.values())
        if held:
            old = held[index % len(held)]
            for each in self.both:
                each.add(partition, Slot(self.now + steps * 100, old.table_key, old.origin, old.attempt, old.tier))

    def op_drop(self, partition: int, _: int) -> None:
        for each in self.both:
            each.drop(partition)

    def op_postpone(self, partition: int, value: tuple[int, int]) -> None:
        opened, closed = self.now + value[0] * 100, self.now + (value[0] + value[1]) * 100
        moved = [each.postpone_held(opened_at_ms=opened, closed_at_ms=closed) for each in self.both]
        assert moved[0] == moved[1]

    def op_received(self, partition: int, index: int) -> None:
        """The agent took a request: one it was sent (by the send number the oracle gave it; an odd index, the copy
        of an earlier send: it says nothing), or (-1) one of no identity."""
        untaken = list(self.oracle._untaken.get(partition, {}).items())
        if index < 0 or not untaken:
            for each in self.both:
                each.received(partition, self.now)
            return
        ident, (number, _) = untaken[index % len(untaken)]
        number -= index % 2
        for each in self.both:
            each.received(partition, self.now, ident, number)

    def op_lost(self, partition: int, _: int) -> None:
        """A tick sends; the agent takes the partition's latest request (those sent before it look lost) and stays
        busy (takes a request of no identity) while 6 s pass; the next tick sends the skipped ones again."""
        self.op_pop(0, 8)
        untaken = list(self.oracle._untaken.get(partition, {}).items())
        if untaken:
            ident, (number, _) = untaken[-1]
            for each in self.both:
                each.received(partition, self.now, ident, number)
        for _ in range(2):
            self.now += 3_000
            for each in self.both:
                each.received(partition, self.now)
        self.op_pop(0, 8)

    def op_advance(self, partition: int, steps: int) -> None:
        self.now += steps * 100

    def op_stats(self, partition: int, _: int) -> None:
        assert self.schedule.tier_stats(self.now) == self.oracle.tier_stats(self.now)

    def check(self) -> None:
        """Every observable but the figures (which move the lanes' split: asked only by ``op_stats``)."""
        schedule, oracle = self.both
        assert held(schedule) == held(oracle)
        assert schedule._in_flight == oracle._in_flight
        assert schedule.waiting() == oracle.waiting()
        assert schedule.partitions == oracle.partitions and schedule.suspended == oracle.suspended
        assert schedule.next_due_ms() == oracle.next_due_ms()
        assert self.spaced[0] == self.spaced[1]
        assert schedule._taken_up_to == oracle._taken_up_to
        for partition, slot, _ in held(oracle):  # (the number a request carries, for every identity held)
            assert schedule.send_number(partition, slot.ident) == oracle.send_number(partition, slot.ident)
        for partition, lanes in schedule._lanes.items():  # (and the lanes' own record of what is in flight)
            flying = {ident: slot for lane in lanes.values() for ident, slot in lane.flying.items()}
            assert flying == schedule._in_flight[partition]
            for lane in lanes.values():  # (its heap for the oldest, cleaned lazily, holds each of them)
                assert {id(slot) for slot in lane.flying.values()} <= {id(entry[2]) for entry in lane.flying_heap}


@settings(max_examples=400, deadline=None)
@given(ops)
def test_the_schedule_behaves_as_the_walked_one_after_any_operations(operations: list[tuple]) -> None:
    """The same slots sent, probed, held and counted, ``on_space`` called alike, the same figures, after every
    operation (the figures when asked, and at the end at three times)."""
    pair = Pair()
    for op, partition, value in operations:
        getattr(pair, f"op_{op}")(partition, value)
        pair.check()
    now, (schedule, oracle) = pair.now, pair.both
    for at in (now, now - 1_000, now + 10_000):  # (and with the clock gone back)
        assert schedule.tier_stats(at) == oracle.tier_stats(at)
    assert tiered(schedule.pop_due(now + 10_000, limit=1_000)) == tiered(oracle.pop_due(now + 10_000, limit=1_000))


@settings(max_examples=200, deadline=None)
@given(wide_ops)
def test_the_schedule_behaves_as_the_walked_one_with_a_wide_window_and_many_slots(operations: list[tuple]) -> None:
    """As above, with a window of 80 and ~100 slots at a time into one lane (:data:`wide_ops`)."""
    pair = Pair(window=80)
    for op, partition, value in operations:
        getattr(pair, f"op_{op}")(partition, value)
        pair.check()
    now, (schedule, oracle) = pair.now, pair.both
    for at in (now, now - 1_000, now + 60_000):
        assert schedule.tier_stats(at) == oracle.tier_stats(at)
    assert tiered(schedule.pop_due(now + 60_000, limit=1_000)) == tiered(oracle.pop_due(now + 60_000, limit=1_000))
    pair.check()
    assert schedule.tier_stats(now + 60_000) == oracle.tier_stats(now + 60_000)


def test_a_partition_suspended_with_slots_in_flight_resumes_with_them_waiting_once() -> None:
    """Slots in flight at a suspension wait again at resume, on the due side of the split (they come first), counted
    once in the figures (not also as in flight), and are sent again."""
    schedule = ReleaseSchedule(max_in_flight=2)
    first, second, third = (Slot(T0 - 100 * n, b"k", f"items/0/{n}", 1, "5m") for n in (3, 2, 1))
    schedule.adopt(0, [first, second, third])
    schedule.tier_stats(T0)
    assert [slot for _, slot in schedule.pop_due(T0)] == [first, second]
    schedule.suspend(0)
    assert schedule.resume(0)
    assert schedule.next_due_ms() == first.due_at_ms
    assert schedule.first_due(T0, lambda slot: True) == (0, first)
    assert schedule.tier_stats(T0) == {
        0: {"items.retry.5m": {"waiting": 3, "overdue": 3, "oldest_due": first.due_at_ms, "next_release": None}}
    }
    assert [slot for _, slot in schedule.pop_due(T0)] == [first, second]
    assert schedule.tier_stats(T0)[0]["items.retry.5m"]["waiting"] == 3


def test_a_confirm_opening_a_full_window_wakes_the_timer_when_every_waiting_slot_is_overdue() -> None:
    """The figures given, every waiting slot is on the due side of the split: a confirm that opens the full window
    must still call ``on_space`` (the timer sleeps through full windows), or the partition stalls."""
    woken = []
    schedule = ReleaseSchedule(max_in_flight=1, on_space=lambda: woken.append(1))
    sent, waiting = Slot(T0 - 200, b"k", "items/0/1", 1, "5m"), Slot(T0 - 100, b"k", "items/0/2", 1, "5m")
    schedule.adopt(0, [sent, waiting])
    assert [slot for _, slot in schedule.pop_due(T0)] == [sent]
    assert schedule.next_due_ms() is None
    schedule.tier_stats(T0)
    schedule.confirm(0, sent.table_key, sent.origin, sent.attempt)
    assert woken == [1]
    assert schedule.next_due_ms() == waiting.due_at_ms


def test_a_probe_takes_a_slot_due_exactly_at_the_split_time() -> None:
    """A slot due exactly when the figures were last given waits on the due side of the split: a take finds it."""
    schedule = ReleaseSchedule()
    exact, later = Slot(T0, b"k", "items/0/1", 1, "5m"), Slot(T0 + 1, b"k", "items/0/2", 1, "5m")
    schedule.adopt(0, [later])
    schedule.tier_stats(T0)
    schedule.add(0, exact)
    assert schedule.first_due(T0, lambda slot: True) == (0, exact)
    schedule.take(0, exact, T0)
    assert schedule._in_flight[0] == {exact.ident: exact}
    assert schedule.tier_stats(T0)[0]["items.retry.5m"] == {
        "waiting": 2,
        "overdue": 1,
        "oldest_due": T0,
        "next_release": T0 + 1,
    }


def test_a_scrape_with_nothing_come_due_since_the_last_walks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """100,000 overdue over 2 partitions x 2 tiers, a window of them in flight: after the first figures, the next ones
    (nothing came due between) walk neither the overdue slots nor those in flight."""
    schedule = ReleaseSchedule(max_in_flight=1_000)
    for partition in (0, 1):
        schedule.adopt(
            partition,
            [
                Slot(T0 - 1 - number, b"k%d" % number, f"items/{partition}/{number}", 1, ("5m", "30m")[number % 2])
                for number in range(50_000)
            ]
            + [Slot(T0 + 60_000, b"later", f"items/{partition}/later", 1, "5m")],
        )
    schedule.pop_due(T0)
    first = schedule.tier_stats(T0)
    assert first[0]["items.retry.5m"] == {
        "waiting": 25_001,
        "overdue": 25_000,
        "oldest_due": T0 - 49_999,  # (number 49,998)
        "next_release": T0 + 60_000,
    }

    def walk(*args: object, **kwargs: object) -> tuple[int, int | None]:
        raise AssertionError("walked the overdue slots")

    monkeypatch.setattr(schedule_module, "_walk_due", walk)
    monkeypatch.setattr(Slot, "lane", property(lambda slot: pytest.fail("looked at each slot's tier")))
    assert schedule.tier_stats(T0 + 250) == first


def test_a_slot_come_due_behind_many_overdue_moves_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """100,000 overdue in full windows and a stream of new slots, a few at a time coming due: each call moves those
    across the split, not the overdue ones again (a lane with fewer than 8 due later re-sorted them all)."""
    schedule = ReleaseSchedule(max_in_flight=1_000)
    schedule.adopt(
        0, [Slot(T0 - 1 - number, b"k%d" % number, f"items/0/{number}", 1, "5m") for number in range(100_000)]
    )
    schedule.pop_due(T0)
    schedule.tier_stats(T0)
    for step in range(3):
        schedule.add(0, Slot(T0 + 100 * step, b"new", f"items/0/new{step}", 1, "5m"))
    real_heapify = schedule_module.heapq.heapify

    def heapify(heap: list[Slot]) -> None:
        assert len(heap) < 100, "re-sorted the overdue slots"
        real_heapify(heap)

    monkeypatch.setattr(schedule_module.heapq, "heapify", heapify)
    figures = schedule.tier_stats(T0 + 100)
    assert figures[0]["items.retry.5m"]["overdue"] == 100_000 + 2  # (1,000 of them in flight)
    assert figures[0]["items.retry.5m"]["next_release"] == T0 + 200
