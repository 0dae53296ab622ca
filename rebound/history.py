"""Pure arithmetic of the dashboard's history: counter deltas, per-interval rates and mean lateness, a bounded ring.

A worker samples every ``INTERVAL_MS`` (``app/web/history.py``): the per-tier backlog (waiting, overdue, how long
the oldest due message has been due) as it stands, and the outcome counters as they grew since the sample before.
Nothing here reads a table or a topic: the inputs are the runtime's counters and the backlog numbers the status
board already keeps. The last ``WINDOW_MS`` of samples are kept in a ring (``deque(maxlen=...)``), so memory is
bounded by the window and the number of tiers, whatever the traffic.

Counters come from several sources (one per worker, for the cluster-wide history): each source's deltas are taken
against its own previous values, so a worker that appears, disappears or restarts (its counters start again at
zero) never turns into a negative or a huge jump.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

INTERVAL_MS = 10_000
WINDOW_MS = 3_600_000

OUTCOME_COUNTERS: dict[str, tuple[str, ...]] = {
    "succeeded": ("outcome.succeeded",),
    "retried": ("outcome.scheduled",),
    "dead": ("outcome.dead", "outcome.expired"),
    "held": ("outcome.held",),
}
"""Each series of the outcome chart and the runtime counters (``agents/delivery.py``: ``outcome.<value>``) it sums."""

RELEASED = "released"
LAG_TOTAL = "release.lag_ms_total"
"""``agents/release.py``: how many retries were released, and the sum of their lateness (release time - due time)."""

TIER_FIELDS = ("waiting", "overdue", "max_overdue_ms")

Buckets = Sequence[tuple[float, int]]
"""A histogram as Prometheus keeps it: (upper bound ``le``, cumulative count), ascending, the last bound ``inf``."""


def counter_deltas(previous: Mapping[str, int] | None, current: Mapping[str, int]) -> dict[str, int]:
    """How much each counter grew. No ``previous``: everything counted so far. A counter that went down was reset
    (its worker restarted), so its current value is what it grew by, as Prometheus' ``increase`` takes it."""
    base = previous or {}
    deltas: dict[str, int] = {}
    for name, raw in current.items():
        before, value = int(base.get(name, 0)), int(raw)
        deltas[name] = value - before if value >= before else value
    return deltas


def add_counts(into: dict[str, int], more: Mapping[str, int]) -> None:
    for name, value in more.items():
        into[name] = into.get(name, 0) + int(value)


@dataclass
class CounterTracker:
    """The last counters seen per source; :meth:`step` sums every source's growth since then."""

    previous: dict[str, dict[str, int]] = field(default_factory=dict)

    def step(self, sources: Mapping[str, Mapping[str, int]], *, from_zero: Collection[str] = ()) -> dict[str, int]:
        """Sum of every source's deltas. A source seen for the first time counts nothing (its counters may hold
        hours of history: only its growth from now on is this interval's), unless it is in ``from_zero`` (a source
        known to have started at zero, as this worker's own counters). Sources no longer present are forgotten."""
        total: dict[str, int] = {}
        for source, counters in sources.items():
            current = {name: int(value) for name, value in counters.items()}
            if source in self.previous or source in from_zero:
                add_counts(total, counter_deltas(self.previous.get(source), current))
            self.previous[source] = current
        for gone in set(self.previous) - set(sources):
            del self.previous[gone]
        return total


def outcome_counts(deltas: Mapping[str, int]) -> dict[str, int]:
    """The outcome chart's series from counter deltas: succeeded, retried (scheduled for a retry), dead (to the
    failed topic, expired included), held (key-ordered mode)."""
    return {series: sum(int(deltas.get(name, 0)) for name in names) for series, names in OUTCOME_COUNTERS.items()}


def per_minute(count: int, interval_ms: int) -> float:
    """A count over an interval as a rate per minute (0 for an empty interval)."""
    return 0.0 if interval_ms <= 0 else round(count * 60_000 / interval_ms, 3)


def mean_lag_ms(deltas: Mapping[str, int]) -> float | None:
    """Mean lateness of the retries released in the interval (None when none was)."""
    released = int(deltas.get(RELEASED, 0))
    if released <= 0:
        return None
    return round(int(deltas.get(LAG_TOTAL, 0)) / released, 1)


