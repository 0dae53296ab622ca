"""Adaptive concurrency (``REBOUND_CONCURRENCY=auto``): the worker's limit on handler calls in flight, moved between a
minimum and a maximum by what the calls show, without Faust, asyncio or a clock of its own.

Why: a fixed ``REBOUND_CONCURRENCY`` is a guess. Too low wastes a service that could take more; too high queues calls
inside it (each waits longer, and past the handler timeout or the service's queue bound they fail as timeouts, 429 or
503, each one a retry). A service's capacity is a number of calls it runs at once without queueing (Little's law:
throughput x latency), and it changes (deploys, autoscaling, a slow dependency). So the limit is learned the way TCP
Vegas learns a congestion window, as Netflix's concurrency-limits (Vegas and Gradient2 limits, and Uber's uForwarder,
which uses them for a push proxy), and Envoy's adaptive concurrency filter do.

The rule, per *window* of calls (Vegas's, with Rebound's windows and probes):

- **Latency** of a window or a probe: the mean of its middle half (:func:`typical`), robust to a slow call in a
  hundred and to a handler with cache hits (whose median jumps between its two modes).
- **Baseline**: the latency of a call that does not queue. A *probe* measures it: the limit drops to the minimum
  until :data:`PROBE_CALLS` calls started at that concurrency have ended (as Envoy measures its minimum RTT), and
  their latency is the baseline. The first probe runs at start, then the limit is the initial one; probes come again
  every :data:`PROBE_INTERVAL_S` s (at least :data:`PROBE_INTERVAL_LATENCIES` baselines and
  :data:`PROBE_INTERVAL_DRAINS` x the longest call: a probe lasts the drain plus 10 baselines at a minimum of 2, 20
  at 1, so it holds the limit down 2 to 3 % of the time at most), jittered by up to :data:`PROBE_JITTER` so that
  the workers of a group spread theirs. Between probes the baseline is measured again by the windows: a window
  with a lower latency lowers it; a window run at the minimum is a probe (its latency is the baseline, higher or
  lower); and two successive windows whose limits differ by :data:`FLAT_MIN_STEP` or more while their latencies
  hardly moved (:data:`FLAT_SHARE`) raise it to the lower of the two: queueing moves latency with the limit
  (Little's law), so a latency that does not follow the limit is the service's own. A service a third slower or
  more is re-measured in two windows (the first one cuts by a quarter or more, the second, at the lower limit, is
  just as slow), a smaller slowdown by the trial step of a held limit or at the minimum, a baseline taken from a
  burst of fast calls likewise; none waits for a probe.
- **Window**: at least :data:`WINDOW_MIN_S` s and :data:`WINDOW_LATENCIES` baselines, and :data:`WINDOW_MIN_SAMPLES`
  successful calls (a drop ends it without them). Only calls *started* after the limit last changed count: the others
  ran under another limit (TCP likewise reduces once per window of data, not once per loss).
- **Drops** (a timeout, an :class:`~rebound.errors.OverloadError`: 429, 503; :data:`DROPS`): more than
  :data:`DROP_TOLERANCE` of a window's calls and more than :data:`DROP_MARGIN` x the share of drops at half the limit
  and below (:meth:`AdaptiveLimit.low_drop_share`), and the limit is multiplied by :data:`DROP_FACTOR`, once per
  window: overloads that come at any load are not this worker's doing. Fewer, and the window is judged on its
  latency, and grows only with no more than that margin of drops. A drop never raises the limit.
- **Queueing**: ``queue = limit x (1 - baseline / latency)``, the calls that waited. Above beta (:func:`thresholds`:
  :data:`BETA` x log10(limit)), or with a latency more than :data:`HOLD_RATIO` x the baseline, the limit is cut to
  ``limit x baseline / latency`` (``limit - queue``: what ran without waiting), at most by half
  (:data:`MIN_GRADIENT`). Below alpha (:data:`ALPHA` x log10(limit)) and within :data:`GROW_RATIO` x the baseline, the
  limit grows by its square root (at least 1; Envoy's headroom), quickly from small limits and gently near large
  ones, but only if the window used at least half of it (works holding a slot, ``running``, not only calls in
  flight): a limit the load never reached says nothing about more, and growing it would let a burst in unchecked. In
  between it holds, and after :data:`HOLD_WINDOWS` such windows it is tried :data:`FLAT_MIN_STEP` higher, so that a
  baseline too low (calls 15 % slower above the probe's concurrency, a service somewhat slower) is measured again
  rather than holding the limit until the next probe. Thresholds that grow with the limit are VegasLimit's: a large
  limit carries no more queue than a few calls; the latency bounds keep the queue of a service shared by many
  workers short (each worker's alpha and beta count only its own calls).

Other failures of the handler (it raised, it was cancelled) are not samples: a fast failure ("row not there yet")
says nothing about the service's queue, and would pull the baseline down. Nothing here awaits: ``agents/dispatcher.py``
feeds the samples and applies the limit, and :class:`rebound.dispatch.Dispatch` never cancels running work when it
is lowered.
"""

