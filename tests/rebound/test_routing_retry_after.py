"""A ``Retry-After`` the failure carries: the retry is due at the later of its tier's delay and that (capped at
``REBOUND_RETRY_AFTER_MAX``), never before."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rebound.errors import OverloadError, PermanentError, RetryableError
from rebound.policy import RetryPolicy
from rebound.routing import (
    Classification,
    DeadLetter,
    ErrorClassifier,
    Reason,
    Retry,
    classify_and_decide,
    decide,
    retry_after_ms_of,
)

NOW = 1_700_000_000_000
POLICY = RetryPolicy.parse("1s,2s")


def clock() -> int:
    return NOW


def route(retry_after_ms: int | None, *, attempt: int = 0, policy: RetryPolicy = POLICY, cap: int | None = 3_600_000):
    return decide(
        main_topic="items",
        attempt=attempt,
        classification=Classification.RETRYABLE,
        first_received_at_ms=NOW,
        policy=policy,
        clock=clock,
        retry_after_ms=retry_after_ms,
        retry_after_max_ms=cap,
    )


def test_a_retry_after_longer_than_the_tier_delay_sets_the_due_time() -> None:
    assert route(7_000) == Retry(topic="items.retry.1s", tier="1s", attempt=1, due_at_ms=NOW + 7_000)


def test_a_retry_after_shorter_than_the_tier_delay_changes_nothing() -> None:
    assert route(300, attempt=1) == Retry(topic="items.retry.2s", tier="2s", attempt=2, due_at_ms=NOW + 2_000)


def test_a_retry_after_beyond_the_longest_accepted_wait_is_capped_and_retried() -> None:
    # A maintenance window's "Retry-After: 7200" on the first try must not dead-letter the message: it waits the cap.
    assert route(7_200_000) == Retry(topic="items.retry.1s", tier="1s", attempt=1, due_at_ms=NOW + 3_600_000)
    assert route(3_600_001) == Retry(topic="items.retry.1s", tier="1s", attempt=1, due_at_ms=NOW + 3_600_000)
    assert route(3_600_000) == Retry(topic="items.retry.1s", tier="1s", attempt=1, due_at_ms=NOW + 3_600_000)


def test_a_capped_retry_after_still_expires_beyond_the_total_duration() -> None:
    capped = RetryPolicy.parse("1s,2s", "30m")
    assert route(7_200_000, policy=capped) == DeadLetter("items.failed", Reason.EXPIRED)
    assert route(7_200_000, policy=capped, cap=1_800_000) == Retry("items.retry.1s", "1s", 1, NOW + 1_800_000)


def test_the_total_duration_cap_still_applies() -> None:
    capped = RetryPolicy.parse("1s,2s", "5s")
    assert route(6_000, policy=capped) == DeadLetter("items.failed", Reason.EXPIRED)
    assert route(5_000, policy=capped) == Retry(topic="items.retry.1s", tier="1s", attempt=1, due_at_ms=NOW + 5_000)


def test_a_spent_policy_is_exhausted_whatever_the_retry_after() -> None:
    assert route(1_000, attempt=2) == DeadLetter("items.failed", Reason.EXHAUSTED)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (RetryableError("x", retry_after_s=1.0001), 1001),
        (OverloadError("x", retry_after_s=0), 0),
        (RetryableError("x"), None),
        (RetryableError("x", retry_after_s=math.nan), None),
        (RetryableError("x", retry_after_s=-1), None),
        (ValueError("x"), None),
    ],
)
def test_retry_after_is_read_from_retryable_errors_rounded_up(error: BaseException, expected: int | None) -> None:
    assert retry_after_ms_of(error) == expected


def test_classify_and_decide_reads_the_errors_retry_after() -> None:
    def run(error: BaseException) -> object:
        return classify_and_decide(
            error,
            classifier=ErrorClassifier(),
            main_topic="items",
            attempt=0,
            first_received_at_ms=NOW,
            policy=POLICY,
            clock=clock,
            retry_after_max_ms=60_000,
        )

    assert run(OverloadError("busy", retry_after_s=30)) == Retry("items.retry.1s", "1s", 1, NOW + 30_000)
    assert run(OverloadError("busy", retry_after_s=7200)) == Retry("items.retry.1s", "1s", 1, NOW + 60_000)
    assert run(PermanentError("bad")) == DeadLetter("items.failed", Reason.PERMANENT)


@given(
    delays=st.lists(st.integers(1, 10 * 86_400_000), min_size=1, max_size=6),
    attempt=st.integers(0, 6),
    retry_after=st.one_of(st.none(), st.integers(0, 20 * 86_400_000)),
    cap=st.one_of(st.none(), st.integers(1, 20 * 86_400_000)),
    max_duration=st.one_of(st.none(), st.integers(1, 30 * 86_400_000)),
)
def test_never_due_before_the_capped_retry_after_nor_before_the_tier_delay(
    delays: list[int], attempt: int, retry_after: int | None, cap: int | None, max_duration: int | None
) -> None:
    policy = RetryPolicy(delays_ms=tuple(delays), max_duration_ms=max_duration)
    decision = route(retry_after, attempt=attempt, policy=policy, cap=cap)
    honoured = 0 if retry_after is None else retry_after if cap is None else min(retry_after, cap)
    if isinstance(decision, Retry):
        tier_delay = policy.delay_for_retry(decision.attempt)
        assert decision.due_at_ms >= NOW + tier_delay
        assert decision.due_at_ms >= NOW + honoured
        assert decision.due_at_ms - NOW == max(tier_delay, honoured)  # never later than both either
        assert max_duration is None or decision.due_at_ms - NOW <= max_duration
        assert decision.attempt == attempt + 1
    else:
        assert decision.reason in (Reason.EXHAUSTED, Reason.EXPIRED)
        without = route(None, attempt=attempt, policy=policy, cap=cap)
        if decision.reason is Reason.EXPIRED and isinstance(without, Retry):  # only the wait expired it
            assert max_duration is not None and honoured > max_duration
