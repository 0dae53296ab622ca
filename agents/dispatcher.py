"""Runs handler work concurrently across keys, one key at a time, acknowledging offsets only in order.

The decisions are :class:`rebound.dispatch.Dispatch`'s; this carries them out on Faust: each started work runs in a
task of its own with Faust's current event set to its event (table writes take their changelog partition from it),
acknowledgements go to Faust's consumer in offset order only (so Faust never sees a gap to misread, #606), dropped
and second deliveries are let go without an acknowledgement, and a partition with too much offered and unfinished
work is paused through Faust's consumer until it drains.

Agents that use it iterate their stream without Faust's automatic acknowledgements (``stream.noack()``) and hand
every event over; the agent itself never waits for a handler, so one slow key holds up neither its partition's other
keys nor the other partitions.

With ``REBOUND_CONCURRENCY=auto`` the bound on running work follows an adaptive limit (``rebound/limiter.py``):
``call_handler`` reports each handler call's start and end here, the limiter turns them into a limit, and a new limit
is applied at once (:meth:`Dispatch.set_limit`: raised, queued work starts in the same step; lowered, running work
goes on and nothing starts until below it).

Neither a queued record's start nor a handler call goes ahead while the consumer's session lease is stale (the group may
have evicted this worker and given its partitions away: :meth:`Dispatcher.lease_gate`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, NamedTuple, Protocol

from faust.streams import _current_event

from rebound.dispatch import Dispatch, Step, Work, finished
from rebound.limiter import AdaptiveLimit, CallOutcome

log = logging.getLogger(__name__)
RETRY_BACKOFF_S = (0.1, 0.5, 1.0, 5.0)

Run = Callable[[Any], Awaitable[Awaitable[None] | None]]
"""A work: it may return what its writes becoming durable awaits (see :meth:`Dispatcher.offer`)."""


class Lease(Protocol):
    """What the dispatcher reads of the consumer's session lease (``SessionLease`` in ``app/consumer.py``): whether the
    group's word that it counts this worker in is recent enough, and a wait for its next word."""

    def fresh(self) -> bool: ...

    async def wait(self, revoked: Callable[[], bool]) -> bool: ...


class LeaseLapsed(asyncio.CancelledError):
    """A handler call not made: the session lease was stale and the revocation (or the consumer's stop) came before
    the group's next word. Cut short like a cancelled call: not acknowledged, read again by the partition's next reader
    (a breaker probe it was is abandoned)."""


_work_generation: contextvars.ContextVar[int | None] = contextvars.ContextVar("rebound_work_generation", default=None)
"""The generation of the work whose task this is (set in each work's context): a newer one means it was revoked."""


def work_of_generation(generation: int) -> contextvars.Token[int | None]:
    """This task, no dispatched work (a tier lane, the admin agent), is work of ``generation`` from here (until the
    token is reset; ``agents.ownership.taken_in``): its lease waits (:meth:`Dispatcher.lease_gate`) end at the
    revocation that stops that generation, as a work's do, whenever they begin."""
    return _work_generation.set(generation)


class Job(NamedTuple):
    """A work's event and what runs it (a tuple: one per record, and a frozen dataclass costs more to make)."""

    event: Any
    run: Run


class HandlerCall(NamedTuple):
    """One handler call in flight: when it started (the dispatcher's clock), how many were in flight then, itself
    included, and how many works held a slot of the limit then (``Dispatch.running``: calls, and works routing a
    failure or awaiting a store's confirmation; what says whether the limit was used)."""

    started_at: float
    in_flight: int
    running: int


