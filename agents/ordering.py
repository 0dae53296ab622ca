"""Key-ordered mode on the agents: hold a blocked key's messages, and run them in order once it is free.

Beside the main path, not in it: the main agent hands a record of a key to :class:`KeyOrder`, which decides before
its attempt (run, hold, refuse), blocks the key before its retry is sent, and settles the key after it; the attempt
(``agents/attempt.py``) knows nothing of ordering. The decisions are :mod:`rebound.ordering`'s. Every change is a table write, so it happens where Faust allows one (a
stream iteration: the main agent's record, a release request, an admin command, a tier record), and is confirmed
before the record that caused it is acknowledged. A key's main records and release requests share a dispatcher lane,
so holding, releasing and running the held messages of one key never interleave.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial

from agents.attempt import BeforeRetry, dead_letter_entry, run_attempt
from agents.delivery import emit_attempt
from agents.lifecycle import (
    DigestOf,
    announce_dead_letter,
    dropped_orphan,
    forget_expired_marks,
    memory_of,
    owned_after,
    send_intended_dead_letter,
    still_owned,
    still_owned_after_send,
    with_outcome,
)
from agents.ownership import owns, still_owns
from agents.runtime import Runtime
from rebound.attempts import Outcome
from rebound.errors import KeyBacklogFullError, RecordTooLargeError
from rebound.headers import Header, Provenance
from rebound.ordering import (
    HELD_ATTEMPT,
    HELD_PAYLOAD_PREFIX,
    HELD_TIER,
    Placement,
    admit,
    after_outcome,
    held_entry,
    hold,
    keeps_key_unchanged,
    next_held,
    origin_of,
    recheck_at,
    retry_block,
    retry_may_be_out,
    waits_for,
    without_held,
)
from rebound.routing import Reason
from rebound.schedule import Slot
from rebound.state import (
    KeyState,
    Known,
    PendingMessage,
    entry_digest,
    record_digest,
    redelivery,
    room_for_an_end,
)

log = logging.getLogger(__name__)


class KeyOrder:
    """Key-ordered mode around a main-topic record's first try, in one place: neither the main agent's default path
    nor the attempt knows of it.

    Before the attempt, :meth:`admit` carries out :func:`rebound.ordering.admit` (run the record, hold it, recognise
    it as held already, or send it to the failed topic when its key holds all it may). During it, the key is blocked
    before a retry is sent: :func:`blocker` is the attempt's ``before_retry``, as a *sending* mark is in the default
    mode. After it, :meth:`settle` sets or lifts the key's block as the outcome says and runs the held messages
    once it is lifted. The redelivery check (:func:`agents.lifecycle.check_redelivery`) comes before all of it, as in
    the default mode: a redelivery of a message whose retry is parked, on its way or ended does none of this.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def applies(self, key: bytes | None) -> bool:
        """Whether a main-topic record of ``key`` runs in key order (the mode is on, and the record has a key)."""
        return key is not None and self.runtime.settings.key_ordered

    async def run(
        self,
        table_key: bytes,
        *,
        key: bytes | None,
        value: bytes | None,
        headers: list[Header],
        provenance: Provenance,
        sending: bool,
        digest_of: DigestOf,
    ) -> None:
        """Admit the record, run its attempt if it may run now, and settle its key. ``sending``: a *sending* mark
        says its retry may have been sent before its worker stopped (:attr:`rebound.state.Known.SENDING`)."""
        placement, before = await self.admit(table_key, key=key, value=value, headers=headers, provenance=provenance)
        if placement is not Placement.RUN:
            return
        origin = origin_of(provenance)
        maybe_sent = retry_may_be_out(before, origin, sending=sending)
        outcome = await run_attempt(
            self.runtime,
            key=key,
            value=value,
            headers=headers,
            provenance=provenance,
            attempt=0,
            tier=None,
            before_retry=owned_after(self.runtime, provenance, 0, blocker(self.runtime, table_key, origin)),
            before_send=announce_dead_letter(self.runtime, table_key, provenance, 0, digest_of, maybe_sent=maybe_sent),
        )
        await self.settle(
            table_key,
            provenance,
            outcome,
            maybe_sent=maybe_sent,
            digest_of=digest_of,
        )

    async def admit(
        self,
        table_key: bytes,
        *,
        key: bytes | None,
        value: bytes | None,
        headers: list[Header],
        provenance: Provenance,
    ) -> tuple[Placement, KeyState]:
        """Carry out :func:`rebound.ordering.admit`; returns its verdict and the key's state as it was read.

        A key with nothing retrying, held or blocking (the partition's in-memory index says so) is not read: its
        record runs. A record that cannot be held (its key holds all it may, or its bytes do not fit a changelog
        record) goes to the failed topic with the reason: it leaves the key's order, but it is never lost.
        """
        runtime = self.runtime
        if not runtime.store.may_be_unsettled(table_key, provenance.partition):
            return Placement.RUN, KeyState()
        state = line_state(runtime, table_key)  # its retrying messages' offsets decide (a key has one, rarely a few)
        placement = admit(state, provenance, max_held=runtime.settings.max_held_per_key)
        if placement is Placement.RUN:
            return placement, state
        if placement is Placement.ALREADY_HELD:
            # Delivered again: its offset was never committed, so the hold's changelog records may never have been
            # acknowledged (a crash right after the local write). Written again, or the next owner would not have it.
            runtime.store.rewrite_held(table_key, origin_of(provenance))
            await runtime.store.confirm()
            return placement, state
        entry = held_entry(
            key=key,
            value=value,
            headers=tuple(headers),
            provenance=provenance,
            now_ms=runtime.clock(),
            blocked_by=state.blocked_by,
        )
        if placement is Placement.BACKLOG_FULL:
            full = KeyBacklogFullError(f"key already holds {len(state.held)} messages (REBOUND_MAX_HELD_PER_KEY)")
            await self._not_held(table_key, state, entry, Reason.KEY_BACKLOG_FULL, full)
        else:
            await self._hold(table_key, state, entry)
        return placement, state

    async def _hold(self, table_key: bytes, state: KeyState, entry: PendingMessage) -> None:
        """Hold the record behind its key's blocking message, confirmed before its offset is acknowledged.

        A hold the changelog refuses is taken back and the record dead-lettered, each after a confirm: the lease and
        ownership are asked before each (:func:`agents.lifecycle.still_owned`); refused, nothing more is written or
        sent and the record is left unacknowledged, since its next owner may find the key free and run it."""
        runtime = self.runtime
        try:
            after, _ = hold(state, entry)
            runtime.store.save(table_key, state, after)
            try:
                await runtime.store.confirm()
            except RecordTooLargeError:
                await still_owned(runtime, entry.provenance, 0)
                await _take_back_held(runtime, table_key, entry.origin)
                raise
        except RecordTooLargeError as too_large:
            await still_owned(runtime, entry.provenance, 0)  # (the take-back's confirm awaited)
            await self._not_held(table_key, state, entry, Reason.TOO_LARGE, too_large)
            return
        runtime.counters["ordering.held"] += 1
        await emit_attempt(
            runtime,
            key=entry.key,
            provenance=entry.provenance,
            attempt=0,
            tier=None,
            outcome=Outcome.HELD,
            error_message=entry.error_message,
        )

    async def _not_held(
        self, table_key: bytes, state: KeyState, entry: PendingMessage, reason: Reason, error: Exception
    ) -> None:
        """Dead-letter a record that could not be held. ``key-backlog-full`` (from :meth:`admit`) asks no lease: no
        await since its work's start, which the dispatcher's lease gate let through; ``too-large`` asks in ``_hold``."""
        log.error("could not hold %s behind %s: %s", entry.origin, state.blocked_by, error)
        await dead_letter_entry(
            self.runtime,
            table_key,
            entry,
            reason,
            attempt=0,
            tier=None,
            error_class=type(error).__name__,
            error_message=f"could not be held behind its key's blocking message: {error}",
        )

    async def settle(
        self, table_key: bytes, provenance: Provenance, outcome: Outcome, *, maybe_sent: bool, digest_of: DigestOf
    ) -> None:
        """Block the key behind the message (its retry was scheduled) or lift the block it held (it ended), in one
        confirmed write that also remembers where the message went; then run the key's held messages if the block
        was lifted. Nothing is written for a success with no retry out (:func:`rebound.ordering.keeps_key_unchanged`).

        The key's blocker read again (its worker stopped after its block was written) runs again, and its retry may
        have been sent: its end is remembered even if it succeeds on its first try (``maybe_sent``), so that retry,
        if it was sent, is refused when it arrives (no *sending* mark is needed here: the block says it).

        The write follows the send's await: the session lease and ownership are asked first
        (:func:`agents.lifecycle.still_owned_after_send`). Lost meanwhile, nothing is written, the held messages do
        not run here, and the record is left unacknowledged (:class:`~agents.lifecycle.FirstTryRevokedError`). The new
        owner reads it again and finds what the confirmed write before the send left: a retry's block, so the record
        runs again and its end is remembered, the retry sent giving way to it (no fork, at most one more handler call);
        a dead letter's intent, so the same dead letter is sent again without the handler and this settle made there
        (one end, on the failed topic twice); a success read again as the key's blocker, its block, so it runs again
        (an idempotent handler succeeds again). Why not written anyway: :func:`agents.lifecycle.remember_outcome`.
        """
        if keeps_key_unchanged(outcome, maybe_sent=maybe_sent):
            return  # the common case: nothing of the key changes, and nothing is written
        await still_owned_after_send(self.runtime, provenance, 0)
        origin = origin_of(provenance)
        digest = digest_of()
        try:
            after = await record_outcome(
                self.runtime,
                table_key,
                origin,
                outcome,
                remembered=(provenance, 0),
                maybe_sent=maybe_sent,
                digest=digest,
            )
            if next_held(after) is not None:  # this was the blocking message, redelivered, and nothing else of it waits
                await run_held_safely(self.runtime, table_key, provenance.partition)
        except Exception:
            # The message itself has ended (its outcome is routed): this is only the key's bookkeeping, which its
            # partition's next adoption finds again. Letting it reach the catch-all would dead-letter the message.
            log.exception("key-order bookkeeping after %s failed", origin)

    async def ended_in_error(self, table_key: bytes, provenance: Provenance, attempt: int, digest: int) -> None:
        """The record went to the failed topic as ``internal-error`` (an error of ours, caught by the main agent).
        Its block may have been written before the error: the message has ended, so the key stops waiting, and its
        held messages are asked to run. Asked first, as :meth:`settle` asks (the dead letter's send was awaited): lost
        meanwhile, nothing is written and the record is left unacknowledged; with no intent for ``internal-error``,
        the new owner runs it again, as after a crash there."""
        await still_owned_after_send(self.runtime, provenance, attempt)
        after = await record_outcome(
            self.runtime,
            table_key,
            origin_of(provenance),
            Outcome.DEAD,
            remembered=(provenance, attempt),
            digest=digest,
        )
        schedule_held(self.runtime, table_key, provenance.partition, after)


