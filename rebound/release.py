"""What a release request does with the parked message it names: the verdict, before anything runs or is written.

A release request (``rebound/commands.py``) may be stale (the message settled, or a later attempt of it is parked),
an orphan's (its message ended, but a stale copy of its entry is still parked: :func:`ended_mark`), already decided
(its release sent its outcome, or was about to, before its worker stopped: sent again, not run),
early (whatever sent it, nothing runs before its due time), or held back by the open circuit breaker (a release whose
failure would end its policy: it may not be the breaker's probe, and waiting at the breaker would hold a dispatcher
slot the probe needs). A due message then runs: dead-lettered if its payload is missing, re-published to its
original topic in ``republish`` mode, or run through the handler in place. ``agents/release.py`` reads the table,
asks these functions, and carries the verdict out.

Key-ordered mode's deferral of a due retry behind an unsettled lower message of its key comes between the due time
and the breaker; it is not decided here because it needs the key's other messages (``agents/ordering.py``
``defer_behind_lower``, with :func:`rebound.ordering.waits_for`).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from rebound.ordering import settle_blocker
from rebound.state import KeyState, LifecycleMemory, Mark, PendingMessage, sent_intent


class Verdict(Enum):
    SETTLED = "settled"
    """Stale: the message is no longer parked (its settle's writes are asserted again)."""
    SUPERSEDED = "superseded"
    """Stale: a later attempt of the message is parked; the request was for an earlier one."""
    ENDED = "ended"
    """An orphan: the key's index says the message ended, or is being dead-lettered (:func:`ended_mark`), though its
    entry is still parked (a stale copy): dropped, the handler does not run."""
    RESEND = "resend"
    """Its release decided its outcome and may have sent it (:func:`rebound.state.sent_intent`): the same outcome is
    sent again and settled, the handler does not run (neither the due time, key order nor the breaker hold it back:
    it already ran)."""
    EARLY = "early"
    """Not due yet: back into the schedule at its due time."""
    BREAKER_DEFERRED = "breaker-deferred"
    """The breaker is open and this attempt's failure would end the message: it stays parked until it closes."""
    DUE = "due"
    """Due, and nothing holds it back: :func:`how_to_run` says how it runs."""
    PAYLOAD_MISSING = "payload-missing"
    """Its payload is not in the payload table: dead-lettered (``payload-missing``) rather than run without it."""
    REPUBLISH = "republish"
    """``REBOUND_RELEASE_MODE=republish``: put back on its original topic, signed."""
    RUN = "run"
    """Run through the handler in place."""


STALE = frozenset({Verdict.SETTLED, Verdict.SUPERSEDED})
DEFAULT_MEMORY = LifecycleMemory()


def check_release(
    entry: PendingMessage | None,
    attempt: int,
    now_ms: int,
    *,
    breaker_open: bool,
    would_retry: Callable[[PendingMessage], bool],
    state: KeyState | None = None,
    memory: LifecycleMemory = DEFAULT_MEMORY,
) -> Verdict:
    """The verdict on a request for ``attempt`` of a message, given its parked entry (None: not parked).

    ``would_retry`` answers whether a retryable failure of the entry's attempt would be retried (the policy and the
    total duration cap); it is asked only while the breaker is open, the one case its answer matters. ``state`` is
    the key's index the entry was read with (None: not checked for :attr:`Verdict.ENDED`).
    """
    if entry is None:
        return Verdict.SETTLED
    if entry.attempt != attempt:
        return Verdict.SUPERSEDED
    if state is not None and ended_mark(state, entry, now_ms=now_ms, memory=memory) is not None:
        return Verdict.ENDED
    if sent_intent(entry, attempt) is not None:
        return Verdict.RESEND
    if entry.due_at_ms > now_ms:
        return Verdict.EARLY
    if breaker_open and not would_retry(entry):
        return Verdict.BREAKER_DEFERRED
    return Verdict.DUE


def ended_mark(state: KeyState, entry: PendingMessage, *, now_ms: int, memory: LifecycleMemory) -> Mark | None:
    """The mark of the key's index (``state``) that says the message of the parked ``entry`` ended (an *ended*
    mark) or is being dead-lettered (a *dead-lettering* mark), at any attempt; None if none does. Any: no later
    attempt is parked after an end (``remember()`` writes none over one, except the orphan it removes with it, and
    the tier agent refuses a retry of an ended message), so an end at an earlier attempt (a run read again whose end
    removed this retry) makes the entry an orphan as much as one at its own. Such an entry is an orphan: a stale copy of the payload table (a recovery that read the index's changelog
    and not all of the payloads') still holds it, and running it would give its message a second end (issue 22).

    Only a live mark naming the entry's record counts (``REBOUND_ENDED_MEMORY``): an older one, or one of another
    record with the same origin, says nothing about it. No read beyond the one the release already made: the index
    comes with the entry.
    """
    mark = state.mark_of(entry.origin)
    if mark is None or not mark.live(now_ms, memory):
        return None
    if not (mark.ended or mark.intent is not None) or not mark.names(entry.provenance):
        return None
    return mark


def without_ended(state: KeyState, mark: Mark, *, dead_letter_blocks: bool) -> KeyState:
    """The key's state without the orphan entry of ``mark``'s message (:func:`ended_mark`), its bytes with it.

    Key-ordered mode: a block of the key by that message goes too once it has ended (a stale run's retry block),
    unless it is a dead letter's block and dead letters block. While it is being dead-lettered (not ended yet) its
    block is left to the run that sends the dead letter, which settles it."""
    after = state.without({mark.origin})
    if mark.ended and after.blocked_by == mark.origin:
        after = settle_blocker(after, mark.origin, dead=after.blocked_dead, dead_letter_blocks=dead_letter_blocks)
    return after


def how_to_run(entry: PendingMessage, *, republish: bool) -> Verdict:
    """How a due message runs, once its payload was read (``entry`` with its payload, when there is one)."""
    if not entry.has_payload:
        return Verdict.PAYLOAD_MISSING
    return Verdict.REPUBLISH if republish else Verdict.RUN
