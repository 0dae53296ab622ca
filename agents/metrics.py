"""Prometheus metrics of one worker, through ``prometheus_client``, in a registry of the runtime's own.

Counters and histograms are observed where things happen: every attempt outcome (``agents/delivery.py``
``emit_attempt``), every park (``agents/tier.py``), every handler call (``agents/attempt.py``), every release
and every release tick (``agents/release.py``). Gauges are read when ``/metrics`` is scraped (:class:`RuntimeCollector`), from what the status
views read (counts and the schedule's heaps, never a scan of the table), and so are the few internal counters worth
exporting (``runtime.counters`` stays as it is: the tests and the benchmarks read it).

Label values are bounded: ``topic`` is a configured main topic (or a tier topic for a tier record whose own headers
could not be trusted), ``tier`` a tier label (``main`` for a first try, ``held`` for a key-ordered held message),
``outcome`` and ``reason`` enumerations, ``error_class`` a class name (never a message), capped at
:data:`MAX_ERROR_CLASSES` distinct values per worker (the rest are ``other``: a tier record's error class comes from its
headers).
"""

from __future__ import annotations

import bisect
import copy
import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from rebound.undecodable import UndecodableBatches

if TYPE_CHECKING:
    from agents.runtime import Runtime

log = logging.getLogger(__name__)

MAIN_TIER = "main"
"""The ``tier`` label of a first try (an attempt that ran from the main topic)."""
OTHER = "other"
MAX_ERROR_CLASSES = 100
_ERROR_CLASS = re.compile(r"[A-Za-z_][\w.]{0,199}")

LATENESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Release lateness (due time to the release's start): 5 ms to 60 s."""
_HANDLER_LADDER = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TICK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
"""A release tick's own duration: 0.1 ms to 1 s."""
BREAKER_STATES = {"closed": 0, "open": 1, "half-open": 2}

# runtime.counters name -> label value, for the internal counters exported at scrape time.
RELEASE_SKIPPED = {
    "release.stale": "stale",
    "release.early": "early",
    "breaker.deferred": "breaker-open",
    "release.revoked": "revoked",
    "release.ended": "ended",
}
FIRST_TRY_REVOKED = {"main.revoked_before_send": "before-send", "main.revoked_after_send": "after-send"}
ADMIN_ACTIONS = {"admin.dead_lettered": "dead-letter", "admin.retry_now": "retry-now", "admin.unblocked": "unblock"}
# tables/fencing.py TableFence counter -> kind label, for the changelog records the writer-epoch fence handled.
FENCE_RECORDS = {
    "records_skipped": "skipped",
    "records_deferred": "deferred",
    "records_fetched_before": "fetched-before",
    "records_before_the_marker": "before-the-marker",
}


def handler_buckets(timeout_s: float) -> tuple[float, ...]:
    """1 ms up to the handler timeout (a timed-out call is observed at the timeout)."""
    return (*(bound for bound in _HANDLER_LADDER if bound < timeout_s), timeout_s)


class Metrics:
    """The registry of one runtime, with the metrics observed in the agents."""

    def __init__(self, runtime: Runtime) -> None:
        self.registry = CollectorRegistry()
        self.attempts = Counter(
            "rebound_attempts",
            "Attempt outcomes: every first try, retry, held message and dead letter, as on the attempts topic.",
            ["topic", "tier", "outcome", "reason", "error_class"],
            registry=self.registry,
        )
        self.parked = Counter(
            "rebound_parked",
            "Messages parked in a retry tier (a redelivered tier record that parks nothing new is not counted).",
            ["topic", "tier"],
            registry=self.registry,
        )
        self.handler_timeout_s = runtime.settings.handler_timeout_s
        self.handler_duration = Histogram(
            "rebound_handler_duration_seconds",
            "Handler call duration; result ok, error (it raised) or timeout (observed at the handler timeout).",
            ["topic", "tier", "result"],
            buckets=handler_buckets(runtime.settings.handler_timeout_s),
            registry=self.registry,
        )
        self.release_lateness = Histogram(
            "rebound_release_lateness_seconds",
            "Time from a parked message's due time to the start of its release (never negative: never early).",
            ["topic", "tier"],
            buckets=LATENESS_BUCKETS,
            registry=self.registry,
        )
        self.release_tick = Histogram(
            "rebound_release_tick_seconds",
            "Duration of each release tick: choosing the due releases and handing their request records to the "
            "producer, on the event loop (not the wait between ticks).",
            buckets=TICK_BUCKETS,
            registry=self.registry,
        )
        for tier in runtime.tiers.values():  # every tier shows from the start, so rate() has a zero to start from
            if not tier.draining:
                self.parked.labels(tier.main_topic, tier.label)
                self.release_lateness.labels(tier.main_topic, tier.label)
        self._error_classes: set[str] = set()
        # Every message counts an attempt and observes a handler call, each on the child of its label values; the
        # children are kept here because ``labels()`` checks, converts and looks them up under a lock on every call
        # (measured: 1.7 and 2.6 µs a call through ``labels()``, 0.6 and 0.8 µs on a kept child). Their label
        # values are bounded (see the module's docstring), and so are these dicts.
        self._attempt_children: dict[tuple[str, str, str, str, str], Any] = {}
        self._handler_children: dict[tuple[str, str, str], Any] = {}
        # What was observed since the last scrape, applied to the children when ``/metrics`` is read
        # (:meth:`flush`): a child's inc() and observe() take a lock and a few calls each, twice per healthy message.
        self._attempts_pending: dict[tuple[str, str, str, str, str], int] = {}
        self._handler_pending: dict[tuple[str, str, str], list[float]] = {}
        """Per label values: the sum of the durations, then a count per bucket (the +Inf one last)."""
        self._handler_bounds = (*handler_buckets(runtime.settings.handler_timeout_s), float("inf"))
        self._tick_pending: list[float] | None = None
        """The release ticks since the last scrape, as a row of ``_handler_pending``."""
        self._tick_bounds = (*TICK_BUCKETS, float("inf"))
        self.registry.register(RuntimeCollector(runtime))

    def attempt(
        self, topic: str, tier: str | None, outcome: str, reason: str | None = None, error_class: str | None = None
    ) -> None:
        values = (topic, tier or MAIN_TIER, outcome, reason or "", self.error_class(error_class) if error_class else "")
        pending = self._attempts_pending
        pending[values] = pending.get(values, 0) + 1

    def handler_called(self, topic: str, tier: str | None, seconds: float, task: Any) -> None:
        """``task`` is the handler's finished task, or None when it ran past its timeout."""
        if task is None:
            result = "timeout"
            seconds = self.handler_timeout_s  # in the timeout's own bucket: the wait that noticed it ran a bit over
        elif task.cancelled() or task.exception() is not None:
            result = "error"
        else:
            result = "ok"
        values = (topic, tier or MAIN_TIER, result)
        row = self._handler_pending.get(values)
        if row is None:
            row = self._handler_pending[values] = _pending_row(self._handler_bounds, self._handler_children.get(values))
        seconds = max(0.0, seconds)  # (:func:`_observe` written out: this runs once per handler call)
        row[0] += seconds
        row[1 + bisect.bisect_left(self._handler_bounds, seconds)] += 1

    def release_ticked(self, seconds: float) -> None:
        """One release tick took ``seconds`` (``agents/release.py``, :func:`release_ticks`): kept as the handler
        durations are, applied at the scrape."""
        row = self._tick_pending
        if row is None:
            row = self._tick_pending = _pending_row(self._tick_bounds, self.release_tick)
        _observe(row, self._tick_bounds, seconds)

    def flush(self) -> None:
        """Apply what was observed since the last flush to the Prometheus children (before every scrape)."""
        attempts, self._attempts_pending = self._attempts_pending, {}
        for values, times in attempts.items():
            child = self._attempt_children.get(values)
            if child is None:
                child = self._attempt_children[values] = self.attempts.labels(*values)
            child.inc(times)
        durations, self._handler_pending = self._handler_pending, {}
        for labels, row in durations.items():
            histogram = self._handler_children.get(labels)
            if histogram is None:
                histogram = self._handler_children[labels] = self.handler_duration.labels(*labels)
            _apply(histogram, row)
        ticks, self._tick_pending = self._tick_pending, None
        if ticks is not None:
            _apply(self.release_tick, ticks)

    def released(self, topic: str, tier: str | None, lateness_ms: int) -> None:
        self.release_lateness.labels(topic, tier or MAIN_TIER).observe(max(0, lateness_ms) / 1000)

    def error_class(self, name: str | None) -> str:
        """A bounded label value for an error class name."""
        if not name:
            return ""
        if name in self._error_classes:
            return name
        if len(self._error_classes) >= MAX_ERROR_CLASSES or not _ERROR_CLASS.fullmatch(name):
            return OTHER
        self._error_classes.add(name)
        return name

    def exposition(self) -> tuple[bytes, str]:
        """The text to serve on ``/metrics`` and its content type."""
        self.flush()
        return generate_latest(WithoutCreated(self.registry)), CONTENT_TYPE_LATEST


def _pending_row(bounds: tuple[float, ...], histogram: Any) -> list[float]:
    """A histogram's observations kept between scrapes: the sum, then a count per bucket of ``bounds`` (the +Inf one
    last). The sum starts at the histogram's own (None: a child not made yet), so it is added to one observation at a
    time, as observe() does (float addition is not associative)."""
    row = [0.0] * (len(bounds) + 1)
    if histogram is not None:
        row[0] = histogram._sum.get()
    return row


def _observe(row: list[float], bounds: tuple[float, ...], seconds: float) -> None:
    seconds = max(0.0, seconds)
    row[0] += seconds
    row[1 + bisect.bisect_left(bounds, seconds)] += 1  # the first bucket it is at most


def _apply(histogram: Any, row: list[float]) -> None:
    """Write a row kept by :func:`_observe` into the histogram (or histogram child) it was kept for."""
    # (prometheus_client's Histogram child: a value for the sum, one per bucket; observe() adds to them so)
    histogram._sum.set(row[0])
    for index, observed in enumerate(row[1:]):
        if observed:
            histogram._buckets[index].inc(observed)


class WithoutCreated:
    """A registry's metrics without their ``*_created`` samples (in the text format, a gauge per counter and
    histogram child, which nothing here wants).

    Left out here, at the scrape, rather than with ``prometheus_client.disable_created_metrics()``: that switch is
    process-wide and would also change the metrics a handler exports through ``prometheus_client``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            created = metric.name + "_created"
            if not any(sample.name == created for sample in metric.samples):
                yield metric
                continue
            kept = copy.copy(metric)
            kept.samples = [sample for sample in metric.samples if sample.name != created]
            yield kept


class RuntimeCollector:
    """Gauges (and the exported internal counters) read at scrape time. Each part is read on its own: one that fails
    is logged and left out, never the whole scrape."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def describe(self) -> Iterable[Metric]:
        return ()  # names are not checked against the registry's others: they are all distinct by construction

    def collect(self) -> Iterator[Metric]:
        for part in (
            self._tiers,
            self._counters,
            self._paused,
            self._breaker,
            self._ordering,
            self._consumer_lag,
            self._undecodable,
            self._redeliveries_skipped,
            self._concurrency,
            self._fences,
            self._settings_mismatch,
        ):
            try:
                yield from list(part())
            except Exception:
                log.warning("metrics: %s failed; left out of this scrape", part.__name__, exc_info=True)

    def _tiers(self) -> Iterator[Metric]:
        from agents.status import local_partition_tiers
        from rebound.summary import finish, sum_tiers

        runtime = self.runtime
        labels = ["topic", "tier"]
        waiting = GaugeMetricFamily("rebound_tier_waiting", "Messages parked per tier on this worker.", labels=labels)
        overdue = GaugeMetricFamily(
            "rebound_tier_overdue",
            "Parked messages already due (not yet released), per tier, on this worker.",
            labels=labels,
        )
        oldest = GaugeMetricFamily(
            "rebound_tier_oldest_overdue_seconds",
            "How long the oldest due, not yet released message of a tier has been due (0 when none is).",
            labels=labels,
        )
        now = runtime.clock()
        for name, stats in sorted(sum_tiers(local_partition_tiers(runtime), runtime.tier_topics).items()):
            tier = runtime.tiers.get(name)
            label = [tier.main_topic, tier.label] if tier is not None else [name, OTHER]
            done = finish(stats, now)
            waiting.add_metric(label, done["waiting"])
            overdue.add_metric(label, done["overdue"])
            oldest.add_metric(label, done["max_overdue_ms"] / 1000)
        yield from (waiting, overdue, oldest)

    def _counters(self) -> Iterator[Metric]:
        counters = self.runtime.counters
        received = CounterMetricFamily("rebound_main_received", "Records taken off the main topics by this worker.")
        received.add_metric([], counters.get("main.received", 0))
        yield received
        yield _labelled(
            counters,
            "rebound_first_try_revoked",
            "First tries (a key-ordered held message's included) whose partition was revoked, or whose session lease "
            "lapsed, around their retry or dead letter, the record (or the release request that ran the held message) "
            "left unacknowledged for the new owner: before-send, during the confirmed write before the send (nothing "
            "sent); after-send, during the send (the write that records it not made).",
            "when",
            FIRST_TRY_REVOKED,
        )
        yield _labelled(
            counters,
            "rebound_release_skipped",
            "Release requests that sent nothing: stale (settled or superseded), early (not due yet: rescheduled), "
            "breaker-open (deferred while the circuit breaker is open), revoked (its partition was revoked before its "
            "outcome was sent: nothing sent, the new owner releases it), ended (a stale parked copy of a message that "
            "ended already: dropped, not run).",
            "reason",
            RELEASE_SKIPPED,
        )
        duplicates = CounterMetricFamily(
            "rebound_tier_duplicates", "Redelivered tier records that parked nothing new (already parked)."
        )
        duplicates.add_metric([], counters.get("tier.duplicates", 0))
        yield duplicates
        yield _labelled(
            counters,
            "rebound_admin_actions",
            "Admin actions carried out on this worker: messages dead-lettered, messages retried now, keys unblocked.",
            "action",
            ADMIN_ACTIONS,
        )
        rejected = CounterMetricFamily(
            "rebound_signature_rejected",
            "Signed (republished) records that failed verification and were taken as first deliveries.",
        )
        rejected.add_metric([], counters.get("main.signature_rejected", 0))
        yield rejected
        paced = CounterMetricFamily(
            "rebound_release_paced",
            "Releases REBOUND_RELEASE_RATE (or the ramp after the breaker closed) sent later than they were due, each "
            "counted once (a lost request sent again is neither paced nor counted); the delay is in "
            "rebound_release_lateness_seconds.",
        )
        paced.add_metric([], counters.get("release.paced", 0))
        yield paced
        for name, counter, text in (
            (
                "rebound_release_requests_sent",
                "release.requests",
                "Release requests the release timer sent (a lost one sent again counted again).",
            ),
            (
                "rebound_release_request_records",
                "release.request_records",
                "Records the release timer sent them in (REBOUND_RELEASE_BATCH): requests per record is "
                "rebound_release_requests_sent over this.",
            ),
            (
                "rebound_release_request_send_failed",
                "release.send_failed",
                "Release request records whose send failed (their requests are sent again later).",
            ),
        ):
            family = CounterMetricFamily(name, text)
            family.add_metric([], counters.get(counter, 0))
            yield family
        rate = self.runtime.pacer.rate_at(self.runtime.clock())
        if rate is not None:
            gate = self.runtime.breaker_gate
            if gate is not None and gate.breaker.is_open:
                rate = 0.0  # the breaker holds releases back: only its probe goes
            allowed = GaugeMetricFamily(
                "rebound_release_rate_allowed",
                "Releases per second the pacer allows now: 0 while the circuit breaker is open (only its probe goes); "
                "absent: unlimited.",
            )
            allowed.add_metric([], rate)
            yield allowed

    def _paused(self) -> Iterator[Metric]:
        from agents.control import main_paused, pause_state_known

        paused = GaugeMetricFamily(
            "rebound_main_paused",
            "1 while an operator's pause of the main topics is in effect (first tries held; retries still released).",
        )
        paused.add_metric([], 1 if main_paused(self.runtime) else 0)
        yield paused
        known = GaugeMetricFamily(
            "rebound_pause_state_known",
            "1 once this worker has read the pause state; 0 while its first tries are held for not knowing it.",
        )
        known.add_metric([], 1 if pause_state_known(self.runtime) else 0)
        yield known

    def _settings_mismatch(self) -> Iterator[Metric]:
        from agents.status import status_board

        mismatch = GaugeMetricFamily(
            "rebound_settings_mismatch",
            "1 while a fresh worker of the group reports other retry settings than this one (see /retry/backlog).",
        )
        mismatch.add_metric([], 1 if status_board(self.runtime).settings_mismatch(self.runtime.clock()) else 0)
        yield mismatch

    def _breaker(self) -> Iterator[Metric]:
        runtime = self.runtime
        gate = runtime.breaker_gate
        if gate is None:
            return
        snapshot = gate.breaker.snapshot(runtime.clock())
        state = GaugeMetricFamily(
            "rebound_breaker_state", "Circuit breaker of this worker: 0 closed, 1 open, 2 half-open."
        )
        state.add_metric([], BREAKER_STATES.get(str(snapshot["state"]), -1))
        opens = CounterMetricFamily("rebound_breaker_opens", "Times the circuit breaker opened.")
        opens.add_metric([], snapshot["opens_total"])
        probes = CounterMetricFamily("rebound_breaker_probes", "Probe calls let through the open circuit breaker.")
        probes.add_metric([], snapshot["probes_total"])
        held = CounterMetricFamily(
            "rebound_breaker_held_seconds", "Time the circuit breaker held consumption and releases."
        )
        held.add_metric([], snapshot["held_ms_total"] / 1000)
        waiting = GaugeMetricFamily(
            "rebound_breaker_waiting_calls", "Handler calls waiting at the open circuit breaker."
        )
        waiting.add_metric([], gate.waiting)
        yield from (state, opens, probes, held, waiting)

    def _ordering(self) -> Iterator[Metric]:
        runtime = self.runtime
        if not runtime.settings.key_ordered:
            return
        from agents.status import local_ordering
        from rebound.summary import sum_ordering

        counts = sum_ordering(local_ordering(runtime).values())
        blocked = GaugeMetricFamily(
            "rebound_ordering_blocked_keys", "Keys whose later messages wait for a retrying message (key-ordered mode)."
        )
        blocked.add_metric([], counts["blocked_keys"])
        held = GaugeMetricFamily(
            "rebound_ordering_held_messages", "Messages held behind their key's retrying message (key-ordered mode)."
        )
        held.add_metric([], counts["held"])
        released = CounterMetricFamily(
            "rebound_ordering_released", "Held messages run once their key's block was lifted (key-ordered mode)."
        )
        released.add_metric([], runtime.counters.get("ordering.released", 0))
        yield from (blocked, held, released)

    def _consumer_lag(self) -> Iterator[Metric]:
        lag = GaugeMetricFamily(
            "rebound_consumer_lag",
            "Records of a main-topic partition this worker owns not yet committed: the highwater seen by the fetcher "
            "minus the committed offset (the fetch position before the first commit).",
            labels=["topic", "partition"],
        )
        for (topic, partition), value in sorted(consumer_lag(self.runtime).items()):
            lag.add_metric([topic, str(partition)], value)
        yield lag

    def _undecodable(self) -> Iterator[Metric]:
        labels = ["topic", "partition"]
        stopped = GaugeMetricFamily(
            "rebound_undecodable_offset",
            "Partitions this worker's consumer is stopped on: the first offset of the record batch it cannot decode "
            "(corrupt CRC, unknown codec). Present only while the partition is stopped; every other partition goes "
            "on. docs/undecodable-batches.md says how to move past it.",
            labels=labels,
        )
        failed = CounterMetricFamily(
            "rebound_undecodable_batches",
            "Fetched record batches this worker could not decode (the first failure and every retry), per partition.",
            labels=labels,
        )
        batches = undecodable_batches(self.runtime.app)
        if batches is not None:
            for stuck in batches.snapshot():
                stopped.add_metric([stuck.topic, str(stuck.partition)], stuck.offset)
            for (topic, partition), count in sorted(batches.failures().items()):
                failed.add_metric([topic, str(partition)], count)
        yield from (stopped, failed)

    def _redeliveries_skipped(self) -> Iterator[Metric]:
        skipped = CounterMetricFamily(
            "rebound_redelivery_skipped",
            "Records read again that this worker had finished already (before it lost and got back the partition, or "
            "before a seek back): acknowledged without reaching a handler, per topic read.",
            labels=["topic"],
        )
        counts = getattr(getattr(self.runtime.app, "_consumer", None), "redeliveries_skipped", None)
        if isinstance(counts, Mapping):
            for topic, count in sorted(counts.items()):
                skipped.add_metric([topic], count)
        yield skipped

    def _concurrency(self) -> Iterator[Metric]:
        """The limit on handler calls and the calls in flight; with ``REBOUND_CONCURRENCY=auto`` also its range, the
        no-queue latency it compares with (once a probe measured it) and whether it is probing."""
        snapshot = self.runtime.dispatcher.concurrency()
        limit = GaugeMetricFamily(
            "rebound_concurrency_limit",
            "Handler calls this worker may run at once now: REBOUND_CONCURRENCY, or the adaptive limit with auto.",
        )
        limit.add_metric([], snapshot["limit"])
        in_flight = GaugeMetricFamily("rebound_handler_in_flight", "Handler calls running now on this worker.")
        in_flight.add_metric([], snapshot["in_flight"])
        yield from (limit, in_flight)
        if snapshot["mode"] != "auto":
            return
        for name, key, text in (
            ("rebound_concurrency_min", "minimum", "REBOUND_CONCURRENCY_MIN: the lowest the adaptive limit goes."),
            ("rebound_concurrency_max", "maximum", "REBOUND_CONCURRENCY_MAX: the highest the adaptive limit goes."),
        ):
            gauge = GaugeMetricFamily(name, text)
            gauge.add_metric([], snapshot[key])
            yield gauge
        probing = GaugeMetricFamily(
            "rebound_concurrency_probing",
            "1 while the adaptive limit is held at its minimum to measure the handler's latency without queueing.",
        )
        probing.add_metric([], 1 if snapshot["probing"] else 0)
        yield probing
        if snapshot["baseline_ms"] is not None:
            baseline = GaugeMetricFamily(
                "rebound_concurrency_baseline_seconds",
                "The handler's latency without queueing that the adaptive limit compares each window's median with.",
            )
            baseline.add_metric([], snapshot["baseline_ms"] / 1000)
            yield baseline

    def _fences(self) -> Iterator[Metric]:
        """What each table's writer-epoch fence (``tables/fencing.py``) counted since the worker started."""
        records = CounterMetricFamily(
            "rebound_fence_records",
            "Changelog records the writer-epoch fence handled, per table: skipped (written by an owner already "
            "superseded), deferred (fetched past the recovery's high watermark, left to the next), fetched-before "
            "(fetched before the last rebalance, read again), before-the-marker (read between a recovery's high "
            "watermark and its claim's marker).",
            labels=["table", "kind"],
        )
        written_over = CounterMetricFamily(
            "rebound_fence_keys_written_over",
            "Keys a claim wrote again after its marker because a record of theirs landed between the recovery's high "
            "watermark and that marker, per table.",
            labels=["table"],
        )
        for fence in self.runtime.fences:
            table = fence.table.name
            for attribute, kind in FENCE_RECORDS.items():
                records.add_metric([table, kind], getattr(fence, attribute))
            written_over.add_metric([table], fence.keys_written_over_the_span)
        yield from (records, written_over)


def _labelled(
    counters: Mapping[str, int], name: str, documentation: str, label: str, values: Mapping[str, str]
) -> CounterMetricFamily:
    """A counter family of internal counters, one sample per ``values`` item (``runtime.counters`` name -> value of
    ``label``), 0 for a counter not counted yet."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for counter, value in values.items():
        family.add_metric([value], counters.get(counter, 0))
    return family


def consumer_lag(runtime: Runtime) -> dict[tuple[str, int], int]:
    """Per main-topic partition actively owned here: highwater minus committed offset. No request to the broker: the
    highwater is the one the fetcher's last fetch answered (aiokafka keeps it per partition; a plain read, as Faust's
    own ``consumer.highwater`` is used from the event loop), the committed offset the one Faust keeps after each
    commit. A partition not fetched from yet (no highwater) or not assigned (any more) is left out."""
    consumer = getattr(runtime.app, "_consumer", None)  # not ``app.consumer``: that would make one
    thread = getattr(consumer, "_thread", None)
    if consumer is None or getattr(thread, "_consumer", None) is None:
        return {}  # the worker has not started its consumer
    mains = set(runtime.settings.topics)
    owned = [tp for tp in runtime.app.assignor.assigned_actives() if tp.topic in mains]
    committed_offsets = consumer._committed_offset
    lags: dict[tuple[str, int], int] = {}
    for tp in owned:
        try:
            highwater = consumer.highwater(tp)
            committed = committed_offsets.get(tp)
            if committed is None:
                committed = thread._positions([tp]).get(tp)  # type: ignore[union-attr]
        except Exception:  # revoked since (aiokafka asserts the assignment), or stopping
            continue
        if highwater is None or committed is None:
            continue
        lags[(tp.topic, tp.partition)] = max(0, int(highwater) - int(committed))
    return lags


def undecodable_batches(app: Any) -> UndecodableBatches | None:
    """The consumer thread's record of stopped partitions (None before the worker started its consumer). Read through
    ``app._consumer``: ``app.consumer`` would make a consumer."""
    thread = getattr(getattr(app, "_consumer", None), "_thread", None)
    found = getattr(thread, "undecodable", None)
    return found if isinstance(found, UndecodableBatches) else None
