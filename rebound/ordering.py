"""Key-ordered mode (``REBOUND_ORDERING=key``): the pure decisions about a key's blocking message and held messages.

Non-blocking retry gives up per-key order: a key's second message can succeed while its first waits in a tier. In
key-ordered mode a key whose message is waiting for a retry is *blocked*: its later messages are *held* in the key's
state (the changelog-backed table, so they survive a crash and a partition move) and run, in arrival order, once the
blocking message settles (succeeds or is dead-lettered). Other keys never wait.

A key's state says who blocks it (``blocked_by``, set from the first failure until the message settles, including the
moments between a release and the next park, when nothing of it is pending) and what is held behind it. Nothing here
touches Faust: the agents carry these decisions out, and tests check them without a broker.

Within one original topic and partition, a key's messages take their turns in offset order: a parked retry or a held
message runs only once nothing of its key below it is unsettled (:func:`waits_for`, :func:`next_held`), and the
lowest retrying message blocks the key (:func:`retry_block`). Usually a key has one unsettled message at a time; two
retry at once when a record read again below a retrying one fails too, or after retries left by unordered mode. Every
wait points to a lower offset (or, for a held message, to a retry of another partition, which never waits for it), so
no two messages wait for each other.
"""

from __future__ import annotations

from dataclasses import replace
from enum import StrEnum

from rebound.attempts import Outcome
from rebound.headers import Header, Provenance
from rebound.state import HELD_TIER, KeyState, PendingMessage

__all__ = [
    "HELD_ATTEMPT",
    "HELD_PAYLOAD_PREFIX",
    "HELD_TIER",
    "Placement",
    "admit",
    "after_outcome",
    "block",
    "comes_first",
    "first_unsettled_offset",
    "held_entry",
    "hold",
    "holds_its_fill",
    "in_transit",
    "is_held",
    "is_unsettled",
    "keeps_key_unchanged",
    "next_held",
    "origin_of",
    "place",
    "recheck_at",
    "retry_block",
    "retry_may_be_out",
    "settle_blocker",
    "unblock",
    "waits_for",
    "without_held",
]

HELD_ATTEMPT = -1
"""The attempt number in a release request that asks for the key's first held message to run."""
HELD_PAYLOAD_PREFIX = "held:"
"""Held payloads live under their own origins, so the message's later retry (same origin) never shares its bytes."""


class Placement(StrEnum):
    """What key-ordered mode does with a main-topic record of a key, before any handler runs (:func:`admit`)."""

    RUN = "run"
    """Nothing of the key before it is unsettled: it runs now."""
    HOLD = "hold"
    """Held behind the key's blocking message, durably; it runs once the block is lifted."""
    ALREADY_HELD = "already-held"
    """Delivered again while held: its hold is written again, and it does not run."""
    BACKLOG_FULL = "backlog-full"
    """To be held, but its key holds ``REBOUND_MAX_HELD_PER_KEY`` already: it goes to the failed topic."""


def origin_of(provenance: Provenance) -> str:
    return PendingMessage.origin_of(provenance)


def _offset_in(origin: str, topic: str, partition: int) -> int | None:
    """The offset of ``origin`` if it is a record of ``topic``/``partition``, else None."""
    origin_topic, _, rest = origin.rpartition("/")
    head, _, partition_text = origin_topic.rpartition("/")
    if head != topic or partition_text != str(partition):
        return None
    try:
        return int(rest)
    except ValueError:
        return None


def _position(origin: str) -> tuple[str, int, int] | None:
    """``origin``'s topic, partition and offset (None if it is not ``topic/partition/offset``)."""
    origin_topic, _, rest = origin.rpartition("/")
    topic, _, partition_text = origin_topic.rpartition("/")
    try:
        return topic, int(partition_text), int(rest)
    except ValueError:
        return None


def in_transit(state: KeyState) -> list[str]:
    """Origins of the key's messages whose retry is on its way to a tier (or about to be): a *forwarded* or
    *sending* mark (:class:`rebound.state.Mark`). Such a message is unsettled as much as a parked one: once the
    key's block moved off it (a lower message read again failed too, and then settled), nothing else would keep a
    later message from running before its retry. (A *dead-lettering* mark is not: that message is ending.)"""
    return [mark.origin for mark in state.marks if mark.on_its_way]


