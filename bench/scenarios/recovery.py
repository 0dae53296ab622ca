"""Recovery: a fresh worker taking over the partitions of one killed with many messages parked.

A worker parks ``messages`` messages (distinct keys, produced to the main topic; the handler,
``bench.handlers:scripted`` with ``fail_until`` 1, fails each first try and succeeds on the retry) with a one-tier
policy whose delay is longer than the filling, so nothing is due while it fills. It is killed with SIGKILL
``LEAD_S`` before the first parked message is due, and a fresh worker with an empty data directory (a new path)
starts at once: it must read the whole changelog of both retry tables before its agents run, then rebuild the release
schedule from the adopted partitions' entries (``adopt_owned_partitions``). From the fresh worker's start, measured:

* when it logged ``release schedule adopted partitions ... (N parked)`` with N equal to what the killed worker had
  parked (its ``rebound_scheduled_waiting`` just before the kill): the log line's own timestamp;
* when the first due message ran again (its first successful retry in the fresh worker's call log): the target is
  60 s with 100,000 parked; by then the first messages have been due for a while, so this is the time to ready plus
  the first release, not a wait for a due time;
* when it handled a new message produced to the main topic right after its start;
* the changelog it had to read: records and key + value bytes of every ``<app id>-*-changelog`` topic up to the end
  offsets taken just before the kill, and the worker's CPU seconds until the schedule was adopted.

The baseline, in the same run, is the same takeover with nothing parked. Both workers use the harness's group timings
and its one-record producer batches: a recovering table on this broker stops early on multi-record batches.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import re
import signal
import time
from pathlib import Path
from typing import Any

from bench.common import (
    FaustProcess,
    cpu_seconds,
    fresh_broker,
    now_ms,
    proc_status,
    produce_batch,
    read_calls,
    rebound_worker,
    topic_partitions,
    wait_until,
)
from bench.scenarios.base import PARTITIONS, Context, new_topic
from bench.scenarios.hot_key import changelog_topics, counters, read_changelogs
from bench.scenarios.parked_memory import ready
from demo.embedded_broker import EmbeddedBroker

TARGET_S = 60.0
"""At most this long from the fresh worker's start to the first due message running, with 100,000 parked."""
LEAD_S = 2.0
"""The old worker is killed this long before the first parked message is due."""
PARK_RATE = 400
"""Messages parked a second with one-record batches (measured here: about 600 on a quiet machine), for the delay."""
LOG_TIME = re.compile(r"^\[(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")
ADOPTED = re.compile(r"release schedule adopted partitions \[(?P<partitions>[^\]]*)\] \((?P<parked>\d+) parked\)")
MILESTONES = {
    "joined_group": "Joined group",
    "changelog_read_started": "Restoring state from changelog topics",
    "changelog_read_done": "Done reading from changelog topics",
    "worker_ready": "[^Worker]: Ready",
}
"""Faust's own info lines, with their times after the start, to tell the group join from the changelog read."""


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    count = ctx.size(default=100_000, quick=5_000)
    delay_s = int(30 + 1.5 * count / PARK_RATE)
    variants: dict[str, Any] = {"nothing-parked": takeover(ctx, broker, "nothing-parked", 0, delay_s)}
    print(f"  recovery nothing-parked: {variants['nothing-parked']['summary']}", flush=True)
    (ctx.root / "parked").mkdir(parents=True, exist_ok=True)
    with fresh_broker(ctx.root / "parked") as own:  # a broker of its own, as empty as the baseline's was
        variants["parked"] = takeover(ctx, own, "parked", count, delay_s)
    print(f"  recovery parked: {variants['parked']['summary']}", flush=True)
    parked = variants["parked"]["summary"]
    problems = []
    if parked["adopted_parked"] != parked["parked"]:
        problems.append(f"adopted {parked['adopted_parked']} of {parked['parked']} parked")
    if parked["first_due_run_s"] is None or parked["first_due_run_s"] > TARGET_S:
        problems.append(f"first due message after {parked['first_due_run_s']} s (target {TARGET_S:g} s)")
    return {
        "params": {
            "messages": count,
            "retry_sequence": f"{delay_s}s",
            "kill_before_first_due_s": LEAD_S,
            "partitions": PARTITIONS,
            "target_s": TARGET_S,
            "producer_batch_bytes": 1,
        },
        "variants": variants,
        "summary": {name: result["summary"] for name, result in variants.items()},
        "verdict": "ok" if not problems else "FAILED: " + "; ".join(problems),
    }


