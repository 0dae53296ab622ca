"""Hot key: what parking and settling one message costs as one key's backlog grows.

Each parked message is a record of its own in ``retry_payloads`` plus a small per-key index in ``retry_state``; the
layout before it kept every parked message of a key in one document, rewritten on every park and settle, so the
n-th park of a key cost O(n). Here one key gets ``messages`` parked messages, produced to the main topic in ten
equal buckets; the handler (``bench.handlers:scripted``, ``fail_until`` 1) fails each first try, so it is parked
for the one-tier policy's delay, and succeeds on its retry. Per bucket, as the key's backlog grows:

* wall time from producing the bucket until the worker's ``parked`` counter has it all (first try, tier record,
  park), and the worker's and the broker's CPU seconds over that span plus a 1 s quiet tail (``/proc/<pid>/stat``);
* changelog records and bytes (key + value) written to ``<app id>-retry_payloads-changelog`` and
  ``<app id>-retry_state-changelog``, read back with aiokafka at the end and put in buckets by record timestamp.

The delay is longer than the whole parking phase, so the buckets come due in the order they were parked, with the
same gaps: the settle phase (release, handler, settle) is cut at the moments the ``outcome.succeeded`` counter
crosses each bucket boundary, as the backlog shrinks, with the same CPU and changelog figures, the bucket's span of
successful calls (bounded below by its due times, which are as spread as its park) and the mean release lag
(``rebound_release_lateness_seconds``, sum over count). The baseline, in the same run and on a broker of its own,
parks the same number of messages over as many distinct keys. A hot key also puts every record into one partition of each topic (main,
tier, attempts, release, both changelogs), so a control parks the distinct keys with one partition: what grows there
too comes from one partition growing (broker, client), not from the key. The claim checked: a key's cost per message
is flat as it grows (last bucket / first bucket), and close to the spread keys'.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.common import (
    FaustProcess,
    cpu_seconds,
    fresh_broker,
    now_ms,
    produce_batch,
    read_calls,
    rebound_worker,
    running,
    topic_partitions,
    wait_until,
)
from bench.scenarios.base import PARTITIONS, PRODUCTION_BATCH, Context, unique
from bench.scenarios.parked_memory import metrics_text, ready, samples
from bench.scenarios.scale_parked import events
from demo.embedded_broker import EmbeddedBroker
from demo.harness import create_topics

BUCKETS = 10
PAD_BYTES = 100
"""Filler in each message's value, so a payload is more than its script (about 150 bytes in all)."""
QUIET_S = 1.0
"""After a bucket's last park: the last changelog confirms and an offset commit (0.5 s) land in its window."""
FLAT_LIMIT = 1.5
"""Last bucket / first bucket above this, for a hot key's CPU or changelog bytes per message, fails the check."""
TABLES = ("retry_payloads", "retry_state")
SHOWN = (
    "backlog_after",
    "wall_s",
    "span_s",
    "cpu_ms_per_msg",
    "cpu_net_ms_per_msg",
    "broker_cpu_ms_per_msg",
    "changelog_bytes_per_msg",
    "changelog_records_per_msg",
    "state_record_max_bytes",
    "mean_release_lag_ms",
)


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    total = ctx.size(default=10_000, quick=1_000)
    size = max(1, total // BUCKETS)
    total = size * BUCKETS
    # Longer than the parking phase (about 3 s a bucket of 1,000 here, with the quiet tail): nothing comes due while
    # buckets are still being parked, and the settle phase starts soon after.
    delay_s = 30 + total // 150
    variants: dict[str, Any] = {}
    keyings: dict[str, tuple[Callable[[int], bytes], int]] = {
        "hot-key": (lambda i: b"hot", PARTITIONS),
        "distinct-keys": (lambda i: f"k{i:06d}".encode(), PARTITIONS),
        # The control: every record of a hot key lands in one partition of each topic, which the broker may handle
        # worse as it grows. Here the same keys as above share one partition, without sharing a key.
        "distinct-keys-one-partition": (lambda i: f"k{i:06d}".encode(), 1),
    }
    for index, (name, (key_of, partitions)) in enumerate(keyings.items()):
        if index == 0:
            variants[name] = run_variant(ctx, broker, name, key_of, size, delay_s, partitions)
        else:  # a broker of its own: the first variant's records must not slow this one's
            (ctx.root / name).mkdir(parents=True, exist_ok=True)
            with fresh_broker(ctx.root / name) as own:
                variants[name] = run_variant(ctx, own, name, key_of, size, delay_s, partitions)
        print(f"  hot-key {name}: {variants[name]['summary']}", flush=True)
    summary = {name: variants[name]["summary"] for name in variants}
    hot = summary["hot-key"]
    failures = [
        f"{phase} {figure} last/first {hot[phase][figure]}"
        for phase in ("park", "settle")
        for figure in ("cpu_ms_per_msg_last_vs_first", "changelog_bytes_per_msg_last_vs_first")
        if hot[phase][figure] is not None and hot[phase][figure] > FLAT_LIMIT
    ]
    overlaps = [name for name, result in variants.items() if result["phases_overlapped"]]
    if overlaps:
        failures.append(f"settling began before parking ended ({', '.join(overlaps)}): raise the delay")
    return {
        "params": {
            "messages": total,
            "buckets": BUCKETS,
            "bucket_size": size,
            "retry_sequence": f"{delay_s}s",
            "partitions": PARTITIONS,
            "value_bytes": len(value_of(0)),
            "flat_limit": FLAT_LIMIT,
            "producer_batch_bytes": int(PRODUCTION_BATCH["REBOUND_PRODUCER_MAX_BATCH_BYTES"]),
        },
        "variants": variants,
        "summary": summary,
        "verdict": "ok" if not failures else "FAILED: " + "; ".join(failures),
    }


def value_of(i: int) -> bytes:
    return json.dumps({"fail_until": 1, "i": i, "pad": "x" * PAD_BYTES}).encode()


def counters(worker: FaustProcess) -> dict[str, float]:
    """The internal counters by name (``scale_parked.events``), plus the release-lag sum in seconds and the parked
    messages under their former names (``rebound_release_lag_seconds_sum``, ``rebound_scheduled_waiting``)."""
    text = metrics_text(worker)
    found = events(text)
    found["rebound_release_lag_seconds_sum"] = found.get("release.lag_ms_total", 0.0) / 1000
    found["rebound_scheduled_waiting"] = sum(v for name, _, v in samples(text) if name == "rebound_tier_waiting")
    return found


def idle_cpu_rate(worker: FaustProcess, window: float) -> float:
    before, started = cpu_seconds(worker.pid), time.monotonic()
    time.sleep(window)
    return (cpu_seconds(worker.pid) - before) / (time.monotonic() - started)


def run_variant(
    ctx: Context,
    broker: EmbeddedBroker,
    name: str,
    key_of: Callable[[int], bytes],
    size: int,
    delay_s: int,
    partitions: int,
) -> dict[str, Any]:
    topic = unique(f"hk-{name}")
    asyncio.run(create_topics(broker.bootstrap, [topic], partitions))
    calls_path = ctx.root / f"{name}.calls.jsonl"
    worker = rebound_worker(
        broker,
        ctx.root,
        name,
        REBOUND_APP_ID=topic,
        REBOUND_MAIN_TOPICS=topic,
        REBOUND_RETRY_SEQUENCE=f"{delay_s}s",
        REBOUND_HANDLER="bench.handlers:scripted",
        BENCH_CALLS=str(calls_path),
        **PRODUCTION_BATCH,
    )
    with running(worker):
        if not wait_until(lambda: ready(worker), 90, check=[worker]):
            raise RuntimeError(f"{name}: worker never became ready:\n{worker.log_tail()}")
        meter = Meter(worker, broker.process.pid, idle_cpu_rate(worker, 3.0))
        park = park_phase(meter, broker, topic, name, key_of, size)
        first_due = min(c["t"] for c in read_calls(calls_path) if c["a"] == 0) + delay_s * 1000
        overlapped = now_ms() >= first_due - 500
        # Idle with the whole backlog parked (timer ticks, heartbeats, the 30 s first-receipt survey) until due.
        wait_s = max(0.0, (first_due - now_ms()) / 1000 - 0.5)
        idle_full = idle_cpu_rate(worker, wait_s) if wait_s > 1 else None
        settle = settle_phase(meter, name, size)
        final = counters(worker)
    successes = sorted(c["t"] for c in read_calls(calls_path) if c["a"] >= 1 and c["ok"])
    for bucket, row in enumerate(settle):
        done = successes[bucket * size : (bucket + 1) * size]
        row["span_s"] = round((done[-1] - done[0]) / 1000, 3) if done else None
    bytes_by_window = asyncio.run(changelog_by_window(broker.bootstrap, topic, [*park, *settle]))
    for row, found in zip([*park, *settle], bytes_by_window, strict=True):
        row.update(found)
        for figure in ("cpu_s", "cpu_net_s", "broker_cpu_s"):
            row[figure.replace("_s", "_ms_per_msg")] = round(1000 * row[figure] / size, 3)
        row["changelog_bytes_per_msg"] = round(row["changelog_bytes"] / size, 1)
        row["changelog_records_per_msg"] = round(row["changelog_records"] / size, 2)
    for phase, rows in (("park", park), ("settle", settle)):
        for row in rows:
            shown = {k: v for k, v in row.items() if k in SHOWN}
            print(f"  hot-key {name} {phase}: {shown}", flush=True)
    return {
        "key": "one key" if key_of(0) == key_of(1) else f"{size * BUCKETS} keys",
        "partitions": partitions,
        "idle_cpu_pct": {
            "empty": round(100 * meter.idle_rate, 2),
            "all_parked": None if idle_full is None else round(100 * idle_full, 2),
        },
        "phases_overlapped": overlapped,
        "park": park,
        "settle": settle,
        "final_counters": {k: v for k, v in final.items() if k in ("parked", "released", "outcome.succeeded")},
        "summary": {"park": summarize(park), "settle": summarize(settle)},
    }


@dataclass
class Meter:
    """CPU of the worker and the broker, and the release-lag counters, since the last ``mark``."""

    worker: FaustProcess
    broker_pid: int
    idle_rate: float
    """The worker's CPU seconds per second with nothing to do and nothing parked: taken off for ``cpu_net_s``."""
    at: tuple[int, float, float, float, float] = (0, 0.0, 0.0, 0.0, 0.0)

    def mark(self) -> None:
        now = counters(self.worker)
        self.at = (
            now_ms(),
            cpu_seconds(self.worker.pid),
            cpu_seconds(self.broker_pid),
            now.get("rebound_release_lag_seconds_sum", 0.0),
            now.get("released", 0.0),
        )

    def since(self) -> dict[str, Any]:
        """The figures since the last mark, which moves here."""
        before = self.at
        self.mark()
        at_ms, cpu, broker_cpu, lag, released = self.at
        return {
            "cpu_s": round(cpu - before[1], 3),
            "cpu_net_s": round(cpu - before[1] - self.idle_rate * (at_ms - before[0]) / 1000, 3),
            "broker_cpu_s": round(broker_cpu - before[2], 3),
            "mean_release_lag_ms": round(1000 * (lag - before[3]) / (released - before[4]), 1)
            if released > before[4]
            else None,
            "window_ms": [before[0], at_ms],
        }


def park_phase(
    meter: Meter, broker: EmbeddedBroker, topic: str, name: str, key_of: Callable[[int], bytes], size: int
) -> list[dict[str, Any]]:
    """Produce the buckets one after the other; each one's figures from its production until it is all parked."""
    rows = []
    for bucket in range(BUCKETS):
        meter.mark()
        started = time.monotonic()
        first = bucket * size
        records = [(key_of(i), value_of(i)) for i in range(first, first + size)]
        asyncio.run(produce_batch(broker.bootstrap, topic, records))
        target = first + size
        if not wait_until(
            lambda t=target: counters(meter.worker).get("parked", 0) >= t,
            60 + size / 20,
            every=0.05,
            check=[meter.worker],
        ):
            raise RuntimeError(f"{name}: only {counters(meter.worker).get('parked')} of {target} parked")
        wall = time.monotonic() - started
        time.sleep(QUIET_S)
        rows.append({"bucket": bucket + 1, "backlog_after": target, "wall_s": round(wall, 3), **meter.since()})
    return rows


def settle_phase(meter: Meter, name: str, size: int) -> list[dict[str, Any]]:
    """Wait as the buckets come due; each one's figures up to the moment its last message succeeded."""
    rows = []
    meter.mark()
    for bucket in range(BUCKETS):
        target = (bucket + 1) * size
        if not wait_until(
            lambda t=target: counters(meter.worker).get("outcome.succeeded", 0) >= t,
            60 + size / 20,
            every=0.05,
            check=[meter.worker],
        ):
            raise RuntimeError(f"{name}: only {counters(meter.worker).get('outcome.succeeded')} of {target} settled")
        rows.append({"bucket": bucket + 1, "backlog_after": size * BUCKETS - target, **meter.since()})
    time.sleep(QUIET_S)  # the last settles' changelog records
    rows[-1]["window_ms"][1] = now_ms()
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    first, last = rows[0], rows[-1]

    def ratio(figure: str) -> float | None:
        return round(last[figure] / first[figure], 2) if first.get(figure) else None

    out: dict[str, Any] = {}
    for figure in ("cpu_ms_per_msg", "cpu_net_ms_per_msg", "broker_cpu_ms_per_msg", "changelog_bytes_per_msg"):
        out[f"{figure}_first"], out[f"{figure}_last"] = first[figure], last[figure]
        out[f"{figure}_last_vs_first"] = ratio(figure)
    for figure in ("wall_s", "span_s"):
        if figure in first:
            out[f"{figure}_first"], out[f"{figure}_last"] = first[figure], last[figure]
            out[f"{figure}_last_vs_first"] = ratio(figure)
    out["cpu_ms_per_msg_mean"] = round(sum(row["cpu_ms_per_msg"] for row in rows) / len(rows), 3)
    out["changelog_bytes_total"] = sum(row["changelog_bytes"] for row in rows)
    out["state_record_max_bytes"] = max(row["state_record_max_bytes"] for row in rows)
    return out


async def changelog_topics(bootstrap: str, app_id: str) -> list[str]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        topics = await admin.list_topics()
    finally:
        await admin.close()
    return sorted(t for t in topics if t.startswith(f"{app_id}-") and t.endswith("-changelog"))


async def read_changelogs(
    bootstrap: str, topics: list[str], until: dict[tuple[str, int], int] | None = None, quiet_s: float = 2.0
) -> list[Any]:
    """Every record of ``topics`` from the beginning: up to the offsets in ``until`` if given, else until the end
    offsets are passed and nothing more came for ``quiet_s`` (this broker's end offset can stop short of a batch's
    last records)."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, max_poll_records=5000)
    await consumer.start()
    records: list[Any] = []
    try:
        partitions = await topic_partitions(consumer, topics)
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = (
            {tp: until.get((tp.topic, tp.partition), 0) for tp in partitions}
            if until is not None
            else await consumer.end_offsets(partitions)
        )
        quiet_since = time.monotonic()
        while True:
            batch = await consumer.getmany(timeout_ms=200)
            got = False
            for tp, messages in batch.items():
                for message in messages:
                    if until is None or message.offset < ends[tp]:
                        records.append(message)
                        got = True
            if got:
                quiet_since = time.monotonic()
            positions = [await consumer.position(tp) for tp in partitions]
            reached = all(position >= ends[tp] for position, tp in zip(positions, partitions, strict=True))
            if reached and (until is not None or time.monotonic() - quiet_since >= quiet_s):
                break
            if time.monotonic() - quiet_since > 60:
                raise RuntimeError(f"changelog read stalled at {len(records)} records")
    finally:
        await consumer.stop()
    return records


async def changelog_by_window(bootstrap: str, app_id: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Changelog records and bytes (key + value) of the retry tables written in each row's window (record time)."""
    topics = [t for t in await changelog_topics(bootstrap, app_id) if any(f"-{table}-" in t for table in TABLES)]
    found = [{"changelog_records": 0, "changelog_bytes": 0, "state_record_max_bytes": 0} for _ in rows]
    for record in await read_changelogs(bootstrap, topics):
        for window, into in zip(rows, found, strict=True):
            start, end = window["window_ms"]
            if start <= record.timestamp <= end:
                size = len(record.key or b"") + len(record.value or b"")
                into["changelog_records"] += 1
                into["changelog_bytes"] += size
                if "-retry_state-" in record.topic:
                    into["state_record_max_bytes"] = max(into["state_record_max_bytes"], size)
                break
    return found