def is_unsettled(state: KeyState) -> bool:
    """Whether a new message of the key has to wait: something of the key is unsettled (retrying, on its way to a
    tier, held, blocking)."""
    return state.blocked_by is not None or bool(state.held) or state.parked > 0 or bool(in_transit(state))


def first_unsettled_offset(state: KeyState, topic: str, partition: int) -> int | None:
    """The lowest offset of ``topic``/``partition`` among the key's blocking, retrying (parked or on its way) and
    held messages.

    Needs every parked message of the key loaded (in key-ordered mode a key has one, rarely a few).
    """
    if state.others:
        raise LookupError("the key's parked messages were not loaded")
    origins = [entry.origin for entry in (*state.pending, *state.held)] + in_transit(state)
    if state.blocked_by is not None:
        origins.append(state.blocked_by)
    offsets = [offset for origin in origins if (offset := _offset_in(origin, topic, partition)) is not None]
    return min(offsets, default=None)


def place(state: KeyState, provenance: Provenance) -> Placement:
    """Run a record, hold it behind the key's blocking message, or recognise one already held.

    A record at or before the key's first unsettled offset of the same partition is a redelivery (a crash before
    the commit): everything of the key before that offset was handled already, and running it now keeps the order
    a consumer replaying the partition would see. The blocking message itself, redelivered, is refused before this
    is asked when its retry is parked, on its way or ended (:func:`rebound.state.redelivery`); otherwise (its worker
    stopped before its retry was sent) it runs again, at-least-once.

    A record read again after it was lost on its way to the dispatcher (a stream queue cleared when the flow
    resumed) lands there too, but was never handled: later records of its key ran without it, and the first
    unsettled one may be one of them. It is not the blocker's redelivery (only the blocker's own origin is) and it
    is not held behind it: it runs now. The messages it is below have not succeeded (a message keeps its key
    unsettled only until it succeeds), so running it before their next attempts keeps the key's successes in offset
    order; held behind them, it would run only once they had settled (an update read before its create would be
    dead-lettered first). What cannot be had back is the attempt of the later message that already ran. One read
    again below a later unsettled message but after an earlier one is held, in offset order among the held
    (:func:`hold`). The dispatcher runs such a record before the later ones of its key still waiting on its lane,
    so this happens only when a later one had started before the record was read again.
    """
    if is_held(state, provenance):
        return Placement.ALREADY_HELD
    if not is_unsettled(state) or comes_first(state, provenance):
        return Placement.RUN
    return Placement.HOLD


def admit(state: KeyState, provenance: Provenance, *, max_held: int) -> Placement:
    """The one decision about a main-topic record of a key in key-ordered mode, before any handler runs: run it,
    hold it, recognise it as held already, or refuse to hold it. ``state`` is the key's state as read (its parked
    messages loaded if it has any); ``max_held`` is ``REBOUND_MAX_HELD_PER_KEY``.

    Its order is :func:`place`'s; a record to be held whose key holds ``max_held`` already is refused
    (:func:`holds_its_fill`): it leaves the key's order for the failed topic, but it is never lost. A record held
    already is never refused, however full its key: its hold stands.
    """
    placement = place(state, provenance)
    if placement is Placement.HOLD and holds_its_fill(state, max_held):
        return Placement.BACKLOG_FULL
    return placement


def is_held(state: KeyState, provenance: Provenance) -> bool:
    """Whether the record is one of the key's held messages already (delivered again: its offset was not committed)."""
    return state.find_held(origin_of(provenance)) is not None


def comes_first(state: KeyState, provenance: Provenance) -> bool:
    """Whether the record is at or before the key's first unsettled offset of its partition (a redelivery, or a
    record read again after it was lost on its way): it runs rather than wait (:func:`place`)."""
    first = first_unsettled_offset(state, provenance.topic, provenance.partition)
    return first is not None and provenance.offset <= first


def holds_its_fill(state: KeyState, max_held: int) -> bool:
    """Whether the key holds as many messages as it may (``REBOUND_MAX_HELD_PER_KEY``): one more is not held."""
    return len(state.held) >= max_held


def retry_may_be_out(before: KeyState, origin: str, *, sending: bool) -> bool:
    """Whether a retry of ``origin``, which is about to run (or just ran) its first try, may be on a tier already:
    its worker stopped after sending it. The key was blocked by it when it was read (the block is written before
    the retry is sent), or a *sending* mark said so (:attr:`rebound.state.Known.SENDING`). Its end is then
    remembered even if it succeeds, so that retry is refused when it arrives."""
    return before.blocked_by == origin or sending