from __future__ import annotations

import enum
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from rebound.errors import HandlerTimeout, OverloadError
from rebound.http_errors import HttpTimeout

ALPHA = 3.0
"""Calls estimated to queue (``limit x (1 - baseline / latency)``) below ALPHA x log10(limit) (at least 1), and a
used limit may grow: Netflix's VegasLimit's alpha. At large limits it is the tighter bound: 3 x log10(256) = 7 calls
queued at 256 is 1.03 x the baseline."""
BETA = 6.0
"""Above BETA x log10(limit) calls estimated to queue (at least 2), the limit is cut to what ran without queueing
(``limit - queue``, at least half of it); in between it holds (VegasLimit's beta)."""
HOLD_WINDOWS = 10
"""A used limit held for this many windows in a row is tried :data:`FLAT_MIN_STEP` higher: if the latency
does not follow (:data:`FLAT_SHARE`), the baseline was too low (the service became slower by less than it takes to
cut, or what looked like a queue is not one) and is measured again; if it does, the next window cuts back. At the
service's capacity that is one window of a few more calls queued every 10; without it a wrong baseline would hold
the limit until the next probe."""
GROW_RATIO = 1.1
"""Whatever alpha says, a window more than 10 % slower than the baseline does not grow the limit, and ..."""
HOLD_RATIO = 1.25
"""... one more than 25 % slower is cut: alpha and beta count calls queued by this worker, and the workers of a group
that share a service each keep their own, so N workers would queue N times as many; bounds on the latency keep the
service's queue short whatever their number."""
MIN_GRADIENT = 0.5
"""The most one window's queueing cuts: half (Gradient2 and Envoy bound their step the same way)."""
FLAT_SHARE = 0.1
"""Two successive windows whose limits differ by at least :data:`FLAT_MIN_STEP` and whose latencies moved by at most
a tenth of it (in ratio, on a log scale): the latency does not depend on the limit, so it is no queue, and the
baseline is re-measured as the lower of the two. Queueing moves latency with the limit (Little's law); a service that
became slower, a wrong (too low) baseline, a step in latency above the probe's concurrency do not."""
FLAT_MIN_STEP = 1.25
"""A limit change of less than 25 % is too small to tell queueing from noise (or from the share of a service's queue
that other workers hold)."""
DROP_TOLERANCE = 0.01
"""Drops up to 1 % of a window's calls never cut it (a thin tail of timeouts would otherwise pin the limit to the
minimum: at thousands of calls a second nearly every window holds one)."""
DROP_MARGIN = 2.0
"""A window's drops cut the limit only above DROP_MARGIN x the share of drops measured at half the limit and below (and
above :data:`DROP_TOLERANCE`): overloads that come whatever the load (a tenant over its own quota at the service) say
nothing about this worker's limit. A window grows only with at most that share."""
DROP_FACTOR = 0.75
"""The cut for a window with drops: a quarter, more than TCP's AIMD tenth because a drop here is a failed message
(a retry, maybe a dead letter), less than a half because queueing latency has usually cut the limit already."""
LOW_DROP_CALLS = 100
"""The share of drops at lower limits is taken over at least this many calls (until then the missing ones count as
drop-free: a drop is taken as rare), and over about ten times as many per power of two of the limit at most (older
calls weigh less)."""
WINDOW_MIN_S = 0.5
WINDOW_LATENCIES = 5
WINDOW_MIN_SAMPLES = 10
PROBE_CALLS = 20
PROBE_INTERVAL_S = 60.0
PROBE_INTERVAL_LATENCIES = 600
PROBE_INTERVAL_DRAINS = 100
"""A probe waits for the calls in flight to drain to the minimum, as long as the slowest of them takes: the interval
is at least 100 x the longest call seen since the last probe, so that a heavy tail (1 % of calls at 5 s) does not
hold the limit down 5 s a minute."""
PROBE_JITTER = 0.2
_EPSILON = 1e-9


