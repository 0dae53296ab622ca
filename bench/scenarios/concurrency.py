"""Concurrency: how the rate of an I/O-bound handler grows with ``REBOUND_CONCURRENCY``, and whether key order holds.

The handler (``bench.handlers:io20``) awaits 20 ms and succeeds, so one call at a time tops out near 50 messages/s.
A backlog over 200 keys and 4 partitions is produced before the worker starts; a single Rebound worker drains it
once per concurrency level (1, 8, 64, 256), each on a fresh topic. Baseline in the same run: a bare Faust agent
(``bench/baselines/handler_agent.py``) calling the same handler with concurrency 1, the most a Faust agent can
safely run (more lets Faust commit past a record in flight, faust-streaming#606, and breaks per-key order).

Figures per run, all from the handler's call log (one line per call: key, partition, offset, attempt, start, end):

* messages/s from the first to the last completion, so group formation is not in the figure;
* CPU of the worker and of the broker over that window (``/proc/<pid>/stat``, % of one core; the machine has two,
  shared by the worker, the broker and this benchmark), to show where CPU, not the handler's wait, sets the rate;
* calls in flight (mean = summed call time / window; max from the call spans) and the call duration, which grows
  past 20 ms when the event loop is saturated;
* the per-key order check: for every key, first tries (attempt 0) must start in increasing offset order and never
  overlap in time. Any violation fails the run (``verdict``), as every message must be handled.

256 is more than the 200 keys: one key runs one call at a time, so at most 200 calls can be in flight.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.common import (
    FaustProcess,
    baseline_worker,
    cpu_seconds,
    distribution,
    now_ms,
    produce_batch,
    read_calls,
    rebound_worker,
    running,
)
from bench.scenarios.base import PARTITIONS, PRODUCTION_BATCH, Context, new_topic
from demo.embedded_broker import EmbeddedBroker

LEVELS = (1, 8, 64, 256)
KEYS = 200
HANDLER_MS = 20
SAMPLE_EVERY_S = 0.02  # /proc counts CPU in 10 ms ticks; at 64 calls in flight 6000 messages take about 2 s


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    count = ctx.size(default=6_000, quick=600)
    variants: dict[str, dict[str, Any]] = {}
    for level in LEVELS:
        name = f"rebound-c{level}"
        variants[name] = run_variant(ctx, broker, name, count, level)
        print(f"  concurrency {name}: {variants[name]['summary']}", flush=True)
    variants["bare-faust"] = run_variant(ctx, broker, "bare-faust", count, None)
    print(f"  concurrency bare-faust: {variants['bare-faust']['summary']}", flush=True)
    problems = [
        f"{name}: {s['order']['violations']} order violations, {s['messages']}/{count} done"
        for name, s in ((n, v["summary"]) for n, v in variants.items())
        if s["order"]["violations"] or s["messages"] < count
    ]
    return {
        "params": {
            "messages": count,
            "keys": KEYS,
            "partitions": PARTITIONS,
            "handler_ms": HANDLER_MS,
            "levels": list(LEVELS),
            "handler": "bench.handlers:io20",
        },
        "variants": variants,
        "verdict": "ok" if not problems else "FAILED: " + "; ".join(problems),
    }


def run_variant(ctx: Context, broker: EmbeddedBroker, name: str, count: int, level: int | None) -> dict[str, Any]:
    topic = new_topic(broker, f"cc-{name}")
    calls_path = ctx.root / f"cc-{name}.calls.jsonl"
    # key k<i mod 200>: 30 messages per key at 6000, produced in order, so a key's offsets rise with i
    records = [(f"k{i % KEYS}".encode(), json.dumps({"i": i}).encode()) for i in range(count)]
    asyncio.run(produce_batch(broker.bootstrap, topic, records))
    common = {"BENCH_CALLS": str(calls_path), **PRODUCTION_BATCH}
    if level is not None:
        worker = rebound_worker(
            broker,
            ctx.root,
            f"cc-{name}",
            REBOUND_APP_ID=topic,
            REBOUND_MAIN_TOPICS=topic,
            REBOUND_RETRY_SEQUENCE="1m",
            REBOUND_HANDLER="bench.handlers:io20",
            REBOUND_CONCURRENCY=str(level),
            **common,
        )
    else:
        worker = baseline_worker(
            broker, ctx.root, "handler_agent", topic, BENCH_TOPIC=topic, BENCH_HANDLER="bench.handlers:io20", **common
        )
    timeout = 90 + count * HANDLER_MS / 1000 * 1.5  # one call at a time, with room for a slow machine
    with running(worker):
        samples = drain(worker, broker, calls_path, count, timeout)
    calls = [c for c in read_calls(calls_path) if c.get("a") == 0 and "o" in c]
    summary = summarise(calls, samples, level)
    return {"summary": summary, "raw": {"samples": len(samples)}}


def drain(
    worker: FaustProcess, broker: EmbeddedBroker, calls_path: Path, count: int, timeout: float
) -> list[tuple[float, float, float]]:
    """Sample both processes' CPU every 20 ms until every offset had its first try: ``(epoch ms, worker s, broker s)``."""
    samples: list[tuple[float, float, float]] = []
    deadline = time.monotonic() + timeout
    read_at = 0.0
    handled: set[tuple[int, int]] = set()
    while True:
        worker.check()
        samples.append((float(now_ms()), cpu_seconds(worker.pid), cpu_seconds(broker.process.pid)))
        if time.monotonic() - read_at >= 0.5:
            read_at = time.monotonic()
            handled = {(c["p"], c["o"]) for c in read_calls(calls_path) if c.get("a") == 0 and "o" in c}
            if len(handled) >= count:
                samples.append((float(now_ms()), cpu_seconds(worker.pid), cpu_seconds(broker.process.pid)))
                return samples
        if time.monotonic() > deadline:
            raise RuntimeError(f"{worker.module}: {len(handled)} of {count} handled in {timeout:.0f}s")
        time.sleep(SAMPLE_EVERY_S)


