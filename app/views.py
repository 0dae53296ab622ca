"""Faust web views: health, readiness, per-tier backlog in time and count, per-key state, metrics.

Status views show counts and metadata, never payloads unless ``REBOUND_SHOW_PAYLOADS`` is on: a retry backlog is
full of customer data.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from app.runtime import Runtime
from rebound.state import KeyState


def backlog(runtime: Runtime) -> dict[str, Any]:
    """Per tier: waiting count, oldest due, next release and overdue count, over this worker's owned partitions."""
    now = runtime.clock()
    tiers: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"waiting": 0, "overdue": 0, "oldest_due": None, "next_release": None, "oldest_first_received": None}
    )
    for _key, raw in runtime.table.items():
        for entry in KeyState.from_json(raw).pending:
            tier = tiers[entry.tier_topic]
            tier["waiting"] += 1
            if entry.due_at_ms <= now:
                tier["overdue"] += 1
            tier["oldest_due"] = min(filter(None, [tier["oldest_due"], entry.due_at_ms]))
            if entry.due_at_ms > now:
                tier["next_release"] = min(filter(None, [tier["next_release"], entry.due_at_ms]))
            first = entry.provenance.first_received_at_ms
            tier["oldest_first_received"] = min(filter(None, [tier["oldest_first_received"], first]))
    for name in runtime.tier_topics:
        tiers[name]
    result = {}
    for name, tier in sorted(tiers.items()):
        oldest = tier["oldest_due"]
        tier["max_overdue_ms"] = max(0, now - oldest) if oldest else 0
        tier["next_release_in_ms"] = tier["next_release"] - now if tier["next_release"] else None
        result[name] = tier
    return {"now": now, "scope": "worker", "owned_partitions": sorted(runtime.schedule.partitions), "tiers": result}


def register_views(runtime: Runtime) -> None:
    app = runtime.app

    @app.page("/health")
    async def health(web: Any, request: Any) -> Any:
        return web.json({"status": "ok"})

    @app.page("/ready")
    async def ready(web: Any, request: Any) -> Any:
        is_ready = not app.rebalancing and bool(runtime.schedule.partitions or not runtime.partitions)
        return web.json({"ready": is_ready, "rebalancing": bool(app.rebalancing)}, status=200 if is_ready else 503)

    @app.page("/retry/backlog")
    async def retry_backlog(web: Any, request: Any) -> Any:
        return web.json(backlog(runtime))

    @app.page("/retry/keys/{key}")
    async def retry_key(web: Any, request: Any, key: str) -> Any:
        raw = runtime.table.get(key.encode("utf-8"))
        if raw is None:
            return web.json({"key": key, "found": False}, status=404)
        summary = KeyState.from_json(raw).summary(show_payloads=runtime.settings.show_payloads)
        return web.json({"key": key, "found": True, **summary})

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
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
        return web.text("\n".join(lines) + "\n", content_type="text/plain; version=0.0.4")
