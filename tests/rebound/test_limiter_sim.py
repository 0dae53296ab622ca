"""The adaptive limit over simulated minutes of saturated load (tests/rebound/limiter_sim.py): it finds a service's
capacity, follows it when it changes, and is not pinned to the minimum by what is not queueing (a service that became
slower, a burst of fast calls, cache hits, overloads that do not depend on the load). Services are mostly 20 to 50 ms
so that a simulated minute stays at a few tens of thousands of calls."""

from __future__ import annotations

import random
import statistics

import pytest

from rebound.limiter import CallOutcome
from tests.rebound.limiter_sim import Service, queueing, simulate, simulate_shared


def test_a_service_of_capacity_32_is_used_to_its_capacity() -> None:
    """The reviewer's reference figure: 32 calls at once of 10 ms, 3,200 a second."""
    run = simulate(queueing(0.010, 32), 40)
    assert run.goodput(15, 40) >= 0.9 * 3200


def test_a_capacity_drop_is_followed_within_10_s_with_few_timeouts_and_back() -> None:
    """32 calls at once of 20 ms, 8 for 30 s, then 32 again; a call later than 200 ms is a handler timeout (a drop)."""

    def service(in_flight: int, now: float, rng: random.Random) -> tuple[float, CallOutcome]:
        latency, _ = queueing(0.020, 8 if 30 <= now < 60 else 32)(in_flight, now, rng)
        return (0.2, CallOutcome.DROPPED) if latency > 0.2 else (latency, CallOutcome.SUCCEEDED)

    run = simulate(service, 90, seed=6)
    assert run.goodput(40, 60) >= 0.9 * 400
    assert run.drop_share(30, 60) <= 0.01
    assert run.goodput(70, 90) >= 0.9 * 1600
    recovered = run.reached(28, 60, 90)
    assert recovered is not None and recovered <= 70


def test_latency_somewhat_higher_above_the_probe_concurrency_does_not_stop_growth() -> None:
    """Calls run 15 % slower once more than 2 run at once (a pool warming up, a busier event loop), with room for 128
    at once: between 1.1 and 1.25 x the baseline probed at 2, which no queue explains."""

    def service(in_flight: int, now: float, rng: random.Random) -> tuple[float, CallOutcome]:
        step = 1.0 if in_flight <= 2 else 1.15
        return 0.050 * step * max(1.0, in_flight / 128) * (1 + 0.05 * (rng.random() - 0.5)), CallOutcome.SUCCEEDED

    capacity = 128 / (0.050 * 1.15)
    run = simulate(service, 60)
    assert run.goodput(30, 60) >= 0.75 * capacity


def test_one_second_of_fast_calls_does_not_pin_the_limit_to_the_minimum() -> None:
    """A second of calls 20 x faster (messages the handler skips): its median is no baseline for the calls after."""

    def service(in_flight: int, now: float, rng: random.Random) -> tuple[float, CallOutcome]:
        base = 0.0025 if 5 <= now < 6 else 0.050
        return base * max(1.0, in_flight / 64) * (1 + 0.05 * (rng.random() - 0.5)), CallOutcome.SUCCEEDED

    run = simulate(service, 40, seed=2)
    assert run.seconds_at_most(8, 40, 2) < 3
    assert run.goodput(10, 40) >= 0.75 * 64 / 0.050


def test_a_steady_share_of_cache_hits_does_not_hold_the_limit_at_the_minimum() -> None:
    """45 % of calls take 5 ms, the rest 50 ms: a probe of a few calls may see mostly hits."""

    def service(in_flight: int, now: float, rng: random.Random) -> tuple[float, CallOutcome]:
        base = 0.005 if rng.random() < 0.45 else 0.050
        return base * max(1.0, in_flight / 64), CallOutcome.SUCCEEDED

    for seed in (1, 2, 3):
        run = simulate(service, 60, seed=seed)
        assert run.seconds_at_most(10, 60, 2) < 5, seed


def test_overloads_that_do_not_depend_on_the_load_do_not_pin_the_limit() -> None:
    """2 % of calls get a 429 whatever the load (a tenant over its own quota): as many at the minimum as at 128."""

    def service(in_flight: int, now: float, rng: random.Random) -> tuple[float, CallOutcome]:
        if rng.random() < 0.02:
            return 0.010, CallOutcome.DROPPED
        return 0.050 * max(1.0, in_flight / 128), CallOutcome.SUCCEEDED

    run = simulate(service, 60, seed=4)
    assert run.goodput(30, 60) >= 0.75 * 128 / 0.050


def test_overloads_that_grow_with_the_load_still_cut() -> None:
    """Beyond 32 at once the service answers 429 to the excess (its queue is bounded): the limit stays near 32."""

    def service(in_flight: int, now: float, rng: random.Random) -> tuple[float, CallOutcome]:
        if in_flight > 32 and rng.random() < 1 - 32 / in_flight:
            return 0.005, CallOutcome.DROPPED
        return 0.050 * (1 + 0.05 * (rng.random() - 0.5)), CallOutcome.SUCCEEDED

    run = simulate(service, 60, seed=5)
    assert run.drop_share(20, 60) <= 0.05
    assert run.goodput(20, 60) >= 0.8 * 32 / 0.050


def slower_for_good(base_s: float, at_s: float, capacity: int = 32, factor: float = 2.0) -> Service:
    def service(in_flight: int, now: float, rng: random.Random) -> tuple[float, CallOutcome]:
        latency = base_s * (factor if now >= at_s else 1) * max(1.0, in_flight / capacity)
        return latency * (1 + 0.05 * (rng.random() - 0.5)), CallOutcome.SUCCEEDED

    return service


def test_a_service_that_became_slower_for_good_is_measured_again_within_seconds() -> None:
    """50 ms calls take 100 ms from 20 s on, still 32 at once without queueing: it looks like queueing at first."""
    run = simulate(slower_for_good(0.050, 20), 60, seed=7)
    assert run.seconds_at_most(20, 60, 2) < 5
    assert run.goodput(30, 60) >= 0.75 * 32 / 0.100


def test_a_service_half_as_slow_again_is_not_held_below_its_capacity() -> None:
    """50 ms calls take 75 ms from 20 s on: at the lower limit the latency is 1.5 x the old baseline, which the
    Vegas thresholds read as calls queueing, too few to cut and too many to grow: a hold. A limit held for long is
    tried one step higher; the latency does not follow it, and the baseline is measured again."""
    run = simulate(slower_for_good(0.050, 20, factor=1.5), 60, seed=9)
    assert run.goodput(40, 60) >= 0.9 * 32 / 0.075


def test_a_slow_handler_that_became_slower_is_not_starved_until_the_next_timed_probe() -> None:
    """1 s calls take 2 s from 100 s on: the timed probe is 8 to 10 minutes away."""
    run = simulate(slower_for_good(1.0, 100), 700, seed=8)
    assert run.seconds_at_most(100, 700, 2) < 60
    assert run.goodput(200, 700) >= 0.75 * 32 / 2.0


@pytest.mark.parametrize("workers", [4, 8])
def test_workers_sharing_a_service_keep_its_queue_short(workers: int) -> None:
    """Each worker's queue estimate counts only its own calls; the latency bounds keep the shared queue short (the
    reviewer's figure: 4 workers, 32 calls at once, median latency within 2 x the service's)."""
    late = simulate_shared(workers, 0.020, 32, 120)
    assert len(late) / 60 >= 0.9 * 32 / 0.020
    assert statistics.median(late) <= 2 * 0.020