async def _take_back_held(runtime: Runtime, table_key: bytes, origin: str) -> None:
    current = runtime.store.load(table_key)
    if current.find_held(origin) is not None:
        runtime.store.save(table_key, current, without_held(current, origin))
        await runtime.store.confirm()


def blocker(runtime: Runtime, table_key: bytes, origin: str, *, written_again: bool = True) -> BeforeRetry:
    """What runs before ``origin``'s retry is sent: the key is blocked behind it, durably.

    A key blocked behind ``origin`` already (a retry of it failing again) changes nothing: its block is written again
    only because it may have been written before a crash and never acknowledged. ``written_again=False`` leaves that
    to the caller's next confirmed write: a release's intent (``agents.release.intent_writer``) writes the key's
    index, block included, and confirms it before the send, so a second write and round trip of its own would add
    nothing; where no intent is written before a retry, the intent writer calls :func:`write_block_again` (and asks
    ownership again after its round trip).
    """

    async def block_key() -> None:
        current = runtime.store.load(table_key)
        # Blocked by another message already: an earlier one (replayed after a crash) keeps its block, a later one
        # of the partition (this one read again below it) gives it to this one (rebound.ordering.retry_block).
        after = retry_block(current, origin)
        if after != current:
            runtime.store.save(table_key, current, after)
            await runtime.store.confirm()
        elif written_again:
            await write_block_again(runtime, table_key, origin, current)

    return block_key


