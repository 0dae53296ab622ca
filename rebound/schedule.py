"""The in-memory release schedule: min-heaps of due times per owned partition and tier topic.

It is derived state: the changelog-backed table is the truth, and the schedule is rebuilt from it whenever a
partition is (re)assigned. It exists so that a timer tick costs in proportion to what is due, not to what is parked.

Release requests are flow-controlled per partition. At most ``max_in_flight`` requests of a partition are sent and
not yet confirmed: a slow release agent then holds the rest back in the heap instead of finding an ever longer queue
of requests on the release topic. Requests are sent again only when their partition has shown no progress (no
confirm, no request taken) for ``resend_after_ms``, which is what lost requests look like (sent before a
rebalance, say); a busy agent, however slow, keeps its lease and sees no duplicates. A per-request timeout would
re-send every request that merely waited its turn, and the duplicates would slow the agent further (seen: 50,000 due
messages became 1,000,000 requests in 10 minutes).

The backlog's figures per partition and tier topic (:meth:`ReleaseSchedule.tier_stats`, asked by every ``/metrics``
scrape, ``/retry/backlog`` request and status tick) cost in proportion to the slots that came due since the last
call, not to how many are overdue. Each tier topic of a partition is a :class:`_Lane`: its waiting slots in two
min-heaps split at the time of the last figures, those due by then and those due later, so that what is overdue is a
length and the next release a heap's top; a new call moves across only the slots that came due since the last one,
each once (the first call after an adoption moves every overdue slot: as long as a walk of them, or longer). Its
in-flight slots are
counted as they are sent and confirmed, with a lazily cleaned heap for the oldest. (Walking the overdue slots of a
single heap instead, as before, cost in proportion to them: docs/benchmarks.md, ``python -m bench.schedule_micro``.)
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rebound.topics import tier_topic

Ident = tuple[bytes, str, int]
HELD_LANE = ""
"""The heap of key-ordered mode's held-message slots (attempt -1): not a tier, left out of the tier figures."""


@dataclass(order=True, frozen=True, slots=True)
class Slot:
    due_at_ms: int
    table_key: bytes = field(compare=True)
    origin: str = field(compare=True)
    attempt: int = field(compare=True)
    tier: str = field(compare=False, default="")

    @property
    def ident(self) -> Ident:
        return (self.table_key, self.origin, self.attempt)

    @property
    def lane(self) -> str:
        """The tier topic this slot waits in (``<main topic>.retry.<tier>``), or :data:`HELD_LANE`."""
        if self.attempt < 0:
            return HELD_LANE
        return tier_topic(self.origin.rsplit("/", 2)[0], self.tier)


def _walk_due(heap: list[Slot], now_ms: int, most: int | None = None) -> tuple[int, int | None]:
    """How many slots of a heap are due at ``now_ms``, and the earliest due time after it: visits only the due slots
    and their children (a heap's children are never due before their parent). With ``most``, stops once more than
    that many are due (and the second figure means nothing)."""
    due, later, stack = 0, None, [0] if heap else []
    while stack and (most is None or due <= most):
        index = stack.pop()
        slot_due = heap[index].due_at_ms
        if slot_due > now_ms:
            later = slot_due if later is None else min(later, slot_due)
            continue
        due += 1
        stack.extend(child for child in (2 * index + 1, 2 * index + 2) if child < len(heap))
    return due, later


