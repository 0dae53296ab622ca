"""Run the handler once and carry out the routing decision: the same code for first tries and retries."""

from __future__ import annotations

import asyncio
import contextvars
import enum
import logging
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from agents.delivery import deliver, emit_attempt
from agents.failure_log import shown_delay, shown_key
from agents.runtime import Runtime
from rebound.attempts import Outcome
from rebound.dead_letters import dead_letter_records
from rebound.errors import HandlerTimeout, RecordTooLargeError, UnsendableRecordError
from rebound.event import Handler, RetryEvent
from rebound.headers import (
    MAX_ERROR_CLASS_BYTES,
    MAX_ERROR_MESSAGE_BYTES,
    Header,
    Provenance,
    retry_headers,
    truncate_utf8,
)
from rebound.limiter import CallOutcome, outcome_of
from rebound.records import estimated_record_bytes
from rebound.routing import (
    Classification,
    DeadLetter,
    Reason,
    Retry,
    classify_and_decide,
    decide,
    error_class_name,
    retry_after_ms_of,
    unless_too_large,
)
from rebound.settings import HANDLER_CANCEL_GRACE_S
from rebound.state import Intent, PendingMessage, encode_payload, payload_key, table_key
from rebound.topics import failed_topic

if TYPE_CHECKING:
    from agents.dispatcher import HandlerCall

log = logging.getLogger(__name__)
BeforeRetry = Callable[[], Awaitable[None]]
BeforeSend = Callable[[Intent], Awaitable[None]]
"""Awaited with what a failure will send (a retry or a dead letter), before it is sent: a release writes it down
(``agents/release.py``), so a request read again after a crash sends the same rather than run the handler again."""


async def dead_letter(
    runtime: Runtime,
    destination: DeadLetter,
    *,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[Header],
    provenance: Provenance,
    attempt: int,
    tier: str | None,
    error_class: str,
    error_message: str,
    trace: str | None = None,
) -> str:
    """Send the record byte-exact to the decided failed topic with provenance and error headers; the reason it was
    sent with (``destination``'s, or ``too-large`` when a stand-in went instead of a record refused for its size).

    What is sent was decided up front (:func:`rebound.dead_letters.dead_letter_records`): the record itself if it
    fits, otherwise a smaller stand-in that still points at the original. The next stand-in is tried only if the
    broker refuses one as too large; any other failure is retried until it is acknowledged.
    """
    topic = runtime.failed_topic_named(destination.topic)
    candidates = dead_letter_records(
        key=key,
        value=value,
        own_headers=headers,
        provenance=provenance,
        group=runtime.group,
        attempt=attempt,
        reason=str(destination.reason),
        error_class=error_class,
        error_message=error_message,
        trace=trace,
        limit=runtime.settings.producer_max_request_bytes,
    )
    partition = provenance.partition % runtime.partitions
    index = 0
    while True:
        candidate = candidates[index]
        record = candidate.record
        try:
            await deliver(topic, key=record.key, value=record.value, headers=list(record.headers), partition=partition)
            break
        except UnsendableRecordError as refused:
            if index == len(candidates) - 1:
                raise
            log.error("dead letter of %s refused (%s); sending a smaller stand-in", provenance, refused)
            # Refused for its size: the next stand-in is smaller. Refused for anything else: only the smallest may pass.
            index = index + 1 if isinstance(refused, RecordTooLargeError) else len(candidates) - 1
    if candidate.reason != str(destination.reason):
        log.error("dead letter of %s sent as %s: %s", provenance, candidate.reason, candidate.error_message)
    runtime.counters[f"dead.{candidate.reason}"] += 1
    await emit_attempt(
        runtime,
        key=key,
        provenance=provenance,
        attempt=attempt,
        tier=tier,
        outcome=Outcome.EXPIRED if candidate.reason == Reason.EXPIRED else Outcome.DEAD,
        reason=candidate.reason,
        error_class=error_class,
        error_message=candidate.error_message,
    )
    return candidate.reason


class _Own(enum.Enum):
    TIER = enum.auto()


