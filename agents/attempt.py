"""Run the handler once and carry out the routing decision: the same code for first tries and retries."""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Sequence

from agents.delivery import deliver, emit_attempt
from app.runtime import Runtime
from rebound.attempts import Outcome
from rebound.errors import RecordTooLargeError
from rebound.event import RetryEvent
from rebound.headers import Provenance, failed_headers, retry_headers
from rebound.routing import DeadLetter, Reason, Retry, classify_and_decide, error_class_name
from rebound.topics import failed_topic

log = logging.getLogger(__name__)


async def dead_letter(
    runtime: Runtime,
    *,
    main_topic: str,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[tuple[str, bytes]],
    provenance: Provenance,
    attempt: int,
    tier: str | None,
    reason: Reason | str,
    error_class: str,
    error_message: str,
    trace: str | None = None,
) -> None:
    """Send the record byte-exact to ``<main>.failed`` with provenance and error headers.

    If that record is too large to produce, the error message and trace are dropped first; if it is still too large,
    the value is left out and the reason becomes ``too-large``: the record's provenance still points at the original.
    """
    failed_topic = runtime.failed_topics[main_topic]
    partition = provenance.partition % runtime.partitions

    def headers_for(why: Reason | str, message: str, with_trace: str | None) -> list[tuple[str, bytes]]:
        return failed_headers(
            headers,
            provenance=provenance,
            group=runtime.group,
            attempt=attempt,
            reason=str(why),
            error_class=error_class,
            error_message=message,
            trace=with_trace,
        )

    try:
        await deliver(
            failed_topic, key=key, value=value, headers=headers_for(reason, error_message, trace), partition=partition
        )
    except RecordTooLargeError:
        try:
            await deliver(
                failed_topic, key=key, value=value, headers=headers_for(reason, "", None), partition=partition
            )
        except RecordTooLargeError:
            size = "null" if value is None else f"{len(value)} bytes"
            log.error(
                "dead letter of %s too large even without error headers; sending it without its value", provenance
            )
            reason = Reason.TOO_LARGE
            error_message = f"value of {size} left out ({error_class}: {error_message})"[:1024]
            await deliver(
                failed_topic, key=key, value=None, headers=headers_for(reason, error_message, None), partition=partition
            )
    runtime.counters[f"dead.{reason}"] += 1
    await emit_attempt(
        runtime,
        key=key,
        provenance=provenance,
        attempt=attempt,
        tier=tier,
        outcome=Outcome.EXPIRED if reason == Reason.EXPIRED else Outcome.DEAD,
        reason=str(reason),
        error_class=error_class,
        error_message=error_message,
    )


CANCEL_GRACE_S = 1.0
_abandoned: set[asyncio.Task[object]] = set()


class HandlerCancelledError(RuntimeError):
    """The handler's own awaitable was cancelled by something other than the worker."""


async def call_handler(runtime: Runtime, event: RetryEvent) -> None:
    """Run the handler in a task of its own, so a timeout holds even for a handler that ignores cancellation.

    ``asyncio.wait_for`` would wait for a cancelled handler to actually finish; a handler that swallows the
    cancellation would then hang the agent on every partition. Such a task is abandoned (and logged) after a grace
    period. A cancellation of the agent itself (shutdown, rebalance) propagates: the offset is not committed then.
    A cancellation coming out of the handler is a failure of the handler, routed like any other: letting it escape
    would end the agent, and Faust acks the event of an agent that ended.
    """
    task: asyncio.Task[object] = asyncio.ensure_future(runtime.handler(event))
    try:
        done, _ = await asyncio.wait({task}, timeout=runtime.settings.handler_timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        if not done:
            log.error(
                "handler ignored its cancellation after a timeout on %s@%d; abandoning it", event.topic, event.offset
            )
            _abandoned.add(task)
            task.add_done_callback(_abandoned.discard)
        raise TimeoutError
    if task.cancelled():
        raise HandlerCancelledError("the handler's own awaitable was cancelled")
    error = task.exception()
    if error is not None:
        raise error


async def run_attempt(
    runtime: Runtime,
    *,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[tuple[str, bytes]],
    provenance: Provenance,
    attempt: int,
    tier: str | None,
) -> Outcome:
    """Run the handler and route its failure; returns the outcome. Never raises (except on cancellation)."""
    event = RetryEvent(
        key=key,
        value=value,
        headers=dict(headers),
        topic=provenance.topic,
        partition=provenance.partition,
        offset=provenance.offset,
        attempt=attempt,
        timestamp_ms=provenance.timestamp_ms,
        first_received_at_ms=provenance.first_received_at_ms,
        tier=tier,
    )
    try:
        await call_handler(runtime, event)
    except Exception as error:
        return await _route_failure(runtime, event, headers, provenance, error)
    await emit_attempt(runtime, key=key, provenance=provenance, attempt=attempt, tier=tier, outcome=Outcome.SUCCEEDED)
    return Outcome.SUCCEEDED


async def _route_failure(
    runtime: Runtime,
    event: RetryEvent,
    headers: Sequence[tuple[str, bytes]],
    provenance: Provenance,
    error: Exception,
) -> Outcome:
    if isinstance(error, TimeoutError):
        error_class, message = "TimeoutError", f"handler ran longer than {runtime.settings.handler_timeout}"
    else:
        error_class, message = error_class_name(error), str(error) or repr(error)
    decision = classify_and_decide(
        error,
        classifier=runtime.classifier,
        main_topic=provenance.topic,
        attempt=event.attempt,
        first_received_at_ms=provenance.first_received_at_ms,
        policy=runtime.policy,
        clock=runtime.clock,
    )
    if isinstance(decision, Retry):
        try:
            await _forward_to_tier(runtime, event, headers, provenance, decision, error_class, message)
        except RecordTooLargeError as too_large:
            decision = DeadLetter(failed_topic(provenance.topic), Reason.TOO_LARGE)
            message = f"{message} ({too_large})"
        else:
            return Outcome.SCHEDULED
    trace = "".join(traceback.format_exception(error))
    await dead_letter(
        runtime,
        main_topic=provenance.topic,
        key=event.key,
        value=event.value,
        headers=headers,
        provenance=provenance,
        attempt=event.attempt,
        tier=event.tier,
        reason=decision.reason,
        error_class=error_class,
        error_message=message,
        trace=trace,
    )
    return Outcome.EXPIRED if decision.reason is Reason.EXPIRED else Outcome.DEAD


async def _forward_to_tier(
    runtime: Runtime,
    event: RetryEvent,
    headers: Sequence[tuple[str, bytes]],
    provenance: Provenance,
    decision: Retry,
    error_class: str,
    message: str,
) -> None:
    await deliver(
        runtime.tier_topics[decision.topic],
        key=event.key,
        value=event.value,
        headers=retry_headers(
            headers,
            provenance=provenance,
            group=runtime.group,
            attempt=decision.attempt,
            due_at_ms=decision.due_at_ms,
            error_class=error_class,
            error_message=message,
        ),
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
