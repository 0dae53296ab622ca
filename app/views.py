"""Faust web views: health, readiness, backlog (cluster-wide), per-key state, failed topics, dashboard, metrics, admin.

Status views show counts and metadata, never payloads unless ``REBOUND_SHOW_PAYLOADS`` is on: a retry backlog is
full of customer data.
"""

from __future__ import annotations

import logging
from typing import Any

from agents.ownership import owned_partitions
from agents.status import breaker_snapshot, local_ordering, local_partition_tiers, status_board
from app.runtime import Runtime
from app.web.dashboard import DASHBOARD_HTML
from app.web.failed import DEFAULT_LIMIT, FailedTopicReader
from app.web.summary import (
    WorkerSummary,
    finish,
    sum_ordering,
    sum_tiers,
    worker_backlog,
)
from rebound.state import table_key_of_text

log = logging.getLogger(__name__)


def backlog(runtime: Runtime) -> dict[str, Any]:
    """Per tier over this worker's owned partitions (``?scope=worker``): counted as messages park and settle."""
    owned = owned_partitions(runtime) | runtime.schedule.partitions
    tiers, ordering = local_partition_tiers(runtime), local_ordering(runtime)
    result = worker_backlog(tiers, now_ms=runtime.clock(), tier_names=runtime.tier_topics, owned=owned)
    result["ordering"] = {"mode": runtime.settings.ordering, **sum_ordering(ordering.values())}
    result["breaker"] = breaker_snapshot(runtime)
    return result


def cluster_backlog(runtime: Runtime) -> dict[str, Any]:
    """Per tier over every worker: the latest published summaries, this worker's own part computed now."""
    board = status_board(runtime)
    tiers, ordering = local_partition_tiers(runtime), local_ordering(runtime)
    board.record(
        WorkerSummary(
            worker=board.worker_id,
            url=board.url,
            at_ms=runtime.clock(),
            partitions=tiers,
            owned=tuple(sorted(owned_partitions(runtime))),
            ordering=ordering,
            breaker=breaker_snapshot(runtime),
        )
    )
    result = board.cluster(runtime)
    result["ordering"] = {"mode": runtime.settings.ordering, **result["ordering"]}
    return result


def metrics_text(runtime: Runtime) -> str:
    lines = [
        "# HELP rebound_events_total Messages seen, by stage and outcome.",
        "# TYPE rebound_events_total counter",
    ]
    for name, value in sorted(runtime.counters.items()):
        lines.append(f'rebound_events_total{{event="{name}"}} {value}')
    lines += [
        "# HELP rebound_scheduled_waiting Messages parked on this worker's partitions.",
        "# TYPE rebound_scheduled_waiting gauge",
        f"rebound_scheduled_waiting {runtime.schedule.waiting()}",
    ]
    now = runtime.clock()
    tiers = sum_tiers(local_partition_tiers(runtime), runtime.tier_topics)
    gauges = [
        ("rebound_tier_waiting", "Messages parked per tier on this worker's partitions.", "waiting"),
        ("rebound_tier_overdue", "Parked messages already due, per tier, on this worker.", "overdue"),
        (
            "rebound_tier_oldest_overdue_seconds",
            "How long the oldest due message of a tier has been due.",
            "max_overdue",
        ),
    ]
    for metric, help_text, field in gauges:
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge"]
        for name, stats in sorted(tiers.items()):
            done = finish(stats, now)
            value = done["max_overdue_ms"] / 1000 if field == "max_overdue" else done[field]
            lines.append(f'{metric}{{tier="{name}"}} {value}')
    gate = runtime.breaker_gate
    if gate is not None:
        snapshot = gate.breaker.snapshot(now)
        states = {"closed": 0, "open": 1, "half-open": 2}
        lines += [
            "# HELP rebound_breaker_state Circuit breaker of this worker: 0 closed, 1 open, 2 half-open.",
            "# TYPE rebound_breaker_state gauge",
            f"rebound_breaker_state {states.get(str(snapshot['state']), -1)}",
            "# HELP rebound_breaker_opens_total Times the circuit breaker opened.",
            "# TYPE rebound_breaker_opens_total counter",
            f"rebound_breaker_opens_total {snapshot['opens_total']}",
            "# HELP rebound_breaker_held_seconds_total Time the circuit breaker held consumption.",
            "# TYPE rebound_breaker_held_seconds_total counter",
            f"rebound_breaker_held_seconds_total {snapshot['held_ms_total'] / 1000}",
            "# HELP rebound_breaker_waiting_calls Handler calls waiting at the open circuit breaker.",
            "# TYPE rebound_breaker_waiting_calls gauge",
            f"rebound_breaker_waiting_calls {gate.waiting}",
        ]
    if runtime.settings.key_ordered:
        ordering = sum_ordering(local_ordering(runtime).values())
        lines += [
            "# HELP rebound_ordering_blocked_keys Keys waiting for a retrying message (key-ordered mode; last scan).",
            "# TYPE rebound_ordering_blocked_keys gauge",
            f"rebound_ordering_blocked_keys {ordering['blocked_keys']}",
            "# HELP rebound_ordering_held_messages Messages held behind their key's retrying message.",
            "# TYPE rebound_ordering_held_messages gauge",
            f"rebound_ordering_held_messages {ordering['held']}",
        ]
    if "released" in runtime.counters:
        lines += [
            "# HELP rebound_release_lag_seconds Time from a message's due time to its release.",
            "# TYPE rebound_release_lag_seconds summary",
            f"rebound_release_lag_seconds_sum {runtime.counters.get('release.lag_ms_total', 0) / 1000}",
            f"rebound_release_lag_seconds_count {runtime.counters['released']}",
        ]
    return "\n".join(lines) + "\n"


