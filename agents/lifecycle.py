"""One lifecycle per message: a record that would start a message over, or run a retry of it again, is refused.

The rules are :mod:`rebound.state`'s (:func:`~rebound.state.redelivery`, :func:`~rebound.state.tier_duplicate`,
:func:`~rebound.state.remember`); this module carries them out on the state table for the main agent and key-ordered
mode. A main record is checked only when its key may have state (:meth:`RetryStore.may_know`: an in-memory index),
so a healthy message of a key with nothing retrying costs no read; a first try writes only when it leaves the main
topic for a tier or the failed topic, never when it succeeds. A first try that fails and is retried writes twice: a
*sending* mark confirmed before its retry is sent (:func:`announce_retry`), and the *forwarded* one after, whose
confirmation the dispatcher awaits with the handler slot already free (:func:`remember_outcome`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from agents.attempt import BeforeRetry
from agents.runtime import Runtime
from rebound.attempts import Outcome
from rebound.headers import Provenance
from rebound.state import KeyState, Known, LifecycleMemory, PendingMessage, redelivery, remember, remembers_outcome

log = logging.getLogger(__name__)

DigestOf = Callable[[], int]
"""A record's :func:`~rebound.state.record_digest`, computed only when a mark is read or written
(``partial(record_digest, key, value)``): a healthy message, whose key has no state, never needs it."""


def memory_of(runtime: Runtime) -> LifecycleMemory:
    settings = runtime.settings
    return LifecycleMemory(keep_ms=settings.ended_memory_ms, per_key=settings.ended_memory_per_key)


def known_as(
    runtime: Runtime, table_key: bytes, provenance: Provenance, attempt: int, digest: DigestOf | None = None
) -> Known | None:
    """Where the lifecycle of the message a main-topic record names already is (None: nowhere, run it).

    A state that cannot be read is logged and the record runs (at-least-once, as without the check): refusing it,
    or dead-lettering it as an internal error, could end a message that never ran.
    """
    partition = provenance.partition % runtime.partitions
    try:
        if not runtime.store.may_know(table_key, partition):
            return None
        state = runtime.store.load(table_key, origin=PendingMessage.origin_of(provenance))
    except Exception:
        log.exception("could not read the state of %s; running it", provenance)
        return None
    return redelivery(
        state,
        provenance,
        attempt,
        now_ms=runtime.clock(),
        memory=memory_of(runtime),
        digest=None if digest is None else digest(),
    )


def check_redelivery(
    runtime: Runtime, table_key: bytes, provenance: Provenance, attempt: int, digest: DigestOf | None = None
) -> Known | None:
    """Where the message's lifecycle already is (logged and counted), None if nowhere. Every answer but
    :attr:`Known.SENDING` refuses the record (:func:`refuses`): its offset is acknowledged without running it, its
    retry (parked or on its way) or its end stands for it. ``SENDING``: its retry may have been sent before its
    worker stopped; it runs again, and its end is remembered whatever it is (``maybe_sent``). ``digest``: the
    record's :func:`~rebound.state.record_digest`, so a mark never refuses another record of the same origin
    (computed only when the key may have state)."""
    known = known_as(runtime, table_key, provenance, attempt, digest)
    if known is None:
        return None
    runtime.counters[f"main.redelivery_{known}"] += 1
    log.info(
        "%s[%d]@%d read again as attempt %d, %s",
        provenance.topic,
        provenance.partition,
        provenance.offset,
        attempt,
        _WHERE[known],
    )
    return known


def refuses(known: Known | None) -> bool:
    """Whether :func:`check_redelivery`'s answer keeps the record from running."""
    return known is not None and known is not Known.SENDING


_WHERE = {
    Known.PARKED: "its retry is parked: not started over",
    Known.FORWARDED: "its retry is on its way to a tier: not started over",
    Known.ENDED: "the message ended: not started over",
    Known.SENDING: "its retry may have been sent: run again, its end remembered",
}


