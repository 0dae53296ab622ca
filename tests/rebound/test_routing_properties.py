"""Property tests of the routing decision (clock injected) and of the delay syntax behind tier names."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from rebound.errors import ConfigurationError
from rebound.policy import MAX_RETRIES, RetryPolicy, format_duration, parse_duration_ms, parse_sequence
from rebound.routing import Classification, DeadLetter, Reason, Retry, decide
from rebound.topics import failed_topic, tier_topic

UNITS_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
EPOCH_2100_MS = 4_102_444_800_000

main_topics = st.from_regex(r"[a-zA-Z0-9_-][a-zA-Z0-9._-]{0,30}", fullmatch=True)
# Round delays (as configured in practice) and arbitrary ones (odd milliseconds, very long delays).
delays = st.one_of(
    st.builds(lambda n, unit: n * UNITS_MS[unit], st.integers(1, 120), st.sampled_from(list(UNITS_MS))),
    st.integers(1, 10 * 86_400_000),
    st.integers(1, 10**18 - 1),  # the longest a duration's amount may be (18 digits)
)
policies = st.builds(
    RetryPolicy,
    delays_ms=st.lists(delays, min_size=1, max_size=12).map(tuple),
    max_duration_ms=st.one_of(st.none(), delays),
)
instants = st.integers(0, EPOCH_2100_MS)


class Clock:
    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


@st.composite
def decisions(draw: Any, classification: Any = None) -> dict[str, Any]:
    """Arguments of one ``decide`` call: any valid attempt, a first receipt before (or, skewed, after) now."""
    policy = draw(policies)
    now = draw(instants)
    first = draw(st.one_of(st.integers(0, now), st.integers(now, now + 86_400_000), instants))
    return {
        "main_topic": draw(main_topics),
        "attempt": draw(st.one_of(st.integers(0, policy.max_retries + 2), st.integers(0, 2**40))),
        "classification": draw(classification if classification is not None else st.sampled_from(Classification)),
        "first_received_at_ms": first,
        "policy": policy,
        "clock": Clock(now),
    }


retryable = decisions(classification=st.just(Classification.RETRYABLE))


@given(args=decisions())
def test_decide_never_raises_and_answers_a_retry_or_the_failed_topic(args: dict[str, Any]) -> None:
    decision = decide(**args)
    if isinstance(decision, DeadLetter):
        assert decision.topic == failed_topic(args["main_topic"])
        assert decision.reason in set(Reason)
    else:
        assert isinstance(decision, Retry)
        assert args["classification"] is Classification.RETRYABLE


@given(args=retryable)
def test_a_retry_is_the_next_attempt_on_its_tier_and_never_due_early(args: dict[str, Any]) -> None:
    decision = decide(**args)
    if not isinstance(decision, Retry):
        return
    policy: RetryPolicy = args["policy"]
    assert decision.attempt == args["attempt"] + 1
    assert 1 <= decision.attempt <= policy.max_retries
    assert decision.due_at_ms >= args["clock"].now_ms + policy.delay_for_retry(decision.attempt)
    assert decision.tier in policy.tier_labels
    assert decision.tier == policy.tier_label(decision.attempt)
    assert decision.topic == tier_topic(args["main_topic"], decision.tier)
    assert decision.topic == f"{args['main_topic']}.retry.{decision.tier}"


@given(args=retryable)
def test_a_retry_is_scheduled_whenever_the_policy_allows_one(args: dict[str, Any]) -> None:
    """No early exhaustion or expiry: within the retry count and the cap, a retryable failure is retried."""
    policy: RetryPolicy = args["policy"]
    next_attempt = args["attempt"] + 1
    if next_attempt > policy.max_retries:
        return
    now, first = args["clock"].now_ms, args["first_received_at_ms"]
    due = now + policy.delay_for_retry(next_attempt)
    cap = policy.max_duration_ms
    if cap is not None and (now - first > cap or due - first > cap):
        return
    assert isinstance(decide(**args), Retry)


@given(args=retryable, beyond=st.integers(0, 2**40))
def test_attempts_beyond_the_policy_are_exhausted(args: dict[str, Any], beyond: int) -> None:
    args["attempt"] = args["policy"].max_retries + beyond
    assert decide(**args) == DeadLetter(failed_topic(args["main_topic"]), Reason.EXHAUSTED)


@given(args=retryable)
def test_no_retry_is_ever_due_after_the_total_cap(args: dict[str, Any]) -> None:
    policy: RetryPolicy = args["policy"]
    decision = decide(**args)
    if policy.max_duration_ms is not None and isinstance(decision, Retry):
        assert decision.due_at_ms - args["first_received_at_ms"] <= policy.max_duration_ms
    if isinstance(decision, DeadLetter):
        assert decision.reason in (Reason.EXHAUSTED, Reason.EXPIRED)
        if decision.reason is Reason.EXPIRED:
            assert policy.max_duration_ms is not None


@given(args=decisions(classification=st.sampled_from([Classification.PERMANENT, Classification.UNDECODABLE])))
def test_permanent_and_undecodable_failures_dead_letter_at_once(args: dict[str, Any]) -> None:
    reason = Reason.PERMANENT if args["classification"] is Classification.PERMANENT else Reason.UNDECODABLE
    assert decide(**args) == DeadLetter(failed_topic(args["main_topic"]), reason)


@given(args=retryable)
def test_the_decision_depends_on_the_clock_only_through_now(args: dict[str, Any]) -> None:
    """Same inputs, same answer: the injected clock is the only time source."""
    assert decide(**args) == decide(**args)


# --- the delay syntax -------------------------------------------------------------------------------------------


@given(ms=st.one_of(delays, st.integers(1, 10**18 - 1)))
def test_a_formatted_duration_parses_back_to_itself(ms: int) -> None:
    label = format_duration(ms)
    assert parse_duration_ms(label, variable="REBOUND_RETRY_SEQUENCE") == ms
    assert label.isascii() and label.isalnum()  # safe inside a topic name


@given(amount=st.integers(10**18, 10**400))
def test_an_amount_of_more_than_18_digits_is_a_configuration_error_not_an_overflow(amount: int) -> None:
    with pytest.raises(ConfigurationError, match="REBOUND_RETRY_SEQUENCE"):
        parse_duration_ms(f"{amount}ms", variable="REBOUND_RETRY_SEQUENCE")


@given(amount=st.integers(1, 10**6), unit=st.sampled_from(list(UNITS_MS)), spaces=st.sampled_from(["", " ", "  "]))
def test_a_parsed_duration_formats_to_its_shortest_exact_label(amount: int, unit: str, spaces: str) -> None:
    ms = parse_duration_ms(f"{spaces}{amount}{spaces}{unit}{spaces}", variable="REBOUND_RETRY_SEQUENCE")
    assert ms == amount * UNITS_MS[unit]
    label = format_duration(ms)
    assert parse_duration_ms(label, variable="REBOUND_RETRY_SEQUENCE") == ms
    assert len(label) <= len(f"{amount}{unit}")


@given(a=st.integers(1, 10**15), b=st.integers(1, 10**15))
@example(a=60_000, b=1_000)
@example(a=1_000, b=1)
def test_distinct_delays_get_distinct_labels(a: int, b: int) -> None:
    assert (format_duration(a) == format_duration(b)) == (a == b)


@given(values=st.lists(delays, min_size=1, max_size=MAX_RETRIES))
def test_a_sequence_of_formatted_delays_parses_back(values: list[int]) -> None:
    text = ",".join(format_duration(ms) for ms in values)
    assert parse_sequence(text) == tuple(values)
    policy = RetryPolicy.parse(text)
    labels = policy.tier_labels
    assert len(labels) == len(set(labels)) == len(set(values))
    assert labels == tuple(dict.fromkeys(format_duration(ms) for ms in values))  # in first-use order
    assert [policy.tier_label(retry) for retry in range(1, len(values) + 1)] == [format_duration(v) for v in values]


number_texts = st.one_of(
    st.integers(-5, 10**6).map(str),
    st.integers(10**15, 10**30).map(str),  # larger ones: see the exponential property below
    st.sampled_from(["", "0", "00", "1.5", "+1", "١٢", "1_0", " ", "9" * 30]),
)
unit_texts = st.sampled_from(["ms", "s", "m", "h", "d", "", "x", "M", "sec"])
durations_text = st.builds(lambda n, u: n + u, number_texts, unit_texts)
factor_texts = st.one_of(
    st.just(""),
    st.builds(lambda f: f" x{f}", st.sampled_from(["2", "1", "1.5", "1.0001", "0.5", "10", "9" * 30, "3.0"])),
)
sequence_texts = st.one_of(
    st.text(max_size=30),
    st.lists(durations_text, min_size=1, max_size=8).map(",".join),
    st.builds(lambda a, b, f: f"exp:{a}..{b}{f}", durations_text, durations_text, factor_texts),
)


@given(text=sequence_texts)
@example(text="exp:1s..1h")
@example(text=",".join(["1s"] * (MAX_RETRIES + 1)))
def test_any_sequence_text_gives_valid_delays_or_a_configuration_error(text: str) -> None:
    try:
        values = parse_sequence(text)
    except ConfigurationError as exc:
        assert "REBOUND_RETRY_SEQUENCE" in str(exc)
        return
    assert 1 <= len(values) <= MAX_RETRIES
    assert all(isinstance(ms, int) and ms > 0 for ms in values)
    RetryPolicy(values)  # and it is a valid policy
    if text.strip().startswith("exp:"):
        assert list(values) == sorted(values)


@given(
    start=st.integers(1, 10**3).map(str) | st.integers(10**300, 10**400).map(str),
    growth=st.integers(1, 10**400),
    unit=st.sampled_from(list(UNITS_MS)),
    factor=st.sampled_from(["", " x2", " x1.5"]) | st.integers(300, 500).map(lambda n: " x" + "9" * n),
)
@example(start="1", growth=1, unit="s", factor=" x" + "9" * 400)  # a factor too large for a float
@example(start="1" * 400, growth=1, unit="ms", factor="")  # delays too large for a float
def test_an_exponential_sequence_of_any_size_gives_delays_or_a_configuration_error(
    start: str, growth: int, unit: str, factor: str
) -> None:
    """Settings call parse_sequence in a validator: anything but a ConfigurationError escapes unexplained."""
    text = f"exp:{start}{unit}..{int(start) + growth}{unit}{factor}"
    try:
        values = parse_sequence(text)
    except ConfigurationError:
        return
    assert 1 <= len(values) <= MAX_RETRIES
    assert list(values) == sorted(values)
    assert values[0] == int(start) * UNITS_MS[unit]
    assert values[-1] == (int(start) + growth) * UNITS_MS[unit]