DROPS: tuple[type[BaseException], ...] = (HandlerTimeout, OverloadError, HttpTimeout, TimeoutError)
"""What a handler call that was *dropped* raises: Rebound's handler timeout, an overload (429, 503, or a Python
handler's own ``OverloadError``), the push handler's request timeout (shorter than the handler timeout, so it is the
one that fires), and a handler's own ``TimeoutError`` (its call to a slow dependency): each is the service not
keeping up, the signal TCP takes from a lost packet. A connection refused is not: an outage is the breaker's."""


def outcome_of(error: BaseException | None) -> CallOutcome:
    """What a call that raised ``error`` (None: it returned) tells the limit."""
    if error is None:
        return CallOutcome.SUCCEEDED
    return CallOutcome.DROPPED if isinstance(error, DROPS) else CallOutcome.IGNORED


class CallOutcome(enum.Enum):
    """What one handler call tells the limit."""

    SUCCEEDED = "succeeded"
    """A latency sample."""
    DROPPED = "dropped"
    """Overload: a handler timeout or an ``OverloadError`` (429, 503)."""
    IGNORED = "ignored"
    """Neither: it raised something else, or was cancelled."""


@dataclass(frozen=True)
class LimitRange:
    """``REBOUND_CONCURRENCY_MIN``, ``_MAX`` and ``_INITIAL``: the limit stays within the first two, and starts at the
    third once the first probe has measured the baseline."""

    minimum: int
    maximum: int
    initial: int

    def __post_init__(self) -> None:
        if self.minimum < 1:
            raise ValueError("the minimum must be at least 1")
        if self.maximum < self.minimum:
            raise ValueError("the maximum must be at least the minimum")
        if not self.minimum <= self.initial <= self.maximum:
            raise ValueError("the initial limit must be between the minimum and the maximum")


