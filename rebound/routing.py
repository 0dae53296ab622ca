"""The one routing decision: where a message goes after an attempt failed.

Pure (no Faust, no I/O, the clock is injected), in the spirit of Spring Kafka's ``DestinationTopicResolver``: every
agent asks this function and does exactly what it answers, so the whole retry behaviour is unit-testable without a
broker.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from rebound.errors import HandlerError, HandlerTimeout, PermanentError, RetryableError, UndecodableError
from rebound.policy import RetryPolicy
from rebound.topics import failed_topic, tier_topic

Clock = Callable[[], int]
"""Returns the current time in epoch milliseconds."""


class Reason(StrEnum):
    """Why a record is on the failed topic (header ``rebound.reason``)."""

    EXHAUSTED = "exhausted"
    PERMANENT = "permanent"
    EXPIRED = "expired"
    UNDECODABLE = "undecodable"
    INVALID_RETRY_HEADERS = "invalid-retry-headers"
    KEY_BACKLOG_FULL = "key-backlog-full"
    PAYLOAD_MISSING = "payload-missing"
    TOO_LARGE = "too-large"
    INTERNAL_ERROR = "internal-error"
    ADMIN = "admin"


class Classification(StrEnum):
    RETRYABLE = "retryable"
    PERMANENT = "permanent"
    UNDECODABLE = "undecodable"


@dataclass(frozen=True, slots=True)
class ErrorClassifier:
    """Maps an exception to retryable or permanent.

    Rebound's own error classes decide for themselves; other classes are looked up by qualified or bare class name
    in the configured lists (walking the MRO, so a configured base class covers its subclasses), and fall back to
    ``default``. Rebound's handler timeout (:class:`HandlerTimeout`) is retryable unless it is listed as permanent by
    its own name: a listed ``TimeoutError`` (or ``Exception``) means the handler's own failures, not a handler that
    hung, and ``default`` is for classes Rebound does not know.
    """

    permanent_names: frozenset[str] = frozenset()
    retryable_names: frozenset[str] = frozenset()
    default: Classification = Classification.RETRYABLE

    def classify(self, error: BaseException) -> Classification:
        if isinstance(error, HandlerTimeout):
            return self._classify_timeout()
        if isinstance(error, UndecodableError):
            return Classification.UNDECODABLE
        if isinstance(error, PermanentError):
            return Classification.PERMANENT
        if isinstance(error, RetryableError):
            return Classification.RETRYABLE
        for klass in type(error).__mro__:
            names = {klass.__name__, f"{klass.__module__}.{klass.__qualname__}"}
            if names & self.permanent_names:
                return Classification.PERMANENT
            if names & self.retryable_names:
                return Classification.RETRYABLE
        if isinstance(error, DECODING_ERRORS):
            return Classification.UNDECODABLE
        return self.default

    def _classify_timeout(self) -> Classification:
        if HANDLER_TIMEOUT_NAMES & self.permanent_names:
            return Classification.PERMANENT
        return Classification.RETRYABLE


HANDLER_TIMEOUT_NAMES = frozenset(
    {HandlerTimeout.__name__, f"{HandlerTimeout.__module__}.{HandlerTimeout.__qualname__}", "rebound.HandlerTimeout"}
)
"""The names that list Rebound's handler timeout in ``REBOUND_PERMANENT_ERRORS`` (the bare, the defining module's
and the package's export)."""


DECODING_ERRORS: tuple[type[BaseException], ...] = (UnicodeDecodeError, json.JSONDecodeError)
"""Bytes that could not be decoded fail the same way on every retry (Spring Kafka treats its deserialization and
conversion exceptions as fatal by default for the same reason): undecodable unless configured otherwise."""


def error_class_name(error: BaseException) -> str:
    klass = type(error)
    return klass.__qualname__ if klass.__module__ == "builtins" else f"{klass.__module__}.{klass.__qualname__}"