def takeover(ctx: Context, broker: EmbeddedBroker, name: str, count: int, delay_s: int) -> dict[str, Any]:
    topic = new_topic(broker, f"rec-{name}")
    common = {
        "REBOUND_APP_ID": topic,
        "REBOUND_MAIN_TOPICS": topic,
        "REBOUND_RETRY_SEQUENCE": f"{delay_s}s",
        "REBOUND_HANDLER": "bench.handlers:scripted",
    }
    old_calls, new_calls = ctx.root / f"{name}-old.calls.jsonl", ctx.root / f"{name}-new.calls.jsonl"
    old = rebound_worker(broker, ctx.root, f"{name}-old", BENCH_CALLS=str(old_calls), **common)
    plain = rebound_worker(broker, ctx.root, f"{name}-new", BENCH_CALLS=str(new_calls), **common)
    new = dataclasses.replace(plain, log_level="info")  # the schedule's adoption is an info line
    try:
        old.start()
        if not wait_until(lambda: ready(old), 90, check=[old]):
            raise RuntimeError(f"{name}: the first worker never became ready:\n{old.log_tail()}")
        fill = fill_and_wait(old, broker, topic, old_calls, count, delay_s) if count else {"fill_s": 0.0}
        time.sleep(max(2.0, fill.pop("wait_s", 0.0)))  # (at least: the last confirms and offset commits)
        before = counters(old)
        parked = int(before.get("rebound_scheduled_waiting", 0))
        topics = asyncio.run(changelog_topics(broker.bootstrap, topic))
        ends = asyncio.run(end_offsets(broker.bootstrap, topics))
        assert old.process is not None
        old.process.send_signal(signal.SIGKILL)
        old.process.wait(10)
        killed_ms = now_ms()
        new.start()
        started_ms = now_ms()
        asyncio.run(produce_batch(broker.bootstrap, topic, [(b"probe", json.dumps({"fail_until": 0}).encode())]))
        watched = watch(new, new_calls, started_ms, parked, count, timeout=120 + count / 500)
        hwm = proc_status(new.pid)["VmHWM"]
    finally:
        new.stop()
        old.stop()
    read = asyncio.run(read_changelogs(broker.bootstrap, topics, until=ends))
    by_topic: dict[str, dict[str, int]] = {}
    for record in read:
        into = by_topic.setdefault(record.topic.removeprefix(f"{topic}-"), {"records": 0, "bytes": 0})
        into["records"] += 1
        into["bytes"] += len(record.key or b"") + len(record.value or b"")
    changelog_bytes = sum(t["bytes"] for t in by_topic.values())
    early_retries = sum(1 for c in read_calls(old_calls) if c["a"] >= 1)
    first_due_ms = fill.get("first_due_ms")
    summary = {
        "parked": parked,
        "adopted_parked": watched["adopted_parked"],
        "adopted_s": watched["adopted_s"],
        "first_new_message_s": watched["first_new_message_s"],
        "first_due_run_s": watched["first_due_run_s"],
        "first_due_at_s": None if first_due_ms is None else round((first_due_ms - started_ms) / 1000, 2),
        "group_joined_s": _last_before(watched["milestones_s"].get("joined_group", []), watched["adopted_s"]),
        "changelog_read_s": _read_time(watched["milestones_s"]),
        "changelog_records": sum(t["records"] for t in by_topic.values()),
        "changelog_mib": round(changelog_bytes / 2**20, 1),
        "cpu_s_until_adopted": watched["cpu_s_until_adopted"],
        "rss_hwm_mib": round(hwm / 1024, 1),
        "fill_s": fill.get("fill_s"),
        "released_by_the_killed_worker": early_retries,
    }
    return {
        "summary": summary,
        "kill_to_start_ms": started_ms - killed_ms,
        "adoptions": watched["adoptions"],
        "milestones_s": watched["milestones_s"],
        "changelog": by_topic,
        "changelog_bytes": changelog_bytes,
        "timeline": watched["timeline"],
    }


def fill_and_wait(
    worker: FaustProcess, broker: EmbeddedBroker, topic: str, calls: Path, count: int, delay_s: int
) -> dict[str, Any]:
    """Park ``count`` messages; how long it took, when the first is due and how long to wait before the kill."""
    started = time.monotonic()
    records = [(f"r{i:06d}".encode(), json.dumps({"fail_until": 1, "i": i}).encode()) for i in range(count)]
    asyncio.run(produce_batch(broker.bootstrap, topic, records))
    if not wait_until(
        lambda: counters(worker).get("parked", 0) >= count, 60 + 3 * count / PARK_RATE, every=1.0, check=[worker]
    ):
        raise RuntimeError(f"only {counters(worker).get('parked')} of {count} parked")
    fill_s = time.monotonic() - started
    first_due_ms = min(c["t"] for c in read_calls(calls) if c["a"] == 0) + delay_s * 1000
    wait_s = (first_due_ms - now_ms()) / 1000 - LEAD_S
    print(f"  recovery: {count} parked in {fill_s:.1f} s; killing in {wait_s:.1f} s", flush=True)
    if wait_s < 2.0:
        raise RuntimeError(f"filling took {fill_s:.0f} s, too close to the {delay_s} s delay: lower PARK_RATE")
    return {"fill_s": round(fill_s, 1), "first_due_ms": first_due_ms, "wait_s": wait_s}