class AdaptiveLimit:
    """The limit and what it learned; :meth:`record` takes one ended call, ``limit`` is what to apply now.

    ``clock`` gives seconds (monotonic) and must be the clock the callers take ``started_at`` from. ``jitter`` gives a
    number in [0, 1) for the probe interval's jitter (a seeded one in tests).
    """

    def __init__(
        self, bounds: LimitRange, *, clock: Callable[[], float], jitter: Callable[[], float] = random.random
    ) -> None:
        self.bounds = bounds
        self.clock = clock
        self._jitter = jitter
        now = clock()
        self.limit = bounds.minimum
        self.baseline_s: float | None = None
        self.probing = True
        self._after_probe = bounds.initial
        self._probe_latencies: list[float] = []
        self._probe_drops = 0
        self._changed_at = now
        self._window_started = now
        self._latencies: list[float] = []
        self._drops = 0
        self._most_in_flight = 0
        self._most_running = 0
        self._previous: tuple[int, float] | None = None
        self._holds = 0
        """The last window judged on its latency: its limit and its latency (for :data:`FLAT_SHARE`)."""
        self._drops_by_limit: dict[int, list[float]] = {}
        """Calls and drops of windows (and probes) by their limit's power of two (floor of log2), older ones weighing
        less: the share of drops at lower limits, for :data:`DROP_MARGIN`."""
        self._probed_at = math.inf
        self._probe_spread = 1.0
        self._longest_s = 0.0

    @property
    def window_s(self) -> float:
        return max(WINDOW_MIN_S, WINDOW_LATENCIES * (self.baseline_s or 0.0))

    @property
    def probe_interval_s(self) -> float:
        """The longest a probe can be due for (the jitter only shortens it)."""
        return max(
            PROBE_INTERVAL_S,
            PROBE_INTERVAL_LATENCIES * (self.baseline_s or 0.0),
            PROBE_INTERVAL_DRAINS * self._longest_s,
        )

    def low_drop_share(self, limit: int) -> float:
        """The share of drops measured at half ``limit`` and below (at the lowest limits measured, for those): those
        that do not come from this worker's load. 0 until any, and counted over at least :data:`LOW_DROP_CALLS`."""
        level = limit.bit_length() - 1
        lower = [counts for at, counts in self._drops_by_limit.items() if at < level]
        if not lower and self._drops_by_limit:
            lower = [self._drops_by_limit[min(self._drops_by_limit)]]
        calls = sum(counts[0] for counts in lower)
        drops = sum(counts[1] for counts in lower)
        return drops / max(calls, LOW_DROP_CALLS)

    def record(
        self,
        *,
        started_at: float,
        latency_s: float,
        in_flight: int,
        outcome: CallOutcome,
        running: int | None = None,
    ) -> int:
        """One call ended: it started at ``started_at`` (the limiter's clock) with ``in_flight`` handler calls running,
        itself included, and took ``latency_s``. ``running`` is the work holding a slot of the limit when it started
        (calls in flight, and work routing a failure or awaiting a store's confirmation; ``in_flight`` if not given):
        what says whether the limit was used. Returns the limit to apply now."""
        if outcome is CallOutcome.IGNORED or started_at < self._changed_at:
            return self.limit
        if self.probing:
            self._probe_sample(latency_s, in_flight, outcome)
            return self.limit
        self._most_in_flight = max(self._most_in_flight, in_flight)
        self._longest_s = max(self._longest_s, latency_s)
        self._most_running = max(self._most_running, in_flight if running is None else running)
        if outcome is CallOutcome.DROPPED:
            self._drops += 1
        else:
            self._latencies.append(latency_s)
        now = self.clock()
        if now - self._window_started < self.window_s:
            return self.limit
        if not self._drops and len(self._latencies) < WINDOW_MIN_SAMPLES:
            return self.limit
        self._set(self._decide(may_grow=outcome is CallOutcome.SUCCEEDED), now)
        if now - self._probed_at >= self.probe_interval_s * self._probe_spread:
            self._after_probe = self.limit
            self.probing = True
            self._probe_latencies = []
            self._probe_drops = 0
            self._previous = None
            self._set(self.bounds.minimum, now)
        return self.limit

    def _decide(self, *, may_grow: bool) -> int:
        limit = self.limit
        drops = self._drops
        calls = drops + len(self._latencies)
        share = drops / calls
        at_minimum = limit == self.bounds.minimum and self._most_in_flight <= limit
        low_share = self.low_drop_share(limit)
        self._count_drops(limit, calls, drops)
        if drops and share > max(DROP_TOLERANCE, DROP_MARGIN * low_share):
            self._previous = None
            return self._clamp(math.floor(limit * DROP_FACTOR + _EPSILON))
        assert self.baseline_s is not None  # set by the first probe
        if not self._latencies:
            return limit  # only drops, and no more of them than at lower limits: nothing to judge
        latency = typical(self._latencies)
        baseline = self._rebased(limit, latency, at_minimum)
        self._previous = (limit, latency)
        queue = limit * (1 - baseline / latency) if latency > 0 else 0.0
        alpha, beta = thresholds(limit)
        ratio = latency / baseline if baseline > 0 else 1.0
        if queue > beta or ratio > HOLD_RATIO:
            cut = math.floor(limit * max(MIN_GRADIENT, baseline / latency) + _EPSILON)
            return self._clamp(min(cut, limit - 1))
        grows = may_grow and share <= DROP_MARGIN * low_share and self._most_running * 2 >= limit
        if not grows:
            return limit
        if queue < alpha and ratio <= GROW_RATIO:
            self._holds = 0
            return self._clamp(limit + max(1, math.ceil(math.sqrt(limit))))
        self._holds += 1
        if self._holds > HOLD_WINDOWS:  # one step higher, just enough for FLAT_MIN_STEP to tell
            return self._clamp(limit + max(1, math.ceil(limit * (FLAT_MIN_STEP - 1) - _EPSILON)))
        return limit

    def _rebased(self, limit: int, latency: float, at_minimum: bool) -> float:
        """The baseline after a window of ``latency`` at ``limit``: lowered by a lower latency; re-measured by a window
        at the minimum (a probe by another name) and by one whose latency did not move with the limit."""
        assert self.baseline_s is not None
        baseline = min(self.baseline_s, latency)
        if at_minimum:
            baseline = latency
        elif self._previous is not None and latency > 0 and self._previous[1] > 0:
            before_limit, before = self._previous
            step = abs(math.log(limit / before_limit))
            if step >= math.log(FLAT_MIN_STEP) and abs(math.log(latency / before)) <= FLAT_SHARE * step:
                baseline = max(baseline, min(latency, before))
        self.baseline_s = baseline
        return baseline

    def _count_drops(self, limit: int, calls: int, drops: int) -> None:
        counts = self._drops_by_limit.setdefault(limit.bit_length() - 1, [0.0, 0.0])
        if counts[0] > 10 * LOW_DROP_CALLS:
            counts[0] /= 2
            counts[1] /= 2
        counts[0] += calls
        counts[1] += drops

    def _probe_sample(self, latency_s: float, in_flight: int, outcome: CallOutcome) -> None:
        if outcome is CallOutcome.DROPPED:
            self._probe_drops += 1
            return
        if in_flight > self.bounds.minimum:
            return  # started before the calls of the last limit had drained: it may have queued
        self._probe_latencies.append(latency_s)
        if len(self._probe_latencies) < PROBE_CALLS:
            return
        now = self.clock()
        drops = self._probe_drops
        calls = drops + len(self._probe_latencies)
        if drops and drops / calls > max(DROP_TOLERANCE, DROP_MARGIN * self.low_drop_share(self.limit)):
            # Overloaded even at the minimum: the limit the probe gives back is cut, once.
            self._after_probe = self._clamp(math.floor(self._after_probe * DROP_FACTOR + _EPSILON))
        self._count_drops(self.limit, calls, drops)
        self.baseline_s = typical(self._probe_latencies)
        self.probing = False
        self._probe_latencies = []
        self._probe_drops = 0
        self._probed_at = now
        self._probe_spread = 1 - PROBE_JITTER * self._jitter()
        self._longest_s = 0.0
        self._set(self._after_probe, now)

    def _set(self, limit: int, now: float) -> None:
        """A new window starts (and, for a new limit, only calls started from now on count)."""
        if limit != self.limit:
            self.limit = limit
            self._changed_at = now
            self._holds = 0
        self._window_started = now
        self._latencies = []
        self._drops = 0
        self._most_in_flight = 0
        self._most_running = 0

    def _clamp(self, limit: int) -> int:
        return max(self.bounds.minimum, min(self.bounds.maximum, limit))


def thresholds(limit: int) -> tuple[float, float]:
    """Alpha and beta for ``limit``: :data:`ALPHA` and :data:`BETA` x log10(limit), at least 1 and 2 (below a limit of
    about 20 :data:`GROW_RATIO` and :data:`HOLD_RATIO` are the tighter bounds anyway)."""
    scale = math.log10(limit)
    return max(1.0, ALPHA * scale), max(2.0, BETA * scale)


def typical(latencies: list[float]) -> float:
    """The latency a window (or a probe) is judged by: the mean of its middle half (the interquartile mean). Unlike the
    median it does not jump between the modes of a handler with cache hits (45 % of 1 ms calls, 55 % of 10 ms: the
    median of a few calls is either), and unlike the mean one slow call in a hundred does not move it."""
    ordered = sorted(latencies)
    count = len(ordered)
    quarter = count // 4
    middle = ordered[quarter : count - quarter] or ordered
    return statistics.fmean(middle)
