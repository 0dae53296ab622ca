"""The dashboard's history: a Faust timer samples every 10 s, ``GET /retry/history`` serves the last hour.

Two rings per worker (``rebound/history.py`` does the arithmetic, bounded memory):

- ``worker``: this worker's partitions (the backlog the status board computes from the store's counts and the
  schedule's heaps, no scan) and this worker's counters;
- ``cluster``: the cluster-wide backlog as the status board aggregates it from every worker's latest summary, and the
  sum of every fresh worker's counter growth (each worker publishes its counters with its summary every 2 s, so
  the cluster's rates lag by up to that much).

Release lateness: the mean per interval comes from the counters (``released``, ``release.lag_ms_total``), so it is
cluster-wide in the cluster ring; p50 and p99 per interval come from this worker's lateness histogram
(``runtime.metrics.release_lateness``, read in memory), so they are this worker's in both rings.

Each worker keeps its own rings since it started, so a worker that started ten minutes ago shows ten minutes. The
rings are the web layer's own state: :func:`register_history` makes them and hands them to the timer and the view
(the runtime, which the agents share, does not carry them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from agents.runtime import Runtime
from agents.status import build_summary, local_partition_tiers, status_board
from rebound.history import INTERVAL_MS, Buckets, History
from rebound.summary import finish, sum_tiers

log = logging.getLogger(__name__)

PERIOD_S = INTERVAL_MS / 1000
SCOPES = ("cluster", "worker")


@dataclass
class Histories:
    started_at_ms: int
    worker: History = field(default_factory=History)
    cluster: History = field(default_factory=History)


def lateness_buckets(runtime: Runtime) -> Buckets | None:
    """This worker's release-lateness histogram, every label summed: (bound in seconds, cumulative count)."""
    histogram = getattr(getattr(runtime, "metrics", None), "release_lateness", None)
    if histogram is None:
        return None
    totals: dict[float, int] = {}
    for family in histogram.collect():
        for point in family.samples:
            if point.name.endswith("_bucket"):
                bound = float(point.labels["le"])
                totals[bound] = totals.get(bound, 0) + int(point.value)
    return sorted(totals.items()) or None


def sample(runtime: Runtime, rings: Histories) -> None:
    """One sample of both rings. Reads counters and the status board only: no table, no topic."""
    board = status_board(runtime)
    now = runtime.clock()
    own = {name: int(value) for name, value in runtime.counters.items()}
    local = sum_tiers(local_partition_tiers(runtime), runtime.tier_topics)
    lateness = lateness_buckets(runtime)
    rings.worker.record(
        at_ms=now,
        tiers={name: finish(stats, now) for name, stats in local.items()},
        counters={board.worker_id: own},
        from_zero={board.worker_id},
        started_at_ms=rings.started_at_ms,
        lateness=lateness,
    )
    board.record(build_summary(runtime))  # this worker's part as it is now, as the backlog view does
    cluster = board.cluster(runtime)
    fresh = {worker["worker"] for worker in cluster["workers"]}
    rings.cluster.record(
        at_ms=now,
        tiers=cluster["tiers"],
        counters={worker: summary.counters for worker, summary in board.latest.items() if worker in fresh},
        from_zero={board.worker_id},
        started_at_ms=rings.started_at_ms,
        lateness=lateness,
    )


def history_view(
    runtime: Runtime, rings: Histories, *, scope: str = "cluster", since_ms: int | None = None
) -> dict[str, Any]:
    ring = rings.worker if scope == "worker" else rings.cluster
    board = status_board(runtime)
    result = {
        "scope": "worker" if scope == "worker" else "cluster",
        "sampled_by": board.worker_id,
        "since_start_ms": runtime.clock() - rings.started_at_ms,
        "lateness_percentiles": "this worker",
        **ring.to_dict(now_ms=runtime.clock(), since_ms=since_ms),
    }
    return result


def register_history(runtime: Runtime) -> Histories:
    """The sampling timer (every worker runs it: each keeps its own rings); the rings it fills, for the view."""
    rings = Histories(started_at_ms=runtime.clock())

    @runtime.app.timer(PERIOD_S, name="rebound.history_sample")  # type: ignore[untyped-decorator]
    async def sample_history() -> None:
        try:
            sample(runtime, rings)
        except Exception:  # a chart is never worth a worker
            log.exception("could not sample the dashboard history")

    return rings
