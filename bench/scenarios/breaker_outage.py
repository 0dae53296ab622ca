"""Breaker outage: a dependency down for everyone, with the circuit breaker off and on.

A paced stream runs for ``duration`` seconds; from ``outage_from`` to ``outage_until`` every handler call fails
retryably (the handler's dependency is down), then everything succeeds again. The policy, three retries after 1, 2
and 4 s, is spent 7 s after a message first fails. Without the breaker, the messages that arrive during the
outage are dead-lettered; with it, the breaker opens after a few failures, holds consumption and releases, probes at
a growing interval and closes once the dependency answers: nothing is dead-lettered for the outage. The timeline of
outcomes per second and the breaker's open periods are the figure.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections import Counter
from typing import Any

from bench.common import now_ms, read_calls, rebound_worker, running
from bench.scenarios.base import PRODUCTION_BATCH, Context, await_ready, new_topic, paced
from demo.embedded_broker import EmbeddedBroker
from demo.harness import Tail

RETRY_SEQUENCE = "1s,2s,4s"
"""Spent 7 s after a message's first failure: well within the outage. The breaker's window is shorter than that, so
it opens (the failure ratio over the window reaches its threshold) before the first messages of the outage are
exhausted."""
BREAKER = {
    "REBOUND_BREAKER_WINDOW": "5s",
    "REBOUND_BREAKER_MIN_CALLS": "10",
    "REBOUND_BREAKER_FAILURE_RATIO": "0.5",
    "REBOUND_BREAKER_PROBE_INTERVAL": "2s",
    "REBOUND_BREAKER_PROBE_MAX_INTERVAL": "8s",
}


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    duration = 30 if ctx.quick else 60
    outage = (10, 25) if ctx.quick else (15, 40)
    rate = 20.0 if ctx.quick else 50.0
    variants = {}
    for variant in ("no-breaker", "breaker"):
        variants[variant] = run_variant(ctx, broker, variant, duration, outage, rate)
        print(f"  breaker-outage {variant}: {variants[variant]['summary']}", flush=True)
    return {
        "params": {
            "duration_s": duration,
            "outage_s": list(outage),
            "rate_per_s": rate,
            "retry_sequence": RETRY_SEQUENCE,
            **{name.removeprefix("REBOUND_").lower(): value for name, value in BREAKER.items()},
        },
        "variants": variants,
        "summary": {variant: variants[variant]["summary"] for variant in variants},
    }


def run_variant(
    ctx: Context, broker: EmbeddedBroker, variant: str, duration: int, outage: tuple[int, int], rate: float
) -> dict[str, Any]:
    topic = new_topic(broker, f"bo-{variant}")
    calls_path = ctx.root / f"bo-{variant}.calls.jsonl"
    breaker = {"REBOUND_BREAKER_ENABLED": "true", **BREAKER} if variant == "breaker" else {}
    worker = rebound_worker(
        broker,
        ctx.root,
        f"bo-{variant}",
        REBOUND_APP_ID=topic,
        REBOUND_MAIN_TOPICS=topic,
        REBOUND_RETRY_SEQUENCE=RETRY_SEQUENCE,
        REBOUND_HANDLER="bench.handlers:scripted",
        BENCH_CALLS=str(calls_path),
        **breaker,
        **PRODUCTION_BATCH,
    )
    count = int(duration * rate)
    with running(worker):
        await_ready(broker, topic, calls_path, worker)
        start = now_ms()
        down_from, down_until = start + outage[0] * 1000, start + outage[1] * 1000

        def make(i: int) -> tuple[str, dict[str, int]]:
            return f"m{i}", {"down_from": down_from, "down_until": down_until}

        produced = asyncio.run(paced(broker.bootstrap, topic, rate, count, make))
        events = asyncio.run(settle(broker.bootstrap, topic, set(produced), worker))
        breaker_view = None
        if breaker:
            url = f"http://127.0.0.1:{worker.web_port}/retry/backlog?scope=worker"
            with urllib.request.urlopen(url, timeout=10) as response:
                breaker_view = json.loads(response.read())["breaker"]
    calls = [c for c in read_calls(calls_path) if c["k"] in produced]
    outcomes = Counter(events.values())
    timeline = timeline_of(calls, start)
    open_periods = []
    if breaker_view is not None:
        opened_at = None
        for move in breaker_view["transitions"]:
            if move["from"] == "closed":
                opened_at = move["at"]
            elif move["to"] == "closed" and opened_at is not None:
                open_periods.append([(opened_at - start) / 1000, (move["at"] - start) / 1000])
                opened_at = None
    return {
        "summary": {
            "messages": count,
            "succeeded": outcomes.get("succeeded", 0),
            "dead_lettered": outcomes.get("dead", 0) + outcomes.get("expired", 0),
            "handler_calls": len(calls),
            "breaker_opens": None if breaker_view is None else breaker_view["opens_total"],
            "breaker_probes": None if breaker_view is None else breaker_view["probes_total"],
            "breaker_held_s": None if breaker_view is None else round(breaker_view["held_ms_total"] / 1000, 1),
        },
        "timeline": timeline,
        "open_periods_s": open_periods,
        "outage_s": [outage[0], outage[1]],
    }


def timeline_of(calls: list[dict[str, Any]], start: int) -> dict[str, list[int]]:
    """Handler calls per second since the stream started, split into succeeded and failed."""
    seconds = max([int((c["t"] - start) // 1000) for c in calls] + [0]) + 1
    ok, failed = [0] * seconds, [0] * seconds
    for call in calls:
        second = int((call["t"] - start) // 1000)
        if second >= 0:
            (ok if call["ok"] else failed)[second] += 1
    return {"ok": ok, "failed": failed}


async def settle(bootstrap: str, topic: str, keys: set[str], worker: Any, timeout: float = 240) -> dict[str, str]:
    """Read the attempt events until every message has ended (succeeded, or dead-lettered); key -> final outcome."""
    final: dict[str, str] = {}

    def done(records: list[Any]) -> bool:
        worker.check()
        for record in records[len(seen) :]:
            seen.append(record)
            event = record.json()
            if event["key"] in keys and event["outcome"] in ("succeeded", "dead", "expired"):
                final[event["key"]] = event["outcome"]
        return len(final) >= len(keys)

    seen: list[Any] = []
    async with Tail(bootstrap, [f"{topic}.attempts"]) as tail:
        if not await tail.until(done, timeout):
            raise RuntimeError(f"breaker-outage: {len(final)} of {len(keys)} messages ended:\n{worker.log_tail()}")
    return final