def bucket_deltas(previous: Buckets | None, current: Buckets) -> list[tuple[float, int]]:
    """Cumulative bucket counts grown since ``previous``; all of ``current`` if it has none, or if a count went down
    or the bounds changed (the histogram was reset)."""
    if previous is None or [le for le, _ in previous] != [le for le, _ in current]:
        return [(le, count) for le, count in current]
    if any(now < before for (_, before), (_, now) in zip(previous, current, strict=True)):
        return [(le, count) for le, count in current]
    return [(le, now - before) for (le, before), (_, now) in zip(previous, current, strict=True)]


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """The ``q`` quantile of cumulative buckets, as Prometheus' ``histogram_quantile`` estimates it: linear within the
    bucket it falls in (from 0 for the first), the highest finite bound if it falls in the ``inf`` bucket. None for
    an empty histogram."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0
    for le, count in buckets:
        if count >= rank and count > below:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        if not math.isinf(le):
            lower = le
        below = count
    return lower


def tier_point(stats: Mapping[str, Any]) -> dict[str, int]:
    """The charted numbers of one tier, from a finished tier summary (``rebound/summary.py: finish``)."""
    return {name: int(stats.get(name) or 0) for name in TIER_FIELDS}


@dataclass(frozen=True)
class Sample:
    at_ms: int
    interval_ms: int
    """Since the sample before (the rates' denominator; longer than the period when the timer was held up)."""
    tiers: dict[str, dict[str, int]]
    outcomes: dict[str, int]
    released: int
    lag_mean_ms: float | None
    sources: int = 1
    """Workers whose numbers are in the sample."""
    lag_p50_ms: float | None = None
    lag_p99_ms: float | None = None
    """From the lateness histogram's growth in the interval (the worker's own), when it has one."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at_ms,
            "interval_ms": self.interval_ms,
            "tiers": self.tiers,
            "outcomes": self.outcomes,
            "per_minute": {name: per_minute(count, self.interval_ms) for name, count in self.outcomes.items()},
            "released": self.released,
            "lag_mean_ms": self.lag_mean_ms,
            "lag_p50_ms": self.lag_p50_ms,
            "lag_p99_ms": self.lag_p99_ms,
            "sources": self.sources,
        }


def make_sample(
    *,
    at_ms: int,
    interval_ms: int,
    tiers: Mapping[str, Mapping[str, Any]],
    deltas: Mapping[str, int],
    sources: int = 1,
    lateness: Buckets | None = None,
) -> Sample:
    """``lateness``: the growth of the lateness histogram (seconds) in the interval."""

    def quantile_ms(q: float) -> float | None:
        found = None if lateness is None else histogram_quantile(q, lateness)
        return None if found is None else round(found * 1000, 1)

    return Sample(
        at_ms=at_ms,
        interval_ms=max(0, interval_ms),
        tiers={name: tier_point(stats) for name, stats in tiers.items()},  # (in the backlog's order: the policy's)
        outcomes=outcome_counts(deltas),
        released=max(0, int(deltas.get(RELEASED, 0))),
        lag_mean_ms=mean_lag_ms(deltas),
        sources=sources,
        lag_p50_ms=quantile_ms(0.5),
        lag_p99_ms=quantile_ms(0.99),
    )


def window_summary(samples: Iterable[Sample]) -> dict[str, Any]:
    """Totals over the samples: each outcome, releases, and the mean lateness over every release of the window
    (weighted by releases, not a mean of the intervals' means), and the worst interval's mean."""
    totals = dict.fromkeys(OUTCOME_COUNTERS, 0)
    released = 0
    lag_total = 0.0
    worst: float | None = None
    for sample in samples:
        add_counts(totals, sample.outcomes)
        if sample.lag_mean_ms is not None and sample.released:
            released += sample.released
            lag_total += sample.lag_mean_ms * sample.released
            worst = sample.lag_mean_ms if worst is None else max(worst, sample.lag_mean_ms)
    return {
        "outcomes": totals,
        "released": released,
        "lag_mean_ms": round(lag_total / released, 1) if released else None,
        "lag_worst_interval_mean_ms": worst,
    }


class History:
    """A ring of samples covering the last ``window_ms``, plus the counters seen last (for the next deltas)."""

    def __init__(self, *, interval_ms: int = INTERVAL_MS, window_ms: int = WINDOW_MS) -> None:
        if interval_ms <= 0 or window_ms < interval_ms:
            raise ValueError("the window must hold at least one interval")
        self.interval_ms = interval_ms
        self.window_ms = window_ms
        self.samples: deque[Sample] = deque(maxlen=window_ms // interval_ms + 1)
        self.tracker = CounterTracker()
        self.last_at_ms: int | None = None
        self.last_lateness: Buckets | None = None

    def record(
        self,
        *,
        at_ms: int,
        tiers: Mapping[str, Mapping[str, Any]],
        counters: Mapping[str, Mapping[str, int]],
        from_zero: Collection[str] = (),
        started_at_ms: int | None = None,
        lateness: Buckets | None = None,
    ) -> Sample:
        """Take one sample: ``tiers`` as they stand now, ``counters`` per source (their growth since the last call),
        ``lateness`` a cumulative lateness histogram (its growth since the last call; the first call takes all of it,
        as the counters of ``from_zero``). The first sample's interval runs from ``started_at_ms`` (when the counters
        of ``from_zero`` were zero), or is one period."""
        deltas = self.tracker.step(counters, from_zero=from_zero)
        grown = None if lateness is None else bucket_deltas(self.last_lateness, lateness)
        self.last_lateness = lateness
        if self.last_at_ms is not None:
            interval = at_ms - self.last_at_ms
        elif started_at_ms is not None:
            interval = at_ms - started_at_ms
        else:
            interval = self.interval_ms
        sample = make_sample(
            at_ms=at_ms, interval_ms=interval, tiers=tiers, deltas=deltas, sources=len(counters), lateness=grown
        )
        self.samples.append(sample)
        self.last_at_ms = at_ms
        return sample

    def to_dict(self, *, now_ms: int, since_ms: int | None = None) -> dict[str, Any]:
        """Samples of the window (newer than ``since_ms`` if given: a poller asks only for what it has not seen)."""
        oldest = now_ms - self.window_ms
        kept = [s for s in self.samples if s.at_ms >= oldest and (since_ms is None or s.at_ms > since_ms)]
        windowed = [s for s in self.samples if s.at_ms >= oldest]
        return {
            "now": now_ms,
            "interval_ms": self.interval_ms,
            "window_ms": self.window_ms,
            "capacity": self.samples.maxlen,
            "samples": [sample.to_dict() for sample in kept],
            "window": window_summary(windowed),
        }
