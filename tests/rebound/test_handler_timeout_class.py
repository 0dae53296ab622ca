"""Rebound's handler timeout has its own class, classified in the core apart from a handler's own ``TimeoutError``."""

from __future__ import annotations

import pytest

import rebound
from rebound.breaker import CallOutcome, call_outcome
from rebound.errors import HandlerTimeout, ReboundError
from rebound.routing import Classification, ErrorClassifier, error_class_name

TIMEOUT = HandlerTimeout("handler ran longer than 30s")


def test_it_is_exported_with_the_handler_errors_and_is_not_a_timeout_error() -> None:
    assert rebound.HandlerTimeout is HandlerTimeout
    assert "HandlerTimeout" in rebound.__all__
    assert issubclass(HandlerTimeout, ReboundError)
    assert not issubclass(HandlerTimeout, TimeoutError)  # so ``except TimeoutError`` never catches Rebound's verdict
    assert not issubclass(HandlerTimeout, rebound.RetryableError | rebound.PermanentError)


def test_its_error_class_and_message() -> None:
    assert error_class_name(TIMEOUT) == "rebound.errors.HandlerTimeout"
    assert str(TIMEOUT) == "handler ran longer than 30s"


@pytest.mark.parametrize(
    "classifier",
    [
        ErrorClassifier(),
        ErrorClassifier(permanent_names=frozenset({"TimeoutError"})),
        ErrorClassifier(permanent_names=frozenset({"Exception", "ReboundError", "rebound.errors.ReboundError"})),
        ErrorClassifier(default=Classification.PERMANENT),
        ErrorClassifier(retryable_names=frozenset({"HandlerTimeout"}), default=Classification.PERMANENT),
    ],
    ids=["defaults", "timeout-error-permanent", "bases-permanent", "unknown-permanent", "listed-retryable"],
)
def test_rebounds_timeout_is_retryable_unless_listed_permanent_by_its_own_name(classifier: ErrorClassifier) -> None:
    assert classifier.classify(TIMEOUT) is Classification.RETRYABLE


@pytest.mark.parametrize("name", ["HandlerTimeout", "rebound.errors.HandlerTimeout", "rebound.HandlerTimeout"])
def test_rebounds_timeout_listed_by_its_own_name_is_permanent(name: str) -> None:
    assert ErrorClassifier(permanent_names=frozenset({name})).classify(TIMEOUT) is Classification.PERMANENT


class ServerTimeoutError(TimeoutError):
    """Like aiohttp's: an HTTP client's own timeout, a subclass of ``TimeoutError``."""


@pytest.mark.parametrize("error", [TimeoutError("upstream"), ServerTimeoutError("read timed out")])
def test_a_handlers_own_timeout_error_follows_the_lists(error: Exception) -> None:
    assert ErrorClassifier().classify(error) is Classification.RETRYABLE
    permanent = ErrorClassifier(permanent_names=frozenset({"TimeoutError"}))
    assert permanent.classify(error) is Classification.PERMANENT
    assert ErrorClassifier(permanent_names=frozenset({"HandlerTimeout"})).classify(error) is Classification.RETRYABLE


def test_the_breaker_counts_what_routing_retries_and_ignores_what_it_does_not() -> None:
    assert call_outcome(None) is CallOutcome.SUCCESS
    assert call_outcome(Classification.RETRYABLE) is CallOutcome.FAILURE
    assert call_outcome(Classification.PERMANENT) is CallOutcome.IGNORED
    assert call_outcome(Classification.UNDECODABLE) is CallOutcome.IGNORED
    listed = ErrorClassifier(permanent_names=frozenset({"TimeoutError"}))
    assert call_outcome(listed.classify(TimeoutError())) is CallOutcome.IGNORED
    assert call_outcome(listed.classify(TIMEOUT)) is CallOutcome.FAILURE
