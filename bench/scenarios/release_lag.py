"""Release lag: how long after its due time a parked message really runs again.

Rebound promises never early and within about a timer tick (200 ms) late. The handler is the tests' scripted one,
which logs each call's wall-clock time; due times come from the ``scheduled`` attempt events. A negative lag (a
handler call before its due time) fails the run.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench.common import distribution, read_calls, rebound_worker, running, wait_until
from bench.scenarios.base import PRODUCTION_BATCH, Context, await_ready, new_topic, paced
from demo.embedded_broker import EmbeddedBroker
from demo.harness import Tail


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    count = ctx.size(default=600, quick=60)
    rate = 60.0 if not ctx.quick else 30.0
    sequence = "1s,2s"
    retries = 2  # every message fails twice: parked once in each tier
    topic = new_topic(broker, "lag")
    calls_path = ctx.root / "lag.calls.jsonl"
    worker = rebound_worker(
        broker,
        ctx.root,
        "lag",
        REBOUND_APP_ID=topic,
        REBOUND_MAIN_TOPICS=topic,
        REBOUND_RETRY_SEQUENCE=sequence,
        REBOUND_HANDLER="tests.scripted_handler:handle",
        SCRIPTED_CALLS=str(calls_path),
        **PRODUCTION_BATCH,
    )
    with running(worker):
        await_ready(broker, topic, calls_path, worker, key_field="key")
        produced = asyncio.run(
            paced(broker.bootstrap, topic, rate, count, lambda i: (f"m{i}", {"succeed_on": retries}))
        )

        def finished() -> bool:
            return len({c["key"] for c in read_calls(calls_path) if c["attempt"] == retries}) >= count

        if not wait_until(finished, 60 + count / rate, check=[worker]):
            raise RuntimeError(f"not every message reached attempt {retries}:\n{worker.log_tail()}")
        scheduled = asyncio.run(read_scheduled(broker.bootstrap, f"{topic}.attempts", count * retries))
        idle_ms = timer_interval_ms()
    calls = [c for c in read_calls(calls_path) if c["key"] in produced and c["attempt"] > 0]
    lags = []
    unmatched = 0
    for c in calls:
        due = scheduled.get((c["partition"], c["offset"], c["attempt"]))
        if due is None:
            unmatched += 1
            continue
        lags.append(c["now_ms"] - due)
    negative = [lag for lag in lags if lag < 0]
    summary = {
        "lag_ms": distribution(lags),
        "negative": len(negative),
        "retry_calls": len(calls),
        "unmatched_calls": unmatched,
        "timer_interval_ms": idle_ms,
        "within_one_tick_pct": round(100 * sum(1 for lag in lags if lag <= idle_ms) / max(1, len(lags)), 1),
    }
    verdict = "ok" if not negative and lags and not unmatched else "FAILED: calls before due time or unmatched"
    print(f"  release-lag: {summary}", flush=True)
    return {
        "params": {"messages": count, "rate_per_s": rate, "retry_sequence": sequence, "retries_per_message": retries},
        "summary": summary,
        "verdict": verdict,
        "raw": {"lag_ms": lags},
    }


def timer_interval_ms() -> int:
    from rebound.settings import Settings

    return int(Settings.model_fields["timer_interval"].default * 1000)


async def read_scheduled(bootstrap: str, topic: str, expected: int) -> dict[tuple[int, int, int], int]:
    """``(original partition, offset, attempt it schedules) -> due_at`` from the attempt events."""
    async with Tail(bootstrap, [topic]) as tail:

        def enough(records: list[Any]) -> bool:
            return sum(1 for r in records if b'"scheduled"' in (r.value or b"")) >= expected

        deadline = time.monotonic() + 60
        await tail.until(enough, max(1.0, deadline - time.monotonic()))
        due = {}
        for record in tail.records:
            event = record.json()
            if event.get("outcome") == "scheduled":
                due[(event["original_partition"], event["original_offset"], event["attempt"] + 1)] = event["due_at"]
        return due
