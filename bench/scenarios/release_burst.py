"""A release burst with and without ``REBOUND_RELEASE_RATE`` (issue 23, paced releases).

Thousands of retries coming due in the same instant is what a worker meets after an outage (or when the circuit
breaker closes): unpaced, it releases them as fast as it can and the recovered dependency takes the whole burst.
Here ``count`` messages (2,000; quick: 600) are parked in the worker's ``1h`` tier, written straight to the tier topic
with the headers Rebound's forwarder writes (as ``release-lateness`` does), all due at the same ``T0``, spread
round-robin over the 4 partitions; ``T0`` leaves time to park them all first (the slack is reported). The handler is
``bench.handlers:scripted`` (succeeds on attempt 1, logs each call's wall-clock ms).

Three fresh workers, one after the other on the same broker: ``unpaced`` (the default, unlimited), ``paced``
(``REBOUND_RELEASE_RATE=100``) and ``paced-ramp``: the same rate with ``REBOUND_RELEASE_RAMP=10s`` and the circuit
breaker on, the handler's dependency down until ``T0 + 3 s`` (the first releases fail, the breaker opens, probes
until the dependency is back and closes; the failed ones go to their next retry, an hour later), so the backlog
meets the ramp: from 10/s at the close to 100/s ten seconds later. Reported per variant: handler calls per 100 ms
from ``T0`` (the chart), the most calls in any one second and any 100 ms, how long releasing took, lateness
percentiles (call time - due time, the delay pacing adds shown, not hidden), calls before due (must be 0), and the
worker's ``rebound_release_paced_total``; for the ramp, the successful calls 1, 5 and 10 s after the close against
the ramp's area (14.5, 162.5, 550) plus the burst.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from bench.common import now_ms, percentile, produce_placed, rebound_worker, running, wait_until
from bench.scenarios.base import PARTITIONS, PRODUCTION_BATCH, Context, new_topic
from bench.scenarios.parked_memory import get, metrics_text, ready, samples
from bench.scenarios.release_lateness import await_parked, tier_records
from demo.embedded_broker import EmbeddedBroker
from rebound.pacing import RAMP_START
from rebound.topics import tier_topic

TIER = "1h"
PACED_RATE = 100
RAMP_S = 10
OUTAGE_AFTER_DUE_MS = 3_000
BREAKER = {
    "REBOUND_BREAKER_ENABLED": "true",
    "REBOUND_BREAKER_WINDOW": "10s",
    "REBOUND_BREAKER_MIN_CALLS": "10",
    "REBOUND_BREAKER_FAILURE_RATIO": "0.5",
    "REBOUND_BREAKER_PROBE_INTERVAL": "1s",
    "REBOUND_BREAKER_PROBE_MAX_INTERVAL": "1s",
}
ASSUMED_PARK_RATE = 150.0
"""Parks per second assumed when choosing ``T0`` (the issue measured 197-273/s on this machine kind)."""
FILL_MARGIN_S = 8.0
BUCKET_MS = 100


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    count = ctx.size(default=2_000, quick=600)
    variants = {}
    for name, rate, ramp in (("unpaced", None, False), ("paced", PACED_RATE, False), ("paced-ramp", PACED_RATE, True)):
        variants[name] = run_variant(ctx, broker, name, count, rate, ramp=ramp)
        print(f"  release-burst {name}: {variants[name]['summary']}", flush=True)
    problems = []
    for name, result in variants.items():
        s = result["summary"]
        if s["early"]:
            problems.append(f"{name}: {s['early']} calls before their due time")
        if s["released"] + s.get("failed_in_outage", 0) < count:
            problems.append(f"{name}: {s['released']} of {count} released")
        if s["slack_s"] < 0:
            problems.append(f"{name}: parking ended {-s['slack_s']} s after the due time")
    paced = variants["paced"]["summary"]
    if paced["max_calls_in_1s"] is not None and paced["max_calls_in_1s"] > PACED_RATE * 1.2 + 10:
        problems.append(f"paced: {paced['max_calls_in_1s']} calls in one second at {PACED_RATE}/s")
    ramp = variants["paced-ramp"]["summary"].get("after_close")
    if not ramp:
        problems.append("paced-ramp: the breaker never closed")
    else:
        for second, row in ramp.items():
            if row["calls"] > row["allowed"] * 1.2 + 5:
                problems.append(f"paced-ramp: {row['calls']} calls in the {second} after the close, {row['allowed']}")
    return {
        "params": {
            "count": count,
            "tier": TIER,
            "partitions": PARTITIONS,
            "paced_rate_per_s": PACED_RATE,
            "ramp_s": RAMP_S,
            "outage_after_due_ms": OUTAGE_AFTER_DUE_MS,
            "breaker": BREAKER,
            "bucket_ms": BUCKET_MS,
            "handler": "bench.handlers:scripted",
        },
        "variants": variants,
        "summary": {
            name: {k: result["summary"][k] for k in ("max_calls_in_1s", "release_span_s", "lateness_ms")}
            for name, result in variants.items()
        },
        "verdict": "ok" if not problems else "FAILED: " + "; ".join(problems),
    }


def run_variant(
    ctx: Context, broker: EmbeddedBroker, name: str, count: int, rate: int | None, *, ramp: bool = False
) -> dict[str, Any]:
    topic = new_topic(broker, f"burst-{name}")
    calls_path = ctx.root / f"{name}.calls.jsonl"
    settings = {"REBOUND_RELEASE_RATE": str(rate)} if rate is not None else {}
    if ramp:
        settings |= {"REBOUND_RELEASE_RAMP": f"{RAMP_S}s", "REBOUND_RETRY_SEQUENCE": f"{TIER},{TIER}", **BREAKER}
    worker = rebound_worker(
        broker,
        ctx.root,
        name,
        REBOUND_APP_ID=topic,
        REBOUND_MAIN_TOPICS=topic,
        REBOUND_HANDLER="bench.handlers:scripted",
        BENCH_CALLS=str(calls_path),
        **{"REBOUND_RETRY_SEQUENCE": TIER, **settings},
        **PRODUCTION_BATCH,
    )
    facts: dict[str, Any] = {"rate_per_s": rate}
    with running(worker):
        if not wait_until(lambda: ready(worker), 90, check=[worker]):
            raise RuntimeError(f"worker never became ready:\n{worker.log_tail()}")
        t0 = now_ms() + int((count / ASSUMED_PARK_RATE + FILL_MARGIN_S) * 1000)
        started = time.monotonic()
        records = tier_records(topic, 0, count, lambda i: t0, prefix="s")
        if ramp:  # the dependency is down from before T0 until T0 + 3 s
            down = {"down_from": 0, "down_until": t0 + OUTAGE_AFTER_DUE_MS}
            records = [(p, k, json.dumps({**json.loads(v), **down}).encode(), h) for p, k, v, h in records]
        asyncio.run(produce_placed(broker.bootstrap, tier_topic(topic, TIER), records))
        await_parked(worker, count)
        facts["park_rate_per_s"] = round(count / (time.monotonic() - started), 1)
        facts["slack_s"] = round((t0 - now_ms()) / 1000, 1)
        expected_s = count / rate if rate else 0
        finished = wait_until(
            lambda: succeeded(calls_path) + failed(calls_path) >= count, 60 + 2 * expected_s, every=0.5
        )
        facts["all_released"] = finished
        time.sleep(1.0)  # the last calls' releases settle and count
        metrics = {name: value for name, labels, value in samples(metrics_text(worker)) if not labels}
        facts["release_paced_total"] = metrics.get("rebound_release_paced_total")
        if ramp:
            breaker = json.loads(get(worker, "/retry/backlog?scope=worker")[1])["breaker"]
            closes = [t["at"] for t in breaker["transitions"] if t["to"] == "closed"]
            facts["breaker_closed_at_s"] = round((closes[-1] - t0) / 1000, 2) if closes else None
            facts["failed_in_outage"] = failed(calls_path)
    closed_at_s = facts.get("breaker_closed_at_s")
    closed_at = None if closed_at_s is None else t0 + int(closed_at_s * 1000)
    return summarise(calls_path, t0, count, facts, closed_at=closed_at)


def succeeded(path: Path) -> int:
    """Successful first retries logged so far (a byte count: cheap enough to poll)."""
    return path.read_bytes().count(b'"a":1,"ok":true') if path.exists() else 0


def failed(path: Path) -> int:
    return path.read_bytes().count(b'"a":1,"ok":false') if path.exists() else 0


def summarise(
    calls_path: Path, t0: int, count: int, facts: dict[str, Any], closed_at: int | None = None
) -> dict[str, Any]:
    """Successful first retries only: in the ramp variant the calls that failed in the outage are counted apart."""
    from bench.common import read_calls

    first: dict[str, int] = {}
    for call in read_calls(calls_path):
        key = call.get("k") or ""
        if key.startswith("s") and call.get("a") == 1 and call.get("ok") and key not in first:
            first[key] = int(call["t"])
    times = sorted(first.values())
    lateness: list[float] = [t - t0 for t in times]
    buckets: dict[int, int] = {}
    for t in times:
        buckets[(t - t0) // BUCKET_MS] = buckets.get((t - t0) // BUCKET_MS, 0) + 1
    last = max(buckets, default=-1)
    per_bucket = [buckets.get(b, 0) for b in range(min(0, min(buckets, default=0)), last + 1)]
    per_second = [sum(per_bucket[i : i + 1000 // BUCKET_MS]) for i in range(len(per_bucket))]
    after_close = None
    if closed_at is not None:
        after_close = {
            f"{second}s": {
                "calls": sum(1 for t in times if closed_at <= t < closed_at + second * 1000),
                "allowed": round(ramp_area(second) + PACED_RATE / 10, 1),  # (the bucket: a tenth of a second's worth)
            }
            for second in (1, 5, 10)
        }
    return {
        "summary": {
            "released": len(times),
            "after_close": after_close,
            "early": sum(1 for value in lateness if value < 0),
            "release_span_s": round((times[-1] - times[0]) / 1000, 2) if times else None,
            "max_calls_in_1s": max(per_second, default=None),
            f"max_calls_in_{BUCKET_MS}ms": max(per_bucket, default=None),
            "lateness_ms": {
                "p50": percentile(lateness, 50),
                "p99": percentile(lateness, 99),
                "max": max(lateness, default=None),
            },
            **facts,
        },
        "calls_per_bucket": per_bucket,
    }


def ramp_area(seconds: float) -> float:
    """Releases the ramp allows in its first ``seconds``: the area under the line from RAMP_START of the rate."""
    within = min(seconds, RAMP_S)
    end_share = RAMP_START + (1 - RAMP_START) * within / RAMP_S
    return PACED_RATE * (within * (RAMP_START + end_share) / 2 + max(0.0, seconds - RAMP_S))


def chart(payload: dict[str, Any], plt: Any) -> Any:
    """Calls per 100 ms from the moment everything came due, both variants on one axis."""
    fig, ax = plt.subplots(figsize=(9, 4.2))
    bucket = payload["params"]["bucket_ms"]
    for name, result in payload["variants"].items():
        per_bucket = result["calls_per_bucket"]
        s = result["summary"]
        label = f"{name}: peak {s['max_calls_in_1s']}/s, span {s['release_span_s']} s, p99 late {s['lateness_ms']['p99']} ms"
        ax.step([i * bucket / 1000 for i in range(len(per_bucket))], per_bucket, where="post", label=label)
    ax.set_xlabel("s since all came due")
    ax.set_ylabel(f"handler calls per {bucket} ms")
    ax.set_title(
        f"{payload['params']['count']} retries due at once; paced at {payload['params']['paced_rate_per_s']}/s"
    )
    ax.legend(fontsize=8)
    return fig


def rows(payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The summary table's lines: each worker's peak, span, lateness and early calls (docs/benchmarks.md's table)."""
    bucket = payload["params"]["bucket_ms"]
    out = []
    for name, result in payload["variants"].items():
        s = result["summary"]
        late = s["lateness_ms"]
        peaks = f"{s['max_calls_in_1s']} / {s[f'max_calls_in_{bucket}ms']}"
        out.append((name, f"most calls in 1 s / {bucket} ms", peaks))
        out.append((name, "first to last call s", f"{s['release_span_s']}"))
        out.append((name, "lateness ms p50/p99/max", f"{late['p50']}/{late['p99']}/{late['max']}"))
        out.append((name, "released / before due", f"{s['released']} / {s['early']}"))
        if s.get("after_close"):
            after = ", ".join(f"{at} {v['calls']}/{v['allowed']}" for at, v in s["after_close"].items())
            out.append((name, "calls/allowed after the close", after))
    out.append(("all", "verdict", payload["verdict"]))
    return out
