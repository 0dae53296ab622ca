"""The routing decision after a failed attempt, and error classification."""

from __future__ import annotations

import json

import pytest

from rebound.errors import HandlerError, PermanentError, RetryableError, UndecodableError
from rebound.policy import RetryPolicy
from rebound.routing import (
    Classification,
    DeadLetter,
    ErrorClassifier,
    Reason,
    Retry,
    classify_and_decide,
    decide,
    error_class_name,
)

DEFAULT = RetryPolicy.parse("5m,5m,30m,30m,30m,1h")
MINUTE = 60_000


def route(clock, *, attempt: int = 0, first: int | None = None, policy: RetryPolicy = DEFAULT, **kwargs):
    return decide(
        main_topic=kwargs.pop("main_topic", "items"),
        attempt=attempt,
        classification=kwargs.pop("classification", Classification.RETRYABLE),
        first_received_at_ms=clock.now_ms if first is None else first,
        policy=policy,
        clock=clock,
    )


def test_first_failure_goes_to_tier_one(clock) -> None:
    decision = route(clock, attempt=0)
    assert decision == Retry(topic="items.retry.5m", tier="5m", attempt=1, due_at_ms=clock.now_ms + 5 * MINUTE)


def test_each_attempt_walks_the_tiers(clock) -> None:
    first = clock.now_ms
    expected = [("5m", 5), ("5m", 5), ("30m", 30), ("30m", 30), ("30m", 30), ("1h", 60)]
    for attempt, (tier, minutes) in enumerate(expected):
        decision = route(clock, attempt=attempt, first=first)
        assert isinstance(decision, Retry)
        assert decision.attempt == attempt + 1
        assert decision.tier == tier
        assert decision.topic == f"items.retry.{tier}"
        assert decision.due_at_ms == clock.now_ms + minutes * MINUTE
        clock.advance(minutes * MINUTE)


def test_after_last_retry_dead_letters_exhausted(clock) -> None:
    assert route(clock, attempt=6) == DeadLetter(topic="items.failed", reason=Reason.EXHAUSTED)
    assert route(clock, attempt=7) == DeadLetter(topic="items.failed", reason=Reason.EXHAUSTED)


def test_topic_names_follow_the_main_topic(clock) -> None:
    decision = route(clock, attempt=2, main_topic="orders")
    assert isinstance(decision, Retry)
    assert decision.topic == "orders.retry.30m"
    assert route(clock, attempt=6, main_topic="orders") == DeadLetter("orders.failed", Reason.EXHAUSTED)


@pytest.mark.parametrize(
    ("classification", "reason"),
    [(Classification.PERMANENT, Reason.PERMANENT), (Classification.UNDECODABLE, Reason.UNDECODABLE)],
)
@pytest.mark.parametrize("attempt", [0, 3, 6, 50])
def test_permanent_and_undecodable_go_straight_to_failed(clock, classification, reason, attempt) -> None:
    policy = RetryPolicy.parse("5m,1h", "10m")
    decision = route(clock, attempt=attempt, classification=classification, first=0, policy=policy)
    assert decision == DeadLetter(topic="items.failed", reason=reason)
    assert reason.value in {"permanent", "undecodable"}


def test_expired_when_already_past_the_cap(clock) -> None:
    policy = RetryPolicy.parse("1s,1s", "1h")
    first = clock.now_ms - 60 * MINUTE - 1
    assert route(clock, attempt=0, first=first, policy=policy) == DeadLetter("items.failed", Reason.EXPIRED)


def test_expired_when_next_due_would_be_beyond_the_cap(clock) -> None:
    policy = RetryPolicy.parse("5m,30m", "20m")
    first = clock.now_ms
    assert route(clock, attempt=0, first=first, policy=policy) == Retry("items.retry.5m", "5m", 1, first + 5 * MINUTE)
    clock.advance(5 * MINUTE)
    # Retry 2 would be due 35 minutes after the first receipt: past the 20 minute cap, so expire now.
    assert route(clock, attempt=1, first=first, policy=policy) == DeadLetter("items.failed", Reason.EXPIRED)


