"""Long delay: does a sleep-until-due consumer that sleeps past ``max.poll.interval.ms`` get evicted from its group?

On a plain Kafka consumer that sleeps in its poll loop, yes: no poll for longer than ``max.poll.interval.ms`` and the
consumer leaves the group. Faust is built differently: its consumer fetches in its own task (aiokafka's
``getmany``), hands records to the agents through per-stream buffers, and aiokafka counts the poll interval as the
time since a fetch last ended (``fetcher_idle_time``), not the time an agent spends on a record. So an agent asleep
on one record may never count. This scenario measures it rather than assume it.

The sleep-until-due baseline runs with ``broker_max_poll_interval`` 5 s and a retry delay of 20 s, so its retry agent
sleeps four times the poll interval. Two variants:

* ``sparse``: a paced healthy stream with one failure every 15 s, so the retry agent sleeps 15 to 20 s per record
  while the main topic keeps flowing.
* ``backlog``: a burst of failures larger than Faust's stream buffer (``stream_buffer_maxsize``, 4096 by default),
  so the retry topic's records pile up behind the sleeping agent while the consumer keeps fetching.

Observed: partition revocations and assignments after the group formed (Faust's signals, logged by the worker),
retry calls that ran more than once (a redelivery after a rebalance), healthy latency, retry lateness, and any
heartbeat / group errors the worker logged.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from bench.common import (
    baseline_worker,
    distribution,
    now_ms,
    produce_batch,
    read_calls,
    running,
    wait_until,
)
from bench.scenarios.base import PRODUCTION_BATCH, Context, await_ready, new_topic, paced, script
from demo.embedded_broker import EmbeddedBroker

MAX_POLL_INTERVAL_S = 5.0
LOG_MARKERS = ("heartbeat", "leave", "leaving", "rebalanc", "poll", "member", "generation", "revok")


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    delay_s = 8 if ctx.quick else 20
    sparse_count = ctx.size(default=450, quick=100)
    backlog_count = 1000 if ctx.quick else 6000
    params = {
        "max_poll_interval_s": MAX_POLL_INTERVAL_S,
        "delay_s": delay_s,
        "sparse": {"messages": sparse_count, "rate_per_s": 10.0, "failing_every": 150},
        "backlog": {"messages": backlog_count, "all_fail_once": True},
    }
    results = {
        "sparse": run_variant(ctx, broker, "sparse", delay_s, sparse_count),
        "backlog": run_variant(ctx, broker, "backlog", delay_s, backlog_count),
    }
    for name, result in results.items():
        print(f"  long-delay {name}: {result['summary']}", flush=True)
    return {"params": params, "variants": results}


def run_variant(ctx: Context, broker: EmbeddedBroker, variant: str, delay_s: int, count: int) -> dict[str, Any]:
    topic = new_topic(broker, f"long-{variant}")
    calls_path = ctx.root / f"long-{variant}.calls.jsonl"
    rebalance_path = ctx.root / f"long-{variant}.rebalances.jsonl"
    worker = baseline_worker(
        broker,
        ctx.root,
        "sleeper",
        topic,
        BENCH_TOPIC=topic,
        BENCH_DELAY=str(delay_s),
        BENCH_MAX_POLL_INTERVAL=str(MAX_POLL_INTERVAL_S),
        BENCH_REBALANCE_LOG=str(rebalance_path),
        BENCH_CALLS=str(calls_path),
        **PRODUCTION_BATCH,
    )
    with running(worker):
        ready_s = await_ready(broker, topic, calls_path, worker)
        formed_at = now_ms()
        stream_start = now_ms()
        if variant == "sparse":
            produced = asyncio.run(
                paced(broker.bootstrap, topic, 10.0, count, lambda i: (f"m{i}", {"fail_until": int(i % 150 == 0)}))
            )
            failing = {f"m{i}" for i in range(count) if i % 150 == 0}
        else:
            records = [(f"m{i}".encode(), script(fail_until=1)) for i in range(count)]
            asyncio.run(produce_batch(broker.bootstrap, topic, records))
            produced = {f"m{i}": stream_start for i in range(count)}
            failing = set(produced)

        def all_done() -> bool:
            return len({c["k"] for c in read_calls(calls_path) if c["ok"] and c["k"] in produced}) >= len(produced)

        finished = wait_until(all_done, delay_s + 60, check=[worker])
        cutoff = now_ms()
        log_lines = [
            line.strip()
            for line in worker.log_path.read_text(errors="replace").splitlines()
            if any(marker in line.lower() for marker in LOG_MARKERS)
        ]
    rebalances = read_rebalances(rebalance_path)
    after = [r for r in rebalances if r["t"] > formed_at]
    calls = [c for c in read_calls(calls_path) if c["k"] in produced]
    counts: dict[tuple[str, int], int] = {}
    first_fail: dict[str, int] = {}
    done: dict[str, int] = {}
    for c in calls:
        counts[(c["k"], c["a"])] = counts.get((c["k"], c["a"]), 0) + 1
        if not c["ok"] and c["a"] == 0:
            first_fail.setdefault(c["k"], c["t"])
        if c["ok"]:
            done.setdefault(c["k"], c["t"])
    duplicated = sum(n - 1 for n in counts.values() if n > 1)
    lateness = [done[k] - (first_fail[k] + delay_s * 1000) for k in failing if k in done and k in first_fail]
    healthy = [k for k in produced if k not in failing]
    summary = {
        "revocations_after_ready": sum(1 for r in after if r["event"] == "revoked"),
        "assignments_after_ready": sum(1 for r in after if r["event"] == "assigned"),
        "rebalance_events_total": len(rebalances),
        "duplicate_calls": duplicated,
        "done": len(done),
        "total": len(produced),
        "all_done": finished,
        "retry_lateness_ms": distribution(lateness),
        "healthy_latency_ms": distribution([done.get(k, cutoff) - produced[k] for k in healthy]),
        "group_log_lines": len(log_lines),
        "ready_after_s": round(ready_s, 1),
        "last_success_after_start_s": round((max(done.values(), default=stream_start) - stream_start) / 1000, 1),
    }
    return {"summary": summary, "raw": {"rebalances": rebalances, "log_lines": log_lines[:50], "lateness": lateness}}


def read_rebalances(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
