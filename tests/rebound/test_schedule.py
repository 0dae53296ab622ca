"""The in-memory release schedule: never early, in due order, a window of unconfirmed requests per partition, resend
only when a partition falls silent, per-partition ownership."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    # the confirm was progress (stamped by the next tick): the unconfirmed slot comes back once the partition has
    # been silent for the resend window after it, a confirmed one never
    assert schedule.pop_due(100) == []
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


def due_slots(count: int, partition: int = 0, due: int = 0) -> list[Slot]:
    return [Slot(due + i, b"k%d" % i, f"items/{partition}/{i}", 1) for i in range(count)]


def confirm(schedule: ReleaseSchedule, slot: Slot, partition: int = 0) -> None:
    schedule.confirm(partition, slot.table_key, slot.origin, slot.attempt)


def test_the_window_bounds_what_one_partition_has_in_flight() -> None:
    schedule = ReleaseSchedule(max_in_flight=3)
    schedule.adopt(0, due_slots(10))
    schedule.adopt(1, due_slots(2, partition=1))
    due = schedule.pop_due(100)
    assert [(partition, s.due_at_ms) for partition, s in due] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert schedule.pop_due(100) == []  # full: the rest waits, and nothing is sent twice
    assert schedule.waiting() == 12


def test_a_confirm_frees_room_that_the_next_tick_fills_in_due_order() -> None:
    schedule = ReleaseSchedule(max_in_flight=3)
    slots = due_slots(10)
    schedule.adopt(0, list(reversed(slots)))
    schedule.pop_due(100)
    confirm(schedule, slots[1])
    confirm(schedule, slots[0])
    assert [s.due_at_ms for _, s in schedule.pop_due(100)] == [3, 4]
    assert schedule.pop_due(100) == []


def test_a_busy_partition_is_never_sent_again_however_long_it_stays_busy() -> None:
    """A slow agent: one confirm a minute, a request taken every 20 s in between, for ten hours."""
    schedule = ReleaseSchedule(resend_after_ms=30_000, max_in_flight=5)
    schedule.adopt(0, due_slots(1_000))
    sent: list[Slot] = []
    now = 100
    for minute in range(600):
        sent += [s for _, s in schedule.pop_due(now)]
        confirm(schedule, sent[minute])
        for _ in range(3):
            now += 20_000
            schedule.received(0, now)
            sent += [s for _, s in schedule.pop_due(now)]
    assert len(sent) == len(set(sent)) == 600 + 5  # each sent once; the window stays full behind the slow agent


def test_a_partition_taking_requests_without_confirming_keeps_its_lease() -> None:
    schedule = ReleaseSchedule(resend_after_ms=30_000, max_in_flight=2)
    schedule.adopt(0, due_slots(5))
    assert len(schedule.pop_due(100)) == 2
    for now in range(20_000, 3_600_000, 20_000):
        schedule.received(0, now)
        assert schedule.pop_due(now) == []
    assert schedule.pop_due(3_580_000 + 29_999) == []
    assert len(schedule.pop_due(3_580_000 + 30_000)) == 2  # and once it falls silent, they are sent again


def test_a_request_skipped_on_a_busy_partition_is_sent_again_once_a_later_one_was_taken() -> None:
    """A send that failed (or a tick cut short) leaves a slot in flight that the agent never sees. Requests of a
    partition are read in order, so once a later one was taken it is lost: sent again after ``resend_after_ms``,
    however busy the partition, and only it."""
    schedule = ReleaseSchedule(resend_after_ms=30_000, max_in_flight=10)
    slots = due_slots(3)
    schedule.adopt(0, list(slots))
    assert [s for _, s in schedule.pop_due(100)] == slots
    for later in slots[1:]:  # the first request never arrived; the others did, and are still running
        schedule.received(0, 200, later.ident)
    for now in range(1_000, 30_100, 1_000):  # busy: the agent keeps taking requests of other keys
        schedule.received(0, now)
        assert schedule.pop_due(now) == []
    assert [s for _, s in schedule.pop_due(30_100)] == [slots[0]]
    assert schedule.pop_due(30_200) == []  # once, then it waits for its own new window
    schedule.received(0, 30_300, slots[0].ident)
    for now in range(31_000, 90_000, 1_000):
        schedule.received(0, now)
        assert schedule.pop_due(now) == []  # taken now: running, not lost


def test_a_request_taken_but_running_long_is_not_sent_again_while_the_partition_is_busy() -> None:
    schedule = ReleaseSchedule(resend_after_ms=30_000, max_in_flight=10)
    slots = due_slots(2)
    schedule.adopt(0, list(slots))
    schedule.pop_due(100)
    for taken in slots:
        schedule.received(0, 200, taken.ident)
    for now in range(1_000, 600_000, 1_000):
        schedule.received(0, now)
        assert schedule.pop_due(now) == []


def test_a_silent_partition_is_sent_again_once_per_resend_window_and_only_its_window() -> None:
    schedule = ReleaseSchedule(resend_after_ms=30_000, max_in_flight=3)
    slots = due_slots(10)
    schedule.adopt(0, slots)
    schedule.adopt(1, due_slots(1, partition=1))
    assert len(schedule.pop_due(100)) == 4
    schedule.received(1, 20_100)  # partition 1 is taking requests; partition 0 says nothing
    assert schedule.pop_due(30_099) == []
    assert schedule.pop_due(30_100) == [(0, s) for s in slots[:3]]  # its window again, none of the 7 behind it
    assert schedule.pop_due(50_099) == []
    assert schedule.pop_due(50_100) == [(1, due_slots(1, partition=1)[0])]
    assert schedule.pop_due(60_099) == []
    assert schedule.pop_due(60_100) == [(0, s) for s in slots[:3]]


def test_a_confirm_renews_the_lease_of_its_partition_only() -> None:
    schedule = ReleaseSchedule(resend_after_ms=30_000, max_in_flight=3)
    schedule.adopt(0, due_slots(3))
    schedule.adopt(1, due_slots(1, partition=1))
    assert len(schedule.pop_due(100)) == 4
    confirm(schedule, due_slots(3)[0])
    assert schedule.pop_due(20_000) == []  # stamped now: the confirm happened since the last tick
    assert schedule.pop_due(30_100) == [(1, due_slots(1, partition=1)[0])]
    assert schedule.pop_due(49_999) == []
    assert [s.due_at_ms for _, s in schedule.pop_due(50_000)] == [1, 2]


def test_a_confirm_of_a_slot_not_in_flight_is_no_progress() -> None:
    """The tier agent confirms too (a take-back), and a stale request may be confirmed: neither says that this
    partition's requests are being taken."""
    schedule = ReleaseSchedule(resend_after_ms=30_000)
    schedule.adopt(0, due_slots(1))
    schedule.pop_due(0)
    schedule.confirm(0, b"other", "items/0/99", 1)
    assert schedule.pop_due(20_000) == []
    assert len(schedule.pop_due(30_000)) == 1