async def end_offsets(bootstrap: str, topics: list[str]) -> dict[tuple[str, int], int]:
    """Exact with the one-record batches the workers use here."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = await topic_partitions(consumer, topics)
        ends = await consumer.end_offsets(partitions)
    finally:
        await consumer.stop()
    return {(tp.topic, tp.partition): int(offset) for tp, offset in ends.items()}


def watch(
    worker: FaustProcess, calls: Path, started_ms: int, parked: int, count: int, timeout: float
) -> dict[str, Any]:
    """Follow the fresh worker until it adopted ``parked`` messages, handled the probe and (if any were parked) ran
    a due message; with a timeline of its parked gauge and CPU seconds."""
    deadline = time.monotonic() + timeout
    adoptions: list[dict[str, Any]] = []
    milestones: dict[str, list[float]] = {}
    timeline: list[tuple[float, int | None, float]] = []
    position = 0
    cpu_at_adoption = None
    figures: dict[str, Any] = {"adopted_s": None, "adopted_parked": None, "first_new_message_s": None}
    figures["first_due_run_s"] = None
    while time.monotonic() < deadline:
        worker.check()
        with worker.log_path.open("rb") as log:
            log.seek(position)
            lines = log.read().split(b"\n")[:-1]  # the last piece is an unfinished line (or empty)
        position += sum(len(line) + 1 for line in lines)
        for raw in lines:
            line = raw.decode(errors="replace")
            stamp = LOG_TIME.match(line)
            if stamp is None:
                continue
            at_s = round(
                (dt.datetime.strptime(stamp["at"], "%Y-%m-%d %H:%M:%S,%f").timestamp() * 1000 - started_ms) / 1000, 2
            )
            for name, marker in MILESTONES.items():
                if marker in line:
                    milestones.setdefault(name, []).append(at_s)
            match = ADOPTED.search(line)
            if match:
                found = int(match["parked"])
                adoptions.append({"at_s": at_s, "parked": found})
                if figures["adopted_s"] is None and found == parked:
                    figures["adopted_s"], figures["adopted_parked"] = adoptions[-1]["at_s"], found
                    cpu_at_adoption = cpu_seconds(worker.pid)
        done = read_calls(calls)
        if figures["first_new_message_s"] is None:
            probe = [c["t"] for c in done if c["k"] == "probe" and c["ok"]]
            figures["first_new_message_s"] = round((probe[0] - started_ms) / 1000, 2) if probe else None
        if figures["first_due_run_s"] is None:
            retries = [c["t"] for c in done if c["a"] >= 1 and c["ok"]]
            figures["first_due_run_s"] = round((min(retries) - started_ms) / 1000, 2) if retries else None
        gauge = counters(worker).get("rebound_scheduled_waiting")
        timeline.append(
            (round((now_ms() - started_ms) / 1000, 2), None if gauge is None else int(gauge), cpu_seconds(worker.pid))
        )
        finished = figures["adopted_s"] is not None and figures["first_new_message_s"] is not None
        if finished and (not count or figures["first_due_run_s"] is not None):
            break
        time.sleep(0.25)
    if figures["adopted_s"] is None and adoptions:
        figures["adopted_parked"] = adoptions[-1]["parked"]
    return {
        **figures,
        "cpu_s_until_adopted": None if cpu_at_adoption is None else round(cpu_at_adoption, 2),
        "adoptions": adoptions,
        "milestones_s": milestones,
        "timeline": timeline,
    }


def _last_before(times: list[float], limit: float | None) -> float | None:
    earlier = [t for t in times if limit is None or t <= limit]
    return earlier[-1] if earlier else None


def _read_time(milestones: dict[str, list[float]]) -> float | None:
    """The changelog read that restored the state: from the last start of reading to the first end after it."""
    starts, ends = milestones.get("changelog_read_started", []), milestones.get("changelog_read_done", [])
    for start in reversed(starts):
        after = [end for end in ends if end >= start]
        if after:
            return round(after[0] - start, 2)
    return None