async def dead_letter_entry(
    runtime: Runtime,
    table_key: bytes,
    entry: PendingMessage,
    reason: Reason,
    *,
    attempt: int,
    error_class: str,
    error_message: str,
    tier: str | Literal[_Own.TIER] | None = _Own.TIER,
) -> Outcome:
    """End a parked or held ``entry`` on its topic's failed topic as ``reason``, carrying what
    :meth:`PendingMessage.dead_letter_bytes` gives (its own bytes or, those gone, its key alone), ``attempt`` and the
    error it ends with. ``tier``: the tier its attempt event names, the entry's own unless given (a held message,
    never run in a tier, names none). Returns the outcome to settle with. Logs nothing of its own: each caller says
    why."""
    key, value, headers = entry.dead_letter_bytes(table_key)
    await dead_letter(
        runtime,
        DeadLetter(failed_topic(entry.provenance.topic), reason),
        key=key,
        value=value,
        headers=headers,
        provenance=entry.provenance,
        attempt=attempt,
        tier=entry.tier if tier is _Own.TIER else tier,
        error_class=error_class,
        error_message=error_message,
    )
    return Outcome.DEAD


CANCEL_GRACE_S = HANDLER_CANCEL_GRACE_S
_abandoned: set[asyncio.Task[object]] = set()


class HandlerCancelledError(RuntimeError):
    """The handler's own awaitable was cancelled by something other than the worker."""


class HandlerAbortedError(RuntimeError):
    """The handler raised a ``BaseException`` that is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``...).

    Let through, it would end the agent (and Faust acks the message of an agent that ended) or, for the two that
    asyncio re-raises, stop the event loop. It is routed like any failure, classified by the original's class.
    """

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original


_IN_HANDLER: contextvars.ContextVar[bool] = contextvars.ContextVar("rebound_in_handler", default=False)


async def _guarded_call(
    handler: Handler,
    event: RetryEvent,
    ended: asyncio.Future[bool | None] | None = None,
    lease_fresh: Callable[[], bool] | None = None,
) -> object:
    """Call and await the handler, turning a non-``Exception`` it raises (even while being called) into
    :class:`HandlerAbortedError`.

    ``ended`` gets ``True`` as the call's last step, however it ends (``False`` when the call was not made: below;
    :func:`call_handler` waits for it): the task is
    done by the time its waiter runs again, without a done callback of its own (one more turn of the event loop per
    call), unless a task factory wraps the coroutine and suspends after it (a tracer's span): the waiter then waits for
    the task. Set already, a wait ended first (the deadline sets ``None``, or the waiter was cancelled), it is left
    alone. A task cancelled before its first step never runs this body: its call then ends at the deadline, with the
    task's own outcome (the cancellation), not a timeout; only something other than Rebound cancels a handler's task
    that early.

    ``lease_fresh`` is asked again in this first step, right before the handler: between :func:`call_handler`'s check
    and this step the event loop runs whatever else was ready, and a worker stopped (SIGSTOP) in that gap would call
    the handler the moment it wakes, on a lease it no longer has (a CI run saw one such call, 0 ms after the wake).
    Stale here, the handler is not called (``ended`` gets ``False``) and :func:`call_handler` goes through the
    lease's gate again. Renewed there, the task asks again; a stall the gate gave up on (after ``max_wait_s``) is not
    asked about again, or the call would go back to the gate for as long as the coordinator is away. The check and
    the handler's first step are one step of one task."""
    try:
        if lease_fresh is not None and not lease_fresh():
            if ended is not None and not ended.done():
                ended.set_result(False)
            return None
        return await handler(event)
    except (Exception, asyncio.CancelledError, GeneratorExit):
        raise
    except BaseException as error:
        raise HandlerAbortedError(error) from error
    finally:
        if ended is not None and not ended.done():
            ended.set_result(True)  # (the deadline's is None)