def test_the_lease_of_new_requests_starts_when_they_are_sent() -> None:
    schedule = ReleaseSchedule(resend_after_ms=30_000)
    schedule.adopt(0, [])
    schedule.received(0, 0)  # long ago
    schedule.add(0, Slot(100_000, b"k", "items/0/1", 1))
    assert len(schedule.pop_due(100_000)) == 1
    assert schedule.pop_due(129_999) == []
    assert len(schedule.pop_due(130_000)) == 1


def test_next_due_ms_leaves_out_partitions_whose_window_is_full() -> None:
    schedule = ReleaseSchedule(max_in_flight=1)
    slots = due_slots(2, due=100)
    schedule.adopt(0, slots)
    schedule.adopt(1, [Slot(500, b"x", "items/1/1", 1)])
    assert schedule.pop_due(200) == [(0, slots[0])]
    assert schedule.next_due_ms() == 500  # partition 0's due slot waits for a confirm, not for the clock
    schedule.pop_due(500)
    assert schedule.next_due_ms() is None
    confirm(schedule, slots[0])
    assert schedule.next_due_ms() == 101


def test_on_space_is_called_when_a_confirm_opens_a_full_window_with_slots_waiting() -> None:
    calls: list[None] = []
    schedule = ReleaseSchedule(max_in_flight=2, on_space=lambda: calls.append(None))
    slots = due_slots(4)
    schedule.adopt(0, slots)
    schedule.pop_due(10)
    confirm(schedule, slots[0])
    assert len(calls) == 1
    confirm(schedule, slots[1])  # it was not full any more
    assert len(calls) == 1
    schedule.pop_due(10)
    confirm(schedule, slots[2])  # full, but nothing waits behind it
    assert len(calls) == 1


