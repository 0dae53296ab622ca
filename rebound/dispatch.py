"""Per-key dispatch with bounded concurrency and contiguous acknowledgements: the bookkeeping, without Faust.

Faust's agents either run one message at a time (a 20 ms handler caps a worker at 50 messages/s) or, with
``concurrency=N``, acknowledge past messages still in flight (faust-streaming#606). Confluent's Parallel Consumer and
Karafka's virtual partitions show the way out, and this is it: different keys run at once, one key runs one message
at a time in offset order, and an offset is acknowledged only once it and every earlier offset of its partition are
done, so the committed offset never passes work that has not finished.

:class:`Dispatch` only decides: what starts now, what may be acknowledged now (in offset order), what must never be
acknowledged (it will be read again), and which partitions should stop or start being read. ``agents/dispatcher.py``
carries the decisions out with asyncio tasks and Faust's consumer. Nothing here awaits, so every rule is tested
step by step without a broker or an event loop.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")


class State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    CONFIRMING = "confirming"
    """Let go of its slot and lane (:meth:`Dispatch.let_go`): its writes are becoming durable, not acknowledged yet."""
    DONE = "done"
    DROPPED = "dropped"


@dataclass(eq=False, slots=True)
class Work(Generic[T]):
    """One offset of one partition (or one of the works of a record that carries several: :attr:`batch`), on its
    key's lane, from one generation of the assignment."""

    partition: Hashable
    offset: int
    lane: Hashable
    item: T
    generation: int
    state: State = State.QUEUED
    orphaned: bool = False
    """Running when an earlier offset of its partition was dropped: done or not, it is never acknowledged."""
    batch: list[Work[T]] | None = None
    """The works of its offset, in order, itself included, when a record carries several (:meth:`Dispatch.offer_batch`);
    None for a record's one work. They are acknowledged, dropped and abandoned together, as one record."""
    completed: bool = False
    """It ended completed (:meth:`Dispatch.finish`): handled, or forwarded, parked or held durably. Abandoned all the
    same when an earlier offset of its partition was dropped (see :func:`finished`)."""

    def __repr__(self) -> str:
        return f"Work({self.partition!r}@{self.offset}, lane={self.lane!r}, {self.state.value})"


class Step(Generic[T]):
    """What the caller carries out after one call, in this order: abandon, acknowledge, pause/resume, start.

    (A plain class: every offer and every finish makes one, and list literals cost less than a dataclass's
    factories.)"""

    __slots__ = ("abandon", "ack", "pause", "resume", "start")

    def __init__(self) -> None:
        self.start: list[Work[T]] = []
        self.ack: list[Work[T]] = []
        self.abandon: list[Work[T]] = []
        self.pause: list[Hashable] = []
        self.resume: list[Hashable] = []

    def __repr__(self) -> str:
        return (
            f"Step(start={self.start!r}, ack={self.ack!r}, abandon={self.abandon!r}, pause={self.pause!r}, "
            f"resume={self.resume!r})"
        )


class Outstanding(NamedTuple):
    """One partition's works not yet acknowledged (:meth:`Dispatch.outstanding`)."""

    lowest: int
    """The lowest offset taken and not yet acknowledged: the furthest its commit can move."""
    queued: int
    running: int
    """Running or confirming (:meth:`Dispatch.let_go`)."""
    done: int
    """Done, and waiting for a lower offset of the partition to be done too."""