def _int_arg(request: Any, name: str, default: int) -> int:
    try:
        return int(request.query.get(name, default))
    except (TypeError, ValueError):
        return default


def register_views(runtime: Runtime) -> None:
    from app.web.admin import register_admin_views

    app = runtime.app
    failed_reader = FailedTopicReader(
        runtime.settings.bootstrap_servers,
        [topic.get_topic_name() for topic in runtime.failed_topics.values()],
        fetch_max_wait_ms=min(runtime.settings.fetch_max_wait_ms, 200),
    )

    async def ensure_routable() -> None:
        """``table_route`` hashes the key with the producer's metadata of the changelog topic, which a worker that
        never wrote to it may not have yet; fetch it first (a 500 otherwise)."""
        try:
            topic = runtime.table.changelog_topic.get_topic_name()
            producer = app.producer._ensure_producer()  # type: ignore[attr-defined]
            if producer.client.cluster.partitions_for_topic(topic) is None:
                await producer.client._wait_on_metadata(topic)
        except Exception:
            log.debug("could not fetch changelog metadata for routing", exc_info=True)

    @app.page("/health")
    async def health(web: Any, request: Any) -> Any:
        return web.json({"status": "ok"})

    @app.page("/ready")
    async def ready(web: Any, request: Any) -> Any:
        is_ready = not app.rebalancing and bool(runtime.schedule.partitions or not runtime.partitions)
        return web.json({"ready": is_ready, "rebalancing": bool(app.rebalancing)}, status=200 if is_ready else 503)

    @app.page("/retry/backlog")
    async def retry_backlog(web: Any, request: Any) -> Any:
        if request.query.get("scope") == "worker":
            return web.json(backlog(runtime))
        return web.json(cluster_backlog(runtime))

    async def key_locally(web: Any, request: Any, key: str) -> Any:
        show = runtime.settings.show_payloads
        state = runtime.store.load(runtime.store.existing_key(table_key_of_text(key)), entries=True, with_payloads=show)
        if not state.pending:
            return web.json({"key": key, "found": False, "worker": status_board(runtime).worker_id}, status=404)
        summary = state.summary(show_payloads=show)
        return web.json({"key": key, "found": True, "worker": status_board(runtime).worker_id, **summary})

    routed_key: Any = app.table_route(table=runtime.table, match_info="key")(key_locally)

    @app.page("/retry/keys/{key}")
    async def retry_key(web: Any, request: Any, key: str) -> Any:
        await ensure_routable()
        return await routed_key(web, request, key=key)

    @app.page("/retry/failed")
    async def retry_failed(web: Any, request: Any) -> Any:
        limit = _int_arg(request, "limit", DEFAULT_LIMIT)
        summary = await failed_reader.summary(limit=limit, show_payloads=runtime.settings.show_payloads)
        return web.json(summary)

    @app.task  # type: ignore[untyped-decorator]
    async def close_failed_reader() -> None:
        """Owns the failed-topic reader's lifetime: its consumer is stopped when the worker stops."""
        import asyncio

        try:
            await asyncio.Event().wait()
        finally:
            await failed_reader.close()

    @app.page("/dashboard/")
    async def dashboard(web: Any, request: Any) -> Any:
        return web.html(DASHBOARD_HTML)

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        return web.text(metrics_text(runtime), content_type="text/plain; version=0.0.4")

    register_admin_views(runtime, ensure_routable)