async def _guarded(awaitable: Awaitable[object]) -> object:
    """Await, turning a non-``Exception`` raised inside into :class:`HandlerAbortedError`.

    ``GeneratorExit`` passes: it is how a suspended coroutine is closed, and turning it into anything else breaks
    ``close()``. (One the handler raises itself is still routed: see :func:`call_handler`.)
    """
    try:
        return await awaitable
    except (Exception, asyncio.CancelledError, GeneratorExit):
        raise
    except BaseException as error:
        raise HandlerAbortedError(error) from error


def _guard_handler_subtasks(loop: asyncio.AbstractEventLoop) -> None:
    """Wrap every task a handler starts (``gather``, ``create_task``) in :func:`_guarded` as well.

    asyncio re-raises ``SystemExit`` and ``KeyboardInterrupt`` out of any task straight into the event loop: one
    raised in a handler's sub-task would stop the worker with the offset uncommitted, and the redelivered record would
    stop the next worker too. Tasks started outside a handler (Faust's own) are left as they are.

    Every handler call asks, and the loop's factory itself says whether it is this one: code the handler runs may set
    a factory of its own (a tracer's task-local context does) that takes this one's place without calling it, and the
    guard then goes back in front of it. (One that does call it wraps the handler's sub-tasks twice: harmless.)
    """
    previous = loop.get_task_factory()
    if getattr(previous, "rebound_guard", False) is True:
        return

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **options: Any) -> asyncio.Future[Any]:
        if _IN_HANDLER.get() and asyncio.iscoroutine(coro):
            coro = _guarded(coro)
        if previous is not None:
            return previous(loop, coro, **options)
        return asyncio.Task(coro, loop=loop, **options)

    factory.rebound_guard = True  # type: ignore[attr-defined]
    loop.set_task_factory(factory)