def cpu_pct(samples: list[tuple[float, float, float]], start: float, end: float) -> dict[str, Any]:
    """CPU % of one core over ``[start, end]``: the samples inside it, or the two around it when it is too short."""
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < 250:
        before = [s for s in samples if s[0] <= start] or samples[:1]
        after = [s for s in samples if s[0] >= end] or samples[-1:]
        inside = [before[-1], after[0]]
    first, last = inside[0], inside[-1]
    wall = max(1.0, last[0] - first[0]) / 1000
    return {
        "worker": round(100 * (last[1] - first[1]) / wall, 1),
        "broker": round(100 * (last[2] - first[2]) / wall, 1),
        "window_ms": round(last[0] - first[0]),
    }


def order_check(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, first tries by start time: each must be at a higher offset than the one before and start after
    every earlier one of the key ended. Counts the calls breaking either rule (a redelivered offset breaks the first)."""
    by_key: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for c in calls:
        by_key[(c["p"], c["k"])].append(c)
    out_of_order = overlapping = 0
    examples: list[str] = []
    for (partition, key), key_calls in by_key.items():
        key_calls.sort(key=lambda c: (c["s"], c["o"]))
        last_offset, last_end = key_calls[0]["o"], key_calls[0]["t"]
        for c in key_calls[1:]:
            if c["o"] <= last_offset:
                out_of_order += 1
                if len(examples) < 5:
                    examples.append(f"{key}@{partition}: offset {c['o']} started after {last_offset}")
            if c["s"] < last_end:
                overlapping += 1
                if len(examples) < 5:
                    examples.append(f"{key}@{partition}: offset {c['o']} started {last_end - c['s']:.1f} ms early")
            last_offset, last_end = c["o"], max(last_end, c["t"])
    return {
        "keys": len(by_key),
        "out_of_order": out_of_order,
        "overlapping": overlapping,
        "violations": out_of_order + overlapping,
        "examples": examples,
    }


def in_flight_max(calls: list[dict[str, Any]]) -> int:
    events = sorted([(c["s"], 1) for c in calls] + [(c["t"], -1) for c in calls], key=lambda e: (e[0], e[1]))
    running_now = peak = 0
    for _, step in events:
        running_now += step
        peak = max(peak, running_now)
    return peak


def summarise(
    calls: list[dict[str, Any]], samples: list[tuple[float, float, float]], level: int | None
) -> dict[str, Any]:
    offsets = [(c["p"], c["o"]) for c in calls]
    ends = [c["t"] for c in calls]
    first, last = min(ends), max(ends)
    span_ms = max(1.0, last - first)
    durations = [c["t"] - c["s"] for c in calls]
    return {
        "concurrency": level,
        "messages": len(set(offsets)),
        "calls": len(calls),
        "duplicate_calls": len(offsets) - len(set(offsets)),
        "span_ms": round(span_ms),
        "messages_per_s": round((len(ends) - 1) * 1000 / span_ms, 1),
        "ideal_per_s": round(min(level or 1, KEYS) * 1000 / HANDLER_MS, 1),
        "cpu_pct_one_core": cpu_pct(samples, first, last),
        "in_flight_mean": round(sum(durations) / span_ms, 1),
        "in_flight_max": in_flight_max(calls),
        "call_ms": {k: None if v is None else round(v, 1) for k, v in distribution(durations).items()},
        "order": order_check(calls),
    }