async def write_block_again(runtime: Runtime, table_key: bytes, origin: str, current: KeyState | None = None) -> bool:
    """The key's block behind ``origin``, if it is there, written again and confirmed: written before a crash, it may
    never have been acknowledged, and a retry sent with the changelog not saying it would let the key's later
    messages overtake it on the partition's next owner. True if written (the caller awaited a round trip)."""
    if (current if current is not None else runtime.store.load(table_key)).blocked_by != origin:
        return False
    runtime.store.rewrite_state(table_key)
    await runtime.store.confirm()
    return True


async def record_outcome(
    runtime: Runtime,
    table_key: bytes,
    origin: str,
    outcome: Outcome,
    *,
    remembered: tuple[Provenance, int] | None = None,
    maybe_sent: bool = False,
    digest: int | None = None,
) -> KeyState:
    """Block the key behind ``origin`` or lift its block, as the outcome says; confirmed before returning.

    ``remembered``: the message's provenance and the attempt that ran, when the outcome is also to be remembered in
    the same write (its retry on its way, or its end: :func:`agents.lifecycle.with_outcome`; a first try's success
    too if a retry of it may have been sent, ``maybe_sent``).
    """
    current = runtime.store.load(table_key, origin=origin)
    after = after_outcome(current, origin, outcome, dead_letter_blocks=runtime.settings.ordering_dead_letter_blocks)
    if remembered is not None:
        after = with_outcome(runtime, after, *remembered, outcome, maybe_sent=maybe_sent, digest=digest)
        forget_expired_marks(runtime, remembered[0].partition % runtime.partitions)
    if after != current:
        runtime.store.save(table_key, current, after)
        if remembered is not None:
            dropped_orphan(runtime, table_key, origin, current, after)
        await runtime.store.confirm()
    return after