class _Lane:
    """The slots of one partition's tier topic (:attr:`Slot.lane`): those waiting, and those in flight.

    The waiting slots are two min-heaps split at ``frontier`` (the time of the last figures): ``due`` holds those due
    at or before it, ``later`` the others, so every slot of ``due`` orders before every slot of ``later`` and the
    first of them all is ``due[0]``, else ``later[0]``. :meth:`stats` moves ``later``'s top slots across as time
    passes, each once, and reads the rest off lengths and tops. Until the first figures (``frontier`` None) all wait
    in ``later``. The in-flight slots (the partition's ``_in_flight`` holds them too) are kept by identity in
    ``flying``, with ``flying_heap`` (a min-heap, cleaned lazily) for the oldest and ``flying_max`` (at least the
    latest due time among them) telling when all of them are overdue."""

    __slots__ = ("due", "flying", "flying_heap", "flying_max", "frontier", "later")

    def __init__(self) -> None:
        self.due: list[Slot] = []
        self.later: list[Slot] = []
        self.frontier: int | None = None
        self.flying: dict[Ident, Slot] = {}
        self.flying_heap: list[tuple[int, int, Slot]] = []
        self.flying_max: int | None = None

    @property
    def waiting(self) -> int:
        return len(self.due) + len(self.later)

    def first(self) -> Slot | None:
        """The waiting slot due first."""
        if self.due:
            return self.due[0]
        return self.later[0] if self.later else None

    def __iter__(self) -> Iterator[Slot]:
        """The waiting slots, in no order."""
        yield from self.due
        yield from self.later

    def push(self, slot: Slot) -> None:
        if self.frontier is not None and slot.due_at_ms <= self.frontier:
            heapq.heappush(self.due, slot)
        else:
            heapq.heappush(self.later, slot)

    def pop(self) -> Slot:
        return heapq.heappop(self.due if self.due else self.later)

    def remove(self, slot: Slot) -> bool:
        """Take out one waiting slot equal to ``slot``; False if none waits."""
        heap = self.due if self.frontier is not None and slot.due_at_ms <= self.frontier else self.later
        if slot not in heap:
            return False
        heap.remove(slot)
        heapq.heapify(heap)
        return True

    def reset(self, slots: list[Slot]) -> None:
        """Wait for these slots instead (a pass over them all: for commands, not ticks)."""
        frontier = self.frontier
        if frontier is None:
            self.due, self.later = [], slots
        else:
            self.due = [slot for slot in slots if slot.due_at_ms <= frontier]
            self.later = [slot for slot in slots if slot.due_at_ms > frontier]
        heapq.heapify(self.due)
        heapq.heapify(self.later)

    def fly(self, slot: Slot) -> None:
        self.flying[slot.ident] = slot
        heapq.heappush(self.flying_heap, (slot.due_at_ms, id(slot), slot))  # (ints: no slot compared)
        if self.flying_max is None or slot.due_at_ms > self.flying_max:
            self.flying_max = slot.due_at_ms
        if len(self.flying_heap) > 2 * len(self.flying) + 64:  # (confirms out of due order leave stale entries)
            self.flying_heap = [(slot.due_at_ms, id(slot), slot) for slot in self.flying.values()]
            heapq.heapify(self.flying_heap)

    def land(self, slot: Slot) -> None:
        """``slot`` is in flight no more (confirmed, or replaced by a slot of its identity)."""
        if self.flying.get(slot.ident) is slot:
            del self.flying[slot.ident]
            if not self.flying:
                self.ground()

    def ground(self) -> None:
        """Nothing in flight (the partition was suspended: those in flight wait again)."""
        self.flying, self.flying_heap, self.flying_max = {}, [], None

    def _advance(self, now_ms: int) -> None:
        """Move the frontier on to ``now_ms``: the slots of ``later`` come due since go to ``due``, and only they
        (``due`` is not walked here; :meth:`stats` walks it only when the clock went back, as the old walk did: rare,
        the wall clock stepping back). Few of them: a heap pop and push each. More than an eighth of ``later`` (the
        first figures after an adoption, say): one pass over all of ``later`` splits it, and ``due`` is heapified once
        if they are many beside it. Either way the cost is in proportion to the slots moved (at most 8 times), each
        moved once, never to what was overdue before."""
        later, due = self.later, self.due
        if later and later[0].due_at_ms <= now_ms:
            most = len(later) // 8
            if _walk_due(later, now_ms, most=most)[0] > most:
                coming = [slot for slot in later if slot.due_at_ms <= now_ms]
                self.later = later = [slot for slot in later if slot.due_at_ms > now_ms]
                heapq.heapify(later)
            else:
                coming = []
                while later and later[0].due_at_ms <= now_ms:
                    coming.append(heapq.heappop(later))
            if len(coming) > len(due) // 8:
                due.extend(coming)
                heapq.heapify(due)
            else:
                for slot in coming:
                    heapq.heappush(due, slot)
        self.frontier = now_ms

    def stats(self, now_ms: int) -> dict[str, int | None] | None:
        """Waiting (in flight included), overdue, oldest due and next release at ``now_ms``; None if nothing is."""
        waiting, flying = self.waiting, self.flying
        if not waiting and not flying:
            return None
        if self.frontier is None or now_ms >= self.frontier:
            self._advance(now_ms)
            overdue, next_release = len(self.due), self.later[0].due_at_ms if self.later else None
        else:  # the clock went back: what was due by the frontier may not be due now
            overdue, next_release = _walk_due(self.due, now_ms)
            if self.later and (next_release is None or self.later[0].due_at_ms < next_release):
                next_release = self.later[0].due_at_ms
        first = self.first()
        oldest = None if first is None else first.due_at_ms
        if flying:
            heap = self.flying_heap
            while flying.get(heap[0][2].ident) is not heap[0][2]:
                heapq.heappop(heap)
            oldest = heap[0][0] if oldest is None else min(oldest, heap[0][0])
            if self.flying_max is not None and self.flying_max <= now_ms:
                overdue += len(flying)
            else:  # (a probe taken early, or a clock gone back: rare, and bounded by the window)
                self.flying_max = max(slot.due_at_ms for slot in flying.values())
                for slot in flying.values():
                    if slot.due_at_ms <= now_ms:
                        overdue += 1
                    elif next_release is None or slot.due_at_ms < next_release:
                        next_release = slot.due_at_ms
        return {
            "waiting": waiting + len(flying),
            "overdue": overdue,
            "oldest_due": oldest,
            "next_release": next_release,
        }