@dataclass(frozen=True, slots=True)
class Retry:
    """Send to ``topic`` (the tier for ``tier``) as retry number ``attempt``, not to run before ``due_at_ms``."""

    topic: str
    tier: str
    attempt: int
    due_at_ms: int


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Send to the failed topic with ``reason``."""

    topic: str
    reason: Reason


Decision = Retry | DeadLetter


def decide(
    *,
    main_topic: str,
    attempt: int,
    classification: Classification,
    first_received_at_ms: int,
    policy: RetryPolicy,
    clock: Clock,
    held_ms: int = 0,
    retry_after_ms: int | None = None,
    retry_after_max_ms: int | None = None,
) -> Decision:
    """Route a message whose attempt number ``attempt`` (0 = first try) just failed.

    A retry whose due time would fall beyond the total cap is not scheduled: the message is expired now rather than
    parked for a retry that is not allowed to run. ``held_ms``, the time a circuit breaker held consumption since the
    first receipt, does not count towards that cap.

    ``retry_after_ms`` (a ``Retry-After`` the failure carried, :func:`retry_after_ms_of`) is the earliest the retry
    may run: it is due at the later of its tier's delay and that, in the tier of the next attempt as always (the
    tiers count attempts; a longer wait does not skip one). A wait longer than ``retry_after_max_ms`` (the longest
    a tier accepts a record's due time for, ``REBOUND_RETRY_AFTER_MAX``) is capped there and retried as usual: a
    service announcing a long maintenance window answers again when the record is released, and dead-lettering the
    whole topic on its first ``Retry-After`` would be worse. Only the total cap expires a message.
    """
    if classification is Classification.UNDECODABLE:
        return DeadLetter(failed_topic(main_topic), Reason.UNDECODABLE)
    if classification is Classification.PERMANENT:
        return DeadLetter(failed_topic(main_topic), Reason.PERMANENT)
    next_attempt = attempt + 1
    if next_attempt > policy.max_retries:
        return DeadLetter(failed_topic(main_topic), Reason.EXHAUSTED)
    now = clock()
    wait = policy.delay_for_retry(next_attempt)
    if retry_after_ms is not None:
        honoured = retry_after_ms if retry_after_max_ms is None else min(retry_after_ms, retry_after_max_ms)
        wait = max(wait, honoured)
    due_at = now + wait
    first_received_at_ms += max(0, held_ms)
    if policy.max_duration_ms is not None and (
        now - first_received_at_ms > policy.max_duration_ms or due_at - first_received_at_ms > policy.max_duration_ms
    ):
        return DeadLetter(failed_topic(main_topic), Reason.EXPIRED)
    label = policy.tier_label(next_attempt)
    return Retry(topic=tier_topic(main_topic, label), tier=label, attempt=next_attempt, due_at_ms=due_at)


def retry_after_ms_of(error: BaseException) -> int | None:
    """The ``retry_after_s`` a :class:`RetryableError` carries, in whole milliseconds rounded up (never early);
    ``None`` for other errors and for a value that is not a finite number of seconds >= 0."""
    seconds = getattr(error, "retry_after_s", None) if isinstance(error, RetryableError) else None
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        return None
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return math.ceil(seconds * 1000)


def unless_too_large(decision: Decision, *, main_topic: str, record_bytes: int, limit: int) -> Decision:
    """A retry whose tier record (or its parked copy) is larger than the producer accepts goes to the failed topic.

    Forwarding it could never succeed, and retrying the send would stop the partition: the failure is decided here,
    with the sizes measured up front, so transport never has to re-route.
    """
    if isinstance(decision, Retry) and record_bytes > limit:
        return DeadLetter(failed_topic(main_topic), Reason.TOO_LARGE)
    return decision


def classify_and_decide(
    error: BaseException,
    *,
    classifier: ErrorClassifier,
    main_topic: str,
    attempt: int,
    first_received_at_ms: int,
    policy: RetryPolicy,
    clock: Clock,
    held_ms: int = 0,
    retry_after_max_ms: int | None = None,
) -> Decision:
    """:func:`decide` for ``error``: its classification, and its ``Retry-After`` if it carries one."""
    return decide(
        main_topic=main_topic,
        attempt=attempt,
        classification=classifier.classify(error),
        first_received_at_ms=first_received_at_ms,
        policy=policy,
        clock=clock,
        held_ms=held_ms,
        retry_after_ms=retry_after_ms_of(error),
        retry_after_max_ms=retry_after_max_ms,
    )


__all__ = [
    "Classification",
    "Clock",
    "DeadLetter",
    "Decision",
    "ErrorClassifier",
    "HandlerError",
    "Reason",
    "Retry",
    "classify_and_decide",
    "decide",
    "error_class_name",
    "retry_after_ms_of",
    "unless_too_large",
]
