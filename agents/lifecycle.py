"""One lifecycle per message: a record that would start a message over, or run a retry of it again, is refused.

The rules are :mod:`rebound.state`'s (:func:`~rebound.state.redelivery`, :func:`~rebound.state.tier_duplicate`,
:func:`~rebound.state.remember`); this module carries them out on the state table for the main agent and key-ordered
mode. A main record is checked only when its key may have state (:meth:`RetryStore.may_know`: an in-memory index),
so a healthy message of a key with nothing retrying costs no read; a first try writes only when it leaves the main
topic for a tier or the failed topic, never when it succeeds. A first try that fails and is retried writes twice: a
*sending* mark confirmed before its retry is sent (:func:`announce_retry`), and the *forwarded* one after, whose
confirmation the dispatcher awaits with the handler slot already free (:func:`remember_outcome`). A first try
that is dead-lettered writes twice too: a *dead-lettering* mark (the dead letter's intent) confirmed before the send
(:func:`announce_dead_letter`), and its *ended* mark after; read again in between, the record sends the same dead
letter again instead of running the handler (:func:`send_dead_letter_again`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn

from agents.attempt import BeforeRetry, BeforeSend, send_again
from agents.dispatcher import LeaseLapsed
from agents.ownership import still_owns
from agents.runtime import Runtime
from rebound.attempts import Outcome
from rebound.headers import Header, Provenance
from rebound.state import (
    Intent,
    KeyState,
    Known,
    LifecycleMemory,
    PendingMessage,
    intended_dead_letter,
    redelivery,
    remember,
    remembers_outcome,
    with_dead_letter_intent,
)

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
    :attr:`Known.SENDING` and :attr:`Known.DEAD_LETTERING` refuses the record (:func:`refuses`): its offset is
    acknowledged without running it, its retry (parked or on its way) or its end stands for it. ``SENDING``: its
    retry may have been sent before its worker stopped; it runs again, and its end is remembered whatever it is
    (``maybe_sent``). ``DEAD_LETTERING``: its dead letter may have been sent; the handler does not run, the same dead
    letter is sent again (:func:`send_dead_letter_again`) and its end remembered. ``digest``: the
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
    return known is not None and known not in (Known.SENDING, Known.DEAD_LETTERING)


_WHERE = {
    Known.PARKED: "its retry is parked: not started over",
    Known.FORWARDED: "its retry is on its way to a tier: not started over",
    Known.ENDED: "the message ended: not started over",
    Known.SENDING: "its retry may have been sent: run again, its end remembered",
    Known.DEAD_LETTERING: "its dead letter may have been sent: the same sent again, not run",
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
        await still_owned(runtime, provenance, attempt)

    return write_sending_mark


def announce_dead_letter(
    runtime: Runtime,
    table_key: bytes,
    provenance: Provenance,
    attempt: int,
    digest: DigestOf | None = None,
    *,
    maybe_sent: bool = False,
) -> BeforeSend:
    """What runs before a main-topic run of ``attempt`` sends what it decided (the attempt's ``before_send``): for a
    dead letter, its intent on the key's state as a *dead-lettering* mark, confirmed
    (:func:`rebound.state.with_dead_letter_intent`); a retry has its *sending* mark already (:func:`announce_retry`).

    Without it, a worker stopping after the broker acknowledged the dead letter and before its *ended* mark was
    durable left no trace: the record was read again and the handler ran again, and with a handler whose outcome is
    not a function of the attempt the message ended twice (dead-lettered, then succeeded). With it, that record sends
    the same dead letter again (:func:`send_dead_letter_again`). ``maybe_sent``: the run's retry may be out (a
    *sending* mark, key order's block); if the tier agent parked it meanwhile, the dead letter wins
    (:func:`rebound.state.without_orphan`). Costs one confirmed write per dead-lettered first try. A write that
    fails is logged and the dead letter sent without it (as before intents): the message is not held back for it.
    """

    async def write_intent(intent: Intent) -> None:
        if not intent.dead:
            return
        origin = PendingMessage.origin_of(provenance)
        try:
            before = runtime.store.load(table_key, origin=origin)
            after = with_dead_letter_intent(
                before,
                provenance,
                intent,
                partition=provenance.partition % runtime.partitions,
                now_ms=runtime.clock(),
                memory=memory_of(runtime),
                digest=None if digest is None else digest(),
                orphan=attempt + 1 if maybe_sent else None,
            )
            if after != before:  # (unchanged: nothing to write, but ownership is still asked below)
                runtime.store.save(table_key, before, after)
                dropped_orphan(runtime, table_key, origin, before, after)
                await runtime.store.confirm()
        except Exception:
            runtime.counters["main.dead_letter_intent_failed"] += 1
            log.exception(
                "could not write the dead letter intent of %s attempt %d; sending without it", origin, attempt
            )
        await still_owned(runtime, provenance, attempt)

    return write_intent


class FirstTryRevokedError(LeaseLapsed):
    """A first try's partition was revoked while the mark before its send was confirmed (an evicted worker's): its
    retry or dead letter is not sent. The new owner may have read the changelog before the mark was in it, and runs
    the record itself. Or revoked during the send, before the write that records it (:func:`still_owned_after_send`):
    that write is not made. Cut short like a handler call the lease gate did not make (:class:`LeaseLapsed`, a
    cancellation: past the main agent's catch-all, which would dead-letter it ``internal-error``): the dispatcher
    leaves the record unacknowledged, for the partition's next reader."""


async def still_owned(runtime: Runtime, provenance: Provenance, attempt: int) -> None:
    """Raise :class:`FirstTryRevokedError` (one warning, counted ``main.revoked_before_send``) unless the
    partition of the first try's record is still actively owned here; asked after the confirmed write before its
    send, as a release asks after its intent's (``agents/release.py`` ``intent_writer``).

    The rule is :func:`agents.ownership.still_owns`'s (the session lease, then ownership), as a release's."""
    partition = provenance.partition % runtime.partitions
    if await still_owns(runtime, partition):
        return
    _refuse(
        runtime,
        partition,
        provenance,
        attempt,
        counter="main.revoked_before_send",
        moment="before",
        left="nothing sent; the record or release request that ran it",
    )


async def still_owned_after_send(runtime: Runtime, provenance: Provenance, attempt: int) -> None:
    """Raise :class:`FirstTryRevokedError` (one warning, counted ``main.revoked_after_send``) unless the partition of
    the first try's record is still actively owned here (:func:`agents.ownership.still_owns`), asked before the write
    that records a send already made, which follows the send's await: the *forwarded* or *ended* mark
    (:func:`remember_outcome`), key order's block or unblock with it (``agents/ordering.py`` ``KeyOrder.settle``,
    ``ended_in_error``). Refused, that write is not made and the record is left unacknowledged: what the new owner
    then sees is what the write before the send left (:func:`remember_outcome` says what it does with it).

    A check that fails (an ``Exception`` from the assignor, the consumer or the lease; a cancellation propagates) is
    logged and taken as refused, never as owned: refused leaves exactly what a crash just after the send leaves (the
    confirmed *sending* mark, block or intent, which the record's next reader carries to one end) and writes or runs
    nothing more here, so it cannot fork; taken as owned, the write, and in key order the held messages run after
    it, would go on for a partition maybe another's (two lifecycles). Its price, when the partition was in fact
    still here: the record waits unacknowledged, and its partition's commits stop at it, until the partition's next
    assignment reads it again, as after a crash.
    Raised instead, the error would reach the main agent's catch-all, whose ``internal-error`` dead letter would
    follow the retry already sent."""
    partition = provenance.partition % runtime.partitions
    try:
        owned = await still_owns(runtime, partition)
    except Exception:
        log.exception(
            "could not ask whether partition %d is still owned after the send of %s attempt %d: taken as revoked",
            partition,
            provenance,
            attempt,
        )
        owned = False
    if owned:
        return
    _refuse(
        runtime,
        partition,
        provenance,
        attempt,
        counter="main.revoked_after_send",
        moment="while the outcome of",
        left="its mark not written; the record",
    )


def _refuse(
    runtime: Runtime, partition: int, provenance: Provenance, attempt: int, *, counter: str, moment: str, left: str
) -> NoReturn:
    """The refusal of :func:`still_owned` and :func:`still_owned_after_send`: ``counter`` counted, one warning, and
    :class:`FirstTryRevokedError` raised; ``moment`` says when the send was (``before``, ``while the outcome of``),
    ``left`` what is left and what is left unacknowledged."""
    runtime.counters[counter] += 1
    log.warning(
        "partition %d revoked %s %s[%d]@%d attempt %d was sent: %s left unacknowledged for the new owner",
        partition,
        moment,
        provenance.topic,
        provenance.partition,
        provenance.offset,
        attempt,
        left,
    )
    raise FirstTryRevokedError(f"partition {partition} revoked {moment} {provenance} attempt {attempt} was sent")


def owned_after(runtime: Runtime, provenance: Provenance, attempt: int, then: BeforeRetry) -> BeforeRetry:
    """``then`` (key-ordered mode's block, confirmed), and ownership asked again after it (:func:`still_owned`)."""

    async def and_still_owned() -> None:
        await then()
        await still_owned(runtime, provenance, attempt)

    return and_still_owned


def dropped_orphan(runtime: Runtime, table_key: bytes, origin: str, before: KeyState, after: KeyState) -> None:
    """Counted and taken out of the schedule: the retry of ``origin`` parked meanwhile that an end replaced
    (:func:`rebound.state.without_orphan`). A release request of it already on its way finds nothing (stale)."""
    entry = before.find(origin)
    if entry is None or after.find(origin) is not None:
        return
    runtime.counters["main.orphan_retry_ended"] += 1
    log.warning("%s attempt %d was parked while its record ran again and ended it: dropped", origin, entry.attempt)
    runtime.schedule.discard(entry.partition, {(table_key, origin, entry.attempt)})


async def send_dead_letter_again(
    runtime: Runtime,
    table_key: bytes,
    provenance: Provenance,
    attempt: int,
    *,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[Header],
    tier: str | None,
    digest_of: DigestOf | None = None,
) -> Outcome:
    """Send the dead letter a run of ``attempt`` decided before its worker stopped (:attr:`Known.DEAD_LETTERING`),
    the same again, without running the handler; returns the outcome whose end the caller remembers, as after a
    run. The failed topic may then hold it twice (same reason, same attempt): at-least-once, one end."""
    outcome = await send_intended_dead_letter(
        runtime, table_key, provenance, attempt, key=key, value=value, headers=headers, tier=tier, digest_of=digest_of
    )
    if outcome is None:  # (check_redelivery read it just before, with no await since)
        raise LookupError(f"the dead letter intent of {provenance} attempt {attempt} is gone")
    return outcome


async def send_intended_dead_letter(
    runtime: Runtime,
    table_key: bytes,
    provenance: Provenance,
    attempt: int,
    *,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[Header],
    tier: str | None,
    digest_of: DigestOf | None = None,
) -> Outcome | None:
    """:func:`send_dead_letter_again` if the key's state holds a dead letter intent for the record, else None (run
    it): for key order's held messages, whose run is checked here rather than by the main agent."""
    state = runtime.store.load(table_key, origin=PendingMessage.origin_of(provenance))
    intent = intended_dead_letter(
        state,
        provenance,
        attempt,
        now_ms=runtime.clock(),
        memory=memory_of(runtime),
        digest=None if digest_of is None else digest_of(),
    )
    if intent is None:
        return None
    runtime.counters["main.dead_letter_resent"] += 1
    log.warning(
        "%s[%d]@%d was dead-lettered (%s) before its end was durable; sending its dead letter again",
        provenance.topic,
        provenance.partition,
        provenance.offset,
        intent.reason,
    )
    return await send_again(runtime, intent, key=key, value=value, headers=headers, provenance=provenance, tier=tier)


def with_outcome(
    runtime: Runtime,
    state: KeyState,
    provenance: Provenance,
    attempt: int,
    outcome: Outcome,
    *,
    maybe_sent: bool = False,
    was_held: bool = False,
    digest: int | None = None,
) -> KeyState:
    """``state`` remembering what a main-topic run of ``attempt`` led to: its next retry on its way, or its end
    (a first try's success too when a retry of it may have been sent: ``maybe_sent``; that retry, if the tier
    agent parked it while this ran, gives way to the end: :func:`rebound.state.without_orphan`; or when the run was
    a held message's, whose record may be read again: ``was_held``, :func:`rebound.state.remembers_outcome`)."""
    if not remembers_outcome(outcome, attempt, maybe_sent=maybe_sent, was_held=was_held):
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
        orphan=attempt + 1 if maybe_sent else None,
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
    Never raises, nor does what it returns (the message itself has ended or moved on; without the mark only a
    redelivery's check is lost), except :class:`FirstTryRevokedError`:

    The send was awaited, so the session lease and ownership are asked first (:func:`still_owned_after_send`). A
    partition lost meanwhile gets no mark and the record is left unacknowledged: the mark would be this worker's view
    of a key another worker now writes, fenced by the writer epoch only if it lands after the new owner's claim. The
    new owner reads the record again and finds what the confirmed write before the send left, as after a crash
    between the send and the mark: a retry's *sending* mark, so the record runs again and its end is remembered,
    the retry sent giving way to it (parked: removed in the end's write; on its way: refused as ended), at most one
    more handler call and never two ends; a dead letter's intent, so the same dead letter is sent again without the
    handler (one end, on the failed topic twice); an ``internal-error`` dead letter, or one whose intent could not be
    written, has none, and the record runs again (as after a crash; "What is left" in docs/guarantees.md). Written
    anyway, the mark spares that second send only if it reaches the new owner's recovery: a stop past the session
    timeout ends after the group gave the partition away, usually after that recovery.
    """
    if not remembers_outcome(outcome, attempt, maybe_sent=maybe_sent):
        return None
    await still_owned_after_send(runtime, provenance, attempt)

    def not_remembered(error: Exception) -> None:
        log.error("could not remember the %s of %s attempt %d", outcome, provenance, attempt, exc_info=error)

    try:
        before = runtime.store.load(table_key, origin=PendingMessage.origin_of(provenance))
        after = with_outcome(runtime, before, provenance, attempt, outcome, maybe_sent=maybe_sent, digest=digest)
        if after != before:
            runtime.store.save(table_key, before, after)
            dropped_orphan(runtime, table_key, PendingMessage.origin_of(provenance), before, after)
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
