"""REBOUND_CONCURRENCY as a number or ``auto`` (adaptive concurrency) and what is derived from it."""

from __future__ import annotations

import pytest

from rebound.errors import ConfigurationError
from rebound.limiter import LimitRange
from rebound.settings import ENV_PREFIX, RELEASE_WINDOW_PER_CALL, Settings, load_settings


def from_variables(**variables: str) -> Settings:
    """The settings ``REBOUND_X=text`` gives, as text, the way the environment gives it."""
    return load_settings(**{name.removeprefix(ENV_PREFIX).lower(): value for name, value in variables.items()})


def test_a_number_is_a_fixed_limit_as_before() -> None:
    settings = from_variables(REBOUND_CONCURRENCY="32")
    assert settings.concurrency == 32
    assert settings.concurrency_range is None
    assert settings.most_in_flight == 32
    assert settings.release_window == RELEASE_WINDOW_PER_CALL * 32


def test_the_default_stays_64_fixed() -> None:
    settings = load_settings()
    assert settings.concurrency == 64 and settings.concurrency_range is None and settings.release_window == 1024


@pytest.mark.parametrize("value", ["auto", " AUTO ", "Auto"])
def test_auto_adapts_between_the_minimum_and_the_maximum(value) -> None:
    settings = from_variables(REBOUND_CONCURRENCY=value)
    assert settings.concurrency == "auto"
    assert settings.concurrency_range == LimitRange(minimum=2, maximum=256, initial=16)
    assert settings.most_in_flight == 256
    assert settings.release_window == RELEASE_WINDOW_PER_CALL * 256  # one partition can keep the maximum busy


def test_auto_takes_its_range_from_the_settings() -> None:
    assert from_variables(
        REBOUND_CONCURRENCY="auto",
        REBOUND_CONCURRENCY_MIN="4",
        REBOUND_CONCURRENCY_MAX="1000",
        REBOUND_CONCURRENCY_INITIAL="100",
    ).concurrency_range == LimitRange(4, 1000, 100)


@pytest.mark.parametrize(("low", "high", "initial"), [("1", "8", 8), ("32", "64", 32)])
def test_the_default_initial_limit_is_16_within_the_range(low, high, initial) -> None:
    assert from_variables(
        REBOUND_CONCURRENCY="auto", REBOUND_CONCURRENCY_MIN=low, REBOUND_CONCURRENCY_MAX=high
    ).concurrency_range == LimitRange(int(low), int(high), initial)


def test_a_range_that_is_not_one_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="REBOUND_CONCURRENCY_MIN=10 is above REBOUND_CONCURRENCY_MAX=5"):
        from_variables(REBOUND_CONCURRENCY="auto", REBOUND_CONCURRENCY_MIN="10", REBOUND_CONCURRENCY_MAX="5")


def test_an_initial_limit_outside_the_range_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="REBOUND_CONCURRENCY_INITIAL=1000 is not between"):
        from_variables(REBOUND_CONCURRENCY="auto", REBOUND_CONCURRENCY_INITIAL="1000")


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("fast", "REBOUND_CONCURRENCY='fast': must be a number of handler calls (1 to 4096) or auto"),
        ("0", "REBOUND_CONCURRENCY='0': must be greater than or equal to 1"),
        ("5000", "REBOUND_CONCURRENCY='5000': must be less than or equal to 4096"),
    ],
)
def test_anything_else_is_refused_naming_the_variable(value, problem) -> None:
    with pytest.raises(ConfigurationError) as raised:
        from_variables(REBOUND_CONCURRENCY=value)
    assert problem in str(raised.value).split("; ")
