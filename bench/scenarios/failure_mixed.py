"""Failure path, mixed: failures among healthy traffic at a steady rate, and how late the retry path runs.

One worker, a no-op handler (:func:`fail_first`), policy ``5s``, two phases on the same worker:

1. **Full rate**: ``count`` healthy messages (30,000; 10,000 with ``--quick``) produced as fast as the mixed phase's
   producer goes; the worker's first-try rate (``rebound_attempts_total{tier="main",outcome="succeeded"}``) from 10 %
   of them to 90 % or the end of production (a worker draining alone, with no producer on the machine, measured up
   to twice as fast as it runs beside one).
2. **Mixed**: for 120 s (30 s with ``--quick``) messages produced on an absolute schedule at ``load`` (0.8) times
   that rate, so what is measured is a steady state the worker should keep up with, not a backlog; every fifth one
   (key ``f...``) fails its first try retryably and succeeds on its retry.

Reported, per 10 s window and overall (p50 / p99 / max):

- **tier lag**: a tier record's timestamp (the forward, set by the worker's producer) to the timestamp of the first
  record of the parked copy in the payload table's changelog (``retry_payloads``, the park's write, before its
  acknowledgement), joined on the original partition and offset; windowed by the tier record's time;
- **release lateness**: the retry's handler call (the call log, ``BENCH_CALLS``) minus the ``rebound.due-at`` header
  of its tier record; windowed by the due time. ``rebound_release_lateness_seconds`` (the worker's own histogram, due
  time to the start of the release, bucket upper bounds) is reported beside it, per window from its deltas;
- **backlog**: forwarded but not yet parked (``outcome="scheduled"`` minus ``rebound_parked_total``), sampled every
  0.5 s, parked but not yet released, and produced (on the schedule) but not yet tried (first tries succeeded or
  forwarded): whether the worker kept up with the main topic at all.

Targets (reported, not enforced): tier lag p99 <= 1 s and release lateness p99 <= 250 ms in every window. The verdict
is about conservation only (every failing message released). Knobs: ``BENCH_MIXED_SECONDS``, ``BENCH_MIXED_LOAD``
(fraction of the full rate), ``BENCH_MIXED_FAIL_EVERY`` (5: 20 %), ``BENCH_MIXED_LINGER_MS`` (the mixed phase's
producer linger, 20: unbatched, each record is a batch of its own on the main topic, and the embedded broker's fetch
cost grows with the batches a partition holds, so the broker, not the worker, got slower through the run).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

from app.errors import RetryableError
from bench.common import (
    FaustProcess,
    Sampler,
    distribution,
    follow_counters,
    now_ms,
    rate_between,
    read_calls,
    rebound_worker,
    running,
    wait_until,
)
from bench.handlers import _write
from bench.scenarios.base import PARTITIONS, PRODUCTION_BATCH, Context, new_topic, paced
from bench.scenarios.failure_path import bucket_percentile, counters
from bench.scenarios.parked_memory import metrics_text, ready, samples
from demo.embedded_broker import EmbeddedBroker

SECONDS_ENV = "BENCH_MIXED_SECONDS"
LOAD_ENV = "BENCH_MIXED_LOAD"
FAIL_EVERY_ENV = "BENCH_MIXED_FAIL_EVERY"
LINGER_ENV = "BENCH_MIXED_LINGER_MS"
DELAY = "5s"
DELAY_MS = 5_000
WINDOW_S = 10
TARGETS = {"tier_lag_p99_s": 1.0, "release_lateness_p99_s": 0.25}


async def fail_first(event: Any) -> None:
    """The benchmark's handler: does nothing, fails the first try of a key ``f...`` retryably, and logs each retry
    (partition, offset, attempt, start in epoch ms) so its lateness can be taken against its due time."""
    if event.attempt == 0:
        if event.key is not None and event.key[:1] == b"f":
            raise RetryableError("bench: the first try fails")
        return
    _write({"p": event.partition, "o": event.offset, "a": event.attempt, "t": round(time.time_ns() / 1e6, 3)})


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    count = ctx.size(default=30_000, quick=10_000)
    seconds = float(os.environ.get(SECONDS_ENV) or (30 if ctx.quick else 120))
    load = float(os.environ.get(LOAD_ENV) or 0.8)
    fail_every = int(os.environ.get(FAIL_EVERY_ENV) or 5)
    linger_ms = int(os.environ.get(LINGER_ENV) or 20)
    topic = new_topic(broker, "fm")
    calls = ctx.root / "calls.jsonl"
    worker = rebound_worker(
        broker,
        ctx.root,
        "fm",
        REBOUND_APP_ID=topic,
        REBOUND_MAIN_TOPICS=topic,
        REBOUND_RETRY_SEQUENCE=DELAY,
        REBOUND_HANDLER="bench.scenarios.failure_mixed:fail_first",
        BENCH_CALLS=str(calls),
        **PRODUCTION_BATCH,
    )
    with running(worker):
        if not wait_until(lambda: ready(worker), 90, check=[worker]):
            raise RuntimeError(f"worker never became ready:\n{worker.log_tail()}")
        healthy, produced_until = healthy_run(broker, worker, topic, count)
        full_rate = rate_while_producing(healthy, count, produced_until)
        if not full_rate:
            raise RuntimeError(f"no full rate from the healthy run: {healthy[-1]}")
        rate = round(load * full_rate, 1)
        total = int(rate * seconds)
        failing = len(range(0, total, fail_every))
        print(
            f"  failure-mixed: full rate {full_rate}/s, producing {total} at {rate}/s for {seconds:.0f} s", flush=True
        )
        start_ms = now_ms()
        sampler = Trace(worker)
        with sampler:

            def make(i: int) -> tuple[str, dict[str, Any]]:
                return (f"f{i}" if i % fail_every == 0 else f"m{i}"), {}

            asyncio.run(paced(broker.bootstrap, topic, rate, total, make, linger_ms=linger_ms))
            produced_for_s = round((now_ms() - start_ms) / 1000, 1)
            wait_until(lambda: sampler.last().get("release", 0) >= failing, 120 + seconds, check=[worker])
        tier = asyncio.run(read_topic(broker.bootstrap, f"{topic}.retry.{DELAY}"))
        changelog_topic = asyncio.run(find_topic(broker.bootstrap, "retry_payloads-changelog", prefix=topic))
        payloads = asyncio.run(read_topic(broker.bootstrap, changelog_topic)) if changelog_topic else []
    retries = [c for c in read_calls(calls) if "p" in c]
    for row in sampler.rows:  # produced by then (on schedule) minus first tries done (succeeded or forwarded)
        done = row["first_try"] - count + row["forward"]
        row["main_behind"] = max(0, round(min(total, rate * row["t"]) - done))
    figures = analyse(tier, payloads, retries, sampler.rows, start_ms, seconds)
    last = sampler.last()
    verdict = "ok" if last.get("release", 0) >= failing else f"FAILED: {last.get('release')} of {failing} released"
    summary = {
        "full_rate_per_s": full_rate,
        "produced_per_s": rate,
        "load_of_full_rate": load,
        "produced": total,
        "failing": failing,
        "produced_for_s": produced_for_s,
        **figures["overall"],
        "targets": TARGETS,
        "targets_met": targets_met(figures),
    }
    print(f"  failure-mixed: {summary}", flush=True)
    return {
        "params": {
            "healthy_messages": count,
            "mixed_seconds": seconds,
            "load_of_full_rate": load,
            "failing_fraction": round(1 / fail_every, 3),
            "producer_linger_ms": linger_ms,
            "retry_sequence": DELAY,
            "partitions": PARTITIONS,
            "window_s": WINDOW_S,
        },
        "summary": summary,
        "windows": figures["windows"],
        "verdict": verdict,
        "raw": {"healthy": healthy, "mixed": sampler.rows},
    }


def healthy_run(broker: EmbeddedBroker, worker: FaustProcess, topic: str, count: int) -> tuple[list[Any], float]:
    """``count`` healthy messages produced as fast as the mixed phase's producer can (one send per record, in a
    thread), while the counters are followed: the worker's rate with the same producer beside it on the machine."""
    started = time.monotonic()
    ended: list[float] = []

    def produce() -> None:
        asyncio.run(paced(broker.bootstrap, topic, 1e9, count, lambda i: (f"h{i}", {})))
        ended.append(time.monotonic() - started)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    trace = follow_counters(
        worker,
        started,
        lambda: counters(metrics_text(worker)),
        lambda c: c["first_try"] >= count,
        timeout=60 + count / 50,
    )
    producer.join(60)
    return trace, ended[0] if ended else float("inf")


