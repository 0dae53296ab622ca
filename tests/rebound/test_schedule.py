"""The in-memory release schedule: never early, in due order, resend of unconfirmed, per-partition ownership."""

from __future__ import annotations

import pytest

from rebound.schedule import ReleaseSchedule, Slot


def slot(due: int, key: bytes = b"k", origin: str | None = None, attempt: int = 1, tier: str = "5m") -> Slot:
    return Slot(due, key, origin or f"items/0/{due}", attempt, tier)


@pytest.fixture
def schedule() -> ReleaseSchedule:
    return ReleaseSchedule(resend_after_ms=30_000)


def test_pop_due_returns_only_due_slots_in_due_order(schedule) -> None:
    schedule.adopt(0, [slot(500), slot(100), slot(300), slot(1_000), slot(301)])
    due = schedule.pop_due(300)
    assert [(partition, s.due_at_ms) for partition, s in due] == [(0, 100), (0, 300)]
    assert all(s.due_at_ms <= 300 for _, s in due)
    assert schedule.next_due_ms() == 301
    assert schedule.waiting() == 5  # 3 parked + 2 in flight
    later = schedule.pop_due(600)
    assert [s.due_at_ms for _, s in later] == [301, 500]
    assert schedule.pop_due(600) == []


def test_nothing_released_before_due(schedule) -> None:
    schedule.adopt(0, [slot(1_000)])
    assert schedule.pop_due(999) == []
    assert [s.due_at_ms for _, s in schedule.pop_due(1_000)] == [1_000]


def test_confirm_removes_from_in_flight(schedule) -> None:
    first, second = slot(100, origin="items/0/1"), slot(100, origin="items/0/2")
    schedule.adopt(0, [first, second])
    assert len(schedule.pop_due(100)) == 2
    schedule.confirm(0, first.table_key, first.origin, first.attempt)
    assert schedule.waiting() == 1
    # an unconfirmed slot comes back after the resend window, a confirmed one never
    assert schedule.pop_due(100 + 29_999) == []
    assert schedule.pop_due(100 + 30_000) == [(0, second)]
    schedule.confirm(0, second.table_key, second.origin, second.attempt)
    assert schedule.waiting() == 0
    assert schedule.pop_due(10**9) == []


def test_confirm_needs_the_exact_identity(schedule) -> None:
    entry = slot(100, attempt=2)
    schedule.adopt(0, [entry])
    schedule.pop_due(100)
    schedule.confirm(0, entry.table_key, entry.origin, 1)  # older attempt: not this slot
    schedule.confirm(1, entry.table_key, entry.origin, 2)  # other partition: ignored
    assert schedule.waiting() == 1
    schedule.confirm(0, entry.table_key, entry.origin, 2)
    assert schedule.waiting() == 0


def test_resend_restarts_the_window(schedule) -> None:
    entry = slot(0)
    schedule.adopt(0, [entry])
    assert schedule.pop_due(0) == [(0, entry)]
    assert schedule.pop_due(30_000) == [(0, entry)]
    assert schedule.pop_due(59_999) == []
    assert schedule.pop_due(60_000) == [(0, entry)]


def test_add_to_adopted_partition(schedule) -> None:
    schedule.adopt(0, [])
    schedule.add(0, slot(200))
    schedule.add(0, slot(100))
    assert schedule.next_due_ms() == 100
    assert [s.due_at_ms for _, s in schedule.pop_due(1_000)] == [100, 200]


def test_add_to_unadopted_partition_is_ignored(schedule) -> None:
    schedule.adopt(0, [])
    schedule.add(1, slot(100))
    assert schedule.partitions == frozenset({0})
    assert schedule.waiting() == 0
    assert schedule.pop_due(10**9) == []


def test_drop_forgets_parked_and_in_flight(schedule) -> None:
    schedule.adopt(0, [slot(100), slot(200)])
    schedule.adopt(1, [slot(150, origin="items/1/150")])
    schedule.pop_due(100)
    schedule.drop(0)
    assert schedule.partitions == frozenset({1})
    assert schedule.waiting() == 1
    due = schedule.pop_due(10**9)
    assert [(partition, s.origin) for partition, s in due] == [(1, "items/1/150")]
    schedule.drop(0)  # dropping twice is harmless
    schedule.add(0, slot(1))  # and a dropped partition takes no new slots
    assert schedule.waiting() == 1


def test_readopt_replaces_previous_schedule(schedule) -> None:
    schedule.adopt(0, [slot(100), slot(200)])
    schedule.pop_due(100)
    schedule.adopt(0, [slot(300)])
    assert schedule.waiting() == 1
    assert schedule.pop_due(10**9) == [(0, slot(300))]


def test_several_partitions(schedule) -> None:
    schedule.adopt(0, [slot(100, origin="a"), slot(400, origin="b")])
    schedule.adopt(2, [slot(50, origin="c"), slot(500, origin="d")])
    due = schedule.pop_due(450)
    assert sorted((partition, s.origin) for partition, s in due) == [(0, "a"), (0, "b"), (2, "c")]
    assert schedule.next_due_ms() == 500


def test_limit_bounds_one_tick(schedule) -> None:
    schedule.adopt(0, [slot(due) for due in range(10)])
    first = schedule.pop_due(100, limit=4)
    assert [s.due_at_ms for _, s in first] == [0, 1, 2, 3]
    assert [s.due_at_ms for _, s in schedule.pop_due(100, limit=100)] == [4, 5, 6, 7, 8, 9]


def test_slot_order_ignores_tier() -> None:
    assert slot(1, tier="5m") == slot(1, tier="30m")
    assert slot(1) < slot(2)
    assert Slot(5, b"a", "o", 1) < Slot(5, b"b", "o", 1)


def test_many_far_future_slots_release_nothing(schedule) -> None:
    now = 1_700_000_000_000
    schedule.adopt(0, [Slot(now + 3_600_000 + i, b"k%d" % i, f"items/0/{i}", 1) for i in range(100_000)])
    assert schedule.pop_due(now) == []
    assert schedule.waiting() == 100_000
    assert schedule.next_due_ms() == now + 3_600_000
    schedule.add(0, Slot(now - 1, b"due", "items/0/due", 1))
    assert schedule.pop_due(now) == [(0, Slot(now - 1, b"due", "items/0/due", 1))]


def test_slots_lists_waiting_and_in_flight_with_their_partition() -> None:
    schedule = ReleaseSchedule()
    schedule.adopt(0, [Slot(10, b"a", "o/0/1", 1), Slot(30, b"b", "o/0/2", 1)])
    schedule.adopt(1, [Slot(20, b"c", "o/1/1", 1)])
    schedule.pop_due(15)  # moves the first slot of partition 0 in flight
    assert sorted((partition, slot.origin) for partition, slot in schedule.slots()) == [
        (0, "o/0/1"),
        (0, "o/0/2"),
        (1, "o/1/1"),
    ]
