"""Releasing due messages: a timer finds what is due, a stream on a co-partitioned topic runs it.

The split exists because Faust lets only a stream iteration change a table (the changelog partition comes from the
current event). The timer reads the in-memory schedule and sends release requests to partition ``p`` of the release
topic; the release agent, which owns partition ``p`` of the table on the same worker, re-checks the entry, runs the
handler and settles the entry. The check makes duplicates and stale requests harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable
from functools import partial
from time import perf_counter
from typing import Any

from agents.attempt import (
    BeforeRetry,
    BeforeSend,
    dead_letter,
    dead_letter_entry,
    failure_would_retry,
    run_attempt,
    send_again,
)
from agents.delivery import deliver, direct_producer
from agents.lifecycle import forget_expired_marks, memory_of
from agents.ordering import (
    blocker,
    dead_letters_block,
    defer_behind_lower,
    line_state,
    run_held_safely,
    schedule_next_in_line,
    write_block_again,
)
from agents.ownership import lease_held, owned_partitions, owns, owns_nothing, still_owns
from agents.records import release_lane
from agents.runtime import Runtime
from agents.services import Restarting, start_with
from rebound.attempts import Outcome
from rebound.commands import ReleaseBatch, ReleaseRequest, read_release_record, release_record_bytes, release_records
from rebound.errors import RecordTooLargeError
from rebound.ordering import HELD_ATTEMPT, HELD_TIER, after_outcome, next_held
from rebound.pacing import pop_paced
from rebound.records import fits
from rebound.release import STALE, Verdict, check_release, ended_mark, how_to_run, without_ended
from rebound.routing import DeadLetter, Reason
from rebound.schedule import Slot
from rebound.settings import reveal
from rebound.signing import signed_republish_headers
from rebound.state import Intent, KeyState, PendingMessage, after_settle, entry_digest, sent_intent, with_intent
from rebound.topics import failed_topic
from tables.kafka_errors import is_too_large
from tables.retry_state import Loaded

log = logging.getLogger(__name__)


MAX_RELEASE_FAILURES = 3


async def give_up(
    runtime: Runtime, table_key: bytes, partition: int, origin: str, attempt: int, error: Exception
) -> None:
    """A release that keeps failing (a bug, or corrupt stored bytes) ends on the failed topic as ``internal-error``.

    Whatever can still be read is sent, byte-exact where the payload is intact, and the entry is removed, so one bad
    entry ends instead of looping forever or blocking the key. The state is read again after the dead letter's await:
    a message of the same key parked meanwhile must not be erased by writing an older snapshot. An entry with an
    intent ends as its intent says (:func:`send_intent`); one whose message the key's index says ended is dropped, as
    :func:`release` drops it (:func:`drop_ended`), never ended a second time. That drop writes the key's index too: a
    broker that keeps refusing the index as too large refuses it each time: the entry stays parked and its releases
    (this, every third of them) fail for as long as the refusals last, as every write of that key fails meanwhile.
    On a partition revoked meanwhile nothing is sent: the new owner ends it.
    """
    runtime.release_failures.pop((table_key, origin, attempt), None)
    trying = "dead-letter"  # (what the log says failed)
    try:
        if not await lease_held(runtime):  # (asked before the entry is read: its wait may be long)
            raise RevokedBeforeSendError(f"session lease lapsed before {origin} attempt {attempt} was dead-lettered")
        loaded = runtime.store.read(table_key, origin)  # (the key's index comes with the entry: one read)
        state = loaded.state
        entry = state.find(origin)
        if entry is None or entry.attempt != attempt:  # settled, or a newer attempt parked: not this one's to end
            runtime.schedule.confirm(partition, table_key, origin, attempt)
            return
        now = runtime.clock()
        if ended_mark(state, entry, now_ms=now, memory=memory_of(runtime)) is not None:
            # Its message ended already, as release() asks first: typically its own settle, written here and refused
            # by the changelog as too large, whose record deletion waits for that index (so the entry is still read
            # here). A dead letter now would be a second end (after a success: a fork), sent again each time the
            # refusals bring it back here. Dropped instead, as release() drops it; refused again, tried again later.
            trying = "drop (its message ended already)"
            await drop_ended(runtime, table_key, partition, state, entry, now)
            return
        try:
            entry = runtime.store.with_payload(table_key, entry, read=loaded)  # (nothing awaited since the read)
        except Exception:
            log.exception("payload of %s unreadable; dead-lettering without it", origin)
        # (No await since the entry was read: asked again, before any send, as a release asks after its intent.)
        _owned(runtime, partition, origin, attempt)
        intent = sent_intent(entry, attempt)
        if intent is not None:  # its outcome may be out: that one (or, its bytes gone, payload-missing), not another
            outcome = await send_intent(runtime, table_key, partition, entry, intent)
            await settle(runtime, table_key, partition, origin, attempt, outcome, ran=entry)
            return
        outcome = await dead_letter_entry(
            runtime,
            table_key,
            entry,
            Reason.INTERNAL_ERROR,
            attempt=entry.attempt,
            error_class=type(error).__name__,
            error_message=f"release failed {MAX_RELEASE_FAILURES} times: {error}",
        )
        await settle(runtime, table_key, partition, origin, attempt, outcome)
    except RevokedBeforeSendError as revoked:
        revoked_release(runtime, partition, table_key, origin, attempt, revoked)
    except Exception:
        log.exception("could not %s %s attempt %d after repeated release failures", trying, origin, attempt)
        # Not lost: it stays parked and is tried again later (left in flight, it would wait for a silent partition).
        retry_release_later(runtime, partition, table_key, origin, attempt, delay_ms=30_000)


def _digest_of(
    runtime: Runtime, table_key: bytes, entry: PendingMessage | None, ran: PendingMessage | None = None
) -> int | None:
    """The digest of the settled message's bytes, which its mark names it by (:func:`rebound.state.record_digest`):
    one read of its own record (the state was loaded without the bytes). None if they cannot be read: the mark
    then names it by origin and timestamp only, and the settle goes on.

    ``ran`` is the entry the release ran, with its bytes: when it is the same attempt of the same message, its bytes
    are the stored ones (a parked message's bytes are filled in if missing, never replaced:
    :meth:`RetryStore.rewrite_parked`), so they are not read and decoded a second time."""
    if entry is None:
        return None
    if ran is not None and ran.has_payload and ran.origin == entry.origin and ran.attempt == entry.attempt:
        return entry_digest(ran)
    try:
        return entry_digest(runtime.store.with_payload(table_key, entry))
    except Exception:
        log.warning("bytes of %s unreadable; its mark names it without them", entry.origin, exc_info=True)
        return None


async def settle(
    runtime: Runtime,
    table_key: bytes,
    partition: int,
    origin: str,
    attempt: int,
    outcome: Outcome | None = None,
    *,
    confirm: bool = True,
    ran: PendingMessage | None = None,
    loaded: Loaded | None = None,
) -> None:
    """Remove a released entry, reading the state afresh (the caller awaited) and confirming the changelog writes
    (without ``confirm``, unordered mode leaves them to the caller: :func:`handle_release_request` hands them to
    the dispatcher, which acknowledges the request once they are durable and frees the handler slot meanwhile).

    In key-ordered mode the same write blocks the key behind the message (its next retry is scheduled) or lifts
    the block (it ended), and the key's held messages then run at once, in order, in this same request: there the
    settle is confirmed before they run, whatever ``confirm`` says. ``ran`` is the entry the release ran, with its
    bytes: the settled message's mark is named by their digest (:func:`_digest_of`). ``loaded`` is the release's
    read of the key before its handler: the state is read again, and decoded again only if its records changed
    (:meth:`RetryStore.read`).

    A partition revoked while the caller awaited belongs to its new owner now, which has the entry and will run it
    again (at-least-once): writing this worker's stale view would erase whatever the new owner parked meanwhile.
    """
    if not await still_owns(runtime, partition):
        log.warning("partition %d revoked while %s was released; leaving its state to the new owner", partition, origin)
        return
    current = runtime.store.read(table_key, origin, since=loaded).state
    # The same write remembers where the message went (its next retry on its way, or its end): agents/lifecycle.py.
    settled = after_settle(
        current,
        origin,
        attempt,
        outcome,
        now_ms=runtime.clock(),
        memory=memory_of(runtime),
        republished=runtime.settings.release_mode == "republish",
        digest=_digest_of(runtime, table_key, current.find(origin), ran),
    )
    if outcome is not None:  # (also with key order switched off since: what it held still runs, once unblocked)
        settled = after_outcome(settled, origin, outcome, dead_letter_blocks=dead_letters_block(runtime))
    if settled != current:
        runtime.store.save(table_key, current, settled)
        forget_expired_marks(runtime, partition)  # (the partition that writes marks forgets them too)
        if confirm or runtime.settings.key_ordered:
            await runtime.store.confirm()
    runtime.schedule.confirm(partition, table_key, origin, attempt)
    if settled.parked and runtime.settings.key_ordered:
        settled = line_state(runtime, table_key)  # (the order of its held and parked messages needs them all)
    if next_held(settled, dead_letters_block=dead_letters_block(runtime)) is not None:
        await run_held_safely(runtime, table_key, partition)
    if settled.parked:  # key-ordered mode: a retry deferred behind this one is released right after it
        schedule_next_in_line(runtime, table_key, partition)


async def handle_release_request(runtime: Runtime, event: Any) -> Awaitable[None] | None:
    """One release request record, read here (the agent reads each record once and binds what it read:
    :func:`register_release_agent`; this is for a record it could not read, and for tests): a single request is
    released (:func:`handle_release`), anything else logged and skipped."""
    message = event.message
    try:
        request = ReleaseRequest.from_json(message.value)
    except ValueError:
        log.error("ignoring malformed release request at %s@%d", message.partition, message.offset)
        return None
    return await handle_release(runtime, message.key, message.partition, request)


async def run_release(
    runtime: Runtime, table_key: bytes, request: ReleaseRequest, event: Any
) -> Awaitable[None] | None:
    """The dispatcher's work for one release of a record (a single request, or one element of a batch): its table
    key and request are bound, read once from the record; the event gives the partition."""
    return await handle_release(runtime, table_key, event.message.partition, request)


async def skip_record(event: Any) -> None:
    """The work of a record with nothing to release (every element of a batch unreadable: logged as it was read):
    acknowledged in its turn."""
    return None


async def handle_release(
    runtime: Runtime, table_key: bytes, partition: int, request: ReleaseRequest
) -> Awaitable[None] | None:
    """One release request: run the parked message if it is still parked and due. Never raises (except on
    cancellation): an entry whose release failed stays parked and the schedule sends its request again.

    Returns what the settle's confirmation awaits, if it is still on its way (``RetryStore.confirm_later``): the
    dispatcher acknowledges the request once it completes, and its slot and the key's lane serve others meanwhile.
    A settle the changelog refused is handled as a failed release (tried again later), as when it was awaited here.
    Each release of a batch record is one call of its own (its own key's lane), with the same rules.
    """
    origin, attempt = request.origin, request.attempt
    try:
        async with runtime.key_locks.hold(table_key):
            await release(runtime, table_key, partition, origin, attempt, confirm=False)
        runtime.release_failures.pop((table_key, origin, attempt), None)
    except RevokedBeforeSendError as revoked:  # a rebalance's ordinary outcome, not a failed release
        revoked_release(runtime, partition, table_key, origin, attempt, revoked)
    except Exception as exc:
        # The entry stays in the table and the schedule resends it: nothing is lost, nothing skipped.
        failures = runtime.release_failures[(table_key, origin, attempt)] = (
            runtime.release_failures.get((table_key, origin, attempt), 0) + 1
        )
        log.exception("release of %s attempt %d failed (%d times)", origin, attempt, failures)
        if failures >= MAX_RELEASE_FAILURES:
            async with runtime.key_locks.hold(table_key):
                await give_up(runtime, table_key, partition, origin, attempt, exc)
        else:
            retry_release_later(runtime, partition, table_key, origin, attempt, delay_ms=1000 * failures)
    # (Also after a failure: whatever the release wrote before it failed is durable before the request is acked.)
    return runtime.store.confirm_later(failed=partial(settle_refused, runtime, table_key, partition, origin, attempt))


def settle_refused(
    runtime: Runtime, table_key: bytes, partition: int, origin: str, attempt: int, error: Exception
) -> None:
    """A settle's changelog records were refused after the request was handled: a failed release, tried again later
    (the request then finds it settled, and writes the settle again: :meth:`RetryStore.reassert_settled`)."""
    failures = runtime.release_failures[(table_key, origin, attempt)] = (
        runtime.release_failures.get((table_key, origin, attempt), 0) + 1
    )
    log.error("settling %s attempt %d failed (%d times)", origin, attempt, failures, exc_info=error)
    retry_release_later(runtime, partition, table_key, origin, attempt, delay_ms=1000 * failures)


def revoked_release(
    runtime: Runtime, partition: int, table_key: bytes, origin: str, attempt: int, revoked: RevokedBeforeSendError
) -> None:
    """A release whose partition was revoked before its outcome was sent: nothing was sent, and its new owner runs
    it. A rebalance's ordinary outcome, not a failure: one line, no trace, not counted towards ``give_up``, counted
    as ``release.revoked``. Its slot goes back to the schedule as a failed release's does: a partition suspended by
    the revocation keeps it for its return, one dropped is read again when it comes back."""
    runtime.counters["release.revoked"] += 1
    log.warning("%s; its new owner releases it", revoked)
    retry_release_later(runtime, partition, table_key, origin, attempt, delay_ms=1000)


def retry_release_later(
    runtime: Runtime, partition: int, table_key: bytes, origin: str, attempt: int, *, delay_ms: int
) -> None:
    """Put a failed release back in the schedule after a backoff. Left in flight, it would wait for its partition
    to fall silent (the resend lease), which a busy partition never does."""
    runtime.schedule.confirm(partition, table_key, origin, attempt)
    tier = ""
    with contextlib.suppress(Exception):  # (the read may be what failed: the slot only loses its tier label)
        entry = runtime.store.entry(table_key, origin)
        tier = entry.tier if entry is not None else ""
    runtime.schedule.add(partition, Slot(runtime.clock() + delay_ms, table_key, origin, attempt, tier))
    runtime.release_wakeup.set()


def taken(runtime: Runtime, message: Any, record: ReleaseRequest | ReleaseBatch | None = None) -> None:
    """Tell the schedule a request was taken off the topic, in topic order (before it waits in its key's lane): its
    partition is alive, so nothing is re-sent while it is busy, and a request sent earlier and never taken was lost.
    A batch record tells it of each of its requests, with each one's send number. ``record`` is the record's value as
    read (:func:`rebound.commands.read_release_record`); None: read here, or unreadable."""
    now = runtime.clock()
    if record is None:
        with contextlib.suppress(ValueError):
            record = read_release_record(message.value)
    if isinstance(record, ReleaseBatch) and record.requests:
        for key, request in record.requests:
            runtime.schedule.received(message.partition, now, (key, request.origin, request.attempt), request.number)
    elif isinstance(record, ReleaseRequest):
        ident = (message.key, record.origin, record.attempt)
        runtime.schedule.received(message.partition, now, ident, record.number)
    else:
        runtime.schedule.received(message.partition, now)


def offer_record(runtime: Runtime, event: Any) -> None:
    """Read one release record once, tell the schedule it was taken (:func:`taken`) and hand its releases to the
    dispatcher: a single request as one work in its key's lane; a batch as one work per release, each in its own
    key's lane, concurrently, the record acknowledged once all of them are done (``Dispatcher.offer_batch``). A
    batch's unreadable elements are logged and left out (their entries stay parked; the schedule sends again what it
    never hears of); an unreadable record is logged and acknowledged in its turn."""
    message = event.message
    dispatcher = runtime.dispatcher
    try:
        record = read_release_record(message.value)
    except ValueError:
        taken(runtime, message, None)
        dispatcher.offer(event, release_lane(message), partial(handle_release_request, runtime))
        return
    taken(runtime, message, record)
    if isinstance(record, ReleaseRequest):
        dispatcher.offer(event, release_lane(message), partial(run_release, runtime, message.key, record))
        return
    if record.malformed:
        log.error(
            "ignoring %d malformed release requests of the batch at %s@%d (%s); its %d others run",
            len(record.malformed),
            message.partition,
            message.offset,
            "; ".join(record.malformed),
            len(record.requests),
        )
    if not record.requests:
        dispatcher.offer(event, release_lane(message), skip_record)
        return
    partition = message.partition
    dispatcher.offer_batch(
        event, [((partition, key), partial(run_release, runtime, key, request)) for key, request in record.requests]
    )


def register_release_agent(runtime: Runtime) -> Any:
    async def release_agent(stream: Any) -> None:
        # Releases share the dispatcher (and its lanes) with first tries: one key's first tries and retries never
        # run at once, and the worker's concurrency bounds both together.
        async for event in stream.noack().events():
            offer_record(runtime, event)

    return runtime.app.agent(runtime.release_topic, name="rebound.release", concurrency=1)(release_agent)


async def release(
    runtime: Runtime, table_key: bytes, partition: int, origin: str, attempt: int, *, confirm: bool = True
) -> bool:
    """Run one parked message if it is still parked and due; True if it ran. The verdict is
    :func:`rebound.release.check_release`'s, then :func:`rebound.release.how_to_run`'s; this carries it out.
    Without ``confirm`` its settle's changelog writes may be left unconfirmed for the caller (see :func:`settle`)."""
    if attempt == HELD_ATTEMPT:
        return await release_held(runtime, table_key, partition, origin)
    # The lease before the read, ownership after it without awaiting (:func:`_owned`), as ``give_up`` asks: the tier
    # agent writes the key without its lock, and what it wrote during a wait would be lost to a write of this read.
    if not await lease_held(runtime):
        raise RevokedBeforeSendError(f"session lease lapsed before {origin} attempt {attempt} was released")
    loaded = runtime.store.read(table_key, origin)  # (the key's index comes with the entry: one read)
    state = loaded.state
    entry = state.find(origin)
    now = runtime.clock()
    gate = runtime.breaker_gate
    verdict = check_release(
        entry,
        attempt,
        now,
        breaker_open=gate is not None and gate.breaker.is_open,
        would_retry=lambda parked: failure_would_retry(
            runtime, parked.provenance.topic, parked.attempt, parked.provenance.first_received_at_ms
        ),
        state=state,
        memory=memory_of(runtime),
    )
    if verdict is Verdict.ENDED and entry is not None:
        await drop_ended(runtime, table_key, partition, state, entry, now)
        return False
    if verdict in STALE or entry is None:
        if verdict is Verdict.SETTLED:  # the settle's changelog records may not have been acknowledged
            _owned(runtime, partition, origin, attempt)  # (this worker's view of the key: revoked, not written)
            runtime.store.reassert_settled(table_key, origin)
            await runtime.store.confirm()
        runtime.schedule.confirm(partition, table_key, origin, attempt)
        runtime.counters["release.stale"] += 1
        return False
    if verdict is Verdict.RESEND:
        return await resend(runtime, table_key, partition, entry, attempt, confirm=confirm)
    if verdict is Verdict.EARLY:  # never before due, whatever sent the request
        runtime.schedule.confirm(partition, table_key, origin, attempt)
        runtime.schedule.add(partition, Slot(entry.due_at_ms, table_key, origin, attempt, entry.tier))
        runtime.release_wakeup.set()
        runtime.counters["release.early"] += 1
        return False
    if runtime.settings.key_ordered and defer_behind_lower(runtime, table_key, partition, entry):
        # A lower message of its key is still unsettled: released right after it, so the key succeeds in order.
        if gate is not None:
            gate.release_probe_sent_at = None  # if it was sent to be the probe, another one may go
        return False
    if verdict is Verdict.BREAKER_DEFERRED and gate is not None:
        # This attempt's failure would end it: it stays parked until the breaker closes, rather than hold a
        # dispatcher slot a probe may need.
        runtime.schedule.confirm(partition, table_key, origin, attempt)
        runtime.schedule.add(partition, Slot(entry.due_at_ms, table_key, origin, attempt, entry.tier))
        runtime.counters["breaker.deferred"] += 1
        gate.release_probe_sent_at = None  # if it was sent to be the probe, another one may go
        return False
    runtime.counters["released"] += 1
    runtime.counters["release.lag_ms_total"] += now - entry.due_at_ms
    runtime.metrics.released(entry.provenance.topic, entry.tier, now - entry.due_at_ms)
    entry = runtime.store.with_payload(table_key, entry, read=loaded)  # its record, read above (nothing awaited)
    verdict = how_to_run(entry, republish=runtime.settings.release_mode == "republish")
    if verdict in (Verdict.PAYLOAD_MISSING, Verdict.REPUBLISH):  # sent with no handler call (whose path asks)
        _owned(runtime, partition, origin, attempt)  # (no await since the lease, awaited before the read)
    if verdict is Verdict.PAYLOAD_MISSING:
        log.error("payload of %s attempt %d is missing from the payload table", origin, attempt)
        outcome = await dead_letter_entry(
            runtime,
            table_key,
            entry,
            Reason.PAYLOAD_MISSING,
            attempt=entry.attempt,
            error_class=entry.error_class,
            error_message=entry.error_message,
        )
    elif verdict is Verdict.REPUBLISH:
        await republish(runtime, entry)
        outcome = Outcome.SUCCEEDED
    else:
        outcome = await run_attempt(
            runtime,
            key=entry.key,
            value=entry.value,
            headers=list(entry.headers),
            provenance=entry.provenance,
            attempt=entry.attempt,
            tier=entry.tier,
            # Key-ordered mode: its next retry keeps the key blocked, written before the retry is sent.
            before_retry=(
                owned_first(
                    runtime, partition, origin, attempt, blocker(runtime, table_key, origin, written_again=False)
                )
                if runtime.settings.key_ordered
                else None
            ),
            before_send=intent_writer(runtime, table_key, partition, origin, attempt),
        )
    # settle() re-reads: the handler awaited, and a newer attempt of this message may have been parked meanwhile.
    await settle(runtime, table_key, partition, origin, attempt, outcome, confirm=confirm, ran=entry, loaded=loaded)
    return True


async def drop_ended(
    runtime: Runtime, table_key: bytes, partition: int, state: KeyState, entry: PendingMessage, now: int
) -> None:
    """Drop a parked entry whose message ended already (``Verdict.ENDED``, :func:`rebound.release.ended_mark`): a
    stale copy's, or one whose settle the changelog refused (its record's deletion waited for that index), whose run
    would be a second end. The entry and its bytes go in one confirmed write, with (key order) the block that message
    still held once it ended; the key's held messages then run, as after a settle. Counted as ``release.ended``, one
    warning. The normal path pays nothing: the index is read with the entry.

    ``state`` is :func:`release`'s (or :func:`give_up`'s) read, which awaited the session lease before it: ownership
    is asked here without awaiting, so nothing written meanwhile (the tier agent's ended mark or park: no key lock) is
    written over."""
    _owned(runtime, partition, entry.origin, entry.attempt)  # (revoked: its new owner drops it)
    mark = ended_mark(state, entry, now_ms=now, memory=memory_of(runtime))
    assert mark is not None  # (check_release said ENDED, on the same state and the same clock)
    after = without_ended(state, mark, dead_letter_blocks=dead_letters_block(runtime))
    runtime.store.save(table_key, state, after)
    await runtime.store.confirm()
    runtime.schedule.confirm(partition, table_key, entry.origin, entry.attempt)
    runtime.counters["release.ended"] += 1
    log.warning(
        "%s attempt %d is parked though its message %s with attempt %d (a stale copy): dropped, not run",
        entry.origin,
        entry.attempt,
        "ended" if mark.ended else "is being dead-lettered",
        mark.attempt,
    )
    if after.parked and runtime.settings.key_ordered:
        after = line_state(runtime, table_key)
    if next_held(after, dead_letters_block=dead_letters_block(runtime)) is not None:
        await run_held_safely(runtime, table_key, partition)
    if after.parked:  # key-ordered mode: a retry deferred behind this one is released now
        schedule_next_in_line(runtime, table_key, partition)


class RevokedBeforeSendError(RuntimeError):
    """The release's partition was revoked before its outcome was sent: the new owner runs it (nothing was sent)."""


async def _still_owned(runtime: Runtime, partition: int, origin: str, attempt: int) -> None:
    """Raise :class:`RevokedBeforeSendError` unless the session lease holds and the partition is still this worker's
    (:func:`agents.ownership.still_owns`, the rule a first try's check follows too)."""
    if not await still_owns(runtime, partition):
        raise RevokedBeforeSendError(
            f"partition {partition} revoked (or the session lease lapsed) before {origin} attempt {attempt} was sent"
        )


def _owned(runtime: Runtime, partition: int, origin: str, attempt: int) -> None:
    """The ownership half of :func:`_still_owned` (:func:`agents.ownership.owns`), for a check that must not await:
    the caller awaited :func:`agents.ownership.lease_held` before its read."""
    if not owns(runtime, partition):
        raise RevokedBeforeSendError(f"partition {partition} revoked before {origin} attempt {attempt} was sent")


def owned_first(runtime: Runtime, partition: int, origin: str, attempt: int, then: BeforeRetry) -> BeforeRetry:
    """``then`` (key-ordered mode's block, the first write after the handler) only while the partition is still
    this worker's: revoked meanwhile, nothing is written nor sent (:func:`intent_writer`)."""

    async def if_owned() -> None:
        await _still_owned(runtime, partition, origin, attempt)
        await then()

    return if_owned


def intent_writer(runtime: Runtime, table_key: bytes, partition: int, origin: str, attempt: int) -> BeforeSend:
    """What runs before a release's failure is sent (a dead letter or its next retry): the :class:`Intent` on its
    entry, confirmed. A worker stopped after the send and before the settle was durable leaves the entry parked;
    its request read again then finds the intent and sends the same (:func:`resend`) instead of running the
    handler again, which could decide otherwise (issue 22: a message dead-lettered and then succeeded, or
    dead-lettered while its next retry runs). Costs one confirmed write (the entry's record and the key's index)
    per failing release; a succeeding one writes none.

    A partition revoked meanwhile is its new owner's: writing this worker's view could erase what that owner
    parked, so nothing is written and nothing sent (:class:`RevokedBeforeSendError`, a failed release).

    An entry parked within the intent's size of the changelog's record limit is sent without one, as before
    intents: refusing its send would fail its release until ``give_up`` ended it ``internal-error``.
    """

    async def write_intent(intent: Intent) -> None:
        await _still_owned(runtime, partition, origin, attempt)
        before = runtime.store.load(table_key, origin=origin)
        after = with_intent(before, origin, attempt, intent)
        if after == before:
            await block_again(intent)
            return
        try:
            runtime.store.save(table_key, before, after)
        except RecordTooLargeError:  # (checked before any write: the tables are as they were)
            runtime.counters["release.intent_too_large"] += 1
            log.warning("%s attempt %d: its intent does not fit its record; sent without it", origin, attempt)
            await block_again(intent)
            return
        await runtime.store.confirm()
        # Revoked during that round trip: the new owner may have read the changelog before the intent was in it,
        # and runs the handler itself. Not sent here; an owner that did read the intent sends the same.
        await _still_owned(runtime, partition, origin, attempt)

    async def block_again(intent: Intent) -> None:
        # No intent written: before a retry, key order's blocker left the key's block to this write. Revoked during
        # its round trip, the retry is not sent, as after an intent's. (A dead letter's needs none: its parked entry
        # keeps the key waiting.)
        if not intent.dead and await write_block_again(runtime, table_key, origin):
            await _still_owned(runtime, partition, origin, attempt)

    return write_intent


async def resend(
    runtime: Runtime, table_key: bytes, partition: int, entry: PendingMessage, attempt: int, *, confirm: bool
) -> bool:
    """Send again what the release of ``attempt`` decided before its worker stopped (``Verdict.RESEND``), then
    settle: the handler does not run. A dead letter may reach the failed topic twice, a retry its tier twice (the
    tier parks one): the same end, at-least-once. Only while the partition is still this worker's: revoked, its new
    owner sends it (:class:`RevokedBeforeSendError`)."""
    intent = sent_intent(entry, attempt)
    assert intent is not None  # (check_release said RESEND)
    _owned(runtime, partition, entry.origin, attempt)  # (no await since release() awaited the lease and read the entry)
    entry = runtime.store.with_payload(table_key, entry)
    runtime.counters["release.resent"] += 1
    log.warning(
        "%s attempt %d was released before its settle was durable; sending its %s again",
        entry.origin,
        attempt,
        "dead letter" if intent.dead else f"retry {intent.next_attempt}",
    )
    outcome = await send_intent(runtime, table_key, partition, entry, intent)
    await settle(runtime, table_key, partition, entry.origin, attempt, outcome, confirm=confirm, ran=entry)
    return True


async def send_intent(
    runtime: Runtime, table_key: bytes, partition: int, entry: PendingMessage, intent: Intent
) -> Outcome:
    """Send ``intent`` again (:func:`agents.attempt.send_again`) for ``entry`` read with its bytes; returns the outcome
    to settle with. An entry whose bytes are gone (missing or unreadable) cannot carry them: its retry cannot be sent
    and its dead letter would have no value, so it ends as a release without its payload does, ``payload-missing``
    (the message's key, no value, no headers of its own; the attempt and error of the intent). The reason tells the
    failed topic's readers the value was left out (the redrive job skips it rather than send a tombstone).

    A retry the broker refuses as too large falls back to its dead letter only while ``partition`` is still this
    worker's (:func:`_still_owned`, after the refused send's await): revoked, nothing is sent
    (:class:`RevokedBeforeSendError`), and the new owner, reading the same intent, sends that dead letter once."""
    if entry.has_payload:
        key, value, headers = entry.dead_letter_bytes(table_key)
        return await send_again(
            runtime,
            intent,
            key=key,
            value=value,
            headers=headers,
            provenance=entry.provenance,
            tier=entry.tier,
            before_fallback=partial(_still_owned, runtime, partition, entry.origin, intent.attempt),
        )
    log.error(
        "payload of %s attempt %d is missing; its %s cannot be sent again, dead-lettering it as payload-missing",
        entry.origin,
        intent.attempt,
        "dead letter" if intent.dead else f"retry {intent.next_attempt}",
    )
    return await dead_letter_entry(
        runtime,
        table_key,
        entry,
        Reason.PAYLOAD_MISSING,
        attempt=intent.attempt,
        error_class=intent.error_class,
        error_message=intent.error_message,
    )


async def release_held(runtime: Runtime, table_key: bytes, partition: int, origin: str) -> bool:
    """A request to run a key's held messages (its block was lifted outside its lane); stale unless ``origin`` is
    still the first of them and may run."""
    head = next_held(line_state(runtime, table_key), dead_letters_block=dead_letters_block(runtime))
    if head is None or head.origin != origin:
        runtime.schedule.confirm(partition, table_key, origin, HELD_ATTEMPT)
        runtime.counters["release.stale"] += 1
        return False
    ran = await run_held_safely(runtime, table_key, partition)
    runtime.schedule.confirm(partition, table_key, origin, HELD_ATTEMPT)  # (not confirmed if it raised: sent again)
    return ran > 0


async def republish(runtime: Runtime, entry: Any) -> None:
    """Seed pattern: put the message back on its original topic, signed so the main agent trusts its attempt.

    A message that no longer fits once the signed headers are added goes to the failed topic as ``too-large``:
    resending it could never succeed and would stop the release partition.
    """
    headers = signed_republish_headers(
        list(entry.headers),
        key=entry.key,
        value=entry.value,
        provenance=entry.provenance,
        group=runtime.group,
        attempt=entry.attempt,
        tier=entry.tier,
        secret=reveal(runtime.settings.header_secret),
        expires_at_ms=runtime.clock() + runtime.settings.republish_ttl_ms,
    )
    limit = runtime.settings.producer_max_request_bytes
    problem = f"the re-published record would be more than {limit} bytes"
    if fits(entry.key, entry.value, headers, limit):
        try:
            await deliver(
                runtime.main_topics[entry.provenance.topic],
                key=entry.key,
                value=entry.value,
                headers=headers,
                partition=entry.provenance.partition % runtime.partitions,
            )
            return
        except RecordTooLargeError as exc:
            problem = str(exc)
    await dead_letter(
        runtime,
        DeadLetter(failed_topic(entry.provenance.topic), Reason.TOO_LARGE),
        key=entry.key,
        value=entry.value,
        headers=list(entry.headers),
        provenance=entry.provenance,
        attempt=entry.attempt,
        tier=entry.tier,
        error_class=entry.error_class,
        error_message=f"{problem}; last error: {entry.error_message}",
    )


def slots_by_partition(runtime: Runtime, partitions: frozenset[int]) -> dict[int, list[Slot]]:
    """What the schedule holds for ``partitions``, from one read of those partitions' records: every parked
    message's due slot, and in key-ordered mode a slot to run the first held message of every key no longer blocked
    (its worker stopped before they all ran)."""
    slots: dict[int, list[Slot]] = {partition: [] for partition in partitions}
    for partition in partitions:
        runtime.store.index_partition(partition)
    for key, entry in runtime.store.parked(partitions):  # (version 2 states' lists included)
        if entry.partition in slots:
            slots[entry.partition].append(Slot(entry.due_at_ms, key, entry.origin, entry.attempt, entry.tier))
            runtime.store.count_parked(entry, +1)
    for key, state in runtime.store.key_states(partitions):
        if state.partition in slots:
            runtime.store.count_blocked(key, None, state)
        head = next_held(state, dead_letters_block=dead_letters_block(runtime))
        if head is not None and head.partition in slots:
            slots[head.partition].append(Slot(0, key, head.origin, HELD_ATTEMPT, HELD_TIER))
    return slots


def adopt_owned_partitions(runtime: Runtime) -> None:
    """Build the schedule for every release partition this worker actively owns and does not schedule as it is.

    Called after every recovery. A partition that moved here brings its parked messages with its changelog, and a
    read of that partition's records turns them back into due slots. A partition kept across the rebalance (Faust
    revokes every partition at each one) resumes the slots it had, unless changelog records of it were replayed
    since: then another worker wrote to it meanwhile, or Faust reported a recovery complete (an interrupted one,
    after the assignment already changed) before the recovery that actually read the partition's changelog, which
    once left 83 retries never released in a chaos run; the replay marks the partition, and the recovery that
    follows reads it again. Partitions nothing was replayed into are never read again.

    While the worker owns nothing (:func:`agents.ownership.owns_nothing`) nothing changes: Faust's recovery is cut
    short only by the next assignment, not by a revocation, so the previous generation's can complete between the
    revocation and the assignment; dropping every suspended partition then would read each again after the
    assignment and send its requests in flight again. The assignment's own recovery adopts.
    """
    if owns_nothing(runtime):
        return
    owned = owned_partitions(runtime)
    for partition in (runtime.schedule.partitions | runtime.schedule.suspended) - owned:
        runtime.schedule.drop(partition)
    for partition in (
        set(runtime.store.blocked) | set(runtime.store.unsettled) | set(runtime.store.parked_per_tier)
    ) - owned:
        runtime.store.forget_partition(partition)
    replayed = runtime.store.replayed & owned
    runtime.store.replayed -= replayed
    for partition in (owned & runtime.schedule.suspended) - replayed:
        runtime.schedule.resume(partition)
    moved = (owned - runtime.schedule.partitions) | replayed
    if not moved:
        runtime.release_wakeup.set()
        return
    slots = slots_by_partition(runtime, frozenset(moved))
    for partition, found in slots.items():
        runtime.schedule.adopt(partition, found)
    runtime.release_wakeup.set()
    log.info(
        "release schedule adopted partitions %s (%d parked); kept %s as scheduled",
        sorted(moved),
        sum(map(len, slots.values())),
        sorted(owned - moved),
    )


async def release_due(runtime: Runtime) -> int:
    """One tick: send release requests for the due slots of the partitions this worker still owns, as many as each
    partition's window of unconfirmed requests has room for, and again those of a partition silent for so long they
    look lost; returns how many. A partition's requests go up to ``REBOUND_RELEASE_BATCH`` to a record
    (:func:`rebound.commands.release_records`), each with its own send number; the breaker's probe goes alone."""
    owned = owned_partitions(runtime)
    for partition in runtime.schedule.partitions - owned:  # revoked since the last tick: release nothing of it
        runtime.schedule.suspend(partition)
    gate = runtime.breaker_gate
    if gate is not None and gate.breaker.is_open:
        # Open: due messages wait (their due times move when it closes), but one may be sent to be the probe.
        probe = gate.release_probe(runtime.clock())
        if probe is None:
            return 0
        runtime.schedule.take(*probe, runtime.clock())
        due = [probe]
    else:
        due = paced_due(runtime, runtime.clock())
    topic = runtime.release_topic
    producer = direct_producer(runtime, topic) if due else None
    name = topic.get_topic_name()
    schedule = runtime.schedule
    requests = (
        (
            partition,
            slot.table_key,
            ReleaseRequest(slot.origin, slot.attempt, schedule.send_number(partition, slot.ident)),
        )
        for partition, slot in due
    )
    # Each partition's due requests, up to REBOUND_RELEASE_BATCH to a record (one alone: a single request's record).
    settings = runtime.settings
    counters = runtime.counters
    records = release_records(
        requests, settings.release_batch, release_record_bytes(settings.producer_max_request_bytes)
    )
    stuck: set[int] = set()
    for partition, key, value in records:
        if partition in stuck:  # (left in flight, sent again as lost: see below)
            counters["release.send_failed"] += 1
            continue
        try:
            if producer is None:
                await topic.send(key=key, value=value, partition=partition)
            else:  # the same record (raw key and value, no headers), without Faust's send layers
                sent = await producer.send(name, value, key=key, partition=partition)
                sent.add_done_callback(partial(_request_sent, counters))
        except Exception as exc:  # whatever the send raised (aiokafka refuses a record too large at once), the
            # tick's other records still go.
            # Its requests were not sent: they stay in flight in the schedule and are sent again as any lost
            # request is (ReleaseSchedule), without holding up the others of the tick.
            # A refusal for its size is this record's alone; anything else (a full buffer whose partition's broker
            # is down waits out the request timeout, then raises) would likely fail the partition's next records
            # too, each after the same wait: they are left for the resend with it.
            counters["release.send_failed"] += 1
            if not is_too_large(exc):
                stuck.add(partition)
            log.warning(
                "a release request record for partition %s was not sent (%r); its requests are sent again later%s",
                partition,
                exc,
                "" if is_too_large(exc) else ", as are the partition's other records of this tick",
            )
    counters["release.requests"] += len(due)  # (with the failed: these two give the requests per record)
    counters["release.request_records"] += len(records)
    return len(due)


def _request_sent(counters: Counter[str], sent: asyncio.Future[Any]) -> None:
    """A release request record's send ended: a failure is logged (and retrieved) and counted. Nothing else: a
    request that never arrives is sent again as one lost on its way is (``ReleaseSchedule``: once a later request of
    its partition is taken, or the partition falls silent)."""
    if not sent.cancelled() and (error := sent.exception()) is not None:
        counters["release.send_failed"] += 1
        log.warning("a release request was not sent (%r); it is sent again later", error)


def paced_due(runtime: Runtime, now: int) -> list[tuple[int, Slot]]:
    """The due slots to send now: all of them, or with ``REBOUND_RELEASE_RATE`` as many new ones as the pacer allows
    (``rebound/pacing.py``), plus any lost requests sent again (not paced: the windows bound them). Those left waiting
    go at a later tick, never before due either way; the new releases pacing delayed are counted, each once
    (``release.paced``)."""
    due, delayed = pop_paced(runtime.schedule, runtime.pacer, now)
    if delayed:
        runtime.counters["release.paced"] += delayed
    return due


def seconds_until_next_tick(runtime: Runtime) -> float:
    """Sleep until the earliest due time a tick could send, at most one timer interval (which also bounds resends of
    lost requests). A partition whose window is full is left out: a confirm that opens it sets the wakeup."""
    interval = runtime.settings.timer_interval
    gate = runtime.breaker_gate
    if gate is not None and gate.breaker.is_open:
        return interval  # due slots stay in the heap while it is open: a tick per interval looks for a probe
    next_due = runtime.schedule.next_due_ms()
    if next_due is None:
        return interval
    now = runtime.clock()
    wake = max(next_due, runtime.pacer.next_at_ms(now))  # (with REBOUND_RELEASE_RATE, when the pacer allows one)
    return min(interval, max(0.0, (wake - now) / 1000))


async def release_ticks(runtime: Runtime) -> None:
    """The release timer: wakes at the next due time, not only on a fixed tick, so releases follow due times closely.

    Parking a message (or a confirm that opens a full window) sets ``runtime.release_wakeup``, so a new slot earlier
    than the current sleep is not missed. Ticks are at least ``REBOUND_RELEASE_LINGER_MS`` apart: at 1,000 due a second
    a tick per due time sends one request a batch, and a broker pays per batch (Tansu's fetches scan every batch of a
    partition), so what comes due within the linger goes out together.

    Each tick's own duration, a failed one's too, is observed once (``rebound_release_tick_seconds``): its work on the
    event loop and its sends' hand-off to the producer, not the wait for the next tick.
    """
    loop = asyncio.get_running_loop()
    linger = runtime.settings.release_linger_ms / 1000
    while True:
        ticked_at = loop.time()
        started = perf_counter()
        try:
            await release_due(runtime)
        except Exception:  # a failed tick must not end the timer: slots it did not send are sent again once a
            # later request of their partition is taken, or the partition falls silent (ReleaseSchedule)
            ended = perf_counter()  # (its logging is not the tick's)
            log.exception("release tick failed")
        else:
            ended = perf_counter()
        runtime.metrics.release_ticked(ended - started)
        runtime.release_wakeup.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(runtime.release_wakeup.wait(), timeout=seconds_until_next_tick(runtime))
        await asyncio.sleep(max(0.0, ticked_at + linger - loop.time()))


def register_release_timer(runtime: Runtime) -> None:
    def timer_failed(exc: Exception) -> None:  # (release_ticks catches a failed tick itself: this is a bug)
        log.error("release timer failed; restarting it", exc_info=exc)

    start_with(runtime.app, Restarting("release timer", lambda: release_ticks(runtime), timer_failed))

    async def on_recovered() -> None:
        adopt_owned_partitions(runtime)

    runtime.table.on_recover(on_recovered)

    @runtime.app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def on_revoked(app: Any, revoked: Any, **kwargs: Any) -> None:
        name = runtime.release_topic.get_topic_name()
        for tp in revoked:
            if tp.topic == name:  # kept aside: it resumes if the partition comes back with nothing replayed
                runtime.schedule.suspend(tp.partition)