class Dispatch(Generic[T]):
    """Lanes (one per key) of queued work, a bound on running work, and per-partition acknowledgement order.

    ``limit`` bounds the work running at once across every partition. ``partition_buffer`` bounds the work one
    partition may have offered and not yet acknowledged (queued, running, or done behind a slower earlier offset):
    reaching it asks for the partition to be paused, and it is resumed once half of that has drained. A partition
    whose head is slow therefore stops being read instead of buffering without bound.

    Lanes are served in the order they became ready (a lane whose message finished goes to the back), so a hot key
    cannot starve the others.
    """

    def __init__(self, *, limit: int, partition_buffer: int, clock: Callable[[], float] | None = None) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        if partition_buffer < 1:
            raise ValueError("partition_buffer must be at least 1")
        self.limit = limit
        self.partition_buffer = partition_buffer
        self._clock = clock
        """Seconds, read only while a drain's hold-back has a start (:meth:`revoke`'s ``hold_back_at``)."""
        self.generation = 0
        self.running = 0
        self.confirming = 0
        """Works that let go of their slot (:meth:`let_go`) and wait for their writes: at most ``limit``."""
        self._queued = 0
        """Works waiting in a lane to start: counted as they come and go, since the status views ask every few
        seconds and a partition's buffer of queued works would be walked each time."""
        self._lanes: dict[Hashable, deque[Work[T]]] = {}
        self._ready: deque[Hashable] = deque()
        self._partitions: dict[tuple[int, Hashable], deque[Work[T]]] = {}
        self._tracked: dict[Hashable, dict[int, Work[T]]] = {}
        """Offsets of the current generation offered and not yet acknowledged or dropped, per partition."""
        self._acked: dict[Hashable, AckedRuns] = {}
        """Offsets of the current generation acknowledged already, per partition, as runs of consecutive offsets."""
        self._paused: set[Hashable] = set()
        self._broken: set[Hashable] = set()
        self._drain_order: dict[tuple[int, Hashable], deque[Work[T]]] = {}
        """During a revocation's drain: per partition of a revoked generation, its works queued at the revocation in
        offset order (a record's several works in their order), whose first still queued is the only one that may
        start (:meth:`_drained_may_start`); started and dropped ones are passed over as it is read."""
        self._hold_back_at: float | None = None
        """During a drain: when (``clock``) its works begin to be held back (:meth:`revoke`); None: from its start."""
        self._held: set[Hashable] = set()
        """During a drain: lanes whose head, queued, of a revoked generation, waits for a lower work of its partition to
        start (neither ready nor started until then: :meth:`_drained_may_start` gives them back to ``_ready``)."""

    # -- offering and finishing ------------------------------------------------------------------------------------

    def offer(self, partition: Hashable, offset: int, lane: Hashable, item: T) -> Step[T]:
        """Take one record of a partition.

        An offset this generation took already (queued, running, done and waiting for an earlier one, or acknowledged)
        is a second delivery, after a seek back: it is abandoned, and the first one goes on or has gone. Any other
        offset is taken, also one below offsets already taken (a seek back re-reads records the stream dropped before
        they reached here): it takes its place in offset order, so nothing after it is acknowledged before it is done,
        and its place in its key's lane in offset order too, so it runs before the later records of its key that wait
        there (:func:`_enter_lane`). A later record of its key that is running already cannot be overtaken: the late
        one runs right after it. It is neither dropped nor left for another read: it runs (at-least-once), and the
        acknowledgement of every later offset not acknowledged yet, the running one's included, waits for it, so the
        acknowledgements stay contiguous. Dropping it instead would have to stop its partition's acknowledgements
        until the next generation (or the commit would pass it) and run every later record again, the running one
        included, without getting back the order already lost.
        Acknowledged offsets are remembered as runs, only the latest :data:`ACKED_RUNS_KEPT` of them: an offset read
        again from further back runs again (at-least-once), never skipped. Every offset of a partition
        one of whose works was cut short is abandoned until the next generation (see :meth:`finish`).
        """
        step: Step[T] = Step()
        work = Work(partition, offset, lane, item, self.generation)
        # (get, then create if missing: ``setdefault`` would build a container per record to throw away)
        tracked = self._tracked.get(partition)
        if tracked is None:
            tracked = self._tracked[partition] = {}
        acked = self._acked.get(partition)
        if partition in self._broken or offset in tracked or (acked is not None and offset in acked):
            work.state = State.DROPPED
            step.abandon.append(work)
            return step
        tracked[offset] = work
        key = (self.generation, partition)
        works = self._partitions.get(key)
        if works is None:
            works = self._partitions[key] = deque()
        if works and offset < works[-1].offset:
            works.insert(bisect.bisect([w.offset for w in works], offset), work)
        else:
            works.append(work)
        queue = self._lanes.get(lane)
        if queue is None:
            queue = self._lanes[lane] = deque((work,))
        else:
            _enter_lane(queue, work)
        self._queued += 1
        if len(queue) == 1:
            self._ready.append(lane)
        elif self._held and queue[0] is work:
            self._overtook_held(lane)
        self._fill(step)
        if partition not in self._paused and len(works) >= self.partition_buffer:  # (self.tracked(partition))
            self._paused.add(partition)
            step.pause.append(partition)
        return step

    def offer_batch(self, partition: Hashable, offset: int, parts: list[tuple[Hashable, T]]) -> Step[T]:
        """Take one record of a partition that carries several works, each ``(lane, item)``: a batch of release
        requests, each release on its own key's lane.

        The works run as :meth:`offer`'s would, each in its lane and within the limit, concurrently with each other.
        The record stays one offset: it is acknowledged once, after every one of its works is done (:attr:`Step.ack`
        names its last work, once); a second delivery of it is abandoned whole (:attr:`Step.abandon` names its first
        work, once); and if one of its works is cut short, or dropped, none of it is acknowledged: the others are
        dropped with it (queued ones now, running ones orphaned), and the record is abandoned once, when the last of
        its works has ended. A record of one part is :meth:`offer`'s. ``parts`` must not be empty.
        """
        if not parts:
            raise ValueError("a record with no work: offer it as a work that does nothing")
        if len(parts) == 1:
            return self.offer(partition, offset, *parts[0])
        step: Step[T] = Step()
        works = [Work(partition, offset, lane, item, self.generation) for lane, item in parts]
        for work in works:
            work.batch = works
        tracked = self._tracked.get(partition)
        if tracked is None:
            tracked = self._tracked[partition] = {}
        acked = self._acked.get(partition)
        if partition in self._broken or offset in tracked or (acked is not None and offset in acked):
            for work in works:
                work.state = State.DROPPED
            step.abandon.append(works[0])
            return step
        tracked[offset] = works[0]
        key = (self.generation, partition)
        queue = self._partitions.get(key)
        if queue is None:
            queue = self._partitions[key] = deque()
        if queue and offset < queue[-1].offset:
            at = bisect.bisect([w.offset for w in queue], offset)
            for index, work in enumerate(works):
                queue.insert(at + index, work)
        else:
            queue.extend(works)
        for work in works:
            lane = self._lanes.get(work.lane)
            if lane is None:
                lane = self._lanes[work.lane] = deque((work,))
            else:
                _enter_lane(lane, work)
            self._queued += 1
            if len(lane) == 1:
                self._ready.append(work.lane)
            elif self._held and lane[0] is work:
                self._overtook_held(work.lane)
        self._fill(step)
        if partition not in self._paused and len(queue) >= self.partition_buffer:
            self._paused.add(partition)
            step.pause.append(partition)
        return step

    def finish(self, work: Work[T], *, completed: bool = True) -> Step[T]:
        """A running work ended: ``completed`` if it was handled (or safely forwarded), False if it was cut short.

        A work cut short is not acknowledged, nor is anything after it in its partition until the next generation:
        those offsets are read again after the seek to the committed offset that starts it. Only a shutdown cuts
        work short (the caller retries failures in place), so nothing waits long for that seek. A work that let go
        (:meth:`let_go`) ends here too, once its writes are durable (or its wait was cut short).
        """
        step: Step[T] = Step()
        if work.state is State.RUNNING:
            self._leave(work)
        elif work.state is State.CONFIRMING:
            self.confirming -= 1
        else:
            raise ValueError(f"{work!r} is not running")
        work.completed = completed
        key = (work.generation, work.partition)
        if work.orphaned:
            work.state = State.DROPPED
            _abandon(work, step)
        elif completed:
            work.state = State.DONE
            self._acknowledge(key, step)
        else:
            self._drop_from(key, work, step)
            if work.generation == self.generation:
                self._broken.add(work.partition)
        self._maybe_resume(work.partition, step)
        self._fill(step)
        return step

    def let_go(self, work: Work[T]) -> Step[T]:
        """A running work gives its slot and its key's lane to others while its writes become durable; it is not
        acknowledged until :meth:`finish`.

        The next record of its key may run at once: it reads the state from memory, where the work's writes are
        already, and its own acknowledgement waits for this one's anyway (offset order). A revocation leaves it to
        finish like running work; cut short, it is never acknowledged.
        """
        if work.state is not State.RUNNING:
            raise ValueError(f"{work!r} is not running")
        step: Step[T] = Step()
        self._leave(work)
        work.state = State.CONFIRMING
        self.confirming += 1
        self._fill(step)
        return step

    def may_let_go(self) -> bool:
        """Whether a running work may :meth:`let_go`: fewer than ``limit`` wait for durability without a slot. Past
        that, a work keeps its slot while it confirms, so unconfirmed work stays within twice the limit: unbounded, a
        slow changelog let a partition's whole buffer run ahead of its confirms, and every commit and revocation waited
        behind them all."""
        return self.confirming < self.limit

    def _leave(self, work: Work[T]) -> None:
        """A running work gives up its slot and its place at the head of its lane."""
        lane = self._lanes[work.lane]
        if lane[0] is not work:
            raise ValueError(f"{work!r} is not the head of its lane")
        self.running -= 1
        lane.popleft()
        if lane:
            self._ready.append(work.lane)
        else:
            del self._lanes[work.lane]

    def set_limit(self, limit: int) -> Step[T]:
        """A new bound on running work (adaptive concurrency moves it, ``rebound/limiter.py``).

        Raised, queued work starts at once up to it. Lowered, nothing is cut short or dropped: running work ends as
        it would, and nothing starts until fewer than ``limit`` run. Lanes, acknowledgement order and pauses do not
        depend on the limit, so per-key order and contiguous acknowledgements hold whatever it does.
        """
        if limit < 1:
            raise ValueError("limit must be at least 1")
        step: Step[T] = Step()
        self.limit = limit
        self._fill(step)
        return step

    def revoke(self, *, drain: bool = False, hold_back_at: float | None = None) -> Step[T]:
        """The flow stopped for a rebalance (or a shutdown): a new generation begins, running work finishes.

        Without ``drain`` every queued work is dropped now. With ``drain`` queued work stays and keeps starting as
        slots free, so Faust's wait for the streams (``wait_empty``) finds it done and commits it with the revocation
        instead of the partition's next owner doing it again; :meth:`drop_drained` drops what is still queued when
        the time for that is up. Either way Faust seeks every partition it still assigns to the committed offset when
        the rebalance ends, so whatever is dropped is read again, by this worker or the partition's new owner.
        Running work is acknowledged when it ends only if nothing before it in its partition was dropped. Pauses are
        forgotten: Faust resumes every partition at the end of the rebalance.

        From ``hold_back_at`` on (the ``clock``'s time; None: from now) a drained work starts only once no lower work
        of its partition is still queued (:meth:`_drained_may_start`); before it, drained works start as slots free,
        whatever their order. The caller sets it to the drop's time less what a work may take: from then on a work
        started above a queued one would likely run for nothing, the queued one being dropped; earlier, what runs
        ends in time and lower works likely start too, and holding back would only make the waits of separate keys
        add up. A second drain's ``hold_back_at`` applies to the works of the first one too (the caller keeps one
        drop time).
        """
        if drain and hold_back_at is not None and self._clock is None:
            raise ValueError("a drain's hold_back_at needs the dispatch's clock")
        step: Step[T] = Step()
        if not drain:
            self._drop_queued(older_than=self.generation + 1, step=step)
        else:
            self._hold_back_at = hold_back_at
            if self._held:  # (held by the drain before: looked at again under the new time)
                self._ready.extend(self._held)
                self._held.clear()
            self._drain_order = {
                key: order for key, order in self._drain_order.items() if _first_queued(order) is not None
            }
            for key, works in self._partitions.items():
                if key[0] == self.generation:
                    queued = deque(work for work in works if work.state is State.QUEUED)
                    if queued:
                        self._drain_order[key] = queued
        self.generation += 1
        self._tracked.clear()
        self._acked.clear()
        self._paused.clear()
        self._broken.clear()
        if drain:
            self._fill(step)
        return step

    def drop_drained(self) -> Step[T]:
        """The time to drain a revocation is up: drop the queued work of earlier generations."""
        step: Step[T] = Step()
        self._drop_queued(older_than=self.generation, step=step)
        return step

    @property
    def draining(self) -> bool:
        """Whether work of an earlier generation is still queued."""
        return any(
            generation < self.generation and any(work.state is State.QUEUED for work in works)
            for (generation, _), works in self._partitions.items()
        )

    def not_taken(self, work: Work[T]) -> None:
        """The consumer did not take the acknowledgement of ``work``: forget that it was acknowledged, so the offset
        runs again if it is read again (deduplicating it would hold the partition's commits below it for the rest of
        the generation)."""
        acked = self._acked.get(work.partition)
        if work.generation == self.generation and acked is not None:
            acked.discard(work.offset)

    # -- what the caller may ask ---------------------------------------------------------------------------------

    def tracked(self, partition: Hashable) -> int:
        """Works of ``partition`` (current generation) offered and not yet acknowledged or dropped."""
        return len(self._partitions.get((self.generation, partition), ()))

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def paused(self) -> frozenset[Hashable]:
        return frozenset(self._paused)

    def outstanding(self) -> dict[Hashable, Outstanding]:
        """Per partition of the current generation holding works not yet acknowledged, what they are (a record of
        several works counted by its works)."""
        summary: dict[Hashable, Outstanding] = {}
        for (generation, partition), works in self._partitions.items():
            if generation != self.generation or not works:
                continue
            states = [work.state for work in works]
            summary[partition] = Outstanding(
                lowest=works[0].offset,
                queued=states.count(State.QUEUED),
                running=states.count(State.RUNNING) + states.count(State.CONFIRMING),
                done=states.count(State.DONE),
            )
        return summary

    def works(self) -> Iterator[Work[T]]:
        """Every work not yet acknowledged or dropped, by partition and offset."""
        for works in self._partitions.values():
            yield from works

    # -- rules -----------------------------------------------------------------------------------------------------

    def _fill(self, step: Step[T]) -> None:
        generation = self.generation
        while self.running < self.limit and self._ready:
            lane = self._ready.popleft()
            queue = self._lanes.get(lane)
            if not queue or queue[0].state is not State.QUEUED:
                continue  # dropped since it became ready
            head = queue[0]
            if head.generation != generation and not self._drained_may_start(head):
                self._held.add(lane)
                continue
            head.state = State.RUNNING
            self._queued -= 1
            self.running += 1
            step.start.append(head)
            if head.generation != generation:
                self._drained_started(head)

    def _drained_may_start(self, head: Work[T]) -> bool:
        """Whether ``head``, the queued head of its lane, of a revoked generation (a drain), may start: any may before
        the drain holds back (:meth:`revoke`'s ``hold_back_at``); then only if no lower work of its partition is still
        queued (each is done, running or confirming), or if holding it back would wait for ever
        (:meth:`_waits_for_itself`).

        The drain ends by dropping what is still queued, and the commit cannot pass a dropped offset: a work started
        above a queued one that is then dropped runs for nothing (its partition is read again from the dropped one,
        and it runs again). A queued work may wait behind its key's running one, so whether it starts in time is not
        known in advance; running works end (Faust waits for them), so a work started when every lower one has is
        committed with the revocation. A head held back waits, off ``_ready``, until its partition's lower works have
        started (:meth:`_drained_started`).
        """
        if self._hold_back_at is not None and self._clock is not None and self._clock() < self._hold_back_at:
            return True  # not yet holding back (:meth:`revoke`)
        lowest = _first_queued(self._drain_order.get((head.generation, head.partition)))
        return lowest is None or lowest is head or self._waits_for_itself(head)

    def _drained_started(self, started: Work[T]) -> None:
        """A drained work started: its partition's next queued work may be first now, and its lane, if held back for
        it, is ready again (in the same step, slots permitting); a head it waits behind may now wait for itself."""
        key = (started.generation, started.partition)
        following = _first_queued(self._drain_order.get(key))
        if following is None:
            self._drain_order.pop(key, None)
            return
        blocker = self._lanes[following.lane][0]
        if following.lane in self._held and (blocker is following or self._waits_for_itself(blocker)):
            self._held.discard(following.lane)
            self._ready.append(following.lane)

    def _waits_for_itself(self, start: Work[T]) -> bool:
        """Whether ``start``, a queued head of a drained generation not first of its partition, would wait for itself:
        its partition's first queued work waits on its lane behind a head that itself waits for the first of its
        partition, and so on back to ``start``. Only lanes shared across partitions (a key's records on the main topics
        and its release requests) in an order no start order can keep (a record read again late) do that; ``start``
        then starts, as every drained work did before this rule, rather than hold the drain until its time is up.
        Checked as a head is held back and as a partition's first queued work changes: the only times a wait begins."""
        work = start
        seen: set[int] = set()
        while True:
            lowest = _first_queued(self._drain_order.get((work.generation, work.partition)))
            if lowest is None or lowest is work:
                return False
            blocker = self._lanes[lowest.lane][0]
            if blocker is start:
                return True
            if blocker.state is not State.QUEUED or blocker.generation == self.generation or id(blocker) in seen:
                return False  # running (it ends), of the current generation (it starts), or a wait not through start
            seen.add(id(blocker))
            work = blocker

    def _overtook_held(self, lane: Hashable) -> None:
        """A work offered late took the head of a lane held back in a drain (``_enter_lane``): the lane is ready."""
        if lane in self._held:
            self._held.discard(lane)
            self._ready.append(lane)

    def _acknowledge(self, key: tuple[int, Hashable], step: Step[T]) -> None:
        works = self._partitions[key]
        current = key[0] == self.generation
        tracked = self._tracked.get(key[1]) if current else None
        acked = self._acked.get(key[1]) if current else None
        while works and works[0].state is State.DONE:
            done = works.popleft()
            batch = done.batch
            if batch is not None:  # a record of several works: all of them done, or none acknowledged yet
                if any(part.state is not State.DONE for part in batch):
                    works.appendleft(done)
                    break
                for _ in range(len(batch) - 1):  # (its parts are next to each other, in order)
                    works.popleft()
                done = batch[-1]
            if tracked is not None:
                tracked.pop(done.offset, None)
            if current:
                if acked is None:
                    acked = self._acked[key[1]] = AckedRuns()
                acked.add(done.offset)
            step.ack.append(done)
        if not works:
            del self._partitions[key]

    def _drop_from(self, key: tuple[int, Hashable], first: Work[T], step: Step[T]) -> None:
        """``first`` and every later work of its partition can no longer be acknowledged.

        Queued ones are dropped now (and leave their lanes), done ones are abandoned now, running ones when they end.
        A work of a record of several (:meth:`offer_batch`) drops its whole record, from its first work on: none of
        it may be acknowledged.
        """
        works = self._partitions[key]
        ended = first
        if first.batch is not None:
            first = first.batch[0]
        index = next(i for i, work in enumerate(works) if work is first)
        tracked = self._tracked.get(key[1], {}) if key[0] == self.generation else {}
        for work in list(works)[index:]:
            tracked.pop(work.offset, None)
            if work is ended and work.state in _UNFINISHED:
                work.state = State.DROPPED  # the caller's finish(completed=False): it left its lane already
                _abandon(work, step)
            elif work.state in _UNFINISHED:
                work.orphaned = True
            else:
                if work.state is State.QUEUED:
                    self._queued -= 1
                    lane = self._lanes[work.lane]
                    if lane[0] is work and work.lane in self._held:  # (what follows it on its lane is looked at anew)
                        self._held.discard(work.lane)
                        self._ready.append(work.lane)
                    lane.remove(work)
                    if not lane:
                        del self._lanes[work.lane]
                work.state = State.DROPPED
                _abandon(work, step)
        remaining = deque(list(works)[:index])
        if remaining:
            self._partitions[key] = remaining
        else:
            del self._partitions[key]

    def _drop_queued(self, *, older_than: int, step: Step[T]) -> None:
        """Drop, in every partition of a generation before ``older_than``, its first queued work and all after it."""
        for key in list(self._partitions):
            if key[0] >= older_than:
                continue
            first_queued = next((work for work in self._partitions[key] if work.state is State.QUEUED), None)
            if first_queued is not None:
                self._drop_from(key, first_queued, step)
        # Nothing of those generations is queued any more: nothing waits in a drain (ready again below).
        self._held.clear()
        self._drain_order = {key: order for key, order in self._drain_order.items() if key[0] >= older_than}
        # A lane is ready when its head waits to start; dropping may have emptied it, or left a later work at its head.
        ready = [lane for lane in dict.fromkeys(self._ready) if lane in self._lanes and self._waiting(lane)]
        listed = set(ready)
        ready += [lane for lane in self._lanes if lane not in listed and self._waiting(lane)]
        self._ready = deque(ready)
        self._fill(step)

    def _waiting(self, lane: Hashable) -> bool:
        return self._lanes[lane][0].state is State.QUEUED

    def _maybe_resume(self, partition: Hashable, step: Step[T]) -> None:
        if partition in self._paused and self.tracked(partition) <= self.partition_buffer // 2:
            self._paused.discard(partition)
            step.resume.append(partition)


