"""Paced releases: a token bucket in front of the release timer, so a recovered dependency is not flooded.

When thousands of parked messages come due at once (after an outage, or when the circuit breaker closes and the due
times it held catch up), an unpaced worker sends every release request in one tick and the handler meets them all
at once. ``REBOUND_RELEASE_RATE`` caps the releases one worker starts per second, with ``REBOUND_RELEASE_BURST``
allowed at once after a quiet spell; ``REBOUND_RELEASE_RAMP`` makes the cap climb, after the breaker closes, from
:data:`RAMP_START` of the rate to all of it.

The pacer only ever delays: it decides how many due releases may go *now* and when the next may; what is due is still
the schedule's business, and a release still checks its due time before it runs (never early). What pacing delays
shows in the release lateness histogram like any other delay.

The pacer paces *new* release requests only. A request sent again because the first looks lost (its partition fell
silent for the resend timeout, or the release agent skipped it: :class:`rebound.schedule.ReleaseSchedule`) is
neither held back nor charged: its release never ran, so it adds no call on the handler beyond the one already
charged, and holding it back could strand a partition. Resends are bounded by the per-partition window instead (at
most ``max_in_flight`` requests of a partition, once per resend timeout). So new releases, in any window of ``t``
seconds, are at most ``rate * t + burst``; requests on the release topic may exceed that by the resends.

The class is pure, like :class:`rebound.breaker.CircuitBreaker`: no asyncio, no I/O and no clock of its own. Every
method is given ``now_ms``, so the release timer decides what time it is and the tests drive it without sleeping.
Adaptive concurrency (``REBOUND_CONCURRENCY=auto``, :mod:`rebound.limiter`) bounds calls in flight, not their rate:
the pacer's rate stays the ceiling either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rebound.errors import ConfigurationError
from rebound.schedule import Popped, ReleaseSchedule

RAMP_START = 0.1
"""The share of ``REBOUND_RELEASE_RATE`` (and of the burst) allowed just after the breaker closes."""
_EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class PacingConfig:
    rate: float | None
    """Releases per second per worker; None = unlimited (the pacer lets everything due go)."""
    burst: int = 1
    """Releases allowed at once after a quiet spell (the bucket's size)."""
    ramp_ms: int = 0
    """After the breaker closes, how long the allowed rate takes to climb from ``RAMP_START`` of ``rate`` to all of
    it; 0 = no ramp."""

    def __post_init__(self) -> None:
        rate = self.rate
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0
        ):
            raise ConfigurationError(f"REBOUND_RELEASE_RATE must be a number greater than 0, got {rate!r}")
        if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 1:
            raise ConfigurationError(f"REBOUND_RELEASE_BURST must be a whole number >= 1, got {self.burst!r}")
        if isinstance(self.ramp_ms, bool) or not isinstance(self.ramp_ms, int) or self.ramp_ms < 0:
            raise ConfigurationError(f"REBOUND_RELEASE_RAMP must be a duration, got {self.ramp_ms!r}")
        if self.ramp_ms and rate is None:
            raise ConfigurationError(
                "REBOUND_RELEASE_RAMP needs REBOUND_RELEASE_RATE: the ramp climbs to that rate (unset, releases are "
                "not paced at all)"
            )

    @property
    def paced(self) -> bool:
        return self.rate is not None


def default_burst(rate: float, linger_ms: int) -> int:
    """A tenth of a second's worth, or, if more, the least that keeps the rate with release ticks a linger apart
    (:func:`min_burst`: a bucket smaller than what accrues between two ticks would lose rate)."""
    return max(min_burst(rate, linger_ms), math.ceil(rate * 0.1 - _EPSILON))


def min_burst(rate: float, linger_ms: int) -> int:
    """The smallest bucket that keeps the rate. Paced, release ticks are ``linger_ms`` apart (or, at a slower rate,
    a release apart: the timer wakes when the next is allowed, and a burst of 1 keeps up). A tick takes whole
    releases and carries the fraction of one over, so the bucket must hold what accrues between two ticks plus that
    fraction: anything beyond its size is lost, and a smaller burst caps releases below the rate
    (``REBOUND_RELEASE_BURST=1`` at 1,000/s with a 10 ms linger: 100/s)."""
    accrues = rate * linger_ms / 1000
    return 1 if accrues <= 1 + _EPSILON else math.ceil(accrues - _EPSILON) + 1