async def retry_refused(runtime: Runtime, table_key: bytes, partition: int, origin: str) -> None:
    """A tier agent sent ``origin``'s retry to the failed topic instead of parking it: the key stops waiting for it.

    No key lock: the block was written before the retry was sent, so this comes after it, and a release of the key
    still settling the previous attempt only keeps (never re-sets) a block. If the previous attempt is still
    parked, the held messages run once it settles. Its caller asked the lease and ownership just before
    (``agents.tier.still_ours``), with no await since: ownership alone is asked here.
    """
    if owns(runtime, partition):
        after = await record_outcome(runtime, table_key, origin, Outcome.DEAD)
        schedule_held(runtime, table_key, partition, after)
        schedule_next_in_line(runtime, table_key, partition)  # a later retry deferred behind it goes now


def schedule_held(runtime: Runtime, table_key: bytes, partition: int, state: KeyState) -> bool:
    """Ask the release agent (through the schedule) to run the key's first held message, if it may run now.

    Used where the key's block is lifted outside the key's lane (an operator's action, a tier record refused, a
    partition adopted): the release agent runs held messages in the key's lane, like its retries.
    """
    head = next_held(state, dead_letters_block=dead_letters_block(runtime))
    if head is None:
        return False
    runtime.schedule.add(partition, Slot(0, table_key, head.origin, HELD_ATTEMPT, HELD_TIER))
    runtime.release_wakeup.set()
    return True