class _Deadlines:
    """The deadlines of one loop's waits of one length, with one timer for all of them.

    A timer per handler call (``loop.call_later``, then cancelled when the call ends first, as nearly every call
    does) cost a healthy message a timer handle, a push onto the loop's heap and its later removal. Waits of one
    length end in the order they began, so their deadlines form a queue: one timer is armed for the earliest wait
    still pending, and when it fires it wakes every wait due by then and is armed again for the next pending one.
    Each wait still ends at its own deadline, as with its own timer. Ended waits leave the queue from its head, and
    all at once when they fill it (:meth:`_compact`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.loop = loop
        self.timeout = timeout
        self.waits: deque[tuple[float, asyncio.Future[bool | None]]] = deque()
        self.timer: asyncio.TimerHandle | None = None
        self.compact_at = _COMPACT_AT

    def add(self, waiter: asyncio.Future[bool | None]) -> None:
        """``waiter`` gets its result (None) ``timeout`` seconds from now, unless it is done by then."""
        waits = self.waits
        while waits and waits[0][1].done():
            waits.popleft()
        if len(waits) >= self.compact_at:
            waits = self._compact()
        deadline = self.loop.time() + self.timeout
        waits.append((deadline, waiter))
        if self.timer is None:
            self.timer = self.loop.call_at(deadline, self._due)

    def _compact(self) -> deque[tuple[float, asyncio.Future[bool | None]]]:
        """Drop every ended wait, not only those at the head.

        A call near its timeout heads the queue for up to the whole timeout, and every call that ends behind it
        meanwhile would stay queued until then (a few hundred bytes each, thousands a second). Dropped once the queue
        doubled since the last time, as asyncio drops cancelled timers from its heap, the queue holds at most about
        twice the waits pending, for a walk per wait added that costs O(1) amortized.
        """
        self.waits = deque(wait for wait in self.waits if not wait[1].done())
        self.compact_at = max(_COMPACT_AT, 2 * len(self.waits))
        return self.waits

    def _due(self) -> None:
        self.timer = None
        # The loop runs a timer once it is due within its clock's resolution: so is every wait due by then.
        now = self.loop.time() + _CLOCK_RESOLUTION
        waits = self.waits
        while waits:
            deadline, waiter = waits[0]
            if not waiter.done():
                if deadline > now:
                    self.timer = self.loop.call_at(deadline, self._due)
                    return
                waiter.set_result(None)
            waits.popleft()


_CLOCK_RESOLUTION = time.get_clock_info("monotonic").resolution
_COMPACT_AT = 64
"""Waits a queue may hold, ended ones included, before those that ended leave it all at once."""
_deadlines: dict[tuple[asyncio.AbstractEventLoop, float], _Deadlines] = {}


def _deadlines_of(loop: asyncio.AbstractEventLoop, timeout: float) -> _Deadlines:
    deadlines = _deadlines.get((loop, timeout))
    if deadlines is None:
        for stale in [key for key in _deadlines if key[0].is_closed()]:  # (tests make a loop each)
            del _deadlines[stale]
        deadlines = _deadlines[(loop, timeout)] = _Deadlines(loop, timeout)
    return deadlines


async def _finished_within(loop: asyncio.AbstractEventLoop, task: asyncio.Task[object], timeout: float) -> bool:
    """Whether ``task`` finished within ``timeout`` seconds, without cancelling it then; a cancellation of the caller
    cancels it too. ``asyncio.wait({task}, timeout=...)`` does the same with sets and checks that cost a healthy
    message about as much as the rest of its handler call; the timeout is a deadline in a queue shared by the waits
    of that length (:class:`_Deadlines`), not a timer of its own."""
    if task.done():
        return True
    waiter: asyncio.Future[bool | None] = loop.create_future()

    def wake(_: object) -> None:
        if not waiter.done():
            waiter.set_result(None)

    task.add_done_callback(wake)
    _deadlines_of(loop, timeout).add(waiter)
    try:
        await waiter
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        if not waiter.done():
            waiter.cancel()  # (cancelled with its caller already, or ended some other way: the queue lets it go)
        task.remove_done_callback(wake)
    return task.done()


async def call_handler(runtime: Runtime, event: RetryEvent) -> None:
    """Run the handler in a task of its own, and tell the dispatcher how the call went: the samples of adaptive
    concurrency (``rebound/limiter.py``). A success is a latency sample; a timeout or an ``OverloadError`` (429, 503)
    is a drop; anything else (another failure, a cancellation) is neither, only no longer in flight.

    The handler's own task is what lets a timeout hold even for a handler that ignores cancellation:
    ``asyncio.wait_for`` would wait for a cancelled handler to actually finish, and a handler that swallows the
    cancellation would then hang the agent on every partition. Such a task is abandoned (and logged) after a grace
    period. A cancellation of the agent itself (shutdown, rebalance) propagates: the offset is not committed then.
    A cancellation coming out of the handler is a failure of the handler, routed like any other: letting it escape
    would end the agent, and Faust acks the event of an agent that ended. Running past the timeout raises
    :class:`HandlerTimeout`, never the builtin ``TimeoutError``, so a ``TimeoutError`` the handler raises itself is
    classified and reported as the handler's own.

    The wait is :func:`_finished_within`'s, written out here for the healthy path (no coroutine of its own, and no
    done callback on the task: the task sets ``ended`` itself as its last step, :func:`_guarded_call`); the deadline
    is the same queue's, so the call times out at the same moment.
    """
    dispatcher = runtime.dispatcher
    recheck: Callable[[], bool] | None = dispatcher.lease_fresh
    loop = asyncio.get_running_loop()
    while True:
        if not dispatcher.lease_fresh():  # (fresh, as nearly always: no wait, and no coroutine to make for it)
            await (
                dispatcher.lease_gate()
            )  # not on a lease the group may have let lapse (raises LeaseLapsed, a cancellation)
            # renewed: asked again in the task; a stall the gate gave up on: not (it would send the call back)
            recheck = dispatcher.lease_fresh if dispatcher.lease_fresh() else None
        call = dispatcher.call_started()
        try:
            started = loop.time()  # per pass: one sent back to the gate called nothing, and its wait is no latency
            ended: asyncio.Future[bool | None] = loop.create_future()
            task = _start_call(runtime, event, loop, ended, recheck)
            try:
                await ended
            except asyncio.CancelledError:
                task.cancel()
                raise
            finally:
                if not ended.done():
                    ended.cancel()  # (cancelled with its caller already: the queue and the call let it go)
        except BaseException:
            dispatcher.call_ended(call, CallOutcome.IGNORED)
            raise
        if ended.result() is not False:
            break
        dispatcher.call_ended(call, CallOutcome.IGNORED)  # stale in the task's first step: not called, gate again
        if not task.done():  # a task factory's wrapper still runs: kept, and what it raises retrieved, not lost
            _abandoned.add(task)
            task.add_done_callback(_abandoned.discard)
            task.add_done_callback(_retrieved)
    await _end_call(runtime, event, loop, task, ended, started, call)


def _start_call(
    runtime: Runtime,
    event: RetryEvent,
    loop: asyncio.AbstractEventLoop,
    ended: asyncio.Future[bool | None],
    lease_fresh: Callable[[], bool] | None,
) -> asyncio.Task[object]:
    """The handler's task, in a context of its own, under the handler timeout's deadline."""
    _guard_handler_subtasks(loop)
    context = contextvars.copy_context()
    context.run(_IN_HANDLER.set, True)
    call = _guarded_call(runtime.handler, event, ended, lease_fresh)
    task: asyncio.Task[object] = loop.create_task(call, context=context)
    _deadlines_of(loop, runtime.settings.handler_timeout_s).add(ended)
    return task


def _retrieved(task: asyncio.Task[object]) -> None:
    if not task.cancelled():
        task.exception()


async def _end_call(
    runtime: Runtime,
    event: RetryEvent,
    loop: asyncio.AbstractEventLoop,
    task: asyncio.Task[object],
    ended: asyncio.Future[bool | None],
    started: float,
    call: HandlerCall,
) -> None:
    """The rest of :func:`call_handler` once the handler's task said it ended: its outcome, its metrics, the sample."""
    dispatcher = runtime.dispatcher
    outcome = CallOutcome.IGNORED
    try:
        finished = task.done()
        if not finished and ended.result() is True:  # a task factory's wrapper still runs after the call's last step
            finished = await _finished_within(loop, task, runtime.settings.handler_timeout_s)
        runtime.metrics.handler_called(event.topic, event.tier, loop.time() - started, task if finished else None)
        if not finished:
            await _abandon_after_timeout(runtime, event, loop, task)
        _raise_what_it_raised(task)
        outcome = CallOutcome.SUCCEEDED
    except Exception as error:
        outcome = outcome_of(error)
        raise
    finally:
        dispatcher.call_ended(call, outcome)


