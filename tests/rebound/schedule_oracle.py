"""Test-only oracle: :class:`rebound.schedule.ReleaseSchedule` as it was before the lanes kept the backlog figures
(``main`` at the merge of s33-keyorder, 248489f), one plain min-heap per tier topic and ``tier_stats`` walking every
overdue slot. ``tests/rebound/test_schedule_stats.py`` runs it beside the real class and compares every observable
after each operation."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rebound.schedule import HELD_LANE, Ident, Popped, Slot


def _top(heaps: dict[str, list[Slot]]) -> list[Slot] | None:
    """The heap whose first slot is due first (a handful of tiers: a scan beats a heap of heaps)."""
    best: list[Slot] | None = None
    for heap in heaps.values():
        if heap and (best is None or heap[0] < best[0]):
            best = heap
    return best


def _walk_due(heap: list[Slot], now_ms: int) -> tuple[int, int | None]:
    """How many slots of a heap are due at ``now_ms``, and the earliest due time after it: visits only the due slots
    and their children (a heap's children are never due before their parent)."""
    due, later, stack = 0, None, [0] if heap else []
    while stack:
        index = stack.pop()
        slot_due = heap[index].due_at_ms
        if slot_due > now_ms:
            later = slot_due if later is None else min(later, slot_due)
            continue
        due += 1
        stack.extend(child for child in (2 * index + 1, 2 * index + 2) if child < len(heap))
    return due, later


@dataclass
class WalkedSchedule:
    """Due slots per partition, plus those handed to the release stream and not yet confirmed."""

    resend_after_ms: int = 30_000
    max_in_flight: int = 1000
    """Requests of one partition sent and not yet confirmed; more due slots wait in the heap until some are."""
    on_space: Callable[[], None] | None = None
    """Called when a confirm opens a full window while slots wait: the timer sleeps through full windows
    (``next_due_ms`` leaves them out) and must wake to send the next ones."""
    _heaps: dict[int, dict[str, list[Slot]]] = field(default_factory=dict)
    """Per partition, per tier topic (:attr:`Slot.lane`): the slots not yet sent, as a min-heap."""
    _in_flight: dict[int, dict[Ident, Slot]] = field(default_factory=dict)
    _lease_ms: dict[int, int] = field(default_factory=dict)
    """Per partition: its last sign of progress, or when its window last went from empty to in use, or its last
    resend. Its in-flight requests are sent again once this is ``resend_after_ms`` old."""
    _untaken: dict[int, dict[Ident, tuple[int, int]]] = field(default_factory=dict)
    """Per partition, the requests sent and not yet taken off the topic by the release agent, in the order they were
    sent: ``(send number, sent at)``."""
    _taken_up_to: dict[int, int] = field(default_factory=dict)
    """Per partition, the highest send number the release agent has taken: an untaken request sent before it was
    skipped, so lost (a failed send), even while the partition is busy."""
    _suspended: dict[int, dict[str, list[Slot]]] = field(default_factory=dict)
    """Revoked partitions' heaps, kept in case the partition comes straight back with nothing replayed into its
    table: then the schedule resumes without reading the partition again (a rebalance revokes every partition)."""
    _kept: dict[int, dict[Ident, Slot]] = field(default_factory=dict)
    """Per suspended partition, by identity, the slots it had in flight and those added since: :meth:`resume` puts
    them in its heaps. A release still running when its partition was revoked adds its slot again (revoked, tried
    again a second later; a deferral): one slot is kept, so the partition does not come back with two requests for
    one message. The earlier due time wins: a slot only asks for a release, which is never run early (an early
    request puts its slot back at its due time, a deferred one behind its key), so an early slot costs at most a
    request, where a later one would delay a release revoked by a rebalance that gave its partition straight back."""
    _sends: int = 0
    _progressed: set[int] = field(default_factory=set)
    """Partitions confirmed since the last tick: ``confirm`` has no clock, so the tick stamps their lease."""

    @property
    def partitions(self) -> frozenset[int]:
        return frozenset(self._heaps)

    def adopt(self, partition: int, slots: list[Slot]) -> None:
        """Start scheduling ``partition`` from a read of its table entries (on assignment)."""
        self._suspended.pop(partition, None)
        self._kept.pop(partition, None)
        heaps: dict[str, list[Slot]] = {}
        for slot in slots:
            heaps.setdefault(slot.lane, []).append(slot)
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps[partition] = heaps
        self._in_flight[partition] = {}
        self._lease_ms[partition] = 0
        self._untaken[partition] = {}
        self._taken_up_to[partition] = 0
        self._progressed.discard(partition)

    @property
    def suspended(self) -> frozenset[int]:
        return frozenset(self._suspended)

    def suspend(self, partition: int) -> None:
        """Stop releasing a revoked partition, but keep its slots for :meth:`resume` (those in flight too, back in its
        heaps then: their requests may be gone with the revocation)."""
        heaps = self._heaps.get(partition)
        if heaps is None:
            return
        kept = dict(self._in_flight.get(partition, {}))  # (in the heaps at resume, one slot per identity)
        self.drop(partition)
        self._suspended[partition] = heaps
        self._kept[partition] = kept

    def resume(self, partition: int) -> bool:
        """Schedule a partition assigned back as it was when it was revoked; False if it was not kept."""
        heaps = self._suspended.pop(partition, None)
        kept = self._kept.pop(partition, {})
        if heaps is None:
            return False
        self.adopt(partition, [])
        for slot in kept.values():
            heapq.heappush(heaps.setdefault(slot.lane, []), slot)
        self._heaps[partition] = heaps
        return True

    def drop(self, partition: int) -> None:
        """Forget a partition (revoked): nothing of it is released by this worker any more."""
        self._suspended.pop(partition, None)
        self._kept.pop(partition, None)
        self._heaps.pop(partition, None)
        self._in_flight.pop(partition, None)
        self._lease_ms.pop(partition, None)
        self._untaken.pop(partition, None)
        self._taken_up_to.pop(partition, None)
        self._progressed.discard(partition)

    def add(self, partition: int, slot: Slot) -> None:
        """Schedule ``slot``. A suspended partition keeps it for :meth:`resume` (a park or a held message's slot that
        came during the revocation: resumed, the partition is not read again), one per identity with the one it had
        in flight or was given meanwhile (``_kept``); one not adopted, or dropped, takes none (its adoption reads the
        table)."""
        heaps = self._heaps.get(partition)
        if heaps is not None:
            heapq.heappush(heaps.setdefault(slot.lane, []), slot)
        elif partition in self._kept:
            kept = self._kept[partition]
            other = kept.get(slot.ident)
            if other is None or slot.due_at_ms < other.due_at_ms:
                kept[slot.ident] = slot

    def pop_due(self, now_ms: int, limit: int = 10_000) -> Popped:
        """Due slots moved to in-flight, as many as each partition's window has room for; plus, for a partition
        silent for ``resend_after_ms``, its in-flight slots again. The answer tells the two apart
        (:attr:`Popped.new`, :attr:`Popped.resent`).

        Costs one check per partition plus what it returns: in-flight slots are only looked at when they are re-sent.
        ``limit`` bounds the new slots of one tick, never the resends: those are bounded by the windows (at most
        ``max_in_flight`` per partition), and a limit on them could keep a lost request from ever being sent again.
        Under a limit the earliest due go first, whatever their partition (a paced release would otherwise drain one
        partition before the next).
        """
        for partition in self._progressed:
            self._lease_ms[partition] = now_ms
        self._progressed.clear()
        sends: dict[int, list[Slot]] = {}  # (returned grouped by partition, each partition's in send-number order)
        resends: dict[int, int] = {}  # per partition, how many of its sends (the first ones) are resends
        new: list[tuple[int, Slot]] = []
        tops: list[tuple[Slot, int]] = []
        for partition, heaps in self._heaps.items():
            in_flight = self._in_flight[partition]
            if in_flight and now_ms - self._lease_ms[partition] >= self.resend_after_ms:
                sends[partition] = list(in_flight.values())
                for slot in in_flight.values():
                    self._sent(partition, slot.ident, now_ms)
                self._lease_ms[partition] = now_ms
            else:
                sends[partition] = self._skipped(partition, now_ms)
            resends[partition] = len(sends[partition])
            heap = _top(heaps)
            if len(in_flight) < self.max_in_flight and heap is not None and heap[0].due_at_ms <= now_ms:
                tops.append((heap[0], partition))
        heapq.heapify(tops)
        popped = 0
        while tops and popped < limit:
            _, partition = heapq.heappop(tops)
            heaps, in_flight = self._heaps[partition], self._in_flight[partition]
            if not in_flight:  # the lease of requests sent now starts now, not at this partition's last progress
                self._lease_ms[partition] = now_ms
            heap = _top(heaps)
            assert heap is not None
            slot = heapq.heappop(heap)
            in_flight[slot.ident] = slot
            self._sent(partition, slot.ident, now_ms)
            sends[partition].append(slot)
            new.append((partition, slot))
            popped += 1
            heap = _top(heaps)
            if len(in_flight) < self.max_in_flight and heap is not None and heap[0].due_at_ms <= now_ms:
                heapq.heappush(tops, (heap[0], partition))
        resent = [(partition, slot) for partition, slots in sends.items() for slot in slots[: resends[partition]]]
        return Popped([(partition, slot) for partition, slots in sends.items() for slot in slots], new, resent)

    def discard(self, partition: int, idents: set[Ident]) -> None:
        """Take these waiting slots out (an operator moved or ended their messages), so the time figures do not
        count them until they would have come due. Costs a pass over the partition's heaps: for commands, not ticks."""
        for lane, heap in self._heaps.get(partition, {}).items():
            kept = [slot for slot in heap if slot.ident not in idents]
            if len(kept) != len(heap):
                heapq.heapify(kept)
                self._heaps[partition][lane] = kept

    def _sent(self, partition: int, ident: Ident, now_ms: int) -> None:
        self._sends += 1
        untaken = self._untaken[partition]
        untaken.pop(ident, None)
        untaken[ident] = (self._sends, now_ms)

    def _skipped(self, partition: int, now_ms: int) -> list[Slot]:
        """In-flight slots whose request was sent before one the agent has taken, yet never taken itself, for
        ``resend_after_ms``: requests of a partition are read in order, so those were lost. Looks at the oldest
        untaken requests only."""
        untaken, taken_up_to = self._untaken[partition], self._taken_up_to[partition]
        skipped = []
        while untaken:
            ident, (number, sent_at) = next(iter(untaken.items()))
            if number > taken_up_to or now_ms - sent_at < self.resend_after_ms:
                break
            slot = self._in_flight[partition].get(ident)
            if slot is None:
                del untaken[ident]
                continue
            skipped.append(slot)
            self._sent(partition, ident, now_ms)
        return skipped

    def send_number(self, partition: int, ident: Ident) -> int | None:
        """The number of the slot's latest send, for its request to carry: only that copy counts as taken."""
        sent = self._untaken.get(partition, {}).get(ident)
        return None if sent is None else sent[0]

    def received(self, partition: int, now_ms: int, ident: Ident | None = None, number: int | None = None) -> None:
        """The release agent took a request of ``partition`` off the topic: it is alive there, if busy, so what is
        in flight is not lost (a request it takes and never confirms waits for the partition to fall silent).

        Only the copy of the slot's latest send (its ``number``) counts as taking it: an older copy read again after
        a rebalance says nothing about the requests sent since."""
        if partition in self._lease_ms:
            self._lease_ms[partition] = now_ms
        untaken = self._untaken.get(partition, {})
        sent = untaken.get(ident) if ident is not None else None
        if sent is None or (number is not None and number != sent[0]):
            return
        del untaken[ident]  # type: ignore[arg-type]
        self._taken_up_to[partition] = max(self._taken_up_to[partition], sent[0])

    def confirm(self, partition: int, table_key: bytes, origin: str, attempt: int) -> None:
        """The release stream handled (or discarded) this slot."""
        in_flight = self._in_flight.get(partition)
        if in_flight is None or in_flight.pop((table_key, origin, attempt), None) is None:
            return  # not one of this schedule's requests (a tier agent's take-back, a request from before adoption)
        self._untaken[partition].pop((table_key, origin, attempt), None)
        self._progressed.add(partition)
        if (
            len(in_flight) == self.max_in_flight - 1
            and self.on_space is not None
            and any(self._heaps[partition].values())
        ):
            self.on_space()  # (the heaps are looked at only when the window has just opened)

    def slots(self) -> Iterator[tuple[int, Slot]]:
        """Every slot held, waiting or in flight, with its partition: for status views, never for releasing."""
        for partition, heaps in self._heaps.items():
            for heap in heaps.values():
                for slot in heap:
                    yield partition, slot
        for partition, in_flight in self._in_flight.items():
            for slot in in_flight.values():
                yield partition, slot

    def waiting(self) -> int:
        waiting = sum(len(heap) for heaps in self._heaps.values() for heap in heaps.values())
        return waiting + sum(len(f) for f in self._in_flight.values())

    def tier_stats(self, now_ms: int) -> dict[int, dict[str, dict[str, int | None]]]:
        """Per partition and tier topic: slots waiting (in flight included), overdue, oldest due time, next release.

        Costs one look per tier heap plus the overdue slots and the ones in flight (bounded by the windows), never a
        pass over everything parked. Held-message slots are left out (they are not in a tier).
        """
        result: dict[int, dict[str, dict[str, int | None]]] = {}
        for partition, heaps in self._heaps.items():
            tiers = result.setdefault(partition, {})
            for lane, heap in heaps.items():
                if lane == HELD_LANE or not heap:
                    continue
                overdue, later = _walk_due(heap, now_ms)
                tiers[lane] = {
                    "waiting": len(heap),
                    "overdue": overdue,
                    "oldest_due": heap[0].due_at_ms,
                    "next_release": later,
                }
            for slot in self._in_flight.get(partition, {}).values():
                if slot.lane == HELD_LANE:
                    continue
                stats = tiers.setdefault(
                    slot.lane, {"waiting": 0, "overdue": 0, "oldest_due": None, "next_release": None}
                )
                stats["waiting"] = int(stats["waiting"] or 0) + 1
                oldest = stats["oldest_due"]
                stats["oldest_due"] = slot.due_at_ms if oldest is None else min(oldest, slot.due_at_ms)
                if slot.due_at_ms <= now_ms:
                    stats["overdue"] = int(stats["overdue"] or 0) + 1
                else:  # (a probe taken early, or a postponed slot)
                    later = stats["next_release"]
                    stats["next_release"] = slot.due_at_ms if later is None else min(later, slot.due_at_ms)
        return result

    def next_due_ms(self) -> int | None:
        """The earliest due time a tick could send now: a partition with a full window sends nothing before a
        confirm (which calls ``on_space``), so its due slots must not make the timer spin."""
        return min(
            (
                heap[0].due_at_ms
                for partition, heaps in self._heaps.items()
                if len(self._in_flight[partition]) < self.max_in_flight
                for heap in heaps.values()
                if heap
            ),
            default=None,
        )

    def first_due(self, now_ms: int, accept: Callable[[Slot], bool]) -> tuple[int, Slot] | None:
        """The earliest due slot ``accept`` takes, asking in due order (for a breaker's probe, not for releasing:
        it sorts what is due)."""
        due = sorted(
            (slot, partition)
            for partition, heaps in self._heaps.items()
            for heap in heaps.values()
            for slot in heap
            if slot.due_at_ms <= now_ms
        )
        return next(((partition, slot) for slot, partition in due if accept(slot)), None)

    def take(self, partition: int, slot: Slot, now_ms: int) -> None:
        """Move one waiting slot to in-flight (sent out of due order: a breaker's probe). It may exceed the window by
        one: the probe is what decides whether anything else is released at all."""
        heap = self._heaps.get(partition, {}).get(slot.lane)
        if heap is not None and slot in heap:
            heap.remove(slot)
            heapq.heapify(heap)
            in_flight = self._in_flight[partition]
            if not in_flight:
                self._lease_ms[partition] = now_ms
            in_flight[slot.ident] = slot
            self._sent(partition, slot.ident, now_ms)

    def postpone_held(self, *, opened_at_ms: int, closed_at_ms: int) -> int:
        """Move every waiting slot by the time a circuit breaker held it: its wait stopped while the breaker was open.

        A slot due before the breaker opened was overdue already and stays as it is (it runs now); one due while it
        was open moves by the part of its wait the breaker held, one due later by the whole time it was open. Due
        times only ever move later. Returns how many slots moved. (In memory only: the table keeps the policy's due
        time, so after a partition move the new owner releases at the earlier, original time.)
        """
        moved = 0
        for heaps in self._heaps.values():
            for lane, heap in heaps.items():
                shifted = []
                for slot in heap:
                    held = max(0, min(slot.due_at_ms, closed_at_ms) - opened_at_ms)
                    if held and slot.attempt >= 0:
                        moved += 1
                        shifted.append(
                            Slot(slot.due_at_ms + held, slot.table_key, slot.origin, slot.attempt, slot.tier)
                        )
                    else:
                        shifted.append(slot)
                heapq.heapify(shifted)
                heaps[lane] = shifted
        return moved