def announce_retry(
    runtime: Runtime, table_key: bytes, provenance: Provenance, attempt: int, digest: DigestOf | None = None
) -> BeforeRetry:
    """What runs before the retry of a main-topic run of ``attempt`` is sent: a *sending* mark, confirmed.

    Without it, a worker stopping after the broker acknowledged the retry and before its *forwarded* mark was
    written leaves that retry on the tier topic with nothing that knows of it: the redelivered record runs attempt
    0 again and, if it succeeds, the orphan retry still runs (and can end dead-lettered: one message, two ends).
    With it, the redelivery still runs (the send may not have happened) but its end is remembered, so the orphan
    is refused when it arrives. Costs one confirmed write per retried first try; nothing on the healthy path.
    """

    async def write_sending_mark() -> None:
        before = runtime.store.load(table_key, origin=PendingMessage.origin_of(provenance))
        after = remember(
            before,
            provenance,
            attempt=attempt + 1,
            ended=False,
            partition=provenance.partition % runtime.partitions,
            now_ms=runtime.clock(),
            memory=memory_of(runtime),
            sending=True,
            digest=None if digest is None else digest(),
        )
        if after != before:
            runtime.store.save(table_key, before, after)
            await runtime.store.confirm()

    return write_sending_mark


def with_outcome(
    runtime: Runtime,
    state: KeyState,
    provenance: Provenance,
    attempt: int,
    outcome: Outcome,
    *,
    maybe_sent: bool = False,
    digest: int | None = None,
) -> KeyState:
    """``state`` remembering what a main-topic run of ``attempt`` led to: its next retry on its way, or its end
    (a first try's success too when a retry of it may have been sent: ``maybe_sent``)."""
    if not remembers_outcome(outcome, attempt, maybe_sent=maybe_sent):
        return state
    scheduled = outcome is Outcome.SCHEDULED
    return remember(
        state,
        provenance,
        attempt=attempt + 1 if scheduled else attempt,
        ended=not scheduled,
        partition=provenance.partition % runtime.partitions,
        now_ms=runtime.clock(),
        memory=memory_of(runtime),
        digest=digest,
    )


async def remember_outcome(
    runtime: Runtime,
    table_key: bytes,
    provenance: Provenance,
    attempt: int,
    outcome: Outcome,
    *,
    maybe_sent: bool = False,
    digest: int | None = None,
) -> Awaitable[None] | None:
    """Write down where a main-topic run sent the message (a first try's success writes nothing), durable before
    the record is acknowledged, so a redelivery of it finds it (:func:`check_redelivery`).

    Written after the retry or dead letter was acknowledged: a *forwarded* mark written first could stand for a
    retry that was never sent. A crash in between leaves the *sending* mark (:func:`announce_retry`): the record
    runs again, and its end is remembered (``maybe_sent``). Returns what the mark's confirmation awaits (None:
    nothing to wait for): the caller returns it to the dispatcher, which frees the handler slot and the key's lane
    at once and acknowledges the offset once it completes (the key's next record reads the mark from memory).
    Never raises, nor does what it returns: the message itself has ended or moved on; without the mark only a
    redelivery's check is lost.
    """
    if not remembers_outcome(outcome, attempt, maybe_sent=maybe_sent):
        return None

    def not_remembered(error: Exception) -> None:
        log.error("could not remember the %s of %s attempt %d", outcome, provenance, attempt, exc_info=error)

    try:
        before = runtime.store.load(table_key, origin=PendingMessage.origin_of(provenance))
        after = with_outcome(runtime, before, provenance, attempt, outcome, maybe_sent=maybe_sent, digest=digest)
        if after != before:
            runtime.store.save(table_key, before, after)
        forget_expired_marks(runtime, provenance.partition % runtime.partitions)
        return runtime.store.confirm_later(failed=not_remembered)
    except Exception:
        log.exception("could not remember the %s of %s attempt %d", outcome, provenance, attempt)
        return None


def forget_expired_marks(runtime: Runtime, partition: int) -> None:
    """Forget a few expired marks of the partition (inside the caller's stream iteration); never raises."""
    try:
        runtime.store.forget_marks(partition, runtime.clock(), memory_of(runtime))
    except Exception:
        log.exception("forgetting expired marks of partition %d failed", partition)