async def run_held(runtime: Runtime, table_key: bytes, partition: int) -> int:
    """Run the key's held messages in order, each to its outcome, until one blocks the key again; returns how many.

    Each message leaves the held list only after it ran, in a write confirmed before the next one starts: a crash
    in between runs it again (at-least-once) on whichever worker owns the partition next, never out of order. A
    partition revoked meanwhile is left to its new owner, and a stop leaves the next head's slot in the schedule,
    for a partition given straight back (:meth:`rebound.schedule.ReleaseSchedule.add` keeps it while suspended). A
    held message's retry duration counts from when it first runs: the time it waited behind its key is not time
    spent retrying. The write after a run asks the session lease and ownership (:func:`agents.ownership.still_owns`),
    as a send does: a call that outlived the lease may belong to a worker the group evicted. Each head is started
    only after the same check.
    """
    ran, left = 0, True
    # Each head follows an await (the settle or admin write that lifted the block, or the last head's write): the
    # lease, then ownership, before its reads, as its sends (a dead letter again, or payload-missing) come with none.
    while _flow_active(runtime) and await still_owns(runtime, partition):
        state = line_state(runtime, table_key)
        head = next_held(state, dead_letters_block=dead_letters_block(runtime))
        if head is None:
            left = False
            break
        if await _ran_already(runtime, table_key, head):
            continue
        entry = runtime.store.with_payload(table_key, head, held=True)
        provenance = replace(entry.provenance, first_received_at_ms=runtime.clock())
        # Blocking the key itself, the head ran before its worker stopped and its retry may have been sent (the
        # block is written first): it runs again, and its end is remembered even on a first-try success, so that
        # retry, if it was sent, is refused when it arrives.
        maybe_sent = retry_may_be_out(state, head.origin, sending=False)
        digest_of = partial(record_digest, entry.key, entry.value)
        again = None  # (dead-lettered before its worker stopped: the same dead letter again, not the handler)
        if entry.has_payload:
            again = await send_intended_dead_letter(
                runtime, table_key, provenance, 0, key=entry.key, value=entry.value, headers=entry.headers,
                tier=None, digest_of=digest_of,
            )  # fmt: skip
        if again is not None:
            outcome = again
        elif entry.has_payload:
            outcome = await run_attempt(
                runtime,
                key=entry.key,
                value=entry.value,
                headers=list(entry.headers),
                provenance=provenance,
                attempt=0,
                tier=None,
                before_retry=owned_after(runtime, provenance, 0, blocker(runtime, table_key, entry.origin)),
                before_send=announce_dead_letter(runtime, table_key, provenance, 0, digest_of, maybe_sent=maybe_sent),
            )
        else:
            log.error("payload of held %s is missing from the payload table", entry.origin)
            outcome = await dead_letter_entry(
                runtime,
                table_key,
                replace(entry, provenance=provenance),
                Reason.PAYLOAD_MISSING,
                attempt=0,
                tier=None,
                error_class="",
                error_message=entry.error_message,
            )
        if not await still_owns(runtime, partition):  # (the session lease too: the call may have outlived it)
            log.warning("partition %d revoked while held %s ran; leaving its state to the new owner", partition, head)
            break
        current = runtime.store.load(table_key, origin=entry.origin)
        after = after_outcome(
            without_held(current, entry.origin),
            entry.origin,
            outcome,
            dead_letter_blocks=dead_letters_block(runtime),
        )
        after = with_outcome(  # (its end too on a first-try success: a copy of its record read again must find it)
            runtime,
            after,
            entry.provenance,
            0,
            outcome,
            maybe_sent=maybe_sent,
            was_held=room_for_an_end(after, runtime.clock(), memory_of(runtime)),
            digest=entry_digest(entry),
        )
        runtime.store.save(table_key, current, after)
        dropped_orphan(runtime, table_key, entry.origin, current, after)
        forget_expired_marks(runtime, partition)
        await runtime.store.confirm()
        runtime.counters["ordering.released"] += 1
        runtime.release_failures.pop((table_key, HELD_PAYLOAD_PREFIX + entry.origin, HELD_ATTEMPT), None)
        ran += 1
    if left:
        # Stopped by a rebalance (or the lease) with the key's held messages still to run: the first goes back in the
        # schedule, which a partition suspended keeps for its return. Given straight back, the partition is not read
        # again (agents.release.adopt_owned_partitions): without the slot they would wait for a later rebalance.
        schedule_held(runtime, table_key, partition, line_state(runtime, table_key))
    if ran and owns(runtime, partition):  # a retry of the key deferred behind what ran goes now
        schedule_next_in_line(runtime, table_key, partition)
    return ran