def _lane(lanes: dict[str, _Lane], slot: Slot) -> _Lane:
    """The lane of ``slot``, made if it has none yet."""
    lane = lanes.get(slot.lane)
    if lane is None:
        lane = lanes[slot.lane] = _Lane()
    return lane


def _top(lanes: dict[str, _Lane]) -> tuple[Slot, _Lane] | None:
    """The waiting slot due first and its lane (a handful of tiers: a scan beats a heap of heaps)."""
    best: tuple[Slot, _Lane] | None = None
    for lane in lanes.values():
        heap = lane.due or lane.later  # (lane.first(), inline: this runs twice per slot sent)
        if heap and (best is None or heap[0] < best[0]):
            best = (heap[0], lane)
    return best


class Popped(list[tuple[int, Slot]]):
    """What :meth:`ReleaseSchedule.pop_due` hands over: every request to send now, as ``(partition, slot)`` in the
    order to send them (each partition's in the order of their send numbers), and the same split in two."""

    __slots__ = ("new", "resent")

    def __init__(
        self, sends: list[tuple[int, Slot]], new: list[tuple[int, Slot]], resent: list[tuple[int, Slot]]
    ) -> None:
        super().__init__(sends)
        self.new = new
        """Slots sent for the first time (moved from a heap to in-flight): at most the ``limit``."""
        self.resent = resent
        """In-flight slots sent again, their earlier request looking lost: bounded by the windows, not the limit."""


