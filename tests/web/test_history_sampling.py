"""Sampling the dashboard history from a runtime: this worker's counters and the status board's other workers."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from agents.runtime import Runtime
from agents.status import status_board
from app.web.history import Histories, history_view, lateness_buckets, sample
from rebound.summary import WorkerSummary
from tests.agents.conftest import FakeClock


def test_samples_this_worker_and_the_cluster(make_runtime: Callable[..., Runtime], clock: FakeClock) -> None:
    runtime = make_runtime()
    rings = Histories(started_at_ms=clock())  # on the fixture's clock (swapped after the build)
    board = status_board(runtime)
    tier = next(iter(runtime.tier_topics))

    def other(counters: dict[str, int]) -> None:
        board.record(WorkerSummary(worker="other", url="", at_ms=clock(), partitions={}, counters=counters))

    runtime.counters["outcome.succeeded"] += 5
    runtime.counters["released"] += 2
    runtime.counters["release.lag_ms_total"] += 30
    clock.advance(10_000)
    other({"outcome.dead": 100})  # seen for the first time: its past is not this interval's
    sample(runtime, rings)

    runtime.counters["outcome.scheduled"] += 3
    clock.advance(10_000)
    other({"outcome.dead": 106})
    sample(runtime, rings)

    worker: dict[str, Any] = history_view(runtime, rings, scope="worker")
    assert worker["scope"] == "worker" and worker["sampled_by"] == board.worker_id
    first, second = worker["samples"]
    assert first["outcomes"]["succeeded"] == 5 and first["per_minute"]["succeeded"] == 30.0
    assert first["released"] == 2 and first["lag_mean_ms"] == 15.0
    assert second["outcomes"] == {"succeeded": 0, "retried": 3, "dead": 0, "held": 0}
    assert second["lag_mean_ms"] is None and second["interval_ms"] == 10_000
    assert first["tiers"][tier] == {"waiting": 0, "overdue": 0, "max_overdue_ms": 0}

    cluster = history_view(runtime, rings)
    assert cluster["scope"] == "cluster"
    assert [s["sources"] for s in cluster["samples"]] == [2, 2]
    assert cluster["samples"][0]["outcomes"]["dead"] == 0 and cluster["samples"][0]["outcomes"]["succeeded"] == 5
    assert cluster["samples"][1]["outcomes"]["dead"] == 6 and cluster["samples"][1]["outcomes"]["retried"] == 3
    assert cluster["window"]["outcomes"]["dead"] == 6
    assert history_view(runtime, rings, since_ms=cluster["samples"][0]["at"])["samples"] == cluster["samples"][1:]


def test_lateness_percentiles_come_from_this_workers_histogram(
    make_runtime: Callable[..., Runtime], clock: FakeClock
) -> None:
    from prometheus_client import CollectorRegistry, Histogram

    runtime = make_runtime()
    rings = Histories(started_at_ms=clock())
    histogram = Histogram("t_lateness", "test", ["tier"], buckets=(0.01, 0.1, 1.0), registry=CollectorRegistry())
    runtime.metrics = SimpleNamespace(release_lateness=histogram)  # type: ignore[assignment]
    for seconds in (0.005,) * 50 + (0.05,) * 49 + (0.5,):
        histogram.labels("a" if seconds < 0.1 else "b").observe(seconds)
    assert lateness_buckets(runtime) == [(0.01, 50), (0.1, 99), (1.0, 100), (float("inf"), 100)]
    clock.advance(10_000)
    sample(runtime, rings)
    histogram.labels("a").observe(0.5)
    clock.advance(10_000)
    sample(runtime, rings)
    first, second = history_view(runtime, rings, scope="worker")["samples"]
    assert first["lag_p50_ms"] == 10.0 and first["lag_p99_ms"] == 100.0
    assert second["lag_p50_ms"] == 550.0
    assert history_view(runtime, rings)["samples"][1]["lag_p50_ms"] == 550.0  # the cluster ring shows this worker's
    assert history_view(runtime, rings)["lateness_percentiles"] == "this worker"
