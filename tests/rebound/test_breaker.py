"""The circuit breaker state machine: opening on the failure ratio, probing, closing, and the held-time arithmetic."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rebound.breaker import (
    MAX_OPEN_PERIODS,
    Admission,
    BreakerConfig,
    BreakerState,
    CallOutcome,
    CircuitBreaker,
    Transition,
)
from rebound.errors import ConfigurationError

T0 = 1_700_000_000_000
S = CallOutcome.SUCCESS
F = CallOutcome.FAILURE
IGN = CallOutcome.IGNORED


def config(**overrides: Any) -> BreakerConfig:
    fields: dict[str, Any] = {
        "window_ms": 30_000,
        "min_calls": 10,
        "failure_ratio": 0.5,
        "probe_interval_ms": 10_000,
        "probe_max_interval_ms": 60_000,
    }
    fields.update(overrides)
    return BreakerConfig(**fields)


def feed(breaker: CircuitBreaker, outcomes: list[CallOutcome], now_ms: int = T0) -> list[Transition | None]:
    return [breaker.record(outcome, now_ms) for outcome in outcomes]


def opened(now_ms: int = T0, **overrides: Any) -> CircuitBreaker:
    """A breaker just opened at ``now_ms`` by ``min_calls`` failures."""
    breaker = CircuitBreaker(config(**overrides))
    feed(breaker, [F] * breaker.config.min_calls, now_ms)
    assert breaker.state is BreakerState.OPEN
    return breaker


# -- closed -> open -------------------------------------------------------------------------------------------------


def test_new_breaker_is_closed_and_passes_calls() -> None:
    breaker = CircuitBreaker(config())
    assert breaker.state is BreakerState.CLOSED
    assert not breaker.is_open
    assert breaker.admit(T0) is Admission.PASS
    assert breaker.transitions == ()
    assert breaker.open_periods == ()


def test_does_not_open_before_min_calls_even_if_all_fail() -> None:
    breaker = CircuitBreaker(config(min_calls=10))
    assert feed(breaker, [F] * 9) == [None] * 9
    assert breaker.state is BreakerState.CLOSED
    assert breaker.window_counts(T0) == (9, 9)
    transition = breaker.record(F, T0)
    assert transition is not None
    assert breaker.state is BreakerState.OPEN
    assert breaker.is_open


def test_opens_exactly_at_the_ratio() -> None:
    breaker = CircuitBreaker(config(min_calls=20, failure_ratio=0.5))
    feed(breaker, [S] * 10 + [F] * 9)
    assert breaker.state is BreakerState.CLOSED
    transition = breaker.record(F, T0 + 5)
    assert transition == Transition(
        T0 + 5, BreakerState.CLOSED, BreakerState.OPEN, "10 of 20 calls failed in 30s (ratio 0.50 >= 0.50)"
    )
    assert breaker.transitions == (transition,)
    assert breaker.open_periods == ((T0 + 5, None),)


def test_ratio_equality_is_exact_for_awkward_floats() -> None:
    # 0.7 * 10 is 7.000000000000001 in floating point; 7 failures of 10 must still count as "at the ratio".
    breaker = CircuitBreaker(config(min_calls=10, failure_ratio=0.7))
    feed(breaker, [S] * 3 + [F] * 7)
    assert breaker.state is BreakerState.OPEN


def test_just_below_the_ratio_does_not_open() -> None:
    breaker = CircuitBreaker(config(min_calls=20, failure_ratio=0.5))
    feed(breaker, [S] * 11 + [F] * 9)
    assert breaker.state is BreakerState.CLOSED
    assert breaker.window_counts(T0) == (20, 9)


def test_a_success_reaching_min_calls_can_open() -> None:
    # The ratio was already high; the call that completes min_calls is a success and still trips it.
    breaker = CircuitBreaker(config(min_calls=5, failure_ratio=0.5))
    feed(breaker, [F, F, F, S])
    transition = breaker.record(S, T0)
    assert transition is not None
    assert transition.reason == "3 of 5 calls failed in 30s (ratio 0.60 >= 0.50)"


def test_ignored_outcomes_are_not_counted() -> None:
    breaker = CircuitBreaker(config(min_calls=4, failure_ratio=0.5))
    feed(breaker, [IGN] * 50 + [F, S, S])
    assert breaker.window_counts(T0) == (3, 1)
    assert breaker.record(IGN, T0) is None
    assert breaker.state is BreakerState.CLOSED
    feed(breaker, [F])
    assert breaker.state is BreakerState.OPEN


def test_old_failures_expire_from_the_window() -> None:
    breaker = CircuitBreaker(config(window_ms=30_000, min_calls=10))
    feed(breaker, [F] * 9, T0)
    # Buckets are window/20 = 1.5 s wide, so a call is kept for at least window - 1.5 s and at most the window.
    assert breaker.window_counts(T0 + 30_000 - 1_500 - 1) == (9, 9)
    assert breaker.window_counts(T0 + 30_000) == (0, 0)
    assert breaker.record(F, T0 + 30_000) is None
    assert breaker.state is BreakerState.CLOSED
    assert breaker.window_counts(T0 + 30_000) == (1, 1)


def test_window_slides_bucket_by_bucket() -> None:
    breaker = CircuitBreaker(config(window_ms=2_000, min_calls=100))  # buckets of 100 ms
    for step in range(40):
        breaker.record(F, T0 + step * 100)
    # Only the last 20 buckets (2 s) are kept, whatever ran before.
    assert breaker.window_counts(T0 + 3_900) == (20, 20)
    assert len(breaker._buckets) == 20


def test_memory_is_bounded_by_buckets_not_calls() -> None:
    breaker = CircuitBreaker(config(window_ms=1_000, min_calls=1_000_000))
    for i in range(10_000):
        breaker.record(S, T0 + i)
    assert len(breaker._buckets) <= 20
    assert breaker.window_counts(T0 + 9_999) == (1_000, 0)


def test_tiny_window_uses_one_millisecond_buckets() -> None:
    breaker = CircuitBreaker(config(window_ms=5, min_calls=3, failure_ratio=1.0))
    breaker.record(F, T0)
    breaker.record(F, T0 + 1)
    assert breaker.window_counts(T0 + 5) == (1, 1)
    breaker.record(F, T0 + 5)
    assert breaker.state is BreakerState.CLOSED
    breaker.record(F, T0 + 5)
    assert breaker.state is BreakerState.OPEN


def test_opening_clears_the_window() -> None:
    breaker = opened()
    assert breaker.window_counts(T0) == (0, 0)


# -- open -> half-open -> ... ---------------------------------------------------------------------------------------


def test_open_waits_until_probe_time_then_probes_once() -> None:
    breaker = opened(T0, probe_interval_ms=10_000)
    assert breaker.admit(T0) is Admission.WAIT
    assert breaker.admit(T0 + 9_999) is Admission.WAIT
    assert breaker.state is BreakerState.OPEN
    assert breaker.admit(T0 + 10_000) is Admission.PROBE
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.is_open
    # Only one probe in flight.
    assert breaker.admit(T0 + 10_000) is Admission.WAIT
    assert breaker.admit(T0 + 50_000) is Admission.WAIT
    assert breaker.transitions[-1] == Transition(
        T0 + 10_000, BreakerState.OPEN, BreakerState.HALF_OPEN, "probe due after 10s open"
    )


def test_probe_after_probe_time_also_admitted() -> None:
    breaker = opened(T0)
    assert breaker.admit(T0 + 123_456) is Admission.PROBE


def test_probe_success_closes() -> None:
    breaker = opened(T0)
    breaker.admit(T0 + 10_000)
    transition = breaker.record(S, T0 + 10_500, probe=True)
    assert transition == Transition(T0 + 10_500, BreakerState.HALF_OPEN, BreakerState.CLOSED, "probe succeeded")
    assert breaker.state is BreakerState.CLOSED
    assert not breaker.is_open
    assert breaker.admit(T0 + 10_600) is Admission.PASS
    assert breaker.open_periods == ((T0, T0 + 10_500),)
    assert breaker.window_counts(T0 + 10_600) == (0, 0)


def test_two_probes_to_close() -> None:
    breaker = opened(T0, probes_to_close=2)
    assert breaker.admit(T0 + 10_000) is Admission.PROBE
    assert breaker.record(S, T0 + 10_100, probe=True) is None
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.admit(T0 + 10_100) is Admission.PROBE  # the next one goes at once
    transition = breaker.record(S, T0 + 10_200, probe=True)
    assert transition is not None
    assert transition.to_state is BreakerState.CLOSED
    assert transition.reason == "2 probes succeeded"


def test_probe_successes_must_be_consecutive() -> None:
    breaker = opened(T0, probes_to_close=2, probe_interval_ms=1_000)
    breaker.admit(T0 + 1_000)
    breaker.record(S, T0 + 1_000, probe=True)
    breaker.admit(T0 + 1_000)
    breaker.record(F, T0 + 1_000, probe=True)  # re-opens for 2 s
    assert breaker.admit(T0 + 3_000) is Admission.PROBE
    assert breaker.record(S, T0 + 3_000, probe=True) is None
    assert breaker.state is BreakerState.HALF_OPEN


def test_probe_failure_reopens_with_growing_capped_interval() -> None:
    breaker = opened(T0, probe_interval_ms=10_000, probe_max_interval_ms=35_000, probe_multiplier=2.0)
    now = T0
    expected_intervals = [20_000, 35_000, 35_000]
    reasons = ["probe failed; next probe in 20s", "probe failed; next probe in 35s", "probe failed; next probe in 35s"]
    interval = 10_000
    for expected, reason in zip(expected_intervals, reasons, strict=True):
        now += interval
        assert breaker.admit(now - 1) is Admission.WAIT
        assert breaker.admit(now) is Admission.PROBE
        transition = breaker.record(F, now, probe=True)
        assert transition == Transition(now, BreakerState.HALF_OPEN, BreakerState.OPEN, reason)
        assert breaker.snapshot(now)["probe_interval_ms"] == expected
        assert breaker.snapshot(now)["next_probe_at_ms"] == now + expected
        interval = expected
    # A re-open continues the same held period, and is not a new "open".
    assert breaker.open_periods == ((T0, None),)
    assert breaker.snapshot(now)["opens_total"] == 1


def test_fractional_multiplier_rounds_to_whole_milliseconds() -> None:
    breaker = opened(T0, probe_interval_ms=1_000, probe_max_interval_ms=10_000, probe_multiplier=1.5)
    breaker.admit(T0 + 1_000)
    breaker.record(F, T0 + 1_000, probe=True)
    assert breaker.snapshot(T0 + 1_000)["probe_interval_ms"] == 1_500
    breaker.admit(T0 + 2_500)
    breaker.record(F, T0 + 2_500, probe=True)
    assert breaker.snapshot(T0 + 2_500)["probe_interval_ms"] == 2_250


def test_interval_resets_after_closing() -> None:
    breaker = opened(T0, probe_interval_ms=1_000)
    breaker.admit(T0 + 1_000)
    breaker.record(F, T0 + 1_000, probe=True)  # interval 2 s
    breaker.admit(T0 + 3_000)
    breaker.record(S, T0 + 3_000, probe=True)
    feed(breaker, [F] * 10, T0 + 4_000)
    assert breaker.snapshot(T0 + 4_000)["next_probe_at_ms"] == T0 + 5_000
    assert breaker.open_periods == ((T0, T0 + 3_000), (T0 + 4_000, None))


def test_ignored_probe_frees_the_slot_and_stays_half_open() -> None:
    breaker = opened(T0)
    breaker.admit(T0 + 10_000)
    assert breaker.record(IGN, T0 + 10_001, probe=True) is None
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.admit(T0 + 10_002) is Admission.PROBE


def test_probe_abandoned_frees_the_slot() -> None:
    breaker = opened(T0)
    assert breaker.admit(T0 + 10_000) is Admission.PROBE
    assert breaker.admit(T0 + 10_000) is Admission.WAIT
    breaker.probe_abandoned(T0 + 10_001)
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.admit(T0 + 10_002) is Admission.PROBE
    assert breaker.snapshot(T0 + 10_002)["probes_total"] == 2


def test_probe_abandoned_outside_half_open_is_a_no_op() -> None:
    closed = CircuitBreaker(config())
    closed.probe_abandoned(T0)
    assert closed.state is BreakerState.CLOSED
    breaker = opened(T0)
    breaker.probe_abandoned(T0 + 1)
    assert breaker.state is BreakerState.OPEN
    assert breaker.admit(T0 + 1) is Admission.WAIT


def test_stale_outcomes_while_open_are_ignored() -> None:
    breaker = opened(T0)
    # Calls passed before the breaker opened finish now: they neither close nor re-open it, nor count.
    assert feed(breaker, [S] * 30 + [F] * 30, T0 + 1) == [None] * 60
    assert breaker.state is BreakerState.OPEN
    assert breaker.window_counts(T0 + 1) == (0, 0)
    assert breaker.snapshot(T0 + 1)["next_probe_at_ms"] == T0 + 10_000
    # A probe outcome while open (no probe was admitted) is stale too.
    assert breaker.record(S, T0 + 2, probe=True) is None
    assert breaker.record(F, T0 + 2, probe=True) is None
    assert breaker.state is BreakerState.OPEN
    assert len(breaker.transitions) == 1


def test_stale_outcomes_while_half_open_are_ignored() -> None:
    breaker = opened(T0)
    breaker.admit(T0 + 10_000)
    assert feed(breaker, [S] * 5 + [F] * 5, T0 + 10_001) == [None] * 10
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.admit(T0 + 10_001) is Admission.WAIT  # the real probe is still in flight
    assert breaker.record(F, T0 + 10_002, probe=True) is not None  # the probe's own outcome counts


def test_probe_outcome_without_a_probe_in_flight_is_ignored() -> None:
    breaker = opened(T0, probes_to_close=2)
    breaker.admit(T0 + 10_000)
    breaker.record(S, T0 + 10_001, probe=True)  # one of two; slot now free
    assert breaker.record(F, T0 + 10_002, probe=True) is None
    assert breaker.state is BreakerState.HALF_OPEN


def test_stale_probe_outcome_while_closed_is_ignored() -> None:
    breaker = CircuitBreaker(config(min_calls=1))
    assert breaker.record(F, T0, probe=True) is None
    assert breaker.state is BreakerState.CLOSED
    assert breaker.window_counts(T0) == (0, 0)


def test_clock_stepping_back_is_treated_as_no_time_passing() -> None:
    breaker = opened(T0, probe_interval_ms=1_000)
    assert breaker.admit(T0 + 1_000) is Admission.PROBE
    breaker.record(S, T0 - 5_000, probe=True)  # wall clock stepped back
    (period,) = breaker.open_periods
    assert period == (T0, T0 + 1_000)
    assert breaker.snapshot(T0)["held_ms_total"] == 1_000


# -- held time ------------------------------------------------------------------------------------------------------


def held_breaker() -> CircuitBreaker:
    """Periods [T0+100, T0+200), [T0+500, T0+700) (with one re-open inside), and [T0+1000, open)."""
    breaker = CircuitBreaker(config(min_calls=1, failure_ratio=1.0, probe_interval_ms=50, probe_max_interval_ms=200))
    breaker.record(F, T0 + 100)
    breaker.admit(T0 + 200)
    breaker.record(S, T0 + 200, probe=True)
    breaker.record(F, T0 + 500)
    breaker.admit(T0 + 550)
    breaker.record(F, T0 + 550, probe=True)
    breaker.admit(T0 + 700)
    breaker.record(S, T0 + 700, probe=True)
    breaker.record(F, T0 + 1_000)
    assert breaker.open_periods == ((T0 + 100, T0 + 200), (T0 + 500, T0 + 700), (T0 + 1_000, None))
    return breaker


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        (0, 50, 0),  # before everything
        (0, 100, 0),  # ends where the first period starts
        (0, 150, 50),  # straddles the first start
        (120, 180, 60),  # inside a period
        (150, 600, 50 + 100),  # straddles the end of one and the start of the next
        (200, 500, 0),  # exactly the gap
        (0, 900, 100 + 200),  # covers both closed periods
        (800, 1_000, 0),  # ends where the open period starts
        (900, 1_500, 500),  # the unclosed period counts up to end
        (1_200, 1_300, 100),  # inside the unclosed period
        (0, 2_000, 100 + 200 + 1_000),  # everything
        (600, 600, 0),  # empty range
        (700, 600, 0),  # reversed range
    ],
)
def test_held_ms_overlap(start: int, end: int, expected: int) -> None:
    assert held_breaker().held_ms(T0 + start, T0 + end) == expected


def test_held_ms_total_in_snapshot() -> None:
    breaker = held_breaker()
    assert breaker.snapshot(T0 + 1_250)["held_ms_total"] == 100 + 200 + 250


def test_open_periods_history_is_bounded_but_total_is_not() -> None:
    breaker = CircuitBreaker(config(min_calls=1, failure_ratio=1.0, probe_interval_ms=10, probe_max_interval_ms=10))
    now = T0
    for _ in range(MAX_OPEN_PERIODS + 10):
        breaker.record(F, now)
        breaker.admit(now + 10)
        breaker.record(S, now + 10, probe=True)
        now += 100
    assert len(breaker.open_periods) == MAX_OPEN_PERIODS
    assert breaker.open_periods[0] == (T0 + 1_000, T0 + 1_010)
    snapshot = breaker.snapshot(now)
    assert snapshot["held_ms_total"] == 10 * (MAX_OPEN_PERIODS + 10)
    assert snapshot["opens_total"] == MAX_OPEN_PERIODS + 10


# -- snapshot -------------------------------------------------------------------------------------------------------


def test_snapshot_when_closed() -> None:
    breaker = CircuitBreaker(config(min_calls=10))
    feed(breaker, [S, S, F, IGN])
    snapshot = breaker.snapshot(T0 + 1)
    assert snapshot == {
        "state": "closed",
        "calls": 3,
        "failures": 1,
        "failure_ratio": 1 / 3,
        "opened_at_ms": None,
        "next_probe_at_ms": None,
        "probe_interval_ms": 10_000,
        "probe_in_flight": False,
        "opens_total": 0,
        "probes_total": 0,
        "held_ms_total": 0,
    }


def test_snapshot_with_no_calls_has_no_ratio() -> None:
    assert CircuitBreaker(config()).snapshot(T0)["failure_ratio"] is None


def test_snapshot_when_open_and_half_open_is_json() -> None:
    breaker = opened(T0)
    snapshot = breaker.snapshot(T0 + 4_000)
    assert snapshot["state"] == "open"
    assert snapshot["calls"] == 0
    assert snapshot["failure_ratio"] is None
    assert snapshot["opened_at_ms"] == T0
    assert snapshot["next_probe_at_ms"] == T0 + 10_000
    assert snapshot["opens_total"] == 1
    assert snapshot["held_ms_total"] == 4_000
    breaker.admit(T0 + 10_000)
    snapshot = breaker.snapshot(T0 + 10_000)
    assert snapshot["state"] == "half-open"
    assert snapshot["probe_in_flight"] is True
    assert snapshot["probes_total"] == 1
    assert json.loads(json.dumps(snapshot)) == snapshot


# -- config ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"window_ms": 0}, "REBOUND_BREAKER_WINDOW must be greater than zero"),
        ({"window_ms": 1.5}, "REBOUND_BREAKER_WINDOW"),
        ({"min_calls": 0}, "REBOUND_BREAKER_MIN_CALLS must be at least 1"),
        ({"min_calls": True}, "REBOUND_BREAKER_MIN_CALLS"),
        ({"failure_ratio": 0}, r"REBOUND_BREAKER_FAILURE_RATIO must be in \(0, 1\]"),
        ({"failure_ratio": 1.01}, "REBOUND_BREAKER_FAILURE_RATIO"),
        ({"failure_ratio": float("nan")}, "REBOUND_BREAKER_FAILURE_RATIO"),
        ({"probe_interval_ms": 0}, "REBOUND_BREAKER_PROBE_INTERVAL must be greater than zero"),
        ({"probe_max_interval_ms": 9_999}, "REBOUND_BREAKER_PROBE_MAX_INTERVAL must be at least"),
        ({"probe_multiplier": 0.5}, "REBOUND_BREAKER_PROBE_MULTIPLIER must be a finite number >= 1"),
        ({"probe_multiplier": float("inf")}, "REBOUND_BREAKER_PROBE_MULTIPLIER"),
        ({"probes_to_close": 0}, "REBOUND_BREAKER_PROBES_TO_CLOSE must be at least 1"),
    ],
)
def test_config_validation(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        config(**overrides)


def test_config_edges_accepted() -> None:
    edge = config(window_ms=1, min_calls=1, failure_ratio=1, probe_max_interval_ms=10_000, probe_multiplier=1)
    assert edge.bucket_ms == 1
    assert config().bucket_ms == 1_500


def test_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        config().window_ms = 5  # type: ignore[misc]


# -- properties -----------------------------------------------------------------------------------------------------

# Weighted so that runs regularly open, probe, re-open and close rather than idling in one state.
operations = st.sampled_from(["admit"] * 3 + ["probe_result"] * 2 + ["call_result"] * 3 + ["abandon"])
outcomes = st.sampled_from([S, F, F, IGN])
steps = st.lists(
    st.tuples(operations, outcomes, st.integers(min_value=0, max_value=600)),
    min_size=10,
    max_size=150,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=steps,
    min_calls=st.integers(min_value=1, max_value=5),
    ratio=st.sampled_from([0.25, 0.5, 1.0]),
    interval=st.integers(min_value=1, max_value=500),
    extra=st.integers(min_value=0, max_value=2_000),
    multiplier=st.sampled_from([1.0, 1.5, 2.0, 3.0]),
    probes_to_close=st.integers(min_value=1, max_value=3),
)
def test_invariants_hold_over_random_call_sequences(
    ops: list[tuple[str, CallOutcome, int]],
    min_calls: int,
    ratio: float,
    interval: int,
    extra: int,
    multiplier: float,
    probes_to_close: int,
) -> None:
    cfg = BreakerConfig(
        window_ms=2_000,
        min_calls=min_calls,
        failure_ratio=ratio,
        probe_interval_ms=interval,
        probe_max_interval_ms=interval + extra,
        probe_multiplier=multiplier,
        probes_to_close=probes_to_close,
    )
    breaker = CircuitBreaker(cfg)
    now = T0
    probe_held = False  # what the caller believes: it was handed a probe and has not answered it
    for op, outcome, step in ops:
        now += step
        before = (breaker.state, len(breaker.transitions))
        if op == "admit":
            admission = breaker.admit(now)
            if admission is Admission.PROBE:
                assert not probe_held, "a second probe was admitted while one was in flight"
                probe_held = True
            assert (admission is Admission.PASS) == (breaker.state is BreakerState.CLOSED)
        elif op == "probe_result":
            transition = breaker.record(outcome, now, probe=True)
            if not probe_held:  # stale: no probe was handed out
                assert transition is None
                assert (breaker.state, len(breaker.transitions)) == before
            probe_held = False
        elif op == "abandon":
            breaker.probe_abandoned(now)
            assert (breaker.state, len(breaker.transitions)) == before
            probe_held = False
        else:
            was_closed = breaker.state is BreakerState.CLOSED
            breaker.record(outcome, now)
            if not was_closed:  # a call passed before the breaker opened must change nothing
                assert (breaker.state, len(breaker.transitions)) == before
            elif breaker.state is BreakerState.CLOSED and outcome is not IGN:
                # Judged as each counted call lands (as resilience4j does); expiry alone can raise the ratio later.
                calls, failures = breaker.window_counts(now)
                if calls >= cfg.min_calls:
                    assert failures / calls < cfg.failure_ratio  # otherwise it would have opened

        snapshot = breaker.snapshot(now)
        assert snapshot["probe_in_flight"] == probe_held
        assert cfg.probe_interval_ms <= snapshot["probe_interval_ms"] <= cfg.probe_max_interval_ms
        periods = breaker.open_periods
        if breaker.state is BreakerState.CLOSED:
            assert snapshot["next_probe_at_ms"] is None
            assert all(closed_at is not None for _, closed_at in periods)
        else:
            assert snapshot["next_probe_at_ms"] >= snapshot["opened_at_ms"] + cfg.probe_interval_ms
            assert periods[-1] == (snapshot["opened_at_ms"], None)
            assert all(closed_at is not None for _, closed_at in periods[:-1])
        for opened_at, closed_at in periods:
            assert closed_at is None or closed_at > opened_at
        assert breaker.held_ms(T0, now) == snapshot["held_ms_total"]
        calls, failures = breaker.window_counts(now)
        assert 0 <= failures <= calls
        for earlier, later in zip(breaker.transitions, breaker.transitions[1:], strict=False):
            assert earlier.to_state == later.from_state
            assert earlier.at_ms <= later.at_ms