async def _abandon_after_timeout(
    runtime: Runtime, event: RetryEvent, loop: asyncio.AbstractEventLoop, task: asyncio.Task[object]
) -> None:
    """The handler ran past its timeout: cancel it, give it the grace to end, abandon it if it does not (logged), and
    raise :class:`HandlerTimeout`."""
    task.cancel()
    if not await _finished_within(loop, task, CANCEL_GRACE_S):
        log.error(
            "handler ignored its cancellation after a timeout: key %s (%s partition %d offset %d), attempt %d; "
            "abandoning it (it may still be running)",
            shown_key(event.key),
            event.topic,
            event.partition,
            event.offset,
            event.attempt,
        )
        _abandoned.add(task)
        task.add_done_callback(_abandoned.discard)
    raise HandlerTimeout(f"handler ran longer than {runtime.settings.handler_timeout}")


def _raise_what_it_raised(task: asyncio.Task[object]) -> None:
    """The finished handler's failure, as the call's: its cancellation as :class:`HandlerCancelledError`, a
    ``GeneratorExit`` it raised itself as :class:`HandlerAbortedError`."""
    if task.cancelled():
        raise HandlerCancelledError("the handler's own awaitable was cancelled")
    error = task.exception()
    if error is None:
        return
    if not isinstance(error, Exception):  # a GeneratorExit the handler raised itself
        raise HandlerAbortedError(error) from error
    raise error