def test_a_probe_taken_out_of_order_may_exceed_the_window_by_one() -> None:
    schedule = ReleaseSchedule(max_in_flight=1)
    slots = due_slots(3)
    schedule.adopt(0, slots)
    schedule.pop_due(10)
    schedule.take(0, slots[2], 10)
    assert schedule.pop_due(10) == []
    confirm(schedule, slots[0])
    assert schedule.pop_due(10) == []  # still full with the probe
    confirm(schedule, slots[2])
    assert schedule.pop_due(10) == [(0, slots[1])]


Op = tuple[str, int, int]
PARTITIONS = (0, 1, 2)
WINDOW = 3
RESEND_MS = 30_000

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from(PARTITIONS), st.integers(-5_000, 40_000)),
        st.tuples(st.just("pop"), st.just(0), st.integers(1, 8)),
        st.tuples(st.just("confirm"), st.sampled_from(PARTITIONS), st.integers(0, 10)),
        st.tuples(st.just("received"), st.sampled_from(PARTITIONS), st.just(0)),
        st.tuples(st.just("take"), st.sampled_from(PARTITIONS), st.integers(0, 10)),
        st.tuples(st.just("advance"), st.just(0), st.integers(0, 40_000)),
    ),
    min_size=20,  # long enough to fill windows and let partitions fall silent
    max_size=150,
)


@dataclass
class Model:
    """What the schedule should hold, kept by the test: slots waiting, in flight (in the order sent), confirmed."""

    schedule: ReleaseSchedule = field(default_factory=lambda: ReleaseSchedule(RESEND_MS, max_in_flight=WINDOW))
    now: int = 1_000_000
    waiting: dict[int, set[Slot]] = field(default_factory=lambda: {p: set() for p in PARTITIONS})
    in_flight: dict[int, dict[Slot, None]] = field(default_factory=lambda: {p: {} for p in PARTITIONS})
    confirmed: set[Slot] = field(default_factory=set)
    added: set[Slot] = field(default_factory=set)
    progress: dict[int, int] = field(default_factory=lambda: dict.fromkeys(PARTITIONS, -(10**9)))
    """Per partition, the last request taken or in-flight slot confirmed."""

    def __post_init__(self) -> None:
        for partition in PARTITIONS:
            self.schedule.adopt(partition, [])

    def add(self, partition: int, slot: Slot) -> None:
        self.schedule.add(partition, slot)
        self.waiting[partition].add(slot)
        self.added.add(slot)

    def pop(self, limit: int) -> None:
        due = self.schedule.pop_due(self.now, limit=limit)
        new = [(p, s) for p, s in due if s in self.waiting[p]]
        assert len(new) <= limit
        for partition, slot in due:
            assert slot.due_at_ms <= self.now  # nothing early, first send or resend
            if slot in self.waiting[partition]:
                assert slot == min(self.waiting[partition])  # in due order
                self.waiting[partition].remove(slot)
                self.in_flight[partition][slot] = None
            else:
                assert slot in self.in_flight[partition]  # a resend is of what is in flight, never of a confirmed slot
                assert self.now - self.progress[partition] >= RESEND_MS  # nor of a partition showing progress
        for partition in PARTITIONS:
            assert len(self.in_flight[partition]) <= WINDOW + 1
            if len(new) < limit and any(s.due_at_ms <= self.now for s in self.waiting[partition]):
                assert len(self.in_flight[partition]) >= WINDOW  # filled as far as the limit allows

    def confirm(self, partition: int, index: int) -> None:
        if self.in_flight[partition]:
            slot = list(self.in_flight[partition])[index % len(self.in_flight[partition])]
            confirm(self.schedule, slot, partition)
            del self.in_flight[partition][slot]
            self.confirmed.add(slot)
            self.progress[partition] = self.now

    def received(self, partition: int) -> None:
        self.schedule.received(partition, self.now)
        self.progress[partition] = self.now

    def take(self, partition: int, index: int) -> None:
        """A breaker's probe: one at a time, so at most one past the window."""
        due = sorted(s for s in self.waiting[partition] if s.due_at_ms <= self.now)
        if due and len(self.in_flight[partition]) <= WINDOW:
            slot = due[index % len(due)]
            self.schedule.take(partition, slot, self.now)
            self.waiting[partition].remove(slot)
            self.in_flight[partition][slot] = None

    def check(self) -> None:
        held = {(p, s) for p in PARTITIONS for s in self.waiting[p] | set(self.in_flight[p])}
        assert sorted(self.schedule.slots()) == sorted(held)  # every added slot is waiting, in flight or confirmed
        assert self.schedule.waiting() == len(held)
        assert self.added == {s for _, s in held} | self.confirmed


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_traffic_keeps_the_window_loses_nothing_and_releases_nothing_early(operations: list[Op]) -> None:
    model = Model()
    for number, (op, partition, value) in enumerate(operations):
        if op == "add":
            model.add(partition, Slot(model.now + value, b"k%d" % (number % 4), f"items/{partition}/{number}", 1))
        elif op == "pop":
            model.pop(value)
        elif op == "confirm":
            model.confirm(partition, value)
        elif op == "received":
            model.received(partition)
        elif op == "take":
            model.take(partition, value)
        else:
            model.now += value
        model.check()
    for _ in range(len(model.added) + 2):  # and all of it is released in the end, each slot confirmed once
        model.now += RESEND_MS
        model.pop(10_000)
        for partition in PARTITIONS:
            while model.in_flight[partition]:
                model.confirm(partition, 0)
    assert model.confirmed == model.added
    assert model.schedule.waiting() == 0


