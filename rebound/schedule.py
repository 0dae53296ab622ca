"""The in-memory release schedule: a min-heap of due times per owned partition.

It is derived state: the changelog-backed table is the truth, and the schedule is rebuilt from it whenever a
partition is (re)assigned. It exists so that a timer tick costs in proportion to what is due, not to what is parked.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass(order=True, frozen=True, slots=True)
class Slot:
    due_at_ms: int
    table_key: bytes = field(compare=True)
    origin: str = field(compare=True)
    attempt: int = field(compare=True)
    tier: str = field(compare=False, default="")


@dataclass
class ReleaseSchedule:
    """Due slots per partition, plus those handed to the release stream and not yet confirmed."""

    resend_after_ms: int = 30_000
    _heaps: dict[int, list[Slot]] = field(default_factory=dict)
    _in_flight: dict[int, dict[tuple[bytes, str, int], tuple[int, Slot]]] = field(default_factory=dict)

    @property
    def partitions(self) -> frozenset[int]:
        return frozenset(self._heaps)

    def adopt(self, partition: int, slots: list[Slot]) -> None:
        """Start scheduling ``partition`` from a full scan of its table entries (on assignment)."""
        heap = list(slots)
        heapq.heapify(heap)
        self._heaps[partition] = heap
        self._in_flight[partition] = {}

    def drop(self, partition: int) -> None:
        """Forget a partition (revoked): nothing of it is released by this worker any more."""
        self._heaps.pop(partition, None)
        self._in_flight.pop(partition, None)

    def add(self, partition: int, slot: Slot) -> None:
        heap = self._heaps.get(partition)
        if heap is not None:  # not adopted yet: the adoption scan will find it in the table
            heapq.heappush(heap, slot)

    def pop_due(self, now_ms: int, limit: int = 10_000) -> list[tuple[int, Slot]]:
        """Slots due at ``now_ms``, moved to in-flight; plus in-flight slots never confirmed within the resend window."""
        due: list[tuple[int, Slot]] = []
        for partition, heap in self._heaps.items():
            in_flight = self._in_flight[partition]
            while heap and heap[0].due_at_ms <= now_ms and len(due) < limit:
                slot = heapq.heappop(heap)
                in_flight[(slot.table_key, slot.origin, slot.attempt)] = (now_ms, slot)
                due.append((partition, slot))
            for ident, (sent_at, slot) in list(in_flight.items()):
                if now_ms - sent_at >= self.resend_after_ms:
                    in_flight[ident] = (now_ms, slot)
                    due.append((partition, slot))
        return due

    def confirm(self, partition: int, table_key: bytes, origin: str, attempt: int) -> None:
        """The release stream handled (or discarded) this slot."""
        in_flight = self._in_flight.get(partition)
        if in_flight is not None:
            in_flight.pop((table_key, origin, attempt), None)

    def slots(self) -> Iterator[tuple[int, Slot]]:
        """Every slot held, waiting or in flight, with its partition: for status views, never for releasing."""
        for partition, heap in self._heaps.items():
            for slot in heap:
                yield partition, slot
        for partition, in_flight in self._in_flight.items():
            for _sent_at, slot in in_flight.values():
                yield partition, slot

    def waiting(self) -> int:
        return sum(len(heap) for heap in self._heaps.values()) + sum(len(f) for f in self._in_flight.values())

    def next_due_ms(self) -> int | None:
        return min((heap[0].due_at_ms for heap in self._heaps.values() if heap), default=None)

    def first_due(self, now_ms: int, accept: Callable[[Slot], bool]) -> tuple[int, Slot] | None:
        """The earliest due slot ``accept`` takes, asking in due order (for a breaker's probe, not for releasing:
        it sorts what is due)."""
        due = sorted(
            (slot, partition) for partition, heap in self._heaps.items() for slot in heap if slot.due_at_ms <= now_ms
        )
        return next(((partition, slot) for slot, partition in due if accept(slot)), None)

    def take(self, partition: int, slot: Slot, now_ms: int) -> None:
        """Move one waiting slot to in-flight (sent out of due order: a breaker's probe)."""
        heap = self._heaps.get(partition)
        if heap is not None and slot in heap:
            heap.remove(slot)
            heapq.heapify(heap)
            self._in_flight[partition][(slot.table_key, slot.origin, slot.attempt)] = (now_ms, slot)

    def postpone_held(self, *, opened_at_ms: int, closed_at_ms: int) -> int:
        """Move every waiting slot by the time a circuit breaker held it: its wait stopped while the breaker was open.

        A slot due before the breaker opened was overdue already and stays as it is (it runs now); one due while it
        was open moves by the part of its wait the breaker held, one due later by the whole time it was open. Due
        times only ever move later. Returns how many slots moved. (In memory only: the table keeps the policy's due
        time, so after a partition move the new owner releases at the earlier, original time.)
        """
        moved = 0
        for partition, heap in self._heaps.items():
            shifted = []
            for slot in heap:
                held = max(0, min(slot.due_at_ms, closed_at_ms) - opened_at_ms)
                if held and slot.attempt >= 0:
                    moved += 1
                    shifted.append(Slot(slot.due_at_ms + held, slot.table_key, slot.origin, slot.attempt, slot.tier))
                else:
                    shifted.append(slot)
            heapq.heapify(shifted)
            self._heaps[partition] = shifted
        return moved
