"""RetryPolicy parsing: units, explicit and exponential sequences, the total cap, and strict rejection."""

from __future__ import annotations

import pytest

from rebound.errors import ConfigurationError
from rebound.policy import MAX_RETRIES, RetryPolicy, format_duration, parse_duration_ms, parse_sequence

SEQ = "REBOUND_RETRY_SEQUENCE"
CAP = "REBOUND_MAX_RETRY_DURATION"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("250ms", 250),
        ("1s", 1_000),
        ("30s", 30_000),
        ("5m", 300_000),
        ("2h", 7_200_000),
        ("1d", 86_400_000),
        (" 7 m ", 420_000),
    ],
)
def test_parse_duration_units(text: str, expected: int) -> None:
    assert parse_duration_ms(text, variable=SEQ) == expected


def test_default_sequence_delays_and_tiers() -> None:
    policy = RetryPolicy.parse("5m,5m,30m,30m,30m,1h")
    assert policy.delays_ms == (300_000, 300_000, 1_800_000, 1_800_000, 1_800_000, 3_600_000)
    assert policy.max_retries == 6
    assert policy.max_duration_ms is None
    assert policy.tier_labels == ("5m", "30m", "1h")
    assert [policy.tier_label(retry) for retry in range(1, 7)] == ["5m", "5m", "30m", "30m", "30m", "1h"]
    assert policy.delay_for_retry(1) == 300_000
    assert policy.delay_for_retry(6) == 3_600_000
    assert policy.describe() == "5m,5m,30m,30m,30m,1h"


def test_tier_labels_are_distinct_in_first_use_order() -> None:
    policy = RetryPolicy.parse("1h,5m,1h,30s,5m")
    assert policy.tier_labels == ("1h", "5m", "30s")


def test_equal_delays_written_differently_share_one_tier() -> None:
    policy = RetryPolicy.parse("60s,1m,60000ms")
    assert policy.delays_ms == (60_000, 60_000, 60_000)
    assert policy.tier_labels == ("1m",)


def test_exponential_default_factor_two() -> None:
    # 1s doubling: 1,2,4,...,2048 s; the next (4096 s) is capped at 1h = 3600 s.
    expected = (
        1_000,
        2_000,
        4_000,
        8_000,
        16_000,
        32_000,
        64_000,
        128_000,
        256_000,
        512_000,
        1_024_000,
        2_048_000,
        3_600_000,
    )
    assert parse_sequence("exp:1s..1h") == expected
    assert RetryPolicy.parse("exp:1s..1h").tier_labels == (
        "1s",
        "2s",
        "4s",
        "8s",
        "16s",
        "32s",
        "64s",
        "128s",
        "256s",
        "512s",
        "1024s",
        "2048s",
        "1h",
    )


def test_exponential_factor_three() -> None:
    assert parse_sequence("exp:1s..1h x3") == (
        1_000,
        3_000,
        9_000,
        27_000,
        81_000,
        243_000,
        729_000,
        2_187_000,
        3_600_000,
    )


def test_exponential_fractional_factor_and_star_syntax() -> None:
    assert parse_sequence("exp:500ms..1s x1.5") == (500, 750, 1_000)
    assert parse_sequence("exp: 1s .. 4s *2") == (1_000, 2_000, 4_000)


def test_exponential_single_step_when_start_equals_stop() -> None:
    assert parse_sequence("exp:5m..5m") == (300_000,)


@pytest.mark.parametrize(
    "text",
    ["", "   ", "0m", "0", "-5m", "5", "5x", "5 minutes", "1.5m", "5m,,5m", "5m,", ",5m", "5m;5m", "m"],
)
def test_invalid_sequences_name_the_variable(text: str) -> None:
    with pytest.raises(ConfigurationError, match=SEQ):
        parse_sequence(text)


@pytest.mark.parametrize("text", ["exp:1h..1s", "exp:1s..1h x1", "exp:1s..1h x0.5", "exp:0s..1h", "exp:1s..1q"])
def test_invalid_exponential_sequences_name_the_variable(text: str) -> None:
    with pytest.raises(ConfigurationError, match=SEQ):
        parse_sequence(text)


def test_exponential_that_never_grows_is_bounded() -> None:
    # round(1 * 1.1) == 1: the expansion would never reach the stop without the retry bound.
    with pytest.raises(ConfigurationError, match=f"more than {MAX_RETRIES}"):
        parse_sequence("exp:1ms..1s x1.1")


def test_too_many_explicit_retries_rejected() -> None:
    assert len(parse_sequence(",".join(["1s"] * MAX_RETRIES))) == MAX_RETRIES
    with pytest.raises(ConfigurationError, match=SEQ):
        parse_sequence(",".join(["1s"] * (MAX_RETRIES + 1)))


def test_max_duration_parsed() -> None:
    policy = RetryPolicy.parse("5m,30m", "2h")
    assert policy.max_duration_ms == 7_200_000
    assert policy.describe() == "5m,30m (max 2h)"


@pytest.mark.parametrize("blank", [None, "", "   "])
def test_blank_max_duration_means_no_cap(blank: str | None) -> None:
    assert RetryPolicy.parse("5m", blank).max_duration_ms is None


@pytest.mark.parametrize("text", ["0s", "-1h", "1.5h", "forever", "10"])
def test_invalid_max_duration_names_its_variable(text: str) -> None:
    with pytest.raises(ConfigurationError, match=CAP) as info:
        RetryPolicy.parse("5m", text)
    assert SEQ not in str(info.value)


def test_policy_constructor_validates() -> None:
    with pytest.raises(ConfigurationError):
        RetryPolicy(())
    with pytest.raises(ConfigurationError):
        RetryPolicy((1_000, 0))
    with pytest.raises(ConfigurationError):
        RetryPolicy((1_000,), max_duration_ms=0)


def test_policy_is_frozen() -> None:
    policy = RetryPolicy((1_000,))
    with pytest.raises(AttributeError):
        policy.delays_ms = (2_000,)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("ms", "label"),
    [
        (1, "1ms"),
        (1_500, "1500ms"),
        (1_000, "1s"),
        (90_000, "90s"),
        (300_000, "5m"),
        (5_400_000, "90m"),
        (3_600_000, "1h"),
        (86_400_000, "1d"),
        (172_800_000, "2d"),
        (90_000_000, "25h"),
    ],
)
def test_format_duration(ms: int, label: str) -> None:
    assert format_duration(ms) == label
    assert parse_duration_ms(label, variable=SEQ) == ms


def test_format_duration_round_trips_many_values() -> None:
    values = [*range(1, 2_500, 7), *(k * 1_000 for k in range(1, 200)), *(k * 60_000 for k in range(1, 200))]
    for ms in values:
        assert parse_duration_ms(format_duration(ms), variable=SEQ) == ms