async def run_attempt(
    runtime: Runtime,
    *,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[Header],
    provenance: Provenance,
    attempt: int,
    tier: str | None,
    before_retry: BeforeRetry | None = None,
    before_send: BeforeSend | None = None,
) -> Outcome:
    """Run the handler and route its failure; returns the outcome. Never raises (except on cancellation, or what
    ``before_retry`` or ``before_send`` raise: then nothing was sent).

    ``before_retry`` is awaited before a retry is sent to its tier: whatever the caller writes down before the retry
    exists (a *sending* mark, a key's block), so anything that ends the retry later, even a tier agent refusing
    it, comes after that write.
    ``before_send`` is awaited, after it, with what will be sent (a retry or a dead letter), before the send.
    """
    event = RetryEvent(
        key=key,
        value=value,
        headers=dict(headers),
        header_list=tuple(headers),
        topic=provenance.topic,
        partition=provenance.partition,
        offset=provenance.offset,
        attempt=attempt,
        timestamp_ms=provenance.timestamp_ms,
        first_received_at_ms=provenance.first_received_at_ms,
        tier=tier,
    )
    gate = runtime.breaker_gate
    probe = False
    if gate is not None and gate.breaker.is_open:
        probe = await gate.enter(
            can_probe=failure_would_retry(runtime, event.topic, event.attempt, event.first_received_at_ms)
        )
    try:
        await call_handler(runtime, event)
    except asyncio.CancelledError:
        if probe and gate is not None:
            gate.abandoned()
        raise
    except Exception as error:
        if gate is not None:
            gate.record(_classification(runtime, error), probe=probe)
        return await _route_failure(runtime, event, headers, provenance, error, before_retry, before_send)
    if gate is not None:
        gate.record(None, probe=probe)
    await emit_attempt(runtime, key=key, provenance=provenance, attempt=attempt, tier=tier, outcome=Outcome.SUCCEEDED)
    return Outcome.SUCCEEDED


def _classification(runtime: Runtime, error: Exception) -> Classification:
    """How the breaker counts the failure: exactly as routing classifies it (Rebound's timeout included)."""
    return runtime.classifier.classify(_cause(error))


def _cause(error: Exception) -> BaseException:
    """The exception that classifies and describes the failure: the original of an aborted handler's one."""
    return error.original if isinstance(error, HandlerAbortedError) else error


def failure_would_retry(runtime: Runtime, topic: str, attempt: int, first_received_at_ms: int) -> bool:
    """Whether a retryable failure of this call would be retried (not end its policy): only such a call may be the
    circuit breaker's probe, so probing during an outage never dead-letters a message."""
    gate = runtime.breaker_gate
    decision = decide(
        main_topic=topic,
        attempt=attempt,
        classification=Classification.RETRYABLE,
        first_received_at_ms=first_received_at_ms,
        policy=runtime.policy,
        clock=runtime.clock,
        held_ms=0 if gate is None else gate.held_ms(first_received_at_ms),
    )
    return isinstance(decision, Retry)


def _parked_bytes(event: RetryEvent, headers: Sequence[Header], provenance: Provenance) -> int:
    """Size of the changelog record that will hold the message's parked copy (its key is stored twice there)."""
    key = payload_key(table_key(event.key, provenance), PendingMessage.origin_of(provenance))
    return estimated_record_bytes(key, encode_payload(event.key, event.value, headers), ())