class Dispatcher:
    """One per worker, shared by the main agent and the release agent: ``limit`` bounds their handler calls together.

    With a ``limiter`` (adaptive concurrency) the bound starts at its limit and follows it; ``limit`` is then unused.
    """

    def __init__(
        self,
        app: Any,
        *,
        limit: int,
        partition_buffer: int,
        revoke_drain_s: float = 0.0,
        drain_hold_back_s: float | None = None,
        shutdown_work_s: float | None = None,
        limiter: AdaptiveLimit | None = None,
    ) -> None:
        self.app = app
        self.limiter = limiter
        self._clock = limiter.clock if limiter is not None else time.monotonic
        self.handler_in_flight = 0
        """Handler calls running now (``call_handler``): the running works less those routing a failure, waiting at
        the open breaker, for the session lease or between attempts."""
        limit = limiter.limit if limiter is not None else limit
        self.core: Dispatch[Job] = Dispatch(limit=limit, partition_buffer=partition_buffer, clock=self._clock)
        self.revoke_drain_s = revoke_drain_s
        self.drain_hold_back_s = drain_hold_back_s
        """The last seconds of a drain, in which a queued record starts only once no lower record of its partition is
        still queued: what a record started then may take, the handler timeout and its cancellation grace, as the
        drain's own bound counts it (``Settings.revoke_drain_s``: with the flow stopped a drained record makes one
        handler call, key-ordered held messages waiting for the flow to resume). None: the whole drain."""
        self.shutdown_work_s = shutdown_work_s
        self._tasks: dict[Work[Job], asyncio.Task[None]] = {}
        self._drain_timer: asyncio.TimerHandle | None = None
        self._drain_ends_at = 0.0
        """When the drain's timer drops what is still queued (``_clock``), while it runs."""
        self._cut_timer: asyncio.TimerHandle | None = None
        self._held_most: dict[Hashable, int] = {}
        """Partitions paused for back-pressure now: the most records (releases, on the release topic) of each held at
        once since its pause. Above
        ``partition_buffer`` by what the consumer had handed over before the pause applied (the main agent's stream
        queue, the rest of a fetched batch; docs/back-pressure.md)."""

    @property
    def in_flight(self) -> int:
        return self.core.running

    @functools.cached_property
    def session_lease(self) -> Lease | None:
        """The consumer's session lease, looked up once, at the first start (Faust makes the consumer when the worker
        starts, after the dispatcher); None for a consumer without one."""
        lease: Lease | None = getattr(self.app.consumer, "session_lease", None)
        return lease

    def lease_fresh(self) -> bool:
        """Whether the session lease is fresh (or there is none): what :meth:`lease_gate` checks first, one clock read."""
        lease = self.session_lease
        return lease is None or lease.fresh()

    async def _lease_renewed(self, generation: int) -> bool:
        """The lease is stale: whether work of ``generation`` may go on, the group's next word having come before a
        revocation (a new generation) or the consumer's stop."""
        lease = self.session_lease
        return lease is None or await lease.wait(lambda: generation != self.core.generation)

    async def lease_gate(self) -> None:
        """Awaited immediately before every handler call (``agents/attempt.py`` ``call_handler``): a first try, a
        release or a held message, including one that waited at the open breaker, between attempts or for a write.

        The group may have evicted this worker (stopped past its session timeout) and given the partition to another
        member, which runs the message too. While the lease is fresh this is one clock read; stale, it waits for the
        next heartbeat (``SessionLease.wait``), and raises :class:`LeaseLapsed` if the revocation of the work's
        generation (or the consumer's stop) comes first. Outside a dispatched work (or :func:`work_of_generation`), the
        generation is the current one."""
        if self.lease_fresh():
            return
        generation = _work_generation.get()
        if not await self._lease_renewed(self.core.generation if generation is None else generation):
            raise LeaseLapsed("the group may have given the partition away: the handler call is not made")

    def call_started(self) -> HandlerCall:
        """A handler call starts (``agents/attempt.py`` ``call_handler``); :meth:`call_ended` must follow, however it
        ends."""
        self.handler_in_flight += 1
        return HandlerCall(self._clock(), self.handler_in_flight, self.core.running)

    def call_ended(self, call: HandlerCall, outcome: CallOutcome) -> None:
        """A handler call ended: a sample for the adaptive limit, whose new value applies at once."""
        self.handler_in_flight -= 1
        limiter = self.limiter
        if limiter is None:
            return
        limit = limiter.record(
            started_at=call.started_at,
            latency_s=self._clock() - call.started_at,
            in_flight=call.in_flight,
            running=call.running,
            outcome=outcome,
        )
        if limit != self.core.limit:
            log.debug(
                "adaptive concurrency: limit %d -> %d (baseline %s s, %d calls in flight%s)",
                self.core.limit,
                limit,
                limiter.baseline_s,
                self.handler_in_flight,
                ", probing" if limiter.probing else "",
            )
            self._carry_out(self.core.set_limit(limit))

    def concurrency(self) -> dict[str, Any]:
        """The limit and the calls in flight, for the status views and the dashboard."""
        snapshot: dict[str, Any] = {
            "mode": "fixed" if self.limiter is None else "auto",
            "limit": self.core.limit,
            "in_flight": self.handler_in_flight,
            "running": self.core.running,
            "queued": self.core.queued,
        }
        limiter = self.limiter
        if limiter is not None:
            baseline = limiter.baseline_s
            snapshot.update(
                minimum=limiter.bounds.minimum,
                maximum=limiter.bounds.maximum,
                baseline_ms=None if baseline is None else baseline * 1000,
                probing=limiter.probing,
            )
        return snapshot

    def offer(self, event: Any, lane: Hashable, run: Run) -> None:
        """Hand one event over; ``run(event)`` is awaited when its lane and a slot are free, and must not raise.

        It may return an awaitable for "its writes are durable" (``RetryStore.confirm_later``): the slot and the
        key's lane go to other work at once, and the offset is acknowledged only once that completes (in offset
        order, as ever). That awaitable must not raise either: if it does, the offset is never acknowledged (as if
        cut short), since its writes may not be durable.
        """
        message = event.message
        take_void = getattr(self.app.consumer, "take_void", None)
        if take_void is not None and take_void(message):
            # Its hand-over was interrupted when the flow resumed and it was read again: the copy read again runs.
            self._safely(self.app.consumer.abandon, message)
            return
        step = self.core.offer(message.tp, message.offset, lane, Job(event, run))
        held_most = self._held_most
        if held_most and message.tp in held_most:
            held_most[message.tp] = max(held_most[message.tp], self.core.tracked(message.tp))
        self._carry_out(step)

    def offer_batch(self, event: Any, parts: list[tuple[Hashable, Run]]) -> None:
        """Hand over one event that carries several works, each ``(lane, run)`` (a batch of release requests): each
        runs as :meth:`offer`'s one does, in its own lane, and the event is acknowledged once, after all of them
        (:meth:`rebound.dispatch.Dispatch.offer_batch`). ``run(event)`` is given the record's event: what it runs of
        it is bound into ``run``."""
        message = event.message
        take_void = getattr(self.app.consumer, "take_void", None)
        if take_void is not None and take_void(message):
            self._safely(self.app.consumer.abandon, message)
            return
        step = self.core.offer_batch(message.tp, message.offset, [(lane, Job(event, run)) for lane, run in parts])
        held_most = self._held_most
        if held_most and message.tp in held_most:
            held_most[message.tp] = max(held_most[message.tp], self.core.tracked(message.tp))
        self._carry_out(step)

    def revoke(self) -> None:
        """Faust stopped the flow (a rebalance or a shutdown): running work finishes, and queued work runs on for up
        to ``revoke_drain_s`` before it is dropped; in its last ``drain_hold_back_s`` a partition's in offset order: a
        queued record starts then only once no lower record of its partition is still queued (``Dispatch.revoke``), so
        none starts above one the drain is about to drop. Each partition's committed and lowest unacknowledged offsets
        are logged first (:meth:`_log_outstanding`).

        Faust waits for every message its streams took before it commits and lets the rebalance go on; what is done
        by then is committed with the revocation, and what was dropped is read again by the partition's next owner.
        Draining trades a longer revocation (bounded, and the group waits for it) for fewer handler calls made twice.
        A worker the group evicted (``consumer.evicted``) does not drain: its partitions' new owners already run that
        work, and the queued work is dropped unacknowledged.
        At a shutdown both the drain and the running work end after ``shutdown_work_s`` (:meth:`cut_short`), so the
        worker exits within ``REBOUND_SHUTDOWN_TIMEOUT`` whatever the handler timeout.
        """
        self._log_outstanding()
        shutting_down = self._shutting_down()
        drain_s = self.revoke_drain_s
        if shutting_down and self.shutdown_work_s is not None:
            drain_s = min(drain_s, self.shutdown_work_s)
        drain = drain_s > 0
        if drain and getattr(self.app.consumer, "evicted", False):
            # The group gave the partitions away before this worker heard of it: their new owners already run what
            # is queued here, so running it too would only make each call twice (and its commit fails anyway).
            log.info(
                "dispatcher: evicted from the group: not draining %d queued records and releases; their new owners run them",
                self.core.queued,
            )
            drain = False
        for partition, most in self._held_most.items():
            log.info(
                "dispatcher: %s was paused when the flow stopped (held up to %d records, a release batch counted by its "
                "releases)",
                partition,
                most,
            )
        self._held_most.clear()  # the core forgets its pauses too: a new generation counts from nothing
        # A second stop while a drain runs (a shutdown during a rebalance) keeps the first deadline: the revocation in
        # progress is waiting for that work too. A drain that has emptied is over, its timer pending or not: this
        # stop's drain is a fresh one, with its own deadline and hold-back.
        if self._drain_timer is not None and not self.core.draining:
            self._drain_timer.cancel()
            self._drain_timer = None
        first = self._drain_timer is None
        if first:
            self._drain_ends_at = self._clock() + drain_s
        hold_back = self.drain_hold_back_s
        hold_back_at = None if hold_back is None else self._drain_ends_at - hold_back
        self._carry_out(self.core.revoke(drain=drain, hold_back_at=hold_back_at))
        if drain and self.core.draining and first:
            self._drain_timer = asyncio.get_running_loop().call_later(drain_s, self._drain_time_up)
        if shutting_down and self.shutdown_work_s is not None and self._cut_timer is None:
            self._cut_timer = asyncio.get_running_loop().call_later(self.shutdown_work_s, self.cut_short)

    def _log_outstanding(self) -> None:
        """One line per partition the dispatcher holds work of as the flow stops: what its commit can reach (the
        committed offset as Rebound's consumer knows it, the next one to read; the lowest offset taken and not
        acknowledged, which the commit cannot pass) and what is at stake (queued records, which a drain may start or
        drop; running ones; done ones waiting for a lower one), a release batch counted by its releases."""
        for partition, held in self.core.outstanding().items():
            log.info(
                "dispatcher: revocation: %s: committed %s, lowest unacknowledged %d, %d queued, %d running, %d done "
                "behind a lower one (a release batch counted by its releases)",
                partition,
                self._committed(partition),
                held.lowest,
                held.queued,
                held.running,
                held.done,
            )

    def _shutting_down(self) -> bool:
        """A flow stopped by the app's own stop (SIGTERM), not by a rebalance: mode marks the app stopped first."""
        return bool(getattr(self.app, "should_stop", False))

    def cut_short(self) -> None:
        """The shutdown's time for handler work is up (``REBOUND_SHUTDOWN_TIMEOUT`` less what the commits and flushes
        after it need): drop what is queued and cancel what runs, so Faust's wait for the streams ends and the worker
        exits in time.

        Nothing is lost: a cut work is not acknowledged (the core drops it and what follows it in its partition), so
        its record is read again from the committed offset by the partition's next owner: at-least-once, like a
        crash, but with everything finished before the cut committed. A handler that ignores its cancellation is
        left behind (the event loop closes on it).
        """
        self._cut_timer = None
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        running = list(self._tasks.items())
        log.warning(
            "shutdown: %gs for handler work (REBOUND_SHUTDOWN_TIMEOUT less the time to commit and close) is up: "
            "cutting %d running handler calls short and dropping %d queued records and releases; they run again on their "
            "partitions' next owner",
            self.shutdown_work_s or 0.0,
            len(running),
            self.core.queued,
        )
        self._carry_out(self.core.revoke(drain=False))
        for work, task in running:
            task.add_done_callback(functools.partial(self._ended_unstarted, work))
            task.cancel()

    def _drain_time_up(self) -> None:
        self._drain_timer = None
        if self.core.draining:
            log.info("dispatcher: dropping %d queued records and releases a revocation did not reach", self.core.queued)
            self._carry_out(self.core.drop_drained())

    async def wait_idle(self) -> None:
        """Until no work is running (tests, and a shutdown that wants to finish what it started)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks.values()))

    def _carry_out(self, step: Step[Job]) -> None:
        """Work is started whatever happens before it: a work the core counts as running without a task would hold
        its lane, its slot and Faust's ``wait_empty`` for ever."""
        consumer = self.app.consumer
        for work in step.abandon:
            if finished(work):  # done behind an earlier offset dropped: not run again if read again here
                self._safely(functools.partial(consumer.abandon, finished=True), work.item.event.message)
            else:
                self._safely(consumer.abandon, work.item.event.message)
        for work in step.ack:
            self._safely(self._acknowledge, work)
        if step.pause:
            # Between fetched batches: Faust's getmany filters a batch by the live set of active partitions, so a
            # pause now would drop the rest of the batch (read again later, but at the cost of a seek).
            self._note_pauses(step.pause)
            self._safely(consumer.pause_between_batches, step.pause)
        if step.resume:  # also while the flow is stopped: the consumer forgets the pause, and resumes nothing then
            self._note_resumes(step.resume)
            self._safely(consumer.resume_after_pause, step.resume)
        for work in step.start:
            self._start(work)

    def _note_pauses(self, partitions: list[Hashable]) -> None:
        """A partition that stops being read is logged: a stream stalled on purpose must say so."""
        for partition in partitions:
            held = self.core.tracked(partition)
            self._held_most[partition] = held
            log.info(
                "dispatcher: pausing %s: %d records taken and not yet acknowledged (a release batch counted by its "
                "releases; buffer %d, %d handler calls running)",
                partition,
                held,
                self.core.partition_buffer,
                self.core.running,
            )

    def _note_resumes(self, partitions: list[Hashable]) -> None:
        for partition in partitions:
            most = self._held_most.pop(partition, None)
            log.info(
                "dispatcher: resuming %s: drained to %d records (held up to %s since the pause, buffer %d; a release batch "
                "counted by its releases)",
                partition,
                self.core.tracked(partition),
                most,
                self.core.partition_buffer,
            )

    def _acknowledge(self, work: Work[Job]) -> None:
        """Acknowledge to Faust; an acknowledgement Faust does not take (its consumer refuses a message no stream
        tracked, or one below the committed offset) is logged and forgotten, so the record runs again if read again."""
        try:
            taken = work.item.event.ack()
        except Exception:
            log.exception("dispatcher: acknowledging %s@%d failed", work.partition, work.offset)
            taken = False
        message = work.item.event.message
        if taken is False and not (getattr(message, "refcount", 0) > 0 and not getattr(message, "acked", False)):
            # (Still held by another stream, the message is acknowledged to the consumer when that one lets go.)
            log.warning(
                "dispatcher: Faust did not take the acknowledgement of %s@%d (acked %s, tracked %s, refcount %s, "
                "committed %s); it runs again if read again",
                work.partition,
                work.offset,
                getattr(message, "acked", None),
                getattr(message, "tracked", None),
                getattr(message, "refcount", None),
                self._committed(message.tp),
            )
            self.core.not_taken(work)

    def _committed(self, partition: Hashable) -> object:
        committed = getattr(getattr(self.app, "consumer", None), "_committed_offset", None)
        return committed.get(partition) if isinstance(committed, dict) else None

    @staticmethod
    def _safely(action: Callable[..., object], *args: object) -> None:
        """One failing acknowledgement must not cost another partition its resume, or a work its start."""
        try:
            action(*args)
        except Exception:
            log.exception("dispatcher: %s failed", getattr(action, "__name__", action))

    def _start(self, work: Work[Job]) -> None:
        # The task's context is a copy of the current one, as create_task makes it; _run sets Faust's current event
        # and the work's lease generation in it first.
        self._tasks[work] = asyncio.get_running_loop().create_task(self._run(work))

    async def _run(self, work: Work[Job]) -> None:
        """The work's task: run the work, again after a failure, until it completes or is revoked meanwhile; then its
        bookkeeping (:meth:`_ended`), however it ends (completed only if the work did; cut short otherwise).

        One coroutine per work: the run and its bookkeeping are written out here. The bookkeeping is the task's last
        step rather than a done callback (one more turn of the event loop per work). A task cancelled before its first
        step never runs this body: :meth:`cut_short`, the only canceller, gives such a task a done callback that does
        the bookkeeping instead (:meth:`_ended_unstarted`); otherwise its work would stay running for ever, holding its
        slot, its lane and Faust's ``wait_empty``.
        """
        _current_event.set(weakref.ref(work.item.event))
        _work_generation.set(work.generation)
        completed = False
        try:
            attempt = 0
            message = work.item.event.message
            # The group may have evicted this worker (stopped past its session timeout): its partitions' new owners
            # would run this too. Wait for the next heartbeat; the revocation ends the wait (app/consumer.py,
            # SessionLease). Each handler call the work makes checks again (:meth:`lease_gate`).
            if not self.lease_fresh() and not await self._lease_renewed(work.generation):
                return
            while True:
                try:
                    durable = await work.item.run(work.item.event)
                    break
                except LeaseLapsed:
                    return  # a handler call it was about to make was not made: left to the partition's next reader
                except asyncio.CancelledError:
                    raise
                except Exception:
                    # The work routes every failure itself; reaching here means even that failed (the failed topic
                    # refused the record). Running it again is at-least-once; acknowledging it would lose it.
                    delay = RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)]
                    log.exception("work on %s@%d failed; running it again in %.1fs", message.tp, message.offset, delay)
                attempt += 1
                await asyncio.sleep(delay)
                if work.generation != self.core.generation:
                    # Revoked meanwhile: left to the partition's next reader (Faust waits for this task to end).
                    log.warning("leaving %s@%d, which kept failing, to the next reader", message.tp, message.offset)
                    return
            if durable is not None:
                # Its slot and lane are free while its writes become durable (within a bound: ``may_let_go``); its
                # acknowledgement waits (``_ended``).
                if self.core.may_let_go():
                    self._carry_out(self.core.let_go(work))
                await durable
            completed = True
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("work on %s@%d ended with an error", work.partition, work.offset)
        finally:
            self._ended(work, completed)

    def _ended(self, work: Work[Job], completed: bool) -> None:
        """A work's task ended, however: completed only if the work said so; cancelled or failed, it was cut short."""
        if self._tasks.pop(work, None) is None:
            return  # (its bookkeeping is done)
        self._carry_out(self.core.finish(work, completed=completed))

    def _ended_unstarted(self, work: Work[Job], task: asyncio.Task[None]) -> None:
        """A cut task's done callback: the bookkeeping of one cancelled before its first step (else done already)."""
        self._ended(work, False)
