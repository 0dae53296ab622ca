"""Memory under a backlog while the group rebalances: back-pressure must hold through every rebalance.

A worker with ``REBOUND_CONCURRENCY=4`` and a 20 ms handler (``bench.handlers:io20``: at most 200 calls a second)
faces a backlog of ``messages`` records of about 1 KiB each (100,000: about 100 MiB) on a 4-partition topic. It can
never catch up, so all that keeps it from reading the whole backlog into memory is back-pressure: the dispatcher
pauses a partition once it holds ``REBOUND_PARTITION_BUFFER`` records of it, until half of them are done. Meanwhile a
second worker joins the group and leaves it again, three times: each rebalance stops and resumes the flow, and
Faust's recovery resumes every stream partition (issue 22, defect 1: a pause lost there let a partition be fetched
without bound).

Measured on the first worker: its VmRSS every half second (``/proc/<pid>/status``), before the first rebalance and
at its peak, and from its log (``-l info``) the most records the dispatcher held of one partition after pausing it
(``dispatcher: resuming ...: held up to N``), which is the buffer plus what was handed over after the pause was asked
for. The bound on what back-pressure lets a worker hold is, per partition: the buffer's records, plus one fetched
batch handed over after the pause (at most ``max_poll_records`` records across partitions, or all that one fetch
brought), plus aiokafka's prefetched fetch (``max_partition_fetch_bytes``, 1 MiB); times the partitions it owns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading
import time
from typing import Any

from bench.common import (
    FaustProcess,
    fresh_broker,
    now_ms,
    proc_status,
    produce_batch,
    read_calls,
    rebound_worker,
    wait_until,
)
from bench.scenarios.base import PARTITIONS, Context, new_topic
from demo.embedded_broker import EmbeddedBroker

RECORD_BYTES = 1024
"""Each record's value, padded to about this size."""
CYCLES = 3
"""Times the second worker joins and leaves."""
SAMPLE_S = 0.5
HELD = re.compile(r"dispatcher: resuming (?P<tp>.+?): drained to \d+ records \(held up to (?P<most>\d+|None)")
PAUSED_AT_STOP = re.compile(r"dispatcher: (?P<tp>.+?) was paused when the flow stopped \(held up to (?P<most>\d+)")
PAUSING = "dispatcher: pausing "


class Sampler:
    """VmRSS of one process every ``SAMPLE_S``, in a thread: the scenario's own steps block."""

    def __init__(self, process: FaustProcess, started: float) -> None:
        self.process, self.started = process, started
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            if not self.process.alive():
                return
            try:
                rss = proc_status(self.process.pid)["VmRSS"]
            except (OSError, KeyError):
                return
            self.samples.append((round(time.monotonic() - self.started, 1), rss))

    def mib(self, since: float = 0.0) -> list[float]:
        return [round(kib / 1024, 1) for at, kib in self.samples if at >= since]


BUFFERS = {"buffer-512": 512, "buffer-32": 32}
"""The default buffer, and a small one: a rebalance's recovery hands records over between Faust's resume of the
stream partitions and its ``resume_flow`` (while it seeks to the committed offsets), and with a small buffer the
dispatcher reaches its mark inside that window, where a one-shot pause request used to be cleared."""


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    count = ctx.size(default=100_000, quick=10_000)
    hold_s = 10.0 if ctx.quick else 20.0
    variants: dict[str, Any] = {}
    for name, buffer in BUFFERS.items():
        (ctx.root / name).mkdir(parents=True, exist_ok=True)
        with fresh_broker(ctx.root / name) as own:  # each variant on an empty broker: its storage only grows
            variants[name] = probe(Context(ctx.root / name, ctx.quick, ctx.messages), own, count, hold_s, buffer)
        print(f"  rebalance-memory {name}: {variants[name]['summary']}", flush=True)
    return {
        "params": variants["buffer-512"]["params"],
        "variants": variants,
        "summary": {name: variant["summary"] for name, variant in variants.items()},
    }


