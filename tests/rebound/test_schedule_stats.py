"""The schedule's backlog figures (``tier_stats``) kept up to date as slots come and go, against the walk that computed
them from the heaps before: the same figures after any sequence of schedule operations, and no walk of what is
overdue when nothing came due since the last call."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rebound.schedule as schedule_module
from rebound.schedule import HELD_LANE, ReleaseSchedule, Slot, _walk_due
from rebound.state import HELD_TIER

Figures = dict[int, dict[str, dict[str, int | None]]]
PARTITIONS = (0, 1, 2)
T0 = 1_700_000_000_000


def walked_stats(schedule: ReleaseSchedule, now_ms: int) -> Figures:
    """The figures as ``tier_stats`` computed them until the lanes kept them: one min-heap of the waiting slots per
    tier topic, walked down to the first slot not yet due, plus a pass over the slots in flight."""
    result: Figures = {}
    for partition, lanes in schedule._lanes.items():
        tiers = result.setdefault(partition, {})
        for lane, waiting in lanes.items():
            heap = list(waiting)
            heapq.heapify(heap)
            if lane == HELD_LANE or not heap:
                continue
            overdue, later = _walk_due(heap, now_ms)
            tiers[lane] = {
                "waiting": len(heap),
                "overdue": overdue,
                "oldest_due": heap[0].due_at_ms,
                "next_release": later,
            }
        for slot in schedule._in_flight.get(partition, {}).values():
            if slot.lane == HELD_LANE:
                continue
            stats = tiers.setdefault(slot.lane, {"waiting": 0, "overdue": 0, "oldest_due": None, "next_release": None})
            stats["waiting"] = int(stats["waiting"] or 0) + 1
            oldest = stats["oldest_due"]
            stats["oldest_due"] = slot.due_at_ms if oldest is None else min(oldest, slot.due_at_ms)
            if slot.due_at_ms <= now_ms:
                stats["overdue"] = int(stats["overdue"] or 0) + 1
            else:
                later = stats["next_release"]
                stats["next_release"] = slot.due_at_ms if later is None else min(later, slot.due_at_ms)
    return result


def waiting_slots(schedule: ReleaseSchedule, partition: int) -> list[Slot]:
    return sorted(slot for lane in schedule._lanes.get(partition, {}).values() for slot in lane)


# A slot as drawn: (due relative to now, topic, tier, offset, attempt). Offsets and keys from a small range, so that
# a slot of an identity already held (waiting or in flight) turns up now and then.
slot_specs = st.tuples(
    st.integers(-3_000, 6_000),
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
        st.tuples(st.just("confirm"), st.sampled_from(PARTITIONS), st.integers(0, 10)),
        st.tuples(st.just("take"), st.sampled_from(PARTITIONS), st.integers(0, 30)),
        st.tuples(st.just("discard"), st.sampled_from(PARTITIONS), st.integers(0, 30)),
        st.tuples(st.just("suspend"), st.sampled_from(PARTITIONS), st.just(0)),
        st.tuples(st.just("resume"), st.sampled_from(PARTITIONS), st.just(0)),
        st.tuples(st.just("drop"), st.sampled_from(PARTITIONS), st.just(0)),
        st.tuples(st.just("postpone"), st.just(0), st.tuples(st.integers(-4_000, 0), st.integers(0, 4_000))),
        st.tuples(st.just("received"), st.sampled_from(PARTITIONS), st.just(0)),
        st.tuples(st.just("advance"), st.just(0), st.integers(-500, 4_000)),  # now and then the clock goes back
        st.tuples(st.just("stats"), st.just(0), st.just(0)),
        st.tuples(st.just("stats"), st.just(0), st.just(0)),
    ),
    min_size=10,
    max_size=120,
)


def make_slot(partition: int, now: int, spec: tuple[int, str, str, int, int]) -> Slot:
    due, topic, tier, offset, attempt = spec
    if attempt < 0:  # key-ordered mode's held message: in no tier, due at once
        return Slot(0, b"k%d" % (offset % 5), f"{topic}/{partition}/{offset}", attempt, HELD_TIER)
    return Slot(now + due, b"k%d" % (offset % 5), f"{topic}/{partition}/{offset}", attempt, tier)


@settings(max_examples=400, deadline=None)
@given(ops)
def test_the_kept_figures_equal_the_walk_after_any_operations(operations: list[tuple]) -> None:
    schedule = ReleaseSchedule(resend_after_ms=5_000, max_in_flight=3)
    now = T0
    for partition in PARTITIONS:
        schedule.adopt(partition, [])
    for op, partition, value in operations:
        if op == "add":
            schedule.add(partition, make_slot(partition, now, value))
        elif op == "adopt":
            schedule.adopt(partition, [make_slot(partition, now, spec) for spec in value])
        elif op == "pop":
            before = {p: waiting_slots(schedule, p) for p in schedule.partitions}
            popped = schedule.pop_due(now, limit=value)
            for p, slot in popped.new:  # the earliest due of their partition, one heap or two
                assert slot.due_at_ms <= now
                assert all(slot <= left for left in waiting_slots(schedule, p))
                assert slot in before[p]
        elif op == "confirm":
            in_flight = list(schedule._in_flight.get(partition, {}).values())
            if in_flight:
                slot = in_flight[value % len(in_flight)]
                schedule.confirm(partition, slot.table_key, slot.origin, slot.attempt)
        elif op == "take":  # a probe: any waiting slot, due or not (the early one is what the lanes must catch)
            waiting = waiting_slots(schedule, partition)
            if waiting:
                slot = waiting[value % len(waiting)]
                schedule.take(partition, slot, now)
                assert schedule._in_flight[partition].get(slot.ident) == slot
        elif op == "discard":
            waiting = waiting_slots(schedule, partition)
            if waiting:
                ident = waiting[value % len(waiting)].ident
                schedule.discard(partition, {ident})
                assert ident not in {slot.ident for slot in waiting_slots(schedule, partition)}
        elif op == "suspend":
            schedule.suspend(partition)
        elif op == "resume":
            schedule.resume(partition)
        elif op == "drop":
            schedule.drop(partition)
        elif op == "postpone":
            opened, length = value
            schedule.postpone_held(opened_at_ms=now + opened, closed_at_ms=now + opened + length)
        elif op == "received":
            schedule.received(partition, now)
        elif op == "advance":
            now += value
        else:
            assert schedule.tier_stats(now) == walked_stats(schedule, now)
    assert schedule.tier_stats(now) == walked_stats(schedule, now)
    assert schedule.tier_stats(now - 1_000) == walked_stats(schedule, now - 1_000)  # and with the clock gone back
    assert schedule.tier_stats(now + 10_000) == walked_stats(schedule, now + 10_000)


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