def test_a_suspended_partition_releases_nothing_and_resumes_with_its_slots_in_flight_ones_included() -> None:
    schedule = ReleaseSchedule(max_in_flight=2)
    slots = due_slots(4)
    schedule.adopt(0, list(slots))
    assert len(schedule.pop_due(100)) == 2
    schedule.suspend(0)  # revoked: its requests may be gone with the revocation
    assert (schedule.partitions, schedule.suspended) == (frozenset(), frozenset({0}))
    assert schedule.pop_due(100) == [] and schedule.next_due_ms() is None
    assert schedule.resume(0)
    assert [s for _, s in schedule.pop_due(100)] == slots[:2]  # in due order again, those in flight first
    assert not schedule.resume(0)


def test_a_slot_added_while_its_partition_is_suspended_is_kept_for_its_return() -> None:
    """A park or a held message's slot that comes while its partition is suspended (a rebalance revoked it and may
    give it straight back) is kept with its slots: resumed unread, the schedule must have it. A partition dropped or
    never adopted still takes none (its next adoption reads the table)."""
    schedule = ReleaseSchedule()
    schedule.adopt(0, [])
    schedule.suspend(0)
    schedule.add(0, slot(100, origin="items/0/1"))
    schedule.add(1, slot(100, origin="items/1/1"))
    assert schedule.pop_due(100) == []
    assert schedule.resume(0)
    assert [(p, s.origin) for p, s in schedule.pop_due(100)] == [(0, "items/0/1")]
    schedule.suspend(0)
    schedule.drop(0)
    schedule.add(0, slot(100, origin="items/0/2"))
    assert not schedule.resume(0) and schedule.waiting() == 0


def test_a_slot_added_again_while_its_partition_is_suspended_is_kept_once_at_the_earlier_due_time() -> None:
    """A release still running when its partition was revoked puts its slot back (revoked, tried again later; a
    deferral) after ``suspend`` kept the slot it had in flight: the partition given straight back sends one request
    for it, not two (the second one stale), at the earlier due time (a request never runs a release early; a later
    one would only delay it). So does a slot added twice during the suspension (a held message's, say)."""
    schedule = ReleaseSchedule()
    running, waiting = slot(100, origin="items/0/1"), slot(150, origin="items/0/2")
    schedule.adopt(0, [running, waiting])
    assert [s for _, s in schedule.pop_due(100)] == [running]
    schedule.suspend(0)
    schedule.add(0, slot(1100, origin="items/0/1"))  # (its release: revoked, tried again a second later)
    schedule.add(0, slot(200, origin="items/0/3", attempt=-1))
    schedule.add(0, slot(120, origin="items/0/3", attempt=-1))
    assert schedule.resume(0)
    assert [(s.origin, s.attempt, s.due_at_ms) for _, s in schedule.pop_due(10_000)] == [
        ("items/0/1", 1, 100),
        ("items/0/3", -1, 120),
        ("items/0/2", 1, 150),
    ]
    assert schedule.waiting() == 3