_UNFINISHED = (State.RUNNING, State.CONFIRMING)
"""Works that will end with :meth:`Dispatch.finish`: dropping them waits for that."""


def _first_queued(order: deque[Work[T]] | None) -> Work[T] | None:
    """The first work of a drain order still queued; those before it (started, or dropped) are forgotten."""
    if order is None:
        return None
    while order and order[0].state is not State.QUEUED:
        order.popleft()
    return order[0] if order else None


def finished(work: Work[T]) -> bool:
    """Whether the record of an abandoned ``work`` was finished all the same (every work of it completed): its
    partition's next reader here need not run it again (``ReboundConsumer.abandon``)."""
    batch = work.batch
    return work.completed if batch is None else all(part.completed for part in batch)


def _abandon(work: Work[T], step: Step[T]) -> None:
    """``work`` was dropped: its record is abandoned, a record of several works once, when the last of them is (an
    abandoned record no longer counts as taken, and its works still running are part of it)."""
    batch = work.batch
    if batch is None or all(part.state is State.DROPPED for part in batch):
        step.abandon.append(work)


def _enter_lane(lane: deque[Work[T]], work: Work[T]) -> None:
    """Put ``work`` on its key's lane in offset order among the queued works of its partition, never before a
    running one.

    A lower offset arrives late when the consumer reads a partition again after records were dropped on their way
    here (a stream queue cleared when the flow resumed, a hand-over cut short): appended, it would run after later
    records of its key. It goes before the first queued work of its partition with a higher offset, whatever that
    work's generation (a drain of the last generation may still be running its queued works). Works of other
    partitions sharing the lane (a key's release requests share its main records' lane) keep their places: offsets
    of different partitions say nothing about order. The lane's head may be running a higher offset of the same
    partition already; the late work cannot overtake it and runs right after it, ahead of every later queued one:
    see :meth:`Dispatch.offer` for why that keeps at-least-once and contiguous acknowledgements.

    Queued works of one partition stay in offset order on every lane, so the scan walks back from the tail only
    past the works that must come after this one and those of other partitions (none, for a record read in order
    on a lane of its own partition).
    """
    position = len(lane)
    for index in range(len(lane) - 1, -1, -1):
        other = lane[index]
        if other.state is not State.QUEUED:
            break  # the running head: never overtaken
        if other.partition == work.partition:
            if other.offset <= work.offset:
                break
            position = index
    if position == len(lane):
        lane.append(work)
    else:
        lane.insert(position, work)


