"""Key order: what key-ordered mode costs the keys that are not blocked.

One backlog, two workers one after the other: ``REBOUND_ORDERING=none`` and ``REBOUND_ORDERING=key``. A tenth of
the messages belong to a few *blocked* keys, whose first message fails once and waits a minute in its tier; in
key-ordered mode their later messages are held behind it in the state table. The rest belong to many free keys that
always succeed. The figure is the free keys' throughput (first to last successful call) in each mode: key order must
not slow down the keys it does not block. The blocked keys' held messages are counted to show the mode was in effect.
A third run, key-ordered with nothing failing (so nothing blocked), separates what the mode costs every message (one
read of its key's state) from what holding costs (each held message is written to the state table, durably, which
takes worker CPU the free keys share).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

from bench.common import produce_batch, read_calls, rebound_worker, running, wait_until
from bench.scenarios.base import PARTITIONS, PRODUCTION_BATCH, Context, new_topic
from demo.embedded_broker import EmbeddedBroker

MODES = ("none", "key", "key-nothing-blocked")
BLOCKED_KEYS = 20


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    count = ctx.size(default=20_000, quick=2_000)
    variants = {}
    for mode in MODES:
        variants[mode] = run_mode(ctx, broker, mode, count)
        print(f"  key-order {mode}: {variants[mode]['summary']}", flush=True)
    free = {mode: variants[mode]["summary"]["free_keys_per_s"] for mode in MODES}
    return {
        "params": {"messages": count, "partitions": PARTITIONS, "blocked_keys": BLOCKED_KEYS, "blocked_share": 0.1},
        "variants": variants,
        "summary": {
            "key_vs_none": round(free["key"] / max(1e-9, free["none"]), 2),
            "key_nothing_blocked_vs_none": round(free["key-nothing-blocked"] / max(1e-9, free["none"]), 2),
            **free,
        },
    }


def records(count: int, *, blocking: bool = True) -> tuple[list[tuple[bytes, bytes]], int]:
    """A tenth of the messages on the blocked keys (each key's first one fails once, if ``blocking``), the rest on
    free keys."""
    out, free = [], 0
    for i in range(count):
        if i % 10 == 0:
            key = f"blocked-{(i // 10) % BLOCKED_KEYS}"
            first = blocking and i // 10 < BLOCKED_KEYS
            out.append((key.encode(), json.dumps({"i": i, "fail_until": 1 if first else 0}).encode()))
        else:
            free += 1
            out.append((f"free-{i % 2000}".encode(), json.dumps({"i": i}).encode()))
    return out, free


def run_mode(ctx: Context, broker: EmbeddedBroker, mode: str, count: int) -> dict[str, Any]:
    topic = new_topic(broker, f"ko-{mode}")
    backlog, free_count = records(count, blocking=mode != "key-nothing-blocked")
    asyncio.run(produce_batch(broker.bootstrap, topic, backlog))
    calls_path = ctx.root / f"ko-{mode}.calls.jsonl"
    worker = rebound_worker(
        broker,
        ctx.root,
        f"ko-{mode}",
        REBOUND_APP_ID=topic,
        REBOUND_MAIN_TOPICS=topic,
        REBOUND_RETRY_SEQUENCE="1m",
        REBOUND_HANDLER="bench.handlers:scripted",
        REBOUND_ORDERING=mode.split("-", maxsplit=1)[0],
        BENCH_CALLS=str(calls_path),
        **PRODUCTION_BATCH,
    )
    with running(worker):

        def free_done() -> bool:
            return sum(1 for c in read_calls(calls_path) if c["ok"] and c["k"].startswith("free-")) >= free_count

        started = time.monotonic()
        if not wait_until(free_done, 600, check=[worker]):
            raise RuntimeError(f"key-order {mode}: the free keys did not finish:\n{worker.log_tail()}")
        elapsed = time.monotonic() - started
        time.sleep(3)  # one status interval, so the backlog view has this worker's counts
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.web_port}/retry/backlog?scope=worker") as response:
            ordering = json.loads(response.read())["ordering"]
    calls = read_calls(calls_path)
    free_times = [c["t"] for c in calls if c["ok"] and c["k"].startswith("free-")]
    blocked_ok = sum(1 for c in calls if c["ok"] and c["k"].startswith("blocked-"))
    span_ms = max(1, max(free_times) - min(free_times))
    return {
        "summary": {
            "free_keys_per_s": round(len(free_times) / (span_ms / 1000), 1),
            "free_messages": len(free_times),
            "blocked_keys_succeeded_meanwhile": blocked_ok,
            "held": ordering.get("held", 0),
            "blocked_keys": ordering.get("blocked_keys", 0),
            "wall_s": round(elapsed, 1),
        }
    }
