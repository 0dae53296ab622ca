"""Head-of-line blocking: a paced stream where some messages fail once, through four retry designs.

Rebound, a blocking retry (sleep in place), a sleep-until-due retry consumer and a Spring-Kafka-style consumer that
pauses a tier partition until its head record is due (``bench/baselines/spring_pause.py``) all get the same stream,
the same handler and the same delay. What is compared is what happens to the *healthy* messages: how many get through in the
time and how long each waited. Retried messages are measured too: how late after their due time they ran.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench.common import baseline_worker, distribution, read_calls, rebound_worker, running, wait_until
from bench.scenarios.base import PRODUCTION_BATCH, Context, await_ready, new_topic, paced
from demo.embedded_broker import EmbeddedBroker

VARIANTS = ("rebound", "sleep-until-due", "spring-pause", "blocking")
BASELINE_MODULES = {"sleep-until-due": "sleeper", "spring-pause": "spring_pause", "blocking": "blocking"}


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    rate = 20.0 if ctx.quick else 50.0
    count = ctx.size(default=1000, quick=60)
    delay_s = 1 if ctx.quick else 5
    fail_every = 10  # 10% of the messages fail once
    grace = 3 * delay_s + (5.0 if ctx.quick else 10.0)
    params = {"rate_per_s": rate, "messages": count, "failing_pct": 100 // fail_every, "delay_s": delay_s}
    params["grace_after_stream_s"] = grace
    results = {}
    for variant in VARIANTS:
        results[variant] = run_variant(ctx, broker, variant, rate, count, delay_s, fail_every, grace)
        print(f"  head-of-line {variant}: {results[variant]['summary']}", flush=True)
    return {"params": params, "variants": results}


def run_variant(
    ctx: Context,
    broker: EmbeddedBroker,
    variant: str,
    rate: float,
    count: int,
    delay_s: int,
    fail_every: int,
    grace: float,
) -> dict[str, Any]:
    topic = new_topic(broker, f"hol-{variant}")
    calls_path = ctx.root / f"hol-{variant}.calls.jsonl"
    common = {"BENCH_CALLS": str(calls_path), **PRODUCTION_BATCH}
    if variant == "rebound":
        worker = rebound_worker(
            broker,
            ctx.root,
            f"hol-{variant}",
            REBOUND_APP_ID=topic,
            REBOUND_MAIN_TOPICS=topic,
            REBOUND_RETRY_SEQUENCE=f"{delay_s}s",
            REBOUND_HANDLER="bench.handlers:scripted",
            **common,
        )
    else:
        module = BASELINE_MODULES[variant]
        worker = baseline_worker(broker, ctx.root, module, topic, BENCH_TOPIC=topic, BENCH_DELAY=str(delay_s), **common)

    def make(i: int) -> tuple[str, dict[str, int]]:
        return f"m{i}", {"fail_until": 1 if i % fail_every == 0 else 0}

    failing = {f"m{i}" for i in range(count) if i % fail_every == 0}
    with running(worker):
        ready_s = await_ready(broker, topic, calls_path, worker)
        stream_start = time.time_ns() // 1_000_000
        produced = asyncio.run(paced(broker.bootstrap, topic, rate, count, make))
        stream_end = time.time_ns() // 1_000_000

        def all_done() -> bool:
            return len({c["k"] for c in read_calls(calls_path) if c["ok"] and c["k"] in produced}) >= count

        wait_until(all_done, grace, check=[worker])
        cutoff = time.time_ns() // 1_000_000
    return summarise(read_calls(calls_path), produced, failing, delay_s, stream_start, stream_end, cutoff, ready_s)


def summarise(
    calls: list[dict[str, Any]],
    produced: dict[str, int],
    failing: set[str],
    delay_s: int,
    stream_start: int,
    stream_end: int,
    cutoff: int,
    ready_s: float,
) -> dict[str, Any]:
    """Latency of unfinished messages is counted as ``cutoff - produced`` (a lower bound), and flagged."""
    done: dict[str, int] = {}
    first_fail: dict[str, int] = {}
    for c in calls:
        key = c["k"]
        if key not in produced:
            continue
        if c["ok"]:
            done.setdefault(key, c["t"])
        elif c["a"] == 0:
            first_fail.setdefault(key, c["t"])
    healthy = [k for k in produced if k not in failing]
    healthy_lat = [done.get(k, cutoff) - produced[k] for k in healthy]
    healthy_done = [k for k in healthy if k in done]
    retried_lateness = [done[k] - (first_fail[k] + delay_s * 1000) for k in failing if k in done and k in first_fail]
    retried_e2e = [done.get(k, cutoff) - produced[k] for k in failing]
    last_healthy = max((done[k] for k in healthy_done), default=stream_start)
    elapsed_s = max(1e-3, (last_healthy - stream_start) / 1000)
    summary = {
        "healthy_done": len(healthy_done),
        "healthy_total": len(healthy),
        "healthy_throughput_per_s": round(len(healthy_done) / elapsed_s, 1),
        "offered_rate_per_s": round(len(produced) / max(1e-3, (stream_end - stream_start) / 1000), 1),
        "healthy_latency_ms": distribution(healthy_lat),
        "healthy_latency_is_lower_bound": len(healthy_done) < len(healthy),
        "retried_done": sum(1 for k in failing if k in done),
        "retried_total": len(failing),
        "retried_end_to_end_ms": distribution(retried_e2e),
        "retried_lateness_after_due_ms": distribution(retried_lateness),
        "ready_after_s": round(ready_s, 1),
    }
    return {
        "summary": summary,
        "raw": {"healthy_latency_ms": healthy_lat, "retried_lateness_ms": retried_lateness},
    }