def test_a_suspended_partition_is_forgotten_by_drop_and_replaced_by_adopt() -> None:
    schedule = ReleaseSchedule()
    schedule.adopt(0, due_slots(2))
    schedule.suspend(0)
    schedule.drop(0)
    assert schedule.suspended == frozenset() and not schedule.resume(0)
    schedule.adopt(1, due_slots(2, partition=1))
    schedule.suspend(1)
    schedule.adopt(1, [])
    assert schedule.suspended == frozenset() and schedule.waiting() == 0


def test_only_the_latest_copy_of_a_request_counts_as_taken() -> None:
    """After a rebalance the agent reads again what its previous owner had not committed: an old copy of a request
    sent again since says nothing about the requests sent after it, so it must not make them look lost."""
    schedule = ReleaseSchedule(resend_after_ms=30_000)
    x, y = due_slots(2)
    schedule.adopt(0, [x, y])
    schedule.pop_due(100)
    old_x = schedule.send_number(0, x.ident)
    schedule.adopt(0, [y, x])  # a rebalance: both sent again, y first this time
    schedule.pop_due(200)
    assert schedule.send_number(0, x.ident) != old_x
    schedule.received(0, 300, x.ident, old_x)  # the old copy of x, read again first
    for now in range(1_000, 40_000, 1_000):  # the partition stays busy with other keys
        schedule.received(0, now)
        assert schedule.pop_due(now) == []  # y is queued behind, not lost
    schedule.received(0, 40_000, x.ident, schedule.send_number(0, x.ident))
    schedule.received(0, 40_001, y.ident, schedule.send_number(0, y.ident))
    assert schedule.pop_due(40_002) == []  # both taken: running, nothing to send


def test_pop_due_tells_new_slots_from_resent_ones() -> None:
    """The pacer charges only new releases (``rebound/pacing.py``): pop_due says which of its sends are new (moved
    from a heap, at most the limit) and which are lost requests sent again (bounded by the window, not the limit),
    in send order, a partition's resends before its new slots."""
    schedule = ReleaseSchedule(resend_after_ms=30_000, max_in_flight=5)
    slots = due_slots(8)
    schedule.adopt(0, list(slots))
    first = schedule.pop_due(100, limit=3)
    assert first.new == [(0, s) for s in slots[:3]] and first.resent == []
    assert list(first) == first.new
    again = schedule.pop_due(30_100, limit=1)  # silent for the resend window: its 3 in flight again, plus 1 new
    assert again.resent == [(0, s) for s in slots[:3]]
    assert again.new == [(0, slots[3])]
    assert list(again) == again.resent + again.new
    only_resends = schedule.pop_due(60_100, limit=0)  # a limit of 0 holds back new slots, never resends
    assert only_resends.new == []
    assert only_resends.resent == [(0, s) for s in slots[:4]]
    skipped = ReleaseSchedule(resend_after_ms=30_000, max_in_flight=10)
    skipped.adopt(0, due_slots(2))
    skipped.pop_due(100)
    skipped.received(0, 200, due_slots(2)[1].ident)  # the first request was skipped: lost
    popped = skipped.pop_due(30_100, limit=0)
    assert popped.resent == [(0, due_slots(2)[0])] and popped.new == []


def test_an_adoption_number_tells_a_partition_read_again_from_one_kept(schedule) -> None:
    """The survey of first receipts tells a partition adopted again (read afresh) from one kept all along, or kept
    while suspended and resumed as it was, by this number, even when it never saw the partition gone."""
    assert schedule.adoption(0) is None
    schedule.adopt(0, [slot(100)])
    first = schedule.adoption(0)
    assert first is not None
    schedule.suspend(0)
    assert schedule.adoption(0) == first
    assert schedule.resume(0)
    assert schedule.adoption(0) == first
    schedule.adopt(0, [slot(100)])  # read again (a replay into it), never dropped
    again = schedule.adoption(0)
    assert again not in (None, first)
    schedule.drop(0)
    assert schedule.adoption(0) is None
    schedule.adopt(0, [])
    assert schedule.adoption(0) not in (None, first, again)