def rate_while_producing(trace: list[dict[str, float]], count: int, produced_until: float) -> float | None:
    """First tries per second from 10 % of ``count`` to 90 % of it or the end of production, whichever came first
    (a worker draining with the producer gone is faster than one sharing the machine with it); the 10-90 % rate if
    production ended within 2 s of the 10 % point."""
    low = next((row for row in trace if row["first_try"] >= 0.1 * count), None)
    high = next((row for row in trace if row["first_try"] >= 0.9 * count or row["t"] >= produced_until), None)
    if low is None or high is None or high["t"] - low["t"] < 2:
        return rate_between(trace, "first_try", count)
    return round((high["first_try"] - low["first_try"]) / (high["t"] - low["t"]), 1)


class Trace(Sampler):
    """The stage counters and the lateness histogram every 0.5 s, in seconds since the mixed phase began."""

    interval = 0.5

    def __init__(self, worker: FaustProcess) -> None:
        super().__init__()
        self.worker = worker
        self.rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._origin = time.monotonic()

    def last(self) -> dict[str, Any]:
        with self._lock:
            return self.rows[-1] if self.rows else {}

    def sample(self) -> bool:
        if not self.worker.alive():
            return False
        text = metrics_text(self.worker)
        if not text:  # a scrape that timed out: skip it, the next one says the same
            return True
        row: dict[str, Any] = {"t": round(time.monotonic() - self._origin, 3), **counters(text)}
        row["lateness_buckets"] = lateness_cumulative(text)
        with self._lock:
            self.rows.append(row)
        return True


