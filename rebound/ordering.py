"""Key-ordered mode (``REBOUND_ORDERING=key``): the pure decisions about a key's blocking message and held messages.

Non-blocking retry gives up per-key order: a key's second message can succeed while its first waits in a tier. In
key-ordered mode a key whose message is waiting for a retry is *blocked*: its later messages are *held* in the key's
state (the changelog-backed table, so they survive a crash and a partition move) and run, in arrival order, once the
blocking message settles (succeeds or is dead-lettered). Other keys never wait.

A key's state says who blocks it (``blocked_by``, set from the first failure until the message settles, including the
moments between a release and the next park, when nothing of it is pending) and what is held behind it. Nothing here
touches Faust: the agents carry these decisions out, and tests check them without a broker.
"""

from __future__ import annotations

from dataclasses import replace
from enum import StrEnum

from rebound.attempts import Outcome
from rebound.headers import Provenance
from rebound.state import HELD_TIER, KeyState, PendingMessage

__all__ = [
    "HELD_ATTEMPT",
    "HELD_PAYLOAD_PREFIX",
    "HELD_TIER",
    "Placement",
    "after_outcome",
    "block",
    "first_unsettled_offset",
    "held_entry",
    "hold",
    "is_unsettled",
    "next_held",
    "origin_of",
    "place",
    "settle_blocker",
    "unblock",
    "without_held",
]

HELD_ATTEMPT = -1
"""The attempt number in a release request that asks for the key's first held message to run."""
HELD_PAYLOAD_PREFIX = "held:"
"""Held payloads live under their own origins, so the message's later retry (same origin) never shares its bytes."""


class Placement(StrEnum):
    """What the main agent does with a record of a key in key-ordered mode."""

    RUN = "run"
    HOLD = "hold"
    ALREADY_HELD = "already-held"


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


def is_unsettled(state: KeyState) -> bool:
    """Whether a new message of the key has to wait: something of the key is unsettled (retrying, held, blocking)."""
    return state.blocked_by is not None or bool(state.held) or state.parked > 0


def first_unsettled_offset(state: KeyState, topic: str, partition: int) -> int | None:
    """The lowest offset of ``topic``/``partition`` among the key's blocking, retrying and held messages.

    Needs every parked message of the key loaded (in key-ordered mode a key has one, rarely a few).
    """
    if state.others:
        raise LookupError("the key's parked messages were not loaded")
    origins = [entry.origin for entry in (*state.pending, *state.held)]
    if state.blocked_by is not None:
        origins.append(state.blocked_by)
    offsets = [offset for origin in origins if (offset := _offset_in(origin, topic, partition)) is not None]
    return min(offsets, default=None)


def place(state: KeyState, provenance: Provenance) -> Placement:
    """Run a record, hold it behind the key's blocking message, or recognise one already held.

    A record at or before the key's first unsettled offset of the same partition is a redelivery (a crash before
    the commit): everything of the key before that offset was handled already, and running it now keeps the order
    a consumer replaying the partition would see. The blocking message itself, redelivered, runs again as well
    (at-least-once; its parked retry is idempotent by origin).
    """
    if state.find_held(origin_of(provenance)) is not None:
        return Placement.ALREADY_HELD
    if not is_unsettled(state):
        return Placement.RUN
    first = first_unsettled_offset(state, provenance.topic, provenance.partition)
    if first is not None and provenance.offset <= first:
        return Placement.RUN
    return Placement.HOLD


def held_entry(
    *,
    key: bytes | None,
    value: bytes | None,
    headers: tuple[tuple[str, bytes], ...],
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
    """The held message that may run now: the first one, once nothing of the key is blocking or retrying.

    The first held message blocking the key itself was running when its worker stopped (its block is written
    before its retry is sent, and it leaves the held list after): it runs again, or its retry would never come. A
    block kept by a dead letter holds only while dead letters block (the setting, or key order, may be off since).
    """
    if not state.held or state.parked:
        return None
    blocked = state.blocked_by is not None and not (state.blocked_dead and not dead_letters_block)
    if blocked and state.blocked_by != state.held[0].origin:
        return None
    return state.held[0]


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