def test_due_exactly_at_the_cap_is_still_scheduled(clock) -> None:
    policy = RetryPolicy.parse("5m,5m", "10m")
    first = clock.now_ms - 5 * MINUTE
    decision = route(clock, attempt=1, first=first, policy=policy)
    assert decision == Retry("items.retry.5m", "5m", 2, first + 10 * MINUTE)
    clock.advance(1)
    assert route(clock, attempt=1, first=first, policy=policy) == DeadLetter("items.failed", Reason.EXPIRED)


def test_no_cap_never_expires(clock) -> None:
    first = clock.now_ms - 365 * 24 * 60 * MINUTE
    decision = route(clock, attempt=0, first=first)
    assert isinstance(decision, Retry)
    assert decision.due_at_ms == clock.now_ms + 5 * MINUTE


def test_exhausted_wins_over_expired(clock) -> None:
    policy = RetryPolicy.parse("5m", "1m")
    assert route(clock, attempt=1, first=0, policy=policy) == DeadLetter("items.failed", Reason.EXHAUSTED)


def test_injected_clock_is_the_only_time_source(clock) -> None:
    clock.now_ms = 1_000  # far in the past: a decision using the real time would be off by decades
    decision = route(clock, attempt=0, first=1_000)
    assert decision == Retry("items.retry.5m", "5m", 1, 1_000 + 5 * MINUTE)
    assert clock.calls >= 1
    clock.now_ms = 10**15
    later = route(clock, attempt=0, first=10**15)
    assert isinstance(later, Retry)
    assert later.due_at_ms == 10**15 + 5 * MINUTE


def test_reason_values_match_the_contract() -> None:
    assert [reason.value for reason in Reason] == [
        "exhausted",
        "permanent",
        "expired",
        "undecodable",
        "invalid-retry-headers",
        "key-backlog-full",
        "payload-missing",
        "too-large",
        "internal-error",
        "admin",
    ]


# --- classification ------------------------------------------------------------------------------------------------


class DependencyDown(Exception):
    pass


class DatabaseDown(DependencyDown):
    pass


class BadPayload(ValueError):
    pass


class VeryBadPayload(BadPayload):
    pass


class MyRetryable(RetryableError):
    pass


class MyPermanent(PermanentError):
    pass


QUALIFIED = f"{__name__}.DependencyDown"


def test_bytes_that_cannot_be_decoded_are_undecodable_unless_configured_otherwise() -> None:
    """A handler's own json.loads or bytes.decode failing: a retry decodes the same bytes again (a new user's
    handler in a trial had such records retried until their policy was spent, then dead-lettered as exhausted)."""
    classifier = ErrorClassifier()
    with pytest.raises(UnicodeDecodeError) as not_utf8:
        b"\xff\xfe".decode()
    with pytest.raises(json.JSONDecodeError) as not_json:
        json.loads("{")
    assert classifier.classify(not_utf8.value) is Classification.UNDECODABLE
    assert classifier.classify(not_json.value) is Classification.UNDECODABLE
    assert classifier.classify(ValueError("other")) is Classification.RETRYABLE  # only decoding itself
    configured = ErrorClassifier(retryable_names=frozenset({"JSONDecodeError"}))
    assert configured.classify(not_json.value) is Classification.RETRYABLE


def test_default_classifier_retries_unknown_errors() -> None:
    classifier = ErrorClassifier()
    assert classifier.classify(ValueError("x")) is Classification.RETRYABLE
    assert classifier.classify(DependencyDown()) is Classification.RETRYABLE


def test_default_can_be_permanent() -> None:
    classifier = ErrorClassifier(default=Classification.PERMANENT)
    assert classifier.classify(KeyError("x")) is Classification.PERMANENT
    assert classifier.classify(RetryableError("x")) is Classification.RETRYABLE


