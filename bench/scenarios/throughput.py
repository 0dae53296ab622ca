"""Healthy throughput: how fast Rebound's main agent drains a backlog when every message succeeds.

Compared with a bare Faust agent that does the same per-message work a healthy Rebound message costs at the least
(consume, call a no-op, produce one small record). The backlog is produced before the worker starts, and the rate is
taken from the first to the last output record, so group formation is not in the figure.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from bench.common import baseline_worker, follow_topic, produce_batch, rebound_worker, running
from bench.scenarios.base import PARTITIONS, PRODUCTION_BATCH, Context, new_topic
from demo.embedded_broker import EmbeddedBroker
from demo.harness import create_topics


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    count = ctx.size(default=20_000, quick=1_000)
    variants = {}
    for variant in ("rebound", "bare-faust"):
        variants[variant] = run_variant(ctx, broker, variant, count)
        print(f"  healthy-throughput {variant}: {variants[variant]['summary']}", flush=True)
    ratio = variants["rebound"]["summary"]["messages_per_s"] / max(
        1e-9, variants["bare-faust"]["summary"]["messages_per_s"]
    )
    return {
        "params": {"messages": count, "partitions": PARTITIONS},
        "variants": variants,
        "summary": {"rebound_vs_bare": round(ratio, 2)},
    }


def run_variant(ctx: Context, broker: EmbeddedBroker, variant: str, count: int, **env: str) -> dict[str, Any]:
    """``variant`` ``rebound`` (or any name starting so) or a bare agent's (any other name), ``env`` for the worker."""
    worker, output = prepare_variant(ctx, broker, variant, count, **env)
    with running(worker):
        times = asyncio.run(collect(broker.bootstrap, output, count, variant, worker))
    return {"summary": rate_summary(times)}


def prepare_variant(ctx: Context, broker: EmbeddedBroker, variant: str, count: int, **env: str) -> tuple[Any, str]:
    """Produce ``variant``'s backlog of ``count`` messages and build (not start) its worker (``env`` added to its
    environment, Rebound's or the bare agent's); returns the worker and the topic :func:`collect` reads its outputs
    from (the backlog's topic is also the worker's group id)."""
    topic = new_topic(broker, f"tp-{variant}")
    records = [(f"k{i}".encode(), json.dumps({"i": i}).encode()) for i in range(count)]
    asyncio.run(produce_batch(broker.bootstrap, topic, records))
    if variant.startswith("rebound"):
        worker = rebound_worker(
            broker,
            ctx.root,
            f"tp-{variant}",
            REBOUND_APP_ID=topic,
            REBOUND_MAIN_TOPICS=topic,
            REBOUND_RETRY_SEQUENCE="1m",
            REBOUND_HANDLER="bench.handlers:noop",
            **PRODUCTION_BATCH,
            **env,
        )
        return worker, f"{topic}.attempts"
    output = f"{topic}.done"
    asyncio.run(create_topics(broker.bootstrap, [output], PARTITIONS))
    return baseline_worker(broker, ctx.root, "bare", topic, BENCH_TOPIC=topic, **PRODUCTION_BATCH, **env), output


def rate_summary(times: list[int]) -> dict[str, Any]:
    """Messages, span and rate from the first to the last output time (ms)."""
    span_ms = max(1, max(times) - min(times))
    return {"messages": len(times), "span_ms": span_ms, "messages_per_s": round((len(times) - 1) * 1000 / span_ms, 1)}


async def collect(bootstrap: str, topic: str, count: int, variant: str, worker: Any) -> list[int]:
    """Processing times: ``event_time`` of each ``succeeded`` attempt event, or the bare agent's output value."""
    records, _ = await follow_topic(bootstrap, topic, count, worker, 120, what=f"{variant}: ")
    if variant.startswith("rebound"):
        return [r.json()["event_time"] for r in records if r.json()["outcome"] == "succeeded"]
    return [int(r.value or b"0") for r in records]
