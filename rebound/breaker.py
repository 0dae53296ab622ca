"""A per-worker circuit breaker: stop feeding the handler while its dependency looks down, and probe until it is back.

Retrying a message whose dependency is down only burns its retry budget: every tier it passes through fails the same
way and it ends up dead-lettered for an outage that was never its fault. The breaker watches the failure ratio of
recent handler calls and, once too many fail, holds consumption; one probe call at a time, spaced by a growing
interval, decides when to let traffic through again. Modelled on resilience4j's time-based breaker, kept small.

The class is pure on purpose: no asyncio, no I/O and no clock of its own. Every method is given ``now_ms``, so the
worker decides what time it is and the tests can drive every transition without sleeping.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from rebound.errors import ConfigurationError
from rebound.policy import format_duration
from rebound.routing import Classification

BUCKETS_PER_WINDOW = 20
"""How finely the window is cut: failures age out in steps of ``window / 20``, with memory fixed per worker."""
MAX_OPEN_PERIODS = 256
MAX_TRANSITIONS = 1000


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class CallOutcome(StrEnum):
    SUCCESS = "success"
    FAILURE = "failure"
    """A failure classified retryable (Rebound's handler timeout is, by default): the dependency looks down."""
    IGNORED = "ignored"
    """A failure classified permanent or undecodable (bad data): it says nothing about the dependency, so it is not
    counted."""


def call_outcome(classification: Classification | None) -> CallOutcome:
    """What a finished call tells the breaker: ``None`` for a success, else how routing classified its failure.

    The breaker follows the routing's classification and nothing else, so ``REBOUND_PERMANENT_ERRORS`` and
    ``REBOUND_RETRYABLE_ERRORS`` mean the same to both: a failure that is not retried says nothing about the
    dependency, and one that is retried counts against it.
    """
    if classification is None:
        return CallOutcome.SUCCESS
    if classification is Classification.RETRYABLE:
        return CallOutcome.FAILURE
    return CallOutcome.IGNORED


class Admission(StrEnum):
    PASS = "pass"
    PROBE = "probe"
    WAIT = "wait"


def _require_int(value: object, *, minimum: int, variable: str, rule: str) -> None:
    # ``bool`` is an ``int``; a ``True`` here is a wiring mistake, not a count of one.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigurationError(f"{variable} must be {rule}, got {value!r}")


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    window_ms: int
    min_calls: int
    failure_ratio: float
    probe_interval_ms: int
    probe_max_interval_ms: int
    probe_multiplier: float = 2.0
    probes_to_close: int = 1

    def __post_init__(self) -> None:
        """Refuse a bad value at start-up, naming its variable, rather than as a breaker that never (or always) opens."""
        _require_int(self.window_ms, minimum=1, variable="REBOUND_BREAKER_WINDOW", rule="greater than zero")
        _require_int(self.min_calls, minimum=1, variable="REBOUND_BREAKER_MIN_CALLS", rule="at least 1")
        ratio = self.failure_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
            raise ConfigurationError(f"REBOUND_BREAKER_FAILURE_RATIO must be in (0, 1], got {ratio!r}")
        _require_int(
            self.probe_interval_ms, minimum=1, variable="REBOUND_BREAKER_PROBE_INTERVAL", rule="greater than zero"
        )
        _require_int(
            self.probe_max_interval_ms,
            minimum=self.probe_interval_ms,
            variable="REBOUND_BREAKER_PROBE_MAX_INTERVAL",
            rule=f"at least REBOUND_BREAKER_PROBE_INTERVAL ({self.probe_interval_ms} ms)",
        )
        multiplier = self.probe_multiplier
        if (
            isinstance(multiplier, bool)
            or not isinstance(multiplier, int | float)
            or not math.isfinite(multiplier)
            or multiplier < 1
        ):
            raise ConfigurationError(
                f"REBOUND_BREAKER_PROBE_MULTIPLIER must be a finite number >= 1, got {multiplier!r}"
            )
        _require_int(self.probes_to_close, minimum=1, variable="REBOUND_BREAKER_PROBES_TO_CLOSE", rule="at least 1")

    @property
    def bucket_ms(self) -> int:
        return max(1, self.window_ms // BUCKETS_PER_WINDOW)


@dataclass(frozen=True, slots=True)
class Transition:
    at_ms: int
    from_state: BreakerState
    to_state: BreakerState
    reason: str


@dataclass(slots=True)
class _Bucket:
    index: int
    calls: int = 0
    failures: int = 0


class CircuitBreaker:
    """One worker's breaker. Not thread-safe: it lives on the worker's event loop, consulted before each call."""

    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        self._state = BreakerState.CLOSED
        self._bucket_ms = config.bucket_ms
        # A window of n buckets keeps the bucket of ``now`` and the n - 1 before it.
        self._window_buckets = -(-config.window_ms // self._bucket_ms)
        self._buckets: deque[_Bucket] = deque()
        self._calls = 0
        self._failures = 0
        self._latest_ms: int | None = None
        self._opened_at_ms: int | None = None
        self._next_probe_at_ms: int | None = None
        self._probe_interval_ms = config.probe_interval_ms
        self._probe_in_flight = False
        self._probe_successes = 0
        self._opens_total = 0
        self._probes_total = 0
        self._held_closed_ms = 0  # every closed period, including those the bounded history has forgotten
        self._open_periods: deque[tuple[int, int | None]] = deque(maxlen=MAX_OPEN_PERIODS)
        self._transitions: deque[Transition] = deque(maxlen=MAX_TRANSITIONS)

    # -- queries ---------------------------------------------------------------------------------------------------

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def is_open(self) -> bool:
        """Half-open counts as open: consumption is still held, only the probe gets through."""
        return self._state is not BreakerState.CLOSED

    @property
    def open_periods(self) -> tuple[tuple[int, int | None], ...]:
        return tuple(self._open_periods)

    @property
    def transitions(self) -> tuple[Transition, ...]:
        return tuple(self._transitions)

    @property
    def last_transition(self) -> Transition | None:
        return self._transitions[-1] if self._transitions else None

    def window_counts(self, now_ms: int) -> tuple[int, int]:
        """``(calls, failures)`` still inside the window at ``now_ms``."""
        self._expire(self._tick(now_ms))
        return self._calls, self._failures

    def held_ms(self, start_ms: int, end_ms: int) -> int:
        """Time within ``[start_ms, end_ms]`` consumption was held, so a parked message is not charged for it.

        Only the remembered periods count; one older than the last ``MAX_OPEN_PERIODS`` is forgotten.
        """
        if end_ms <= start_ms:
            return 0
        total = 0
        for opened_at, closed_at in self._open_periods:
            until = end_ms if closed_at is None else min(closed_at, end_ms)
            total += max(0, until - max(opened_at, start_ms))
        return total

    def snapshot(self, now_ms: int) -> dict[str, Any]:
        """Everything an operator needs to see why the worker is (not) consuming, as plain JSON values."""
        now = self._tick(now_ms)
        calls, failures = self.window_counts(now)
        held_total = self._held_closed_ms
        if self._state is not BreakerState.CLOSED and self._opened_at_ms is not None:
            held_total += max(0, now - self._opened_at_ms)
        return {
            "state": str(self._state),
            "calls": calls,
            "failures": failures,
            "failure_ratio": failures / calls if calls else None,
            "opened_at_ms": self._opened_at_ms,
            "next_probe_at_ms": self._next_probe_at_ms,
            "probe_interval_ms": self._probe_interval_ms,
            "probe_in_flight": self._probe_in_flight,
            "opens_total": self._opens_total,
            "probes_total": self._probes_total,
            "held_ms_total": held_total,
        }

    # -- the call protocol -----------------------------------------------------------------------------------------

    def admit(self, now_ms: int) -> Admission:
        """Whether a call may start now; a ``probe`` must be answered by ``record(..., probe=True)`` or abandoned."""
        now = self._tick(now_ms)
        if self._state is BreakerState.CLOSED:
            return Admission.PASS
        if self._state is BreakerState.OPEN:
            assert self._next_probe_at_ms is not None
            if now < self._next_probe_at_ms:
                return Admission.WAIT
            self._move(
                now,
                BreakerState.HALF_OPEN,
                f"probe due after {format_duration(self._probe_interval_ms)} open",
            )
        if self._probe_in_flight:
            return Admission.WAIT  # one probe at a time: a dependency coming back should not meet a stampede
        self._probe_in_flight = True
        self._probes_total += 1
        return Admission.PROBE

    def record(self, outcome: CallOutcome, now_ms: int, *, probe: bool = False) -> Transition | None:
        """Count a finished call; returns the transition it caused, if any.

        Outcomes that do not belong to the current state are dropped: a call passed before the breaker opened says
        nothing about whether the dependency is back, and a probe outcome outside half-open is from an earlier round.
        """
        now = self._tick(now_ms)
        if probe:
            if self._state is BreakerState.HALF_OPEN and self._probe_in_flight:
                return self._record_probe(outcome, now)
            return None
        if self._state is not BreakerState.CLOSED or outcome is CallOutcome.IGNORED:
            return None
        return self._record_closed(outcome is CallOutcome.FAILURE, now)

    def probe_abandoned(self, now_ms: int) -> None:
        """A cancelled probe (rebalance, shutdown) proved nothing; free its slot so the next admit probes at once."""
        self._tick(now_ms)
        if self._state is BreakerState.HALF_OPEN:
            self._probe_in_flight = False

    # -- internals -------------------------------------------------------------------------------------------------

    def _tick(self, now_ms: int) -> int:
        # A wall clock can step back; treating that as no time passing keeps periods and intervals non-negative.
        if self._latest_ms is None or now_ms > self._latest_ms:
            self._latest_ms = now_ms
        return self._latest_ms

    def _expire(self, now: int) -> None:
        oldest_kept = now // self._bucket_ms - self._window_buckets + 1
        while self._buckets and self._buckets[0].index < oldest_kept:
            gone = self._buckets.popleft()
            self._calls -= gone.calls
            self._failures -= gone.failures

    def _clear_window(self) -> None:
        self._buckets.clear()
        self._calls = 0
        self._failures = 0

    def _record_closed(self, failed: bool, now: int) -> Transition | None:
        self._expire(now)
        index = now // self._bucket_ms
        if not self._buckets or self._buckets[-1].index != index:
            self._buckets.append(_Bucket(index))
        bucket = self._buckets[-1]
        bucket.calls += 1
        self._calls += 1
        if failed:
            bucket.failures += 1
            self._failures += 1
        config = self.config
        if self._calls < config.min_calls:
            return None
        # Dividing (rather than comparing failures with ratio * calls) keeps "exactly at the ratio" exact: 7 of 10
        # against 0.7 is equal here, whereas 0.7 * 10 is 7.000000000000001.
        ratio = self._failures / self._calls
        if ratio < config.failure_ratio:
            return None
        reason = (
            f"{self._failures} of {self._calls} calls failed in {format_duration(config.window_ms)} "
            f"(ratio {ratio:.2f} >= {config.failure_ratio:.2f})"
        )
        self._opens_total += 1
        self._opened_at_ms = now
        self._open_periods.append((now, None))
        self._probe_interval_ms = config.probe_interval_ms
        return self._open(now, reason)

    def _record_probe(self, outcome: CallOutcome, now: int) -> Transition | None:
        self._probe_in_flight = False
        if outcome is CallOutcome.IGNORED:
            return None  # bad data tells nothing about the dependency: probe again with the next message
        config = self.config
        if outcome is CallOutcome.FAILURE:
            grown = min(self._probe_interval_ms * config.probe_multiplier, config.probe_max_interval_ms)
            self._probe_interval_ms = max(config.probe_interval_ms, round(grown))
            return self._open(now, f"probe failed; next probe in {format_duration(self._probe_interval_ms)}")
        self._probe_successes += 1
        if self._probe_successes < config.probes_to_close:
            return None
        opened_at = self._opened_at_ms
        assert opened_at is not None
        self._held_closed_ms += now - opened_at
        self._open_periods[-1] = (opened_at, now)
        self._opened_at_ms = None
        self._next_probe_at_ms = None
        self._probe_interval_ms = config.probe_interval_ms
        self._probe_successes = 0
        self._clear_window()
        reason = "probe succeeded" if config.probes_to_close == 1 else f"{config.probes_to_close} probes succeeded"
        return self._move(now, BreakerState.CLOSED, reason)

    def _open(self, now: int, reason: str) -> Transition:
        self._next_probe_at_ms = now + self._probe_interval_ms
        self._probe_in_flight = False
        self._probe_successes = 0
        self._clear_window()
        return self._move(now, BreakerState.OPEN, reason)

    def _move(self, now: int, to_state: BreakerState, reason: str) -> Transition:
        transition = Transition(now, self._state, to_state, reason)
        self._state = to_state
        self._transitions.append(transition)
        return transition
