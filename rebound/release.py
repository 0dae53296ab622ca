"""What a release request does with the parked message it names: the verdict, before anything runs or is written.

A release request (``rebound/commands.py``) may be stale (the message settled, or a later attempt of it is parked),
already decided (its release sent its outcome, or was about to, before its worker stopped: sent again, not run),
early (whatever sent it, nothing runs before its due time), or held back by the open circuit breaker (a release whose
failure would end its policy: it may not be the breaker's probe, and waiting at the breaker would hold a dispatcher
slot the probe needs). A due message then runs: dead-lettered if its payload is missing, re-published to its
original topic in ``republish`` mode, or run through the handler in place. ``agents/release.py`` reads the table,
asks these two functions, and carries the verdict out.

Key-ordered mode's deferral of a due retry behind an unsettled lower message of its key comes between the due time
and the breaker; it is not decided here because it needs the key's other messages (``agents/ordering.py``
``defer_behind_lower``, with :func:`rebound.ordering.waits_for`).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from rebound.state import PendingMessage, sent_intent


class Verdict(Enum):
    SETTLED = "settled"
    """Stale: the message is no longer parked (its settle's writes are asserted again)."""
    SUPERSEDED = "superseded"
    """Stale: a later attempt of the message is parked; the request was for an earlier one."""
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


def check_release(
    entry: PendingMessage | None,
    attempt: int,
    now_ms: int,
    *,
    breaker_open: bool,
    would_retry: Callable[[PendingMessage], bool],
) -> Verdict:
    """The verdict on a request for ``attempt`` of a message, given its parked entry (None: not parked).

    ``would_retry`` answers whether a retryable failure of the entry's attempt would be retried (the policy and the
    total duration cap); it is asked only while the breaker is open, the one case its answer matters.
    """
    if entry is None:
        return Verdict.SETTLED
    if entry.attempt != attempt:
        return Verdict.SUPERSEDED
    if sent_intent(entry, attempt) is not None:
        return Verdict.RESEND
    if entry.due_at_ms > now_ms:
        return Verdict.EARLY
    if breaker_open and not would_retry(entry):
        return Verdict.BREAKER_DEFERRED
    return Verdict.DUE


def how_to_run(entry: PendingMessage, *, republish: bool) -> Verdict:
    """How a due message runs, once its payload was read (``entry`` with its payload, when there is one)."""
    if not entry.has_payload:
        return Verdict.PAYLOAD_MISSING
    return Verdict.REPUBLISH if republish else Verdict.RUN