def keeps_key_unchanged(outcome: Outcome, *, maybe_sent: bool) -> bool:
    """Whether a run's outcome leaves the key's state as it was, so nothing is written: a success, unless a retry of
    the message may be out (:func:`retry_may_be_out`). The common case of a key-ordered worker."""
    return outcome is Outcome.SUCCEEDED and not maybe_sent


def held_entry(
    *,
    key: bytes | None,
    value: bytes | None,
    headers: tuple[Header, ...],
    provenance: Provenance,
    now_ms: int,
    blocked_by: str | None,
) -> PendingMessage:
    return PendingMessage(
        origin=origin_of(provenance),
        key=key,
        value=value,
        headers=headers,
        provenance=provenance,
        attempt=0,
        tier=HELD_TIER,
        tier_topic="",
        partition=provenance.partition,
        due_at_ms=now_ms,
        parked_at_ms=now_ms,
        error_class="",
        error_message=f"held behind {blocked_by}" if blocked_by else "held",
        value_size=None if value is None else len(value),
    )


def hold(state: KeyState, entry: PendingMessage) -> tuple[KeyState, bool]:
    """Add a held message after the ones before it; a message held already is left as it is."""
    if state.find_held(entry.origin) is not None:
        return state, False
    # In offset order among the held messages of its partition: a record delivered again after an earlier one of
    # its key could not be held (and went to the failed topic) must not land behind later offsets.
    topic, partition, offset = entry.provenance.topic, entry.provenance.partition, entry.provenance.offset
    position = len(state.held)
    for index, held in enumerate(state.held):
        if (held.provenance.topic, held.provenance.partition) == (topic, partition) and held.provenance.offset > offset:
            position = index
            break
    return replace(state, held=(*state.held[:position], entry, *state.held[position:])), True


def _blocking(state: KeyState, dead_letters_block: bool) -> str | None:
    """The key's blocker if it still keeps later messages waiting (a dead-letter block only while dead letters
    block), else None."""
    if state.blocked_dead and not dead_letters_block:
        return None
    return state.blocked_by


def waits_for(state: KeyState, entry: PendingMessage, *, dead_letters_block: bool = True) -> str | None:
    """The message a parked retry of the key waits for before it may be released; None: it may be released.

    It is the lowest unsettled message of the key below ``entry`` on the same original topic and partition: a
    parked, held or on its way to a tier (:func:`in_transit`), or the blocker (its retry on its way to a tier, or its dead letter while dead letters
    block). Released by due time alone, a later message's retry (scheduled earlier) would succeed before the lower
    one's: the key's successes out of offset order. Deferred, it runs right after the lower one settles. Messages of
    other partitions have no order with it. Needs every parked message of the key loaded.
    """
    if state.others:
        raise LookupError("the key's parked messages were not loaded")
    origins = [other.origin for other in (*state.pending, *state.held)] + in_transit(state)
    if (blocker := _blocking(state, dead_letters_block)) is not None:
        origins.append(blocker)
    topic, partition, offset = entry.provenance.topic, entry.provenance.partition, entry.provenance.offset
    below = [
        (other_offset, origin)
        for origin in origins
        if (other_offset := _offset_in(origin, topic, partition)) is not None and other_offset < offset
    ]
    return min(below)[1] if below else None


DEFER_RECHECK_MIN_MS = 1_000
DEFER_RECHECK_MAX_MS = 60_000


