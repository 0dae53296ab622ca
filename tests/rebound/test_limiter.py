"""Adaptive concurrency's limit (``REBOUND_CONCURRENCY=auto``): the rule step by step on a clock the test moves, and
its properties over any sequence of samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rebound.limiter import (
    DROP_FACTOR,
    HOLD_WINDOWS,
    PROBE_CALLS,
    WINDOW_MIN_SAMPLES,
    AdaptiveLimit,
    CallOutcome,
    LimitRange,
    outcome_of,
)


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def settled(limit: AdaptiveLimit, clock: Clock, latency: float = 0.01) -> None:
    """Ends the first probe with calls at ``latency``, at the minimum concurrency."""
    assert limit.probing
    for _ in range(PROBE_CALLS):
        started = clock.now
        clock.now += latency
        limit.record(started_at=started, latency_s=latency, in_flight=1, outcome=CallOutcome.SUCCEEDED)
    assert not limit.probing


def window(
    limit: AdaptiveLimit,
    clock: Clock,
    latency: float,
    *,
    in_flight: int | None = None,
    drops: int = 0,
    calls: int = WINDOW_MIN_SAMPLES,
) -> int:
    """One window of calls started after the last change, each at ``latency``, ending evenly over the window (the
    drops among them spread too); returns the limit after it."""
    start = clock.now
    step = (limit.window_s + latency) / calls
    load = limit.limit if in_flight is None else in_flight
    every = calls // drops if drops else 0
    for index in range(calls):
        clock.now += step
        dropped = bool(every) and index % every == 0 and index // every < drops
        outcome = CallOutcome.DROPPED if dropped else CallOutcome.SUCCEEDED
        limit.record(started_at=start, latency_s=latency, in_flight=load, outcome=outcome)
    return limit.limit


def make(minimum: int = 2, maximum: int = 256, initial: int = 16, clock: Clock | None = None) -> AdaptiveLimit:
    return AdaptiveLimit(LimitRange(minimum, maximum, initial), clock=clock or Clock(), jitter=lambda: 0.5)


def test_it_starts_by_probing_the_baseline_at_the_minimum_then_takes_the_initial_limit() -> None:
    clock = Clock()
    limit = make(clock=clock)
    assert limit.limit == 2 and limit.probing
    settled(limit, clock, latency=0.02)
    assert limit.limit == 16
    assert limit.baseline_s == pytest.approx(0.02)


def test_latency_near_the_baseline_grows_the_limit_when_it_is_used() -> None:
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    assert window(limit, clock, 0.0105) > 16


def test_at_a_large_limit_the_queue_estimate_holds_it_below_the_latency_bound() -> None:
    """1.08 x the baseline at 128: within GROW_RATIO, but 9.5 calls queue (128 x (1 - 1 / 1.08)), more than
    3 x log10(128) = 6.3: it holds. At 1.03 x (3.7 queued) it grows."""
    clock = Clock()
    limit = make(initial=128, clock=clock)
    settled(limit, clock)
    assert window(limit, clock, 0.0108) == 128
    assert window(limit, clock, 0.0103) > 128


def test_an_unused_limit_does_not_grow() -> None:
    """Fewer than half the limit in flight says nothing about more: growing then would let a burst in unchecked."""
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    assert window(limit, clock, 0.01, in_flight=7) == 16


def test_queueing_latency_cuts_the_limit_to_what_ran_without_queueing() -> None:
    """Twice the baseline at 16 in flight: about 8 run at once and 8 wait (Little's law), so the limit becomes 8."""
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    assert window(limit, clock, 0.02) == 8


def test_a_cut_is_at_most_a_half() -> None:
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    assert window(limit, clock, 0.1) == 8


def test_latency_between_the_bounds_holds_the_limit() -> None:
    """1.15 x the baseline at 16: more than GROW_RATIO, less than HOLD_RATIO."""
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    assert window(limit, clock, 0.0115) == 16


def test_a_limit_held_for_long_is_tried_a_step_higher_and_a_latency_that_does_not_follow_is_the_baseline() -> None:
    """1.15 x the baseline at 16 holds; after HOLD_WINDOWS such windows the limit is tried at 20, and the latency
    there is the same: it is the service's, the baseline is measured again and the limit grows."""
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    for _ in range(HOLD_WINDOWS):
        assert window(limit, clock, 0.0115) == 16
    assert window(limit, clock, 0.0115) == 20
    assert window(limit, clock, 0.0115) > 20
    assert limit.baseline_s == pytest.approx(0.0115)


def test_a_limit_tried_higher_into_a_queue_is_cut_back() -> None:
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    for _ in range(HOLD_WINDOWS + 1):
        window(limit, clock, 0.0115)
    assert limit.limit == 20
    assert window(limit, clock, 0.0115 * 20 / 16 * 1.2) < 16  # the latency followed the limit, and more
    assert limit.baseline_s == pytest.approx(0.01)


def test_a_window_of_drops_only_as_common_as_at_lower_limits_holds() -> None:
    """60 % of the calls dropped at the lowest limits (a service throttling most tenants): a window that ends on
    drops alone is no worse than that, and has no latency to judge."""
    clock = Clock()
    limit = make(minimum=2, initial=2, clock=clock)
    settled(limit, clock)
    for _ in range(5):
        window(limit, clock, 0.01, calls=100, drops=60, in_flight=1)
    limit._set(16, clock.now)  # as if it had grown: a new window at 16
    assert window(limit, clock, 0.01, calls=1, drops=1) == 16


def test_drops_cut_the_limit_once_per_window() -> None:
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    assert window(limit, clock, 0.01, drops=5) == int(16 * DROP_FACTOR)


def test_a_drop_ends_a_window_without_the_minimum_of_samples() -> None:
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    assert window(limit, clock, 0.01, drops=1, calls=1) == int(16 * DROP_FACTOR)


def test_samples_of_calls_started_before_the_last_change_are_ignored() -> None:
    """They ran under the old limit: a timeout of a call started before a cut must not cut again (as TCP reduces once
    per window of data, not once per loss)."""
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    before = clock.now - 0.001
    assert window(limit, clock, 0.01, drops=1, calls=1) == 12
    clock.now += limit.window_s
    limit.record(started_at=before, latency_s=30.0, in_flight=12, outcome=CallOutcome.DROPPED)
    assert limit.limit == 12


def test_ignored_calls_count_for_nothing() -> None:
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    start = clock.now
    clock.now += 10
    for _ in range(50):
        limit.record(started_at=start, latency_s=0.0001, in_flight=16, outcome=CallOutcome.IGNORED)
    assert limit.limit == 16 and limit.baseline_s == pytest.approx(0.01)


def test_a_latency_that_does_not_move_with_the_limit_is_measured_again_as_the_baseline() -> None:
    """The service's own latency doubles for good: the first window looks queued and halves the limit, but the next,
    at half the limit, is just as slow: no queue explains that (Little's law), so it is the new baseline, and the
    limit grows again without waiting for a probe."""
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    assert window(limit, clock, 0.02) == 8
    assert window(limit, clock, 0.02) > 8
    assert limit.baseline_s == pytest.approx(0.02) and not limit.probing


def test_a_latency_that_falls_with_the_limit_keeps_the_baseline() -> None:
    """Queueing: half the limit, half the latency. The baseline stays, and the limit is cut again."""
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    assert window(limit, clock, 0.04) == 8
    assert window(limit, clock, 0.02) == 4
    assert limit.baseline_s == pytest.approx(0.01)


def test_a_window_at_the_minimum_is_a_probe() -> None:
    """At the minimum concurrency nothing queues here: a window there measures the baseline, lower or higher."""
    clock = Clock()
    limit = make(minimum=2, initial=2, clock=clock)
    settled(limit, clock)
    assert window(limit, clock, 0.03, in_flight=2) > 2  # 3 x the probe's latency, and yet it grows
    assert limit.baseline_s == pytest.approx(0.03)


def test_drops_as_common_at_lower_limits_do_not_cut() -> None:
    """3 % of the calls dropped at a limit of 4 and below: 3 % at 16 is not this worker's load, 8 % is."""
    clock = Clock()
    limit = make(minimum=2, initial=4, clock=clock)
    settled(limit, clock)
    for _ in range(3):
        window(limit, clock, 0.01, calls=100, drops=3, in_flight=1)  # unused: holds, and measures the drops
    assert limit.limit == 4 and limit.low_drop_share(16) == pytest.approx(0.03, rel=0.1)
    limit.limit = 16  # as if it had grown
    assert window(limit, clock, 0.01, calls=100, drops=3) >= 16  # not cut (and used: it may grow)
    grown = limit.limit
    assert window(limit, clock, 0.01, calls=100, drops=8) == int(grown * DROP_FACTOR)


def test_a_probe_gives_back_the_limit_it_interrupted() -> None:
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    for _ in range(5):
        window(limit, clock, 0.01)
    grown = limit.limit
    clock.now += limit.probe_interval_s
    window(limit, clock, 0.01, in_flight=1)  # unused: holds, and the probe is due
    assert limit.probing and limit.limit == 2
    settled(limit, clock)
    assert limit.limit == grown


def test_a_probe_counts_only_calls_run_at_the_minimum() -> None:
    clock = Clock()
    limit = make(clock=clock)
    for _ in range(PROBE_CALLS * 3):
        limit.record(started_at=clock.now, latency_s=0.5, in_flight=3, outcome=CallOutcome.SUCCEEDED)
    assert limit.probing


def test_a_drop_during_a_probe_lowers_the_limit_it_gives_back() -> None:
    clock = Clock()
    limit = make(clock=clock)
    limit.record(started_at=clock.now, latency_s=1.0, in_flight=2, outcome=CallOutcome.DROPPED)
    settled(limit, clock)
    assert limit.limit == int(16 * DROP_FACTOR)


def test_the_range_is_checked() -> None:
    with pytest.raises(ValueError):
        LimitRange(0, 10, 5)
    with pytest.raises(ValueError):
        LimitRange(5, 4, 5)
    with pytest.raises(ValueError):
        LimitRange(2, 10, 11)


# -- properties --------------------------------------------------------------------------------------------------

SAMPLE = st.tuples(
    st.floats(min_value=0.0, max_value=5.0),  # time passing before the call ends
    st.floats(min_value=0.0, max_value=3.0),  # how long before its end it started
    st.integers(min_value=1, max_value=300),  # in flight when it started
    st.sampled_from(list(CallOutcome)),
)
RANGES = st.integers(min_value=1, max_value=50).flatmap(
    lambda low: st.integers(min_value=low, max_value=400).flatmap(
        lambda high: st.tuples(st.just(low), st.just(high), st.integers(min_value=low, max_value=high))
    )
)


@settings(max_examples=300, deadline=None)
@given(RANGES, st.lists(SAMPLE, max_size=400))
def test_the_limit_stays_in_its_range_and_a_drop_never_raises_it(
    bounds: tuple[int, int, int], samples: list[tuple[float, float, int, CallOutcome]]
) -> None:
    clock = Clock()
    limit = make(*bounds, clock=clock)
    for advance, age, in_flight, outcome in samples:
        clock.now += advance
        before = limit.limit
        latency = max(age, 1e-6)
        limit.record(started_at=clock.now - latency, latency_s=latency, in_flight=in_flight, outcome=outcome)
        assert bounds[0] <= limit.limit <= bounds[1]
        if outcome is CallOutcome.DROPPED:
            assert limit.limit <= before


def simulate(limit: AdaptiveLimit, clock: Clock, latency_at: Callable[[int], float], steps: int) -> list[int]:
    """Saturated load: ``limit.limit`` calls in flight, each taking ``latency_at(limit)``. Each step moves the clock
    by a latency (or a third of a window, if longer) and records a few of the calls that ended: a sample of them, as
    many calls end in a window. Returns the limit after each step."""
    seen = []
    for _ in range(steps):
        current = limit.limit
        latency = latency_at(current)
        clock.now += max(latency, limit.window_s / 3)
        for _ in range(min(current, 10)):
            limit.record(
                started_at=clock.now - latency, latency_s=latency, in_flight=current, outcome=CallOutcome.SUCCEEDED
            )
        seen.append(limit.limit)
    return seen


@settings(max_examples=40, deadline=None)
@given(
    st.floats(min_value=0.001, max_value=0.5),
    st.integers(min_value=1, max_value=8),
    st.integers(min_value=16, max_value=512),
)
def test_a_steady_baseline_latency_grows_the_limit_to_its_maximum(base: float, minimum: int, maximum: int) -> None:
    clock = Clock()
    limit = make(minimum, maximum, minimum, clock=clock)
    seen = simulate(limit, clock, lambda _: base, steps=600)
    assert max(seen) == maximum
    assert seen[-1] == maximum or limit.probing


@settings(max_examples=40, deadline=None)
@given(st.floats(min_value=0.001, max_value=0.2), st.integers(min_value=2, max_value=64))
def test_latency_that_grows_with_concurrency_brings_the_limit_near_the_capacity(base: float, capacity: int) -> None:
    """A service that runs ``capacity`` calls at once and queues the rest: latency grows past it, and the limit
    comes down from far above to near the capacity (and stays there)."""
    clock = Clock()
    limit = make(1, 1024, 1024, clock=clock)
    seen = simulate(limit, clock, lambda n: base * max(1.0, n / capacity), steps=600)
    tail = [value for value in seen[len(seen) // 2 :] if value > 1]  # probes aside
    assert tail and max(tail) <= 2 * capacity + 2
    assert min(tail) >= capacity // 2


@settings(max_examples=100, deadline=None)
@given(st.floats(min_value=0.001, max_value=0.5), st.floats(min_value=1.3, max_value=10.0))
def test_rising_latency_shrinks_the_limit(base: float, factor: float) -> None:
    clock = Clock()
    limit = make(1, 512, 64, clock=clock)
    settled(limit, clock, latency=base)
    before = limit.limit
    after = window(limit, clock, base * factor)
    assert after < before


def test_timeouts_and_overloads_are_drops_other_failures_are_not_samples() -> None:
    from rebound.errors import HandlerTimeout, OverloadError, PermanentError, RetryableError
    from rebound.http_errors import HttpConnectionError, HttpOverloaded, HttpTimeout

    assert outcome_of(None) is CallOutcome.SUCCEEDED
    for drop in (
        HandlerTimeout("ran past REBOUND_HANDLER_TIMEOUT"),
        OverloadError("queue full"),
        HttpOverloaded("HTTP 503", status=503),
        HttpTimeout("no answer"),
        TimeoutError("the handler's own"),
    ):
        assert outcome_of(drop) is CallOutcome.DROPPED, drop
    for other in (RetryableError("not yet"), PermanentError("bad"), HttpConnectionError("refused"), KeyError("x")):
        assert outcome_of(other) is CallOutcome.IGNORED, other


def test_a_few_drops_among_many_calls_do_not_cut_the_limit_but_stop_it_growing() -> None:
    """A service with a thin tail of timeouts (here 0.5 %) would otherwise be pinned to the minimum: at thousands of
    calls a second nearly every window holds a drop."""
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    assert window(limit, clock, 0.01, drops=1, calls=200) == 16
    assert window(limit, clock, 0.02, drops=1, calls=200) == 8  # queueing still cuts


def test_the_limit_in_use_is_the_work_holding_a_slot_not_only_the_calls_in_flight() -> None:
    """The limit bounds dispatched works, and a work holds its slot after its call (routing a failure, awaiting the
    store's confirmation): few calls in flight but every slot taken is a limit in use, and it grows."""
    clock = Clock()
    limit = make(clock=clock)
    settled(limit, clock)
    start = clock.now
    for _ in range(WINDOW_MIN_SAMPLES):
        clock.now += limit.window_s / WINDOW_MIN_SAMPLES + 0.01
        limit.record(started_at=start, latency_s=0.01, in_flight=3, running=16, outcome=CallOutcome.SUCCEEDED)
    assert limit.limit > 16