@dataclass
class ReleaseSchedule:
    """Due slots per partition, plus those handed to the release stream and not yet confirmed."""

    resend_after_ms: int = 30_000
    max_in_flight: int = 1000
    """Requests of one partition sent and not yet confirmed; more due slots wait in the heap until some are."""
    on_space: Callable[[], None] | None = None
    """Called when a confirm opens a full window while slots wait: the timer sleeps through full windows
    (``next_due_ms`` leaves them out) and must wake to send the next ones."""
    _lanes: dict[int, dict[str, _Lane]] = field(default_factory=dict)
    """Per partition, per tier topic (:attr:`Slot.lane`): the slots not yet sent, and (for the figures) those in
    flight, which ``_in_flight`` holds too."""
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
    _suspended: dict[int, dict[str, _Lane]] = field(default_factory=dict)
    """Revoked partitions' lanes, kept in case the partition comes straight back with nothing replayed into its
    table: then the schedule resumes without reading the partition again (a rebalance revokes every partition)."""
    _kept: dict[int, dict[Ident, Slot]] = field(default_factory=dict)
    """Per suspended partition, by identity, the slots it had in flight and those added since: :meth:`resume` puts
    them in its heaps. A release still running when its partition was revoked adds its slot again (revoked, tried
    again a second later; a deferral): one slot is kept, so the partition does not come back with two requests for
    one message. The earlier due time wins: a slot only asks for a release, which is never run early (an early
    request puts its slot back at its due time, a deferred one behind its key), so an early slot costs at most a
    request, where a later one would delay a release revoked by a rebalance that gave its partition straight back."""
    _sends: int = 0
    _adoptions: int = 0
    _adopted: dict[int, int] = field(default_factory=dict)
    """Per partition scheduled or suspended: its :meth:`adoption` number."""
    _progressed: set[int] = field(default_factory=set)
    """Partitions confirmed since the last tick: ``confirm`` has no clock, so the tick stamps their lease."""

    @property
    def partitions(self) -> frozenset[int]:
        return frozenset(self._lanes)

    def adopt(self, partition: int, slots: list[Slot]) -> None:
        """Start scheduling ``partition`` from a read of its table entries (on assignment)."""
        self._suspended.pop(partition, None)
        self._kept.pop(partition, None)
        lanes: dict[str, _Lane] = {}
        for slot in slots:
            lane = lanes.get(slot.lane)
            if lane is None:
                lane = lanes[slot.lane] = _Lane()
            lane.later.append(slot)
        for lane in lanes.values():
            heapq.heapify(lane.later)
        self._lanes[partition] = lanes
        self._adoptions += 1
        self._adopted[partition] = self._adoptions
        self._in_flight[partition] = {}
        self._lease_ms[partition] = 0
        self._untaken[partition] = {}
        self._taken_up_to[partition] = 0
        self._progressed.discard(partition)

    def adoption(self, partition: int) -> int | None:
        """A number that changes each time ``partition`` is adopted (read afresh from its table entries), kept while
        it is suspended and when it resumes as it was; None if it is neither scheduled nor suspended. Tells a partition
        adopted again (a takeover, a replay into it) from one kept all along, even between two looks at
        :attr:`partitions`."""
        return self._adopted.get(partition)

    @property
    def suspended(self) -> frozenset[int]:
        return frozenset(self._suspended)

    def suspend(self, partition: int) -> None:
        """Stop releasing a revoked partition, but keep its slots for :meth:`resume` (those in flight too, back in its
        heaps then: their requests may be gone with the revocation)."""
        lanes = self._lanes.get(partition)
        if lanes is None:
            return
        for lane in lanes.values():
            lane.ground()
        kept = dict(self._in_flight.get(partition, {}))  # (in the heaps at resume, one slot per identity)
        adoption = self._adopted.get(partition)
        self.drop(partition)
        self._suspended[partition] = lanes
        self._kept[partition] = kept
        if adoption is not None:  # (always, for lanes made by adopt: never a KeyError on the revocation's path)
            self._adopted[partition] = adoption

    def resume(self, partition: int) -> bool:
        """Schedule a partition assigned back as it was when it was revoked; False if it was not kept."""
        lanes = self._suspended.pop(partition, None)
        kept = self._kept.pop(partition, {})
        if lanes is None:
            return False
        adoption = self._adopted.get(partition)
        self.adopt(partition, [])
        for slot in kept.values():
            _lane(lanes, slot).push(slot)  # (the lane's push: each on its side of the split)
        self._lanes[partition] = lanes
        if adoption is not None:
            self._adopted[partition] = adoption
        return True

    def drop(self, partition: int) -> None:
        """Forget a partition (revoked): nothing of it is released by this worker any more."""
        self._suspended.pop(partition, None)
        self._kept.pop(partition, None)
        self._lanes.pop(partition, None)
        self._in_flight.pop(partition, None)
        self._lease_ms.pop(partition, None)
        self._untaken.pop(partition, None)
        self._taken_up_to.pop(partition, None)
        self._adopted.pop(partition, None)
        self._progressed.discard(partition)

    def add(self, partition: int, slot: Slot) -> None:
        """Schedule ``slot``. A suspended partition keeps it for :meth:`resume` (a park or a held message's slot that
        came during the revocation: resumed, the partition is not read again), one per identity with the one it had
        in flight or was given meanwhile (``_kept``); one not adopted, or dropped, takes none (its adoption reads the
        table)."""
        lanes = self._lanes.get(partition)
        if lanes is not None:
            _lane(lanes, slot).push(slot)
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
        for partition, lanes in self._lanes.items():
            in_flight = self._in_flight[partition]
            if in_flight and now_ms - self._lease_ms[partition] >= self.resend_after_ms:
                sends[partition] = list(in_flight.values())
                for slot in in_flight.values():
                    self._sent(partition, slot.ident, now_ms)
                self._lease_ms[partition] = now_ms
            else:
                sends[partition] = self._skipped(partition, now_ms)
            resends[partition] = len(sends[partition])
            top = _top(lanes)
            if len(in_flight) < self.max_in_flight and top is not None and top[0].due_at_ms <= now_ms:
                tops.append((top[0], partition))
        heapq.heapify(tops)
        popped = 0
        while tops and popped < limit:
            _, partition = heapq.heappop(tops)
            lanes, in_flight = self._lanes[partition], self._in_flight[partition]
            if not in_flight:  # the lease of requests sent now starts now, not at this partition's last progress
                self._lease_ms[partition] = now_ms
            top = _top(lanes)
            assert top is not None
            slot = top[1].pop()
            self._fly(partition, top[1], slot)
            self._sent(partition, slot.ident, now_ms)
            sends[partition].append(slot)
            new.append((partition, slot))
            popped += 1
            top = _top(lanes)
            if len(in_flight) < self.max_in_flight and top is not None and top[0].due_at_ms <= now_ms:
                heapq.heappush(tops, (top[0], partition))
        resent = [(partition, slot) for partition, slots in sends.items() for slot in slots[: resends[partition]]]
        return Popped([(partition, slot) for partition, slots in sends.items() for slot in slots], new, resent)

    def discard(self, partition: int, idents: set[Ident]) -> None:
        """Take these waiting slots out (an operator moved or ended their messages), so the time figures do not
        count them until they would have come due. Costs a pass over the partition's heaps: for commands, not ticks."""
        for lane in self._lanes.get(partition, {}).values():
            kept = [slot for slot in lane if slot.ident not in idents]
            if len(kept) != lane.waiting:
                lane.reset(kept)

    def _fly(self, partition: int, lane: _Lane, slot: Slot) -> None:
        """``slot`` (taken off ``lane``) is in flight."""
        in_flight = self._in_flight[partition]
        replaced = in_flight.get(slot.ident)
        if replaced is not None:  # (a second slot of one identity: only the latest counts as in flight)
            _lane(self._lanes[partition], replaced).land(replaced)
        in_flight[slot.ident] = slot
        lane.fly(slot)

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
        slot = None if in_flight is None else in_flight.pop((table_key, origin, attempt), None)
        if in_flight is None or slot is None:
            return  # not one of this schedule's requests (a tier agent's take-back, a request from before adoption)
        lanes = self._lanes[partition]
        _lane(lanes, slot).land(slot)
        self._untaken[partition].pop((table_key, origin, attempt), None)
        self._progressed.add(partition)
        if (
            len(in_flight) == self.max_in_flight - 1
            and self.on_space is not None
            and any(lane.waiting for lane in lanes.values())
        ):
            self.on_space()  # (the heaps are looked at only when the window has just opened)

    def slots(self) -> Iterator[tuple[int, Slot]]:
        """Every slot held, waiting or in flight, with its partition: for status views, never for releasing."""
        for partition, lanes in self._lanes.items():
            for lane in lanes.values():
                for slot in lane:
                    yield partition, slot
        for partition, in_flight in self._in_flight.items():
            for slot in in_flight.values():
                yield partition, slot

    def waiting(self) -> int:
        waiting = sum(lane.waiting for lanes in self._lanes.values() for lane in lanes.values())
        return waiting + sum(len(f) for f in self._in_flight.values())

    def tier_stats(self, now_ms: int) -> dict[int, dict[str, dict[str, int | None]]]:
        """Per partition and tier topic: slots waiting (in flight included), overdue, oldest due time, next release.

        Costs a few steps per tier topic plus a move across the split for each slot that came due since the last call
        (:meth:`_Lane._advance`), whatever was overdue before: the first call after an adoption moves every overdue
        slot once; later calls move only the newly due, with no pass over what is parked or in flight but for these:
        a clock gone back walks each lane's overdue slots (as the old walk did; rare: the wall clock stepping back),
        an in-flight slot due (or lately due) later than now makes one pass over its lane's in-flight slots (bounded
        by the window), and many slots come due at once make one pass over the lane's not yet due ones (bounded to
        about 8 times the slots moved).
        Held-message slots are left out (they are not in a tier).
        """
        result: dict[int, dict[str, dict[str, int | None]]] = {}
        for partition, lanes in self._lanes.items():
            tiers = result[partition] = {}
            for name, lane in lanes.items():
                if name != HELD_LANE:
                    stats = lane.stats(now_ms)
                    if stats is not None:
                        tiers[name] = stats
        return result

    def next_due_ms(self) -> int | None:
        """The earliest due time a tick could send now: a partition with a full window sends nothing before a
        confirm (which calls ``on_space``), so its due slots must not make the timer spin."""
        return min(
            (
                first.due_at_ms
                for partition, lanes in self._lanes.items()
                if len(self._in_flight[partition]) < self.max_in_flight
                for lane in lanes.values()
                if (first := lane.first()) is not None
            ),
            default=None,
        )

    def first_due(self, now_ms: int, accept: Callable[[Slot], bool]) -> tuple[int, Slot] | None:
        """The earliest due slot ``accept`` takes, asking in due order (for a breaker's probe, not for releasing:
        it sorts what is due)."""
        due = sorted(
            (slot, partition)
            for partition, lanes in self._lanes.items()
            for lane in lanes.values()
            for slot in lane
            if slot.due_at_ms <= now_ms
        )
        return next(((partition, slot) for slot, partition in due if accept(slot)), None)

    def take(self, partition: int, slot: Slot, now_ms: int) -> None:
        """Move one waiting slot to in-flight (sent out of due order: a breaker's probe). It may exceed the window by
        one: the probe is what decides whether anything else is released at all."""
        lane = self._lanes.get(partition, {}).get(slot.lane)
        if lane is not None and lane.remove(slot):
            if not self._in_flight[partition]:
                self._lease_ms[partition] = now_ms
            self._fly(partition, lane, slot)
            self._sent(partition, slot.ident, now_ms)

    def postpone_held(self, *, opened_at_ms: int, closed_at_ms: int) -> int:
        """Move every waiting slot by the time a circuit breaker held it: its wait stopped while the breaker was open.

        A slot due before the breaker opened was overdue already and stays as it is (it runs now); one due while it
        was open moves by the part of its wait the breaker held, one due later by the whole time it was open. Due
        times only ever move later. Returns how many slots moved. (In memory only: the table keeps the policy's due
        time, so after a partition move the new owner releases at the earlier, original time.)
        """
        moved = 0
        for lanes in self._lanes.values():
            for lane in lanes.values():
                shifted = []
                for slot in lane:
                    held = max(0, min(slot.due_at_ms, closed_at_ms) - opened_at_ms)
                    if held and slot.attempt >= 0:
                        moved += 1
                        shifted.append(
                            Slot(slot.due_at_ms + held, slot.table_key, slot.origin, slot.attempt, slot.tier)
                        )
                    else:
                        shifted.append(slot)
                lane.reset(shifted)
        return moved
