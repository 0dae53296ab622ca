"""An event-driven simulation of a worker under adaptive concurrency, for tests/rebound/test_limiter_sim.py: a
backlog that never runs out, started through the limit; each call's latency and outcome come from a service model
given the calls in flight when it started, and each ended call is recorded in the limiter as ``agents/dispatcher.py``
records it. Simulated seconds cost nothing but the calls in them: the tests keep to a few hundred thousand calls."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from rebound.limiter import AdaptiveLimit, CallOutcome, LimitRange

Service = Callable[[int, float, random.Random], tuple[float, CallOutcome]]
"""(calls in flight at its start, itself included; seconds since the start; rng) -> (latency, outcome)."""


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Run:
    ends: list[tuple[float, CallOutcome]] = field(default_factory=list)
    """Each call's end (seconds since the start) and outcome."""
    limits: list[tuple[float, int]] = field(default_factory=list)
    """Each change of the limit: (seconds since the start, the new limit)."""

    def goodput(self, start: float, end: float) -> float:
        """Successful calls a second in [start, end)."""
        ok = sum(1 for at, outcome in self.ends if start <= at < end and outcome is CallOutcome.SUCCEEDED)
        return ok / (end - start)

    def drop_share(self, start: float, end: float) -> float:
        outcomes = [outcome for at, outcome in self.ends if start <= at < end]
        return sum(outcome is CallOutcome.DROPPED for outcome in outcomes) / max(1, len(outcomes))

    def seconds_at_most(self, start: float, end: float, value: int) -> float:
        """Seconds in [start, end) the limit was at most ``value``."""
        total = 0.0
        points = [(at, limit) for at, limit in self.limits if at < end]
        for (begin, limit), (until, _) in zip(points, [*points[1:], (end, 0)], strict=True):
            overlap = min(until, end) - max(begin, start)
            if overlap > 0 and limit <= value:
                total += overlap
        return total

    def reached(self, value: int, start: float, end: float) -> float | None:
        """The first time in [start, end) the limit was at least ``value``, if it was."""
        before = [limit for at, limit in self.limits if at <= start]
        if before and before[-1] >= value:
            return start
        return next((at for at, limit in self.limits if start <= at < end and limit >= value), None)


def simulate(service: Service, seconds: float, *, minimum: int = 2, maximum: int = 256, initial: int = 16,
             seed: int = 1) -> Run:  # fmt: skip
    rng = random.Random(seed)
    clock = Clock()
    limiter = AdaptiveLimit(LimitRange(minimum, maximum, initial), clock=clock, jitter=rng.random)
    run = Run(limits=[(0.0, limiter.limit)])
    pending: list[tuple[float, int, float, int, CallOutcome]] = []  # end, order, start, in flight at start, outcome
    in_flight = 0
    order = 0

    def fill() -> None:
        nonlocal in_flight, order
        while in_flight < limiter.limit:
            in_flight += 1
            latency, outcome = service(in_flight, clock.now, rng)
            order += 1
            heapq.heappush(pending, (clock.now + latency, order, clock.now, in_flight, outcome))

    fill()
    while pending and pending[0][0] <= seconds:
        end, _, started, at_start, outcome = heapq.heappop(pending)
        clock.now = end
        in_flight -= 1
        before = limiter.limit
        limiter.record(started_at=started, latency_s=end - started, in_flight=at_start, outcome=outcome)
        run.ends.append((end, outcome))
        if limiter.limit != before:
            run.limits.append((end, limiter.limit))
        fill()
    return run


def queueing(base_s: float, capacity: Callable[[float], int] | int, jitter: float = 0.05) -> Service:
    """A service that runs ``capacity`` calls at once (a number, or one by time) and queues the rest: latency grows
    as in flight / capacity past it."""

    def service(in_flight: int, now: float, rng: random.Random) -> tuple[float, CallOutcome]:
        slots = capacity(now) if callable(capacity) else capacity
        latency = base_s * max(1.0, in_flight / slots) * (1 + jitter * (rng.random() - 0.5))
        return latency, CallOutcome.SUCCEEDED

    return service


def simulate_shared(workers: int, base_s: float, capacity: int, seconds: float, *, seed: int = 1) -> list[float]:
    """``workers`` limiters (one a worker, each with its own backlog) in front of one service that runs ``capacity``
    calls at once and queues the rest, all of theirs together. Returns the latency of each call after the first half
    of the run."""
    rng = random.Random(seed)
    clock = Clock()
    limiters = [AdaptiveLimit(LimitRange(2, 256, 16), clock=clock, jitter=rng.random) for _ in range(workers)]
    in_flight = [0] * workers
    pending: list[tuple[float, int, int, float, int]] = []  # end, order, worker, start, its in flight at start
    order = 0
    late: list[float] = []

    def fill(worker: int) -> None:
        nonlocal order
        while in_flight[worker] < limiters[worker].limit:
            in_flight[worker] += 1
            latency = base_s * max(1.0, sum(in_flight) / capacity) * (1 + 0.05 * (rng.random() - 0.5))
            order += 1
            heapq.heappush(pending, (clock.now + latency, order, worker, clock.now, in_flight[worker]))

    for worker in range(workers):
        fill(worker)
    while pending and pending[0][0] <= seconds:
        end, _, worker, started, at_start = heapq.heappop(pending)
        clock.now = end
        in_flight[worker] -= 1
        limiters[worker].record(
            started_at=started, latency_s=end - started, in_flight=at_start, outcome=CallOutcome.SUCCEEDED
        )
        if end >= seconds / 2:
            late.append(end - started)
        fill(worker)
    return late