def recheck_at(state: KeyState, waiting_for: str, entry: PendingMessage, now_ms: int) -> int:
    """When a deferred retry's release is asked again, should nothing release it earlier.

    The settle of the message it waits for releases it at once (the agents ask then); this is the safety net for
    the ends that do not pass through a settle (a retry refused by its tier, an operator's action). Waiting for a
    parked retry due later, it is asked at that due time; otherwise after a backoff of a quarter of the time it
    has waited, between 1 s and 60 s, so a key waiting long (a dead letter that blocks) costs little.
    """
    lower = next((other for other in state.pending if other.origin == waiting_for), None)
    if lower is not None and lower.due_at_ms > now_ms:
        return lower.due_at_ms
    waited = max(0, now_ms - entry.due_at_ms)
    return now_ms + min(DEFER_RECHECK_MAX_MS, max(DEFER_RECHECK_MIN_MS, waited // 4))


def retry_block(state: KeyState, origin: str) -> KeyState:
    """The key's block once ``origin``'s retry is scheduled (written before the retry is sent).

    A free key, or one blocked by this message's dead letter, is blocked behind it. A key blocked by a later message
    of the same partition (a record read again below a retrying one, now failing too) moves its block to this
    lower one: the lowest unsettled message blocks, and the later one's retry waits for it (:func:`waits_for`). Any
    other block stays: an earlier message (replayed after a crash), a dead letter that blocks, or a message of
    another partition keeps the key waiting too.
    """
    if state.blocked_by is None or (state.blocked_by == origin and state.blocked_dead):
        return block(state, origin)
    if state.blocked_by == origin or state.blocked_dead:
        return state
    position = _position(origin)
    if position is None:
        return state
    topic, partition, offset = position
    current = _offset_in(state.blocked_by, topic, partition)
    if current is not None and offset < current:
        return block(state, origin)
    return state


def block(state: KeyState, origin: str, *, dead: bool = False) -> KeyState:
    """The key waits for ``origin`` (its retry was scheduled, or it was dead-lettered and dead letters block)."""
    return replace(state, blocked_by=origin, blocked_dead=dead)


def settle_blocker(state: KeyState, origin: str, *, dead: bool, dead_letter_blocks: bool) -> KeyState:
    """``origin`` settled: the key stops waiting for it, unless it was dead-lettered and dead letters block."""
    if state.blocked_by not in (origin, None):
        return state  # blocked by another message (a stale release): not this one's to lift
    if dead and dead_letter_blocks:
        return block(state, origin, dead=True)
    return replace(state, blocked_by=None, blocked_dead=False)


def unblock(state: KeyState) -> KeyState:
    """An operator lifts a key kept blocked by a dead letter (or any block): its held messages may run."""
    return replace(state, blocked_by=None, blocked_dead=False)


def next_held(state: KeyState, *, dead_letters_block: bool = True) -> PendingMessage | None:
    """The held message that may run now: the first one, once nothing of the key before it is blocking or retrying.

    The first held message blocking the key itself was running when its worker stopped (its block is written
    before its retry is sent, and it leaves the held list after): it runs again, or its retry would never come. A
    block kept by a dead letter holds only while dead letters block (the setting, or key order, may be off since).

    A retry or a block of a *later* offset of the same partition does not hold it: that one waits for it
    (:func:`waits_for`), and waiting for each other they would wait for ever (a record read again between two
    retrying ones of its key is held between them). Nor does a retry that waits itself (for a message held further
    down the line, say): it cannot run before what it waits for. Any other retry of the key comes first, and so does
    every retry while the key's parked messages are not loaded (as when every retry came first).
    """
    if not state.held:
        return None
    head = state.held[0]
    if state.others:
        return None
    for other in state.pending:
        if not _after(other.origin, head) and waits_for(state, other, dead_letters_block=dead_letters_block) is None:
            return None
    if any(origin != head.origin and not _after(origin, head) for origin in in_transit(state)):
        return None  # a retry on its way to a tier comes first, as if it were parked already
    blocker = _blocking(state, dead_letters_block)
    if blocker is not None and blocker != head.origin and not _after(blocker, head):
        return None
    return head


def _after(origin: str, entry: PendingMessage) -> bool:
    """Whether ``origin`` is a later offset of ``entry``'s original topic and partition."""
    offset = _offset_in(origin, entry.provenance.topic, entry.provenance.partition)
    return offset is not None and offset > entry.provenance.offset


def without_held(state: KeyState, origin: str) -> KeyState:
    return replace(state, held=tuple(entry for entry in state.held if entry.origin != origin))


def after_outcome(state: KeyState, origin: str, outcome: Outcome, *, dead_letter_blocks: bool) -> KeyState:
    """The key's block after ``origin`` ran with ``outcome``: an end lifts the block that message held (a dead letter
    keeps it, if dead letters block); a scheduled retry keeps it (:func:`block` set it before the retry was sent)."""
    if outcome in (Outcome.SCHEDULED, Outcome.HELD):
        return state  # the block was written before the retry was sent (a refusal since may have lifted it)
    dead = outcome in (Outcome.DEAD, Outcome.EXPIRED)
    if dead and dead_letter_blocks and state.blocked_by is None:
        return block(state, origin, dead=True)
    return settle_blocker(state, origin, dead=dead, dead_letter_blocks=dead_letter_blocks)