ACKED_RUNS_KEPT = 1024


class AckedRuns:
    """Acknowledged offsets of one partition as sorted runs ``[first, last]``: acknowledgements come in offset order,
    so a generation's are a few runs (split only where records never reached the dispatcher), not one entry each."""

    def __init__(self) -> None:
        self._firsts: list[int] = []
        self._lasts: list[int] = []

    def add(self, offset: int) -> None:
        if self._lasts and self._lasts[-1] + 1 == offset:
            self._lasts[-1] = offset
            return
        if not self._lasts or offset > self._lasts[-1]:
            self._firsts.append(offset)
            self._lasts.append(offset)
        elif offset not in self:  # below the latest run (an offset read again and taken late): rare
            index = bisect.bisect(self._firsts, offset)
            self._firsts.insert(index, offset)
            self._lasts.insert(index, offset)
            self._merge_around(index)
        while len(self._firsts) > ACKED_RUNS_KEPT:
            del self._firsts[0], self._lasts[0]

    def _merge_around(self, index: int) -> None:
        """Join the run at ``index`` with its neighbours where they touch (an offset added back between them)."""
        if index + 1 < len(self._firsts) and self._lasts[index] + 1 == self._firsts[index + 1]:
            self._lasts[index] = self._lasts[index + 1]
            del self._firsts[index + 1], self._lasts[index + 1]
        if index > 0 and self._lasts[index - 1] + 1 == self._firsts[index]:
            self._lasts[index - 1] = self._lasts[index]
            del self._firsts[index], self._lasts[index]

    def discard(self, offset: int) -> None:
        index = bisect.bisect(self._firsts, offset) - 1
        if index < 0 or offset > self._lasts[index]:
            return
        first, last = self._firsts[index], self._lasts[index]
        del self._firsts[index], self._lasts[index]
        for run_first, run_last in ((offset + 1, last), (first, offset - 1)):  # the upper part first: same index
            if run_first <= run_last:
                self._firsts.insert(index, run_first)
                self._lasts.insert(index, run_last)

    def __contains__(self, offset: object) -> bool:
        if not isinstance(offset, int):
            return False
        index = bisect.bisect(self._firsts, offset) - 1
        return index >= 0 and offset <= self._lasts[index]
