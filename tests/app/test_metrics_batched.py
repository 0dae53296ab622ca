"""Attempt counts, handler durations and release tick durations are kept as plain counts between scrapes and applied to the Prometheus
children when ``/metrics`` is read (``Metrics.flush``): the scrape must read exactly what observing each call on its
child would have written, bucket edges included."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

from agents.metrics import TICK_BUCKETS, Metrics, handler_buckets

DURATIONS = [0.0, 0.0004, 0.001, 0.0010001, 0.003, 0.05, 0.1, 0.1000001, 2.0, 7.5, 60.0, -1.0]


def metrics() -> Metrics:
    settings = SimpleNamespace(handler_timeout_s=5.0)
    return Metrics(SimpleNamespace(settings=settings, tiers={}))  # type: ignore[arg-type]


class Finished:
    """A handler's finished task, as ``call_handler`` passes it: failed or not."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def cancelled(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        return self.error


def lines(text: bytes, *prefixes: str) -> list[str]:
    return sorted(line for line in text.decode().splitlines() if line.startswith(prefixes))


def test_a_scrape_reads_what_observing_each_call_would_have_written() -> None:
    mine = metrics()
    registry = CollectorRegistry()
    attempts = Counter("rebound_attempts", "", ["topic", "tier", "outcome", "reason", "error_class"], registry=registry)
    durations = Histogram(
        "rebound_handler_duration_seconds", "", ["topic", "tier", "result"], buckets=handler_buckets(5.0),
        registry=registry,
    )  # fmt: skip
    for index, seconds in enumerate(DURATIONS):
        result = "ok" if index % 3 else "error"
        mine.handler_called("items", None, seconds, Finished(None if index % 3 else ValueError("boom")))
        durations.labels("items", "main", result).observe(max(0.0, seconds))
        mine.attempt("items", "5m" if index % 2 else None, "succeeded")
        attempts.labels("items", "5m" if index % 2 else "main", "succeeded", "", "").inc()
    mine.handler_called("items", "5m", 9.0, None)  # past its timeout
    durations.labels("items", "5m", "timeout").observe(5.0)
    first = mine.exposition()[0]
    wanted = generate_latest(registry)
    names = ("rebound_attempts_total", "rebound_handler_duration_seconds_bucket", "rebound_handler_duration_seconds_sum",
             "rebound_handler_duration_seconds_count")  # fmt: skip
    assert lines(first, *names) == lines(wanted, *names)
    # What comes after a scrape adds to what it read.
    mine.attempt("items", None, "succeeded")
    attempts.labels("items", "main", "succeeded", "", "").inc()
    assert lines(mine.exposition()[0], *names) == lines(generate_latest(registry), *names)


def test_nothing_observed_since_the_last_scrape_changes_nothing() -> None:
    mine = metrics()
    mine.attempt("items", None, "succeeded")
    once: Any = mine.exposition()[0]
    assert mine.exposition()[0] == once


def test_a_histogram_sum_over_several_scrapes_reads_what_observing_each_call_would_have_written() -> None:
    """The sum added a scrape at a time is not the sum added a call at a time: float addition is not associative
    (0.1 + 0.2 + 0.3 one by one is 0.6000000000000001, 0.1 + (0.2 + 0.3) is 0.6)."""
    mine = metrics()
    registry = CollectorRegistry()
    durations = Histogram(
        "rebound_handler_duration_seconds", "", ["topic", "tier", "result"], buckets=handler_buckets(5.0),
        registry=registry,
    )  # fmt: skip
    names = ("rebound_handler_duration_seconds_sum",)
    for batch in ([0.1], [0.2, 0.3]):
        for seconds in batch:
            mine.handler_called("items", None, seconds, Finished(None))
            durations.labels("items", "main", "ok").observe(seconds)
        assert lines(mine.exposition()[0], *names) == lines(generate_latest(registry), *names)


def test_release_ticks_read_what_observing_each_tick_would_have_written() -> None:
    """One observation per tick, bucket edges (0.1 ms, 1 s) and a tick past the last bucket included, over two
    scrapes."""
    mine = metrics()
    registry = CollectorRegistry()
    ticks = Histogram("rebound_release_tick_seconds", "", buckets=TICK_BUCKETS, registry=registry)
    names = ("rebound_release_tick_seconds_bucket", "rebound_release_tick_seconds_sum",
             "rebound_release_tick_seconds_count")  # fmt: skip
    assert lines(mine.exposition()[0], *names) == lines(generate_latest(registry), *names)  # zeros before any tick
    for batch in ([0.0, 0.00005, 0.0001, 0.0001001, 0.0007, 0.1, 1.0, 1.5, -0.001], [0.003, 0.3]):
        for seconds in batch:
            mine.release_ticked(seconds)
            ticks.observe(max(0.0, seconds))
        assert lines(mine.exposition()[0], *names) == lines(generate_latest(registry), *names)
