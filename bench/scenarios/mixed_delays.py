"""Mixed delays: retries due soon queued behind retries due much later, Rebound vs two retry-topic consumers.

Retry policy ``2s,30s`` on both sides. A paced stream where every fifth message fails: most fail once (one retry,
due 2 s after the failure), every twentieth fails twice (its second retry is due 30 s later). Rebound has one tier
topic per delay and parks each message until its own due time; the sleep-until-due baseline
(``bench/baselines/sleeper.py`` with ``BENCH_RETRY_SEQUENCE``) has one retry topic for both delays, and its retry
agent sleeps until the record at the head is due, so a 2 s retry behind a 30 s one waits for it. The Spring-Kafka-style
baseline (``bench/baselines/spring_pause.py``) has one tier topic per delay like Rebound, but no table or timer: a
tier partition whose head record is not due is sought back to it and paused until it is, then fetched again.

Measured per retry: ``handler call time - due time``, with due time = the logged time of the failed call before it
plus that retry's delay (a few ms early against the real due time, which is taken after the handler returned; the
same on every side). Healthy messages' latency is reported too: neither design should block the main topic.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bench.common import baseline_worker, distribution, now_ms, read_calls, rebound_worker, running, wait_until
from bench.scenarios.base import PRODUCTION_BATCH, Context, await_ready, new_topic, paced
from demo.embedded_broker import EmbeddedBroker

VARIANTS = ("rebound", "sleep-until-due", "spring-pause")
BASELINE_MODULES = {"sleep-until-due": "sleeper", "spring-pause": "spring_pause"}


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    rate = 25.0
    count = ctx.size(default=375, quick=100)
    delays_s = (1, 5) if ctx.quick else (2, 30)
    fail_every, twice_every = 5, 20
    grace = delays_s[0] + delays_s[1] + (10.0 if ctx.quick else 25.0)
    params = {
        "rate_per_s": rate,
        "messages": count,
        "retry_sequence_s": list(delays_s),
        "failing_once_pct": 100 / fail_every - 100 / twice_every,
        "failing_twice_pct": 100 / twice_every,
        "grace_after_stream_s": grace,
    }
    results = {}
    for variant in VARIANTS:
        results[variant] = run_variant(ctx, broker, variant, rate, count, delays_s, fail_every, twice_every, grace)
        print(f"  mixed-delays {variant}: {results[variant]['summary']}", flush=True)
    return {"params": params, "variants": results}


def run_variant(
    ctx: Context,
    broker: EmbeddedBroker,
    variant: str,
    rate: float,
    count: int,
    delays_s: tuple[int, int],
    fail_every: int,
    twice_every: int,
    grace: float,
) -> dict[str, Any]:
    topic = new_topic(broker, f"mix-{variant}")
    calls_path = ctx.root / f"mix-{variant}.calls.jsonl"
    common = {"BENCH_CALLS": str(calls_path), **PRODUCTION_BATCH}
    if variant == "rebound":
        worker = rebound_worker(
            broker,
            ctx.root,
            f"mix-{variant}",
            REBOUND_APP_ID=topic,
            REBOUND_MAIN_TOPICS=topic,
            REBOUND_RETRY_SEQUENCE=",".join(f"{d}s" for d in delays_s),
            REBOUND_HANDLER="bench.handlers:scripted",
            **common,
        )
    else:
        sequence = ",".join(str(d) for d in delays_s)
        worker = baseline_worker(
            broker,
            ctx.root,
            BASELINE_MODULES[variant],
            topic,
            BENCH_TOPIC=topic,
            BENCH_RETRY_SEQUENCE=sequence,
            **common,
        )

    def fail_until(i: int) -> int:
        return 2 if i % twice_every == 0 else 1 if i % fail_every == 0 else 0

    def make(i: int) -> tuple[str, dict[str, int]]:
        return f"m{i}", {"fail_until": fail_until(i)}

    script = {f"m{i}": fail_until(i) for i in range(count)}
    with running(worker):
        ready_s = await_ready(broker, topic, calls_path, worker)
        stream_start = now_ms()
        produced = asyncio.run(paced(broker.bootstrap, topic, rate, count, make))
        stream_end = now_ms()

        def all_done() -> bool:
            return len({c["k"] for c in read_calls(calls_path) if c["ok"] and c["k"] in produced}) >= count

        finished = wait_until(all_done, grace, check=[worker])
        cutoff = now_ms()
    summary, raw = summarise(read_calls(calls_path), produced, script, delays_s, stream_start, cutoff)
    summary["all_done_within_grace"] = finished
    summary["stream_s"] = round((stream_end - stream_start) / 1000, 1)
    summary["ready_after_s"] = round(ready_s, 1)
    return {"summary": summary, "raw": raw}


def summarise(
    calls: list[dict[str, Any]],
    produced: dict[str, int],
    script: dict[str, int],
    delays_s: tuple[int, int],
    stream_start: int,
    cutoff: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lateness per retry attempt (1: the short delay, 2: the long one); a retry never run counts as ``cutoff - due``."""
    by_key: dict[str, dict[int, int]] = {}
    done: dict[str, int] = {}
    for c in calls:
        key = c["k"]
        if key not in produced:
            continue
        by_key.setdefault(key, {}).setdefault(c["a"], c["t"])
        if c["ok"]:
            done.setdefault(key, c["t"])
    lateness: dict[int, list[int]] = {1: [], 2: []}
    timeline: dict[int, list[tuple[float, int]]] = {1: [], 2: []}
    unrun = {1: 0, 2: 0}
    for key, fails in script.items():
        attempts = by_key.get(key, {})
        for attempt in range(1, fails + 1):
            if attempt - 1 not in attempts:
                continue  # the failure before it never happened: nothing was due
            due = attempts[attempt - 1] + delays_s[attempt - 1] * 1000
            if attempt in attempts:
                late = attempts[attempt] - due
            else:
                late = cutoff - due
                unrun[attempt] += 1
            lateness[attempt].append(late)
            timeline[attempt].append((round((due - stream_start) / 1000, 2), late))
    healthy = [k for k, fails in script.items() if fails == 0]
    healthy_lat = [done.get(k, cutoff) - produced[k] for k in healthy]
    short, long = delays_s
    summary = {
        f"retry_{short}s_lateness_ms": distribution(lateness[1]),
        f"retry_{short}s_not_run": unrun[1],
        f"retry_{long}s_lateness_ms": distribution(lateness[2]),
        f"retry_{long}s_not_run": unrun[2],
        "healthy_latency_ms": distribution(healthy_lat),
        "healthy_done": sum(1 for k in healthy if k in done),
        "healthy_total": len(healthy),
        "done": sum(1 for k in produced if k in done),
        "total": len(produced),
        "last_success_after_stream_start_s": round((max(done.values(), default=stream_start) - stream_start) / 1000, 1),
    }
    raw = {
        "short_lateness_ms": lateness[1],
        "long_lateness_ms": lateness[2],
        "short_timeline": timeline[1],
        "long_timeline": timeline[2],
        "healthy_latency_ms": healthy_lat,
    }
    return summary, raw