async def _ran_already(runtime: Runtime, table_key: bytes, head: PendingMessage) -> bool:
    """A held message whose retry is parked or on its way, or that ended, ran before its worker stopped (after its
    retry was sent or its dead letter, before it left the held list): it leaves the list without running again, in
    a confirmed write. Its provenance comes from its held record, whose timestamp the marks compare."""
    state = runtime.store.load(table_key, origin=head.origin)
    entry = runtime.store.with_payload(table_key, head, held=True)
    memory = memory_of(runtime)
    known = redelivery(state, entry.provenance, 0, now_ms=runtime.clock(), memory=memory, digest=entry_digest(entry))
    if known in (None, Known.SENDING, Known.DEAD_LETTERING):  # (a retry or dead letter maybe never sent: run_held)
        return False
    log.info("held %s ran already (its retry is %s): taken off the held list without running again", head.origin, known)
    runtime.store.save(table_key, state, without_held(state, head.origin))
    await runtime.store.confirm()
    runtime.counters["ordering.held_ran_already"] += 1
    return True


def line_state(runtime: Runtime, table_key: bytes) -> KeyState:
    """The key's state with every parked message loaded if it has any (in key-ordered mode one, rarely a few), so
    the order rules (:func:`rebound.ordering.next_held`, :func:`rebound.ordering.waits_for`) can compare offsets."""
    state: KeyState = runtime.store.load(table_key)
    if state.others:
        state = runtime.store.load(table_key, entries=True)
    return state


def defer_behind_lower(runtime: Runtime, table_key: bytes, partition: int, entry: PendingMessage) -> bool:
    """Key-ordered mode: put a due retry back in the schedule while a lower message of its key is unsettled.

    True if deferred. Its release is asked again when the lower one settles (:func:`schedule_next_in_line`, from
    the settle) or at :func:`rebound.ordering.recheck_at`, whichever comes first; never before its due time (it is
    due already). The message it waits for may be a held one that may run now (both adopted with a partition, say):
    that one is asked to run, so the two never wait for each other.
    """
    index: KeyState = runtime.store.load(table_key)
    if index.parked <= 1 and not index.held and index.blocked_by in (None, entry.origin):
        return False  # nothing else of the key is unsettled: the common case costs one read
    state = runtime.store.load(table_key, entries=True) if index.others else index
    lower = waits_for(state, entry, dead_letters_block=dead_letters_block(runtime))
    if lower is None:
        return False
    now = runtime.clock()
    runtime.schedule.confirm(partition, table_key, entry.origin, entry.attempt)
    runtime.schedule.add(
        partition, Slot(recheck_at(state, lower, entry, now), table_key, entry.origin, entry.attempt, entry.tier)
    )
    runtime.release_wakeup.set()
    runtime.counters["ordering.deferred"] += 1
    log.info("retry %d of %s deferred: %s, below it, is unsettled", entry.attempt, entry.origin, lower)
    schedule_held(runtime, table_key, partition, state)
    return True