async def _route_failure(
    runtime: Runtime,
    event: RetryEvent,
    headers: Sequence[Header],
    provenance: Provenance,
    error: Exception,
    before_retry: BeforeRetry | None = None,
    before_send: BeforeSend | None = None,
) -> Outcome:
    cause = _cause(error)
    error_class, message = error_class_name(cause), str(cause) or repr(cause)
    decision = classify_and_decide(
        cause,
        classifier=runtime.classifier,
        main_topic=provenance.topic,
        attempt=event.attempt,
        first_received_at_ms=provenance.first_received_at_ms,
        policy=runtime.policy,
        clock=runtime.clock,
        held_ms=0 if runtime.breaker_gate is None else runtime.breaker_gate.held_ms(provenance.first_received_at_ms),
        retry_after_max_ms=runtime.settings.retry_after_max_ms,
    )
    if isinstance(decision, Retry):
        forward = retry_headers(
            headers,
            provenance=provenance,
            group=runtime.group,
            attempt=decision.attempt,
            due_at_ms=decision.due_at_ms,
            error_class=error_class,
            error_message=message,
        )
        limit = runtime.settings.producer_max_request_bytes
        size = max(estimated_record_bytes(event.key, event.value, forward), _parked_bytes(event, headers, provenance))
        decision = unless_too_large(decision, main_topic=provenance.topic, record_bytes=size, limit=limit)
        if isinstance(decision, DeadLetter):
            message = f"{message} (with its retry headers the record is {size} bytes, more than {limit})"
    if isinstance(decision, Retry):
        if before_retry is not None:
            await before_retry()
        if before_send is not None:
            await before_send(
                Intent(
                    attempt=event.attempt,
                    dead=False,
                    topic=decision.topic,
                    reason="",
                    error_class=_as_carried(error_class, MAX_ERROR_CLASS_BYTES),
                    error_message=_as_carried(message, MAX_ERROR_MESSAGE_BYTES),
                    tier=decision.tier,
                    next_attempt=decision.attempt,
                    due_at_ms=decision.due_at_ms,
                )
            )
        try:
            await _forward_to_tier(runtime, event, forward, provenance, decision, error_class, message)
        except RecordTooLargeError as too_large:  # the broker's limit is lower than the producer's
            decision = DeadLetter(failed_topic(provenance.topic), Reason.TOO_LARGE)
            message = f"{message} ({too_large})"
        else:
            wait = _shown_wait(runtime, decision, cause)
            _log_failure(
                runtime, event, error_class, message, f"retry {decision.attempt} in {wait} on {decision.topic}"
            )
            return Outcome.SCHEDULED
    trace = "".join(traceback.format_exception(error))
    if before_send is not None:  # (after a retry the broker refused as too large, in place of its intent)
        await before_send(
            Intent(
                attempt=event.attempt,
                dead=True,
                topic=decision.topic,
                reason=str(decision.reason),
                error_class=_as_carried(error_class, MAX_ERROR_CLASS_BYTES),
                error_message=_as_carried(message, MAX_ERROR_MESSAGE_BYTES),
            )
        )
    sent_as = await dead_letter(
        runtime,
        decision,
        key=event.key,
        value=event.value,
        headers=headers,
        provenance=provenance,
        attempt=event.attempt,
        tier=event.tier,
        error_class=error_class,
        error_message=message,
        trace=trace,
    )
    _log_failure(runtime, event, error_class, message, f"dead-lettered to {decision.topic}: {sent_as}")
    return Outcome.EXPIRED if decision.reason is Reason.EXPIRED else Outcome.DEAD


def _shown_wait(runtime: Runtime, decision: Retry, error: BaseException) -> str:
    """How long the retry waits, as the log line says it: its tier's configured delay (``5m``), or the error's
    ``Retry-After`` (capped as :func:`rebound.routing.decide` caps it) when that made it wait longer."""
    retry_after = retry_after_ms_of(error)
    if retry_after is not None:
        cap = runtime.settings.retry_after_max_ms
        honoured = retry_after if cap is None else min(retry_after, cap)
        if honoured > runtime.policy.delay_for_retry(decision.attempt):
            return f"{shown_delay(honoured)} (its Retry-After)"
    return decision.tier


def _log_failure(runtime: Runtime, event: RetryEvent, error_class: str, message: str, next_step: str) -> None:
    """The failed call's INFO line, once what follows it is done (``agents/failure_log.py``: rate-limited; never
    raises, even when the logger does: the outcome is already carried out)."""
    runtime.failure_log.failed(
        key=event.key,
        topic=event.topic,
        partition=event.partition,
        offset=event.offset,
        attempt=event.attempt,
        tier=event.tier,
        error_class=error_class,
        message=message,
        next_step=next_step,
    )