def lateness_cumulative(text: str) -> list[list[float]]:
    buckets: dict[float, float] = {}
    for name, labels, value in samples(text):
        if name == "rebound_release_lateness_seconds_bucket":
            bound = float(labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + value
    return [[bound, count] for bound, count in sorted(buckets.items())]


async def find_topic(bootstrap: str, suffix: str, *, prefix: str) -> str | None:
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        topics = await consumer.topics()
    finally:
        await consumer.stop()
    return next((name for name in sorted(topics) if name.startswith(prefix) and name.endswith(suffix)), None)


async def read_topic(bootstrap: str, topic: str) -> list[tuple[bytes | None, bytes | None, int, dict[str, bytes]]]:
    """Every record of ``topic`` up to its end now: key, value, timestamp (ms) and headers."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None)
    await consumer.start()
    out: list[tuple[bytes | None, bytes | None, int, dict[str, bytes]]] = []
    try:
        parts = [TopicPartition(topic, p) for p in (consumer.partitions_for_topic(topic) or set())]
        if not parts:
            await consumer.topics()
            parts = [TopicPartition(topic, p) for p in (consumer.partitions_for_topic(topic) or set())]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        ends = await consumer.end_offsets(parts)
        remaining = {tp for tp in parts if ends[tp] > 0}
        deadline = time.monotonic() + 120
        while remaining and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=1000, max_records=5000)
            for tp, records in batch.items():
                out.extend((r.key, r.value, r.timestamp, dict(r.headers or ())) for r in records)
                if records and records[-1].offset + 1 >= ends[tp]:
                    remaining.discard(tp)
    finally:
        await consumer.stop()
    return out


def analyse(
    tier: list[tuple[Any, Any, int, dict[str, bytes]]],
    payloads: list[tuple[Any, Any, int, dict[str, bytes]]],
    retries: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    start_ms: int,
    seconds: float,
) -> dict[str, Any]:
    """Tier lag and release lateness per message, per window and overall; backlogs per window."""
    forwarded: dict[tuple[int, int], tuple[int, int]] = {}  # origin (partition, offset) -> (forward ms, due ms)
    for _, _, ts, headers in tier:
        origin = (int(headers["rebound.original-partition"]), int(headers["rebound.original-offset"]))
        forwarded.setdefault(origin, (ts, int(headers["rebound.due-at"])))
    parked_at: dict[tuple[int, int], int] = {}
    for key, value, ts, _ in payloads:
        if key is None or value is None:
            continue
        size = int.from_bytes(key[:4], "big")
        parts = key[4 + size :].decode("utf-8", "replace").rsplit("/", 2)
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            parked_at.setdefault((int(parts[1]), int(parts[2])), ts)
    called: dict[tuple[int, int], float] = {}
    for call in retries:
        called.setdefault((int(call["p"]), int(call["o"])), float(call["t"]))
    lags = [(fwd, (parked_at[o] - fwd) / 1000) for o, (fwd, _) in forwarded.items() if o in parked_at]
    late = [(due, (called[o] - due) / 1000) for o, (_, due) in forwarded.items() if o in called]
    horizon = max([t for t, _ in lags] + [t for t, _ in late] + [start_ms]) - start_ms
    windows = []
    for index in range(int(horizon // (WINDOW_S * 1000)) + 1):
        low, high = start_ms + index * WINDOW_S * 1000, start_ms + (index + 1) * WINDOW_S * 1000
        in_rows = [r for r in rows if index * WINDOW_S <= r["t"] < (index + 1) * WINDOW_S]
        windows.append(
            {
                "from_s": index * WINDOW_S,
                "producing": index * WINDOW_S < seconds,
                "tier_lag_s": _rounded(distribution([v for t, v in lags if low <= t < high])),
                "release_lateness_s": _rounded(distribution([v for t, v in late if low <= t < high])),
                "histogram_lateness_s": _histogram_window(rows, index),
                "forwarded_not_parked_max": max((r["forward"] - r["park"] for r in in_rows), default=None),
                "parked_not_released_max": max((r["park"] - r["release"] for r in in_rows), default=None),
                "main_behind_max": max((r["main_behind"] for r in in_rows), default=None),
            }
        )
    last = rows[-1] if rows else {}
    overall = {
        "forwarded": len(forwarded),
        "parked_seen": len(parked_at),
        "retried_seen": len(called),
        "tier_lag_s": _rounded(distribution([v for _, v in lags])),
        "release_lateness_s": _rounded(distribution([v for _, v in late])),
        "histogram_lateness_s": {q: bucket_percentile(_buckets(last), q) for q in (50, 99)} if last else None,
        "forwarded_not_parked_max": max((r["forward"] - r["park"] for r in rows), default=None),
        "parked_not_released_max": max((r["park"] - r["release"] for r in rows), default=None),
        "main_behind_max": max((r["main_behind"] for r in rows), default=None),
        "last_release_after_s": next((r["t"] for r in rows if last and r["release"] >= last["release"]), None),
    }
    return {"overall": overall, "windows": windows}


def _buckets(row: dict[str, Any]) -> list[tuple[float, float]]:
    return [(bound, count) for bound, count in row["lateness_buckets"]]


def _histogram_window(rows: list[dict[str, Any]], index: int) -> dict[int, Any] | None:
    """p50 and p99 bucket of the releases that started within window ``index`` (counter deltas of its samples)."""
    before = [r for r in rows if r["t"] < index * WINDOW_S]
    within = [r for r in rows if r["t"] < (index + 1) * WINDOW_S]
    if not within:
        return None
    end = _buckets(within[-1])
    start = dict(_buckets(before[-1])) if before else {}
    delta = [(bound, count - start.get(bound, 0.0)) for bound, count in end]
    return {q: bucket_percentile(delta, q) for q in (50, 99)} if delta and delta[-1][1] else None


def _rounded(dist: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in dist.items()}


def targets_met(figures: dict[str, Any]) -> dict[str, Any]:
    """Each target overall and in every window that had any of the measured messages."""

    def p99(window: dict[str, Any], name: str) -> float | None:
        value = window[name]["p99"]
        return None if value is None else float(value)

    out: dict[str, Any] = {}
    for name, target in (
        ("tier_lag_s", TARGETS["tier_lag_p99_s"]),
        ("release_lateness_s", TARGETS["release_lateness_p99_s"]),
    ):
        values = [p99(w, name) for w in figures["windows"]]
        values_seen = [v for v in values if v is not None]
        out[name] = {
            "overall_p99_met": (figures["overall"][name]["p99"] or 0) <= target,
            "windows_met": sum(v <= target for v in values_seen),
            "windows": len(values_seen),
            "worst_window_p99": max(values_seen, default=None),
        }
    return out


def chart(payload: dict[str, Any]) -> Any:
    """Per 10 s window: tier lag and release lateness p50/p99 against their targets; the backlogs over time."""
    import matplotlib.pyplot as plt

    fig, (lag_ax, late_ax, backlog_ax) = plt.subplots(1, 3, figsize=(16, 4.4))
    windows = payload["windows"]
    xs = [w["from_s"] + WINDOW_S / 2 for w in windows]
    for ax, name, target in (
        (lag_ax, "tier_lag_s", TARGETS["tier_lag_p99_s"]),
        (late_ax, "release_lateness_s", TARGETS["release_lateness_p99_s"]),
    ):
        for q, style in (("p50", "o-"), ("p99", "s-"), ("max", "x:")):
            ax.plot(xs, [w[name][q] for w in windows], style, label=q)
        ax.axhline(target, color="grey", linestyle="--", label=f"target p99 {target} s")
        ax.axvline(payload["params"]["mixed_seconds"], color="tab:red", linestyle=":", linewidth=1)
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.005)
        ax.set_xlabel("s since the mixed phase began (window centre; red: production stops)", fontsize=8)
        ax.legend(fontsize=7)
    lag_ax.set_ylabel("tier record -> parked (s)")
    late_ax.set_ylabel("retry call - due (s)")
    s = payload["summary"]
    lag_ax.set_title(f"tier lag: p50 {s['tier_lag_s']['p50']} s, p99 {s['tier_lag_s']['p99']} s", fontsize=9)
    late = s["release_lateness_s"]
    late_ax.set_title(f"release lateness: p50 {late['p50']} s, p99 {late['p99']} s", fontsize=9)
    rows = payload["raw"]["mixed"]
    ts = [r["t"] for r in rows]
    backlog_ax.plot(ts, [r["forward"] - r["park"] for r in rows], label="forwarded, not parked")
    backlog_ax.plot(ts, [r["park"] - r["release"] for r in rows], label="parked, not released")
    backlog_ax.plot(ts, [r["main_behind"] for r in rows], ls="--", label="produced, first try not done")
    backlog_ax.axvline(payload["params"]["mixed_seconds"], color="tab:red", linestyle=":", linewidth=1)
    backlog_ax.set_xlabel("s since the mixed phase began")
    backlog_ax.set_ylabel("messages")
    backlog_ax.set_title(
        f"{s['produced_per_s']}/s ({s['load_of_full_rate']} of {s['full_rate_per_s']}/s), "
        f"{payload['params']['failing_fraction']:.0%} failing once, {payload['params']['retry_sequence']}",
        fontsize=9,
    )
    backlog_ax.legend(fontsize=7)
    return fig


def rows(payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    s = payload["summary"]
    lag, late = s["tier_lag_s"], s["release_lateness_s"]
    return [
        ("rebound", "full rate / produced msg/s", f"{s['full_rate_per_s']} / {s['produced_per_s']}"),
        ("rebound", "tier lag p50/p99 s", f"{lag['p50']}/{lag['p99']}"),
        ("rebound", "release lateness p50/p99 s", f"{late['p50']}/{late['p99']}"),
        ("rebound", "forwarded-not-parked max", f"{s['forwarded_not_parked_max']}"),
        ("rebound", "main topic behind max", f"{s['main_behind_max']}"),
    ]