def probe(ctx: Context, broker: EmbeddedBroker, count: int, hold_s: float, buffer: int) -> dict[str, Any]:
    topic = new_topic(broker, "rebal-mem")
    pad = "x" * (RECORD_BYTES - 40)
    records = [(f"k{i}".encode(), json.dumps({"t": now_ms(), "pad": pad}).encode()) for i in range(count)]
    started_produce = time.monotonic()
    asyncio.run(produce_batch(broker.bootstrap, topic, records))
    produce_s = time.monotonic() - started_produce
    backlog_mib = sum(len(key) + len(value) for key, value in records) / 2**20
    del records
    common = {
        "REBOUND_APP_ID": topic,
        "REBOUND_MAIN_TOPICS": topic,
        "REBOUND_RETRY_SEQUENCE": "1h",
        "REBOUND_HANDLER": "bench.handlers:io20",
        "REBOUND_CONCURRENCY": "4",
        "REBOUND_PARTITION_BUFFER": str(buffer),
    }
    calls = ctx.root / "first.calls.jsonl"
    plain = rebound_worker(broker, ctx.root, "first", BENCH_CALLS=str(calls), **common)
    first = dataclasses.replace(plain, log_level="info")
    second = rebound_worker(broker, ctx.root, "second", BENCH_CALLS=str(ctx.root / "second.calls.jsonl"), **common)
    phases: list[dict[str, Any]] = []
    started = time.monotonic()
    first.start()
    try:
        with Sampler(first, started) as sampler:
            if not wait_until(lambda: len(read_calls(calls)) > 0, 120, check=[first]):
                raise RuntimeError(f"the first worker never handled a record:\n{first.log_tail()}")
            handling_at = time.monotonic() - started
            time.sleep(hold_s)
            phases.append(phase("alone", sampler, handling_at))
            for cycle in range(1, CYCLES + 1):
                joined_at = time.monotonic() - started
                second.start()
                time.sleep(hold_s)
                phases.append(phase(f"second worker in ({cycle})", sampler, joined_at))
                left_at = time.monotonic() - started
                second.stop()
                time.sleep(hold_s)
                phases.append(phase(f"second worker gone ({cycle})", sampler, left_at))
            first.check()
    finally:
        second.stop()
        first.stop()
    log = first.log_path.read_text(errors="replace")
    held = held_most(log)
    rss = sampler.mib()
    baseline = phases[0]["rss_mib_max"]
    peak = max(rss) if rss else None
    summary = {
        "backlog_mib": round(backlog_mib, 1),
        "rss_mib_alone_max": baseline,
        "rss_mib_peak": peak,
        "rss_mib_growth_after_alone": round(peak - baseline, 1) if peak is not None and baseline is not None else None,
        "held_most_per_partition": max(held.values()) if held else None,
        "pauses_logged": log.count(PAUSING),
        "handled_by_first": len(read_calls(calls)),
    }
    return {
        "params": {
            "messages": count,
            "record_bytes": RECORD_BYTES,
            "partitions": PARTITIONS,
            "concurrency": 4,
            "partition_buffer": buffer,
            "handler": "bench.handlers:io20 (20 ms)",
            "cycles": CYCLES,
            "hold_s": hold_s,
            "produce_s": round(produce_s, 1),
        },
        "phases": phases,
        "rss_series": sampler.samples,
        "held_most": held,
        "summary": summary,
    }


def phase(name: str, sampler: Sampler, since: float) -> dict[str, Any]:
    values = sampler.mib(since)
    return {
        "phase": name,
        "from_s": round(since, 1),
        "rss_mib_max": max(values) if values else None,
        "rss_mib_last": values[-1] if values else None,
    }


def held_most(log: str) -> dict[str, int]:
    """The most records the dispatcher held of each partition after pausing it, from the worker's log."""
    most: dict[str, int] = {}
    for pattern in (HELD, PAUSED_AT_STOP):
        for match in pattern.finditer(log):
            if match["most"] != "None":
                most[match["tp"]] = max(most.get(match["tp"], 0), int(match["most"]))
    return most