def test_own_error_classes_decide_for_themselves() -> None:
    classifier = ErrorClassifier()
    assert classifier.classify(RetryableError()) is Classification.RETRYABLE
    assert classifier.classify(PermanentError()) is Classification.PERMANENT
    assert classifier.classify(UndecodableError()) is Classification.UNDECODABLE
    assert classifier.classify(HandlerError()) is Classification.RETRYABLE  # plain base: falls to the default


def test_bare_class_name_configures_permanent() -> None:
    classifier = ErrorClassifier(permanent_names=frozenset({"BadPayload"}))
    assert classifier.classify(BadPayload()) is Classification.PERMANENT
    assert classifier.classify(ValueError()) is Classification.RETRYABLE


def test_qualified_class_name_configures_permanent() -> None:
    classifier = ErrorClassifier(permanent_names=frozenset({QUALIFIED}))
    assert classifier.classify(DependencyDown()) is Classification.PERMANENT
    # another module's class with the same bare name is not covered by a qualified entry
    other = type("DependencyDown", (Exception,), {"__module__": "elsewhere"})
    assert classifier.classify(other()) is Classification.RETRYABLE


def test_builtin_names_bare_and_qualified() -> None:
    assert ErrorClassifier(permanent_names=frozenset({"KeyError"})).classify(KeyError()) is Classification.PERMANENT
    qualified = ErrorClassifier(permanent_names=frozenset({"builtins.KeyError"}))
    assert qualified.classify(KeyError()) is Classification.PERMANENT


def test_configured_base_class_covers_subclasses() -> None:
    classifier = ErrorClassifier(permanent_names=frozenset({"ValueError"}), default=Classification.RETRYABLE)
    assert classifier.classify(VeryBadPayload()) is Classification.PERMANENT
    assert classifier.classify(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad")) is Classification.PERMANENT
    retry = ErrorClassifier(retryable_names=frozenset({QUALIFIED}), default=Classification.PERMANENT)
    assert retry.classify(DatabaseDown()) is Classification.RETRYABLE
    assert retry.classify(RuntimeError()) is Classification.PERMANENT


def test_most_specific_configured_class_wins() -> None:
    classifier = ErrorClassifier(
        permanent_names=frozenset({"BadPayload"}), retryable_names=frozenset({"VeryBadPayload"})
    )
    assert classifier.classify(VeryBadPayload()) is Classification.RETRYABLE
    assert classifier.classify(BadPayload()) is Classification.PERMANENT


def test_own_error_classes_win_over_configuration() -> None:
    classifier = ErrorClassifier(
        permanent_names=frozenset({"MyRetryable", "RetryableError", "Exception"}),
        retryable_names=frozenset({"MyPermanent", "PermanentError", "UndecodableError"}),
        default=Classification.PERMANENT,
    )
    assert classifier.classify(MyRetryable()) is Classification.RETRYABLE
    assert classifier.classify(RetryableError()) is Classification.RETRYABLE
    assert classifier.classify(MyPermanent()) is Classification.PERMANENT
    assert classifier.classify(UndecodableError()) is Classification.UNDECODABLE


def test_error_class_name() -> None:
    assert error_class_name(ValueError()) == "ValueError"
    assert error_class_name(DependencyDown()) == QUALIFIED
    assert error_class_name(PermanentError()) == "rebound.errors.PermanentError"


def test_classify_and_decide(clock) -> None:
    classifier = ErrorClassifier(permanent_names=frozenset({"BadPayload"}))
    common = {
        "classifier": classifier,
        "main_topic": "items",
        "attempt": 0,
        "first_received_at_ms": clock.now_ms,
        "policy": DEFAULT,
        "clock": clock,
    }
    assert classify_and_decide(BadPayload(), **common) == DeadLetter("items.failed", Reason.PERMANENT)
    assert classify_and_decide(UndecodableError(), **common) == DeadLetter("items.failed", Reason.UNDECODABLE)
    assert classify_and_decide(TimeoutError(), **common) == Retry("items.retry.5m", "5m", 1, clock.now_ms + 5 * MINUTE)
