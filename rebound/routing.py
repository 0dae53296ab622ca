"""The one routing decision: where a message goes after an attempt failed.

Pure (no Faust, no I/O, the clock is injected), in the spirit of Spring Kafka's ``DestinationTopicResolver``: every
agent asks this function and does exactly what it answers, so the whole retry behaviour is unit-testable without a
broker.
"""

from __future__ import annotations

import json
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
) -> Decision:
    """Route a message whose attempt number ``attempt`` (0 = first try) just failed.

    A retry whose due time would fall beyond the total cap is not scheduled: the message is expired now rather than
    parked for a retry that is not allowed to run. ``held_ms``, the time a circuit breaker held consumption since the
    first receipt, does not count towards that cap.
    """
    if classification is Classification.UNDECODABLE:
        return DeadLetter(failed_topic(main_topic), Reason.UNDECODABLE)
    if classification is Classification.PERMANENT:
        return DeadLetter(failed_topic(main_topic), Reason.PERMANENT)
    next_attempt = attempt + 1
    if next_attempt > policy.max_retries:
        return DeadLetter(failed_topic(main_topic), Reason.EXHAUSTED)
    now = clock()
    due_at = now + policy.delay_for_retry(next_attempt)
    first_received_at_ms += max(0, held_ms)
    if policy.max_duration_ms is not None and (
        now - first_received_at_ms > policy.max_duration_ms or due_at - first_received_at_ms > policy.max_duration_ms
    ):
        return DeadLetter(failed_topic(main_topic), Reason.EXPIRED)
    label = policy.tier_label(next_attempt)
    return Retry(topic=tier_topic(main_topic, label), tier=label, attempt=next_attempt, due_at_ms=due_at)


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
) -> Decision:
    return decide(
        main_topic=main_topic,
        attempt=attempt,
        classification=classifier.classify(error),
        first_received_at_ms=first_received_at_ms,
        policy=policy,
        clock=clock,
        held_ms=held_ms,
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
    "unless_too_large",
]