def schedule_next_in_line(runtime: Runtime, table_key: bytes, partition: int) -> int:
    """Key-ordered mode, after a message of the key settled: ask at once for the release of every due retry of the
    key that waits for nothing any more (one deferred behind the message that settled). Returns how many."""
    if not runtime.settings.key_ordered:
        return 0
    state = line_state(runtime, table_key)
    now = runtime.clock()
    ready = [
        entry
        for entry in state.pending
        if entry.due_at_ms <= now and waits_for(state, entry, dead_letters_block=dead_letters_block(runtime)) is None
    ]
    for entry in ready:
        runtime.schedule.add(partition, Slot(entry.due_at_ms, table_key, entry.origin, entry.attempt, entry.tier))
    if ready:
        runtime.release_wakeup.set()
    return len(ready)


def dead_letters_block(runtime: Runtime) -> bool:
    """``REBOUND_ORDERING_DEAD_LETTER_BLOCKS``, only in key-ordered mode (a mode switched off never blocks anew)."""
    return runtime.settings.key_ordered and runtime.settings.ordering_dead_letter_blocks


def _flow_active(runtime: Runtime) -> bool:
    """False once Faust stopped the flow (a rebalance, a shutdown): what is left of a drain waits in the schedule
    (:func:`run_held`) or for the partition's next adoption, rather than lengthening the revocation."""
    consumer = getattr(runtime.app, "consumer", None)
    return bool(getattr(consumer, "flow_active", True))


MAX_HELD_FAILURES = 3


async def run_held_safely(runtime: Runtime, table_key: bytes, partition: int) -> int:
    """:func:`run_held`, and if it fails (a bug, a failed topic refusing a record), its first held message is tried
    again after a backoff; after ``MAX_HELD_FAILURES`` it goes to the failed topic as ``internal-error``, so one
    bad message neither blocks its key for ever nor loops."""
    while True:
        try:
            return await run_held(runtime, table_key, partition)
        except Exception as exc:
            head = next_held(runtime.store.load(table_key), dead_letters_block=dead_letters_block(runtime))
            if head is None:
                log.exception("running the held messages of %r failed; none is left to run", table_key)
                return 0
            # Not the release request's own key (its success, this return, clears that one's count).
            ident = (table_key, HELD_PAYLOAD_PREFIX + head.origin, HELD_ATTEMPT)
            failures = runtime.release_failures[ident] = runtime.release_failures.get(ident, 0) + 1
            log.exception("running held %s failed (%d times)", head.origin, failures)
            if failures < MAX_HELD_FAILURES:
                due = runtime.clock() + 1000 * failures
                runtime.schedule.add(partition, Slot(due, table_key, head.origin, HELD_ATTEMPT, HELD_TIER))
                runtime.release_wakeup.set()
                return 0
            runtime.release_failures.pop(ident, None)
            if not await _give_up_held(runtime, table_key, partition, head, exc):
                return 0
            # ... and the key's next held message runs now.


async def _give_up_held(
    runtime: Runtime, table_key: bytes, partition: int, head: PendingMessage, error: Exception
) -> bool:
    """Send the held message to the failed topic as ``internal-error`` and take it out; False if the partition was
    revoked during the send (its next owner has it). Lease and ownership are asked before the send, as for its run
    (:func:`agents.lifecycle.still_owned`): refused, nothing is sent and it stays held; :class:`FirstTryRevokedError`
    leaves the record or release request that ran it unacknowledged."""
    try:
        entry = runtime.store.with_payload(table_key, head, held=True)
    except Exception:
        log.exception("payload of held %s unreadable; dead-lettering without it", head.origin)
        entry = head
    await still_owned(runtime, entry.provenance, 0)
    await dead_letter_entry(
        runtime,
        table_key,
        entry,
        Reason.INTERNAL_ERROR,
        attempt=0,
        tier=None,
        error_class=type(error).__name__,
        error_message=f"running it after its key's block was lifted failed {MAX_HELD_FAILURES} times: {error}",
    )
    if not await still_owns(runtime, partition):
        return False
    current = runtime.store.load(table_key)
    after = after_outcome(
        without_held(current, head.origin), head.origin, Outcome.DEAD, dead_letter_blocks=dead_letters_block(runtime)
    )
    runtime.store.save(table_key, current, after)
    await runtime.store.confirm()
    return True