class ReleasePacer:
    """One worker's release pacer. Asked by the release timer how many due releases may go now
    (:meth:`allowance`), told how many went (:meth:`take`), and asked when the next one may (:meth:`next_at_ms`)."""

    def __init__(self, config: PacingConfig) -> None:
        self.config = config
        self._tokens = float(config.burst)
        self._at_ms: int | None = None
        self._ramp_from_ms: int | None = None
        self._held_at_ms: int | None = None

    @property
    def paced(self) -> bool:
        return self.config.paced

    def ramp_from(self, now_ms: int) -> None:
        """The breaker closed at ``now_ms``: start the ramp (without one configured, nothing changes)."""
        if not self.config.paced or not self.config.ramp_ms:
            return
        self._refill(now_ms)
        self._ramp_from_ms = self._at_ms
        self._tokens = min(self._tokens, self._capacity(self._at_ms or now_ms))

    def share(self, now_ms: int) -> float:
        """The share of the full rate allowed at ``now_ms``: below 1 only during a ramp."""
        start = self._ramp_from_ms
        ramp = self.config.ramp_ms
        if start is None or not ramp:
            return 1.0
        elapsed = now_ms - start
        if elapsed >= ramp:
            return 1.0
        return RAMP_START + (1 - RAMP_START) * max(0, elapsed) / ramp

    def rate_at(self, now_ms: int) -> float | None:
        """Releases per second allowed at ``now_ms``; None when unlimited."""
        rate = self.config.rate
        return None if rate is None else rate * self.share(now_ms)

    def allowance(self, now_ms: int) -> int | None:
        """How many due releases may go now; None: any number."""
        if not self.config.paced:
            return None
        self._refill(now_ms)
        return math.floor(self._tokens + _EPSILON)

    def take(self, count: int, now_ms: int) -> None:
        """``count`` releases went now (at most the allowance: more is refused, not borrowed)."""
        if not self.config.paced or count <= 0:
            return
        self._refill(now_ms)
        if count > math.floor(self._tokens + _EPSILON):
            raise ValueError(f"{count} releases taken with {self._tokens:.3f} allowed")
        self._tokens = max(0.0, self._tokens - count)

    def next_at_ms(self, now_ms: int) -> int:
        """The earliest time a release may go: ``now_ms`` if one may go now. Solved for the rate as it will be, a
        ramp's line included (at the rate allowed now, a ramp's wake would come late: up to ten times late at its
        start)."""
        allowed = self.allowance(now_ms)
        if allowed is None or allowed >= 1:
            return now_ms
        at = self._at_ms if self._at_ms is not None else now_ms
        return max(now_ms, math.ceil(self._earned_at(at, 1 - self._tokens) - 1e-6))

    def held_back(self, now_ms: int) -> None:
        """The timer left due releases waiting at ``now_ms`` for want of allowance."""
        self._held_at_ms = now_ms if self._held_at_ms is None else max(self._held_at_ms, now_ms)

    def none_held(self) -> None:
        """A tick left nothing due waiting for want of allowance: what comes due from now on is not delayed by
        what pacing held back before (until it holds some back again)."""
        self._held_at_ms = None

    def was_held(self, due_at_ms: int) -> bool:
        """Whether a release due at ``due_at_ms`` was already due when pacing last held releases back, with no tick
        since that left nothing held: it goes later than it would have unpaced (for the metric of releases pacing
        delayed)."""
        return self._held_at_ms is not None and due_at_ms <= self._held_at_ms

    # -- internals -------------------------------------------------------------------------------------------------

    def _capacity(self, now_ms: int) -> float:
        return max(1.0, self.config.burst * self.share(now_ms))

    def _refill(self, now_ms: int) -> None:
        """Add what accrued since the last call: the integral of the allowed rate (exact across a ramp, which is
        linear), up to the bucket's size. A clock stepping back counts as no time passing."""
        if self._at_ms is None:
            self._at_ms = now_ms
            return
        if now_ms <= self._at_ms:
            return
        rate = self.config.rate
        assert rate is not None
        start, end = self._at_ms, now_ms
        earned = rate * self._mean_share(start, end) * (end - start) / 1000
        self._tokens = min(self._capacity(end), self._tokens + earned)
        self._at_ms = end

    def _earned_at(self, start: int, need: float) -> float:
        """When (in ms, not rounded) ``need`` tokens will have accrued from ``start`` on: the inverse of
        :meth:`_refill`'s integral. On the ramp's line the share is ``s0 + k * x`` after ``x`` ms, so the tokens are
        ``rate * (s0 * x + k * x**2 / 2) / 1000``, a quadratic in ``x``; after the ramp, the full rate."""
        rate = self.config.rate
        assert rate is not None
        ramp_from, ramp = self._ramp_from_ms, self.config.ramp_ms
        if ramp_from is not None and ramp and start < ramp_from + ramp:
            ramp_end = ramp_from + ramp
            s0, slope = self.share(start), (1 - RAMP_START) / ramp
            on_ramp = rate * (ramp_end - start) * (s0 + 1) / 2 / 1000  # what the rest of the ramp earns
            if need <= on_ramp:
                area = need * 1000 / rate  # share-weighted ms needed
                return start + (math.sqrt(s0 * s0 + 2 * slope * area) - s0) / slope
            need -= on_ramp
            start = ramp_end
        return start + need * 1000 / rate

    def _mean_share(self, start: int, end: int) -> float:
        """The share's mean over ``[start, end]``: linear during the ramp, 1 after it."""
        ramp_from, ramp = self._ramp_from_ms, self.config.ramp_ms
        if ramp_from is None or not ramp or start >= ramp_from + ramp:
            return 1.0
        ramp_end = ramp_from + ramp
        cut = min(end, ramp_end)
        ramping = (cut - start) * (self.share(start) + self.share(cut)) / 2
        return (ramping + max(0, end - ramp_end)) / (end - start)


def pop_paced(schedule: ReleaseSchedule, pacer: ReleasePacer, now_ms: int) -> tuple[Popped, int]:
    """What one release tick sends: every due slot the windows have room for, or, paced, as many new ones as the
    pacer allows, earliest due first; and, either way, the requests that look lost sent again (not paced and not
    charged: their release never ran; the windows bound them). Also how many of the new ones pacing delayed: they
    were due at an earlier tick that left due slots waiting for want of allowance (each counted once, when first
    sent; a resend is never counted)."""
    allowed = pacer.allowance(now_ms)
    if allowed is None:
        return schedule.pop_due(now_ms), 0
    popped = schedule.pop_due(now_ms, limit=allowed)
    pacer.take(len(popped.new), now_ms)
    delayed = sum(1 for _, slot in popped.new if pacer.was_held(slot.due_at_ms))
    next_due = schedule.next_due_ms()
    if next_due is not None and next_due <= now_ms:  # due, with room in its window: left waiting by the pacer
        pacer.held_back(now_ms)
    else:
        pacer.none_held()
    return popped, delayed