def _as_carried(text: str, limit: int) -> str:
    """``text`` cut as its header carries it: an intent keeps no more of an error than is sent, so a handler's
    error quoting the whole record cannot make the intent's changelog record too large (its write refused, the
    release failing until it ends ``internal-error``)."""
    return truncate_utf8(text, limit).decode("utf-8")


async def send_again(
    runtime: Runtime,
    intent: Intent,
    *,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[Header],
    provenance: Provenance,
    tier: str | None,
    before_fallback: BeforeRetry | None = None,
) -> Outcome:
    """Send what a run of ``intent.attempt`` decided before its worker stopped (:class:`~rebound.state.Intent`), the
    same again, without running the handler: the dead letter with its reason and error (no trace: it is not kept),
    or the retry with its number, tier and due time. Returns the outcome to settle with. The record may now be on
    its topic twice: at-least-once, one end (a tier parks one copy; the failed topic's readers de-duplicate).

    A retry the broker refuses as too large was not sent and ends ``too-large``, as the first run would have ended
    it; ``before_fallback`` (the caller's ownership check: the refused send was an await) is awaited before that dead
    letter, and what it raises leaves it unsent. The next owner reads the same intent and reaches the same dead
    letter: one, where sending it here too made two. None: there is no retry to fall back from (a dead letter's
    intent); a retry's intent without it is refused (``ValueError``) before anything is sent."""
    if before_fallback is None and not intent.dead:
        raise ValueError(f"the retry intent of {provenance} attempt {intent.attempt} needs a before_fallback")
    if intent.dead:
        await dead_letter(
            runtime,
            DeadLetter(intent.topic, Reason(intent.reason)),
            key=key,
            value=value,
            headers=headers,
            provenance=provenance,
            attempt=intent.attempt,
            tier=tier,
            error_class=intent.error_class,
            error_message=intent.error_message,
        )
        return intent.outcome
    forward = retry_headers(
        headers,
        provenance=provenance,
        group=runtime.group,
        attempt=intent.next_attempt,
        due_at_ms=intent.due_at_ms,
        error_class=intent.error_class,
        error_message=intent.error_message,
    )
    event = RetryEvent(
        key=key,
        value=value,
        headers=dict(headers),
        header_list=tuple(headers),
        topic=provenance.topic,
        partition=provenance.partition,
        offset=provenance.offset,
        attempt=intent.attempt,
        timestamp_ms=provenance.timestamp_ms,
        first_received_at_ms=provenance.first_received_at_ms,
        tier=tier,
    )
    retry = Retry(intent.topic, intent.tier, intent.next_attempt, intent.due_at_ms)
    try:
        await _forward_to_tier(runtime, event, forward, provenance, retry, intent.error_class, intent.error_message)
    except RecordTooLargeError as too_large:  # refused: then it was never sent, and ends as the first run would have
        assert before_fallback is not None  # (refused above for a retry's intent)
        await before_fallback()
        await dead_letter(
            runtime,
            DeadLetter(failed_topic(provenance.topic), Reason.TOO_LARGE),
            key=key,
            value=value,
            headers=headers,
            provenance=provenance,
            attempt=intent.attempt,
            tier=tier,
            error_class=intent.error_class,
            error_message=f"{intent.error_message} ({too_large})",
        )
        return Outcome.DEAD
    return intent.outcome


async def _forward_to_tier(
    runtime: Runtime,
    event: RetryEvent,
    headers: list[Header],
    provenance: Provenance,
    decision: Retry,
    error_class: str,
    message: str,
) -> None:
    await deliver(
        runtime.tier_topics[decision.topic],
        key=event.key,
        value=event.value,
        headers=headers,
        partition=provenance.partition % runtime.partitions,
    )
    await emit_attempt(
        runtime,
        key=event.key,
        provenance=provenance,
        attempt=event.attempt,
        tier=event.tier,
        outcome=Outcome.SCHEDULED,
        error_class=error_class,
        error_message=message,
        due_at=decision.due_at_ms,
        next_tier=decision.tier,
    )
