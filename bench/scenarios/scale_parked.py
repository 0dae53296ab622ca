"""Parked at scale: what 10,000, 100,000 and 1,000,000 parked messages cost one worker (issue 9).

One worker (4 partitions, ``bench.handlers:always_fail``, retry sequence ``1h``) parks everything it reads: each
message takes the real path (main topic, a failed first try, the ``1h`` tier topic, the tier agent parking it in the
two RocksDB tables). Levels are reached in turn on the same worker; the baseline is that worker at 0 parked, measured
first, in the same run. Between levels the benchmark produces the next messages with pipelined sends (``produce_batch``
in chunks) straight away, so the worker always has a backlog and the park rate is the worker's own rate, not the
producer's.

At each level, once ``rebound_tier_waiting`` (summed) on ``GET /metrics`` says every message is parked, and after a short
settle: the worker's VmRSS and VmHWM (its peak so far, which includes the fill), its CPU over an idle window (nothing
to consume, nothing due: the release timer, heartbeats and RocksDB's background work), the size of its data
directory on disk, and the broker's VmRSS and VmHWM (Tansu keeps every topic in memory: the main, tier, attempts and
two changelog topics grow with every parked message). The park rate is the level's new messages divided by the time
from the first send to the last one parked. During the fill, parked count and RSS are sampled for the chart. At the
top level the worker's ``/proc/<pid>/smaps_rollup`` and its largest mappings are kept, to say where the memory is.

Idle CPU is also split per thread name (``main`` is the event loop; RocksDB's flushes and compactions run in
``rocksdb:*`` threads), and after the top level it is measured again in consecutive windows for a minute, to tell
a compaction that fades from work that stays. Last, when every figure is taken, ``py-spy record`` (if installed)
samples the idle worker for 10 s and its busiest stacks are kept.

The target: worker RSS at most 1 GiB with 1,000,000 parked. ``--quick`` parks 2,000, 10,000 and 20,000.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import FaustProcess, cpu_seconds, proc_status, produce_batch, rebound_worker, running, wait_until
from bench.scenarios.base import PARTITIONS, PRODUCTION_BATCH, Context, new_topic
from bench.scenarios.parked_memory import metrics_text, parked, ready, samples
from demo.embedded_broker import EmbeddedBroker

RETRY_SEQUENCE = "1h"
TARGET_RSS_MIB = 1024
TARGET_AT = 1_000_000
CHUNK = 50_000
"""Records per ``produce_batch`` call: the producer's own futures stay bounded, the worker never runs dry."""


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    top = ctx.size(default=1_000_000, quick=20_000)
    fractions = (10, 2) if ctx.quick else (100, 10)  # quick: 2,000 / 10,000 / 20,000
    levels = sorted({0, *(max(1, top // f) for f in fractions), top})
    idle_window = 5.0 if ctx.quick else 10.0
    settle_s = 2.0 if ctx.quick else 5.0
    topic = new_topic(broker, "scale")
    name = "scale"
    data_dir = ctx.root / f"data-{name}"
    worker = rebound_worker(
        broker,
        ctx.root,
        name,
        REBOUND_APP_ID=topic,
        REBOUND_MAIN_TOPICS=topic,
        REBOUND_RETRY_SEQUENCE=RETRY_SEQUENCE,
        REBOUND_HANDLER="bench.handlers:always_fail",
        **PRODUCTION_BATCH,
    )
    broker_pid = broker.process.pid
    measured: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    smaps: dict[str, Any] = {}
    started_all = time.monotonic()
    with running(worker):
        if not wait_until(lambda: ready(worker), 90, check=[worker]):
            raise RuntimeError(f"worker never became ready:\n{worker.log_tail()}")
        produced = 0
        for level in levels:
            started = time.monotonic()
            if level > produced:
                fill(ctx, broker, worker, topic, produced, level, samples, started_all)
            park_s = time.monotonic() - started
            time.sleep(settle_s)  # the last commits and memtable flushes, before the idle window
            row = measure(worker, broker_pid, idle_window, data_dir)
            row.update(level=level, parked=parked(worker), park_s=round(park_s, 1))
            if level > produced:
                row["park_rate_per_s"] = round((level - produced) / park_s, 1)
            produced = level
            measured.append(row)
            print(f"  scale-parked: {row}", flush=True)
        smaps = memory_map(worker.pid)
        counters = events(metrics_text(worker))
        later = idle_over_time(worker, broker_pid, data_dir, windows=3 if ctx.quick else 6, window=idle_window)
        stacks = profile(worker.pid, seconds=5 if ctx.quick else 10)
    top_row = measured[-1]
    within = top_row["rss_mib"] <= TARGET_RSS_MIB
    verdict = "ok" if within else f"FAILED: worker RSS {top_row['rss_mib']} MiB > {TARGET_RSS_MIB} MiB at {top} parked"
    if counters.get("released", 0):
        verdict = f"FAILED: {counters['released']} messages were released during the run (nothing should come due)"
    return {
        "params": {
            "levels": levels,
            "idle_window_s": idle_window,
            "settle_s": settle_s,
            "retry_sequence": RETRY_SEQUENCE,
            "handler": "bench.handlers:always_fail",
            "partitions": PARTITIONS,
            "produce_chunk": CHUNK,
            "target_rss_mib": TARGET_RSS_MIB,
            "target_at_parked": TARGET_AT,
        },
        "levels": measured,
        "summary": {
            "top_parked": top_row["parked"],
            "rss_mib_at_top": top_row["rss_mib"],
            "hwm_mib_at_top": top_row["hwm_mib"],
            "rss_mib_at_0": measured[0]["rss_mib"],
            "kib_per_parked_message": round(
                1024 * (top_row["rss_mib"] - measured[0]["rss_mib"]) / max(1, top_row["parked"]), 2
            ),
            "rss_within_target": within,
            "counters": counters,
        },
        "verdict": verdict,
        "idle_after_top": later,
        "profile_at_top": stacks,
        "smaps_at_top": smaps,
        "raw": {"fill_samples": samples},
    }


def fill(
    ctx: Context,
    broker: EmbeddedBroker,
    worker: FaustProcess,
    topic: str,
    first: int,
    level: int,
    samples: list[dict[str, Any]],
    started_all: float,
) -> None:
    """Produce messages ``first..level`` in chunks while sampling, then wait until all of them are parked."""
    every = 1.0 if ctx.quick else 3.0
    last_sample = 0.0

    def sample() -> int:
        count = parked(worker)
        status = proc_status(worker.pid)
        samples.append(
            {
                "t_s": round(time.monotonic() - started_all, 1),
                "parked": count,
                "rss_mib": round(status["VmRSS"] / 1024, 1),
            }
        )
        return count

    for start in range(first, level, CHUNK):
        end = min(level, start + CHUNK)
        records = ((f"p{i}".encode(), b"{}") for i in range(start, end))
        asyncio.run(produce_batch(broker.bootstrap, topic, records))
        worker.check()
        if time.monotonic() - last_sample >= every:
            sample()
            last_sample = time.monotonic()

    def done() -> bool:
        nonlocal last_sample
        if time.monotonic() - last_sample < every:
            return False
        last_sample = time.monotonic()
        return sample() >= level

    # At least 100 parked per second, or this is not a run worth waiting for.
    if not wait_until(done, 120 + (level - first) / 100, every=0.5, check=[worker]):
        raise RuntimeError(f"only {parked(worker)} of {level} parked:\n{worker.log_tail()}")


def measure(worker: FaustProcess, broker_pid: int, window: float, data_dir: Path) -> dict[str, Any]:
    """RSS and peak of the worker and the broker, the worker's idle CPU over ``window`` s (in all, and per thread
    name: the event loop is the main thread, RocksDB's flushes and compactions run in ``rocksdb:*`` threads), its
    data on disk."""
    cpu_before, broker_before, wall_before = cpu_seconds(worker.pid), cpu_seconds(broker_pid), time.monotonic()
    threads_before = thread_cpu(worker.pid)
    time.sleep(window)
    wall = time.monotonic() - wall_before
    cpu_used = cpu_seconds(worker.pid) - cpu_before
    broker_used = cpu_seconds(broker_pid) - broker_before
    threads = thread_cpu(worker.pid)
    by_thread = {
        name: round((used - threads_before.get(name, 0.0)) / wall, 4)
        for name, used in sorted(threads.items())
        if used - threads_before.get(name, 0.0) > 0
    }
    status, broker_status = proc_status(worker.pid), proc_status(broker_pid)
    return {
        "rss_mib": round(status["VmRSS"] / 1024, 1),
        "hwm_mib": round(status["VmHWM"] / 1024, 1),
        "idle_cpu_cores": round(cpu_used / wall, 4),
        "idle_cpu_cores_by_thread": by_thread,
        "broker_idle_cpu_cores": round(broker_used / wall, 4),
        "data_dir_mib": round(dir_bytes(data_dir) / 2**20, 1),
        "broker_rss_mib": round(broker_status["VmRSS"] / 1024, 1),
        "broker_hwm_mib": round(broker_status["VmHWM"] / 1024, 1),
    }


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads, summed per thread name; the main thread is ``main``."""
    ticks = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = "main" if task.name == str(pid) else (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return totals


def idle_over_time(worker: FaustProcess, broker_pid: int, data_dir: Path, windows: int, window: float) -> list[Any]:
    """Idle CPU in consecutive windows after the top level: whether it fades (RocksDB compacting what the fill
    wrote) or stays (work that grows with what is parked)."""
    rows = []
    started = time.monotonic()
    for _ in range(windows):
        row = measure(worker, broker_pid, window, data_dir)
        rows.append(
            {
                "t_s": round(time.monotonic() - started, 1),
                "idle_cpu_cores": row["idle_cpu_cores"],
                "by_thread": row["idle_cpu_cores_by_thread"],
                "rss_mib": row["rss_mib"],
                "data_dir_mib": row["data_dir_mib"],
            }
        )
        print(f"  scale-parked idle after the top level: {rows[-1]}", flush=True)
    return rows


def profile(pid: int, seconds: int = 10) -> dict[str, Any]:
    """The worker's busiest Python stacks over ``seconds`` (``py-spy record``, raw format), if py-spy is installed.

    py-spy runs beside the worker and pauses it briefly per sample: taken only after every figure is measured."""
    py_spy = Path(sys.executable).with_name("py-spy")
    if not py_spy.exists():
        return {"skipped": "py-spy not installed"}
    out = Path(f"/tmp/scale-parked-{pid}.raw")
    try:
        subprocess.run(
            [str(py_spy), "record", "-p", str(pid), "-d", str(seconds), "-r", "50", "-f", "raw", "-o", str(out)],
            capture_output=True,
            timeout=seconds + 30,
            check=True,
        )
        stacks = []
        for line in out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            stacks.append((int(count), stack))
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return {"skipped": f"py-spy failed: {exc}"}
    finally:
        out.unlink(missing_ok=True)
    total = sum(count for count, _ in stacks)
    leaves: dict[str, int] = {}
    for count, stack in stacks:
        frames = stack.split(";")
        key = ";".join(frames[-4:])
        leaves[key] = leaves.get(key, 0) + count
    return {
        "samples": total,
        "seconds": seconds,
        "top_stacks_last_4_frames": [
            {"samples": count, "stack": key} for key, count in sorted(leaves.items(), key=lambda kv: -kv[1])[:15]
        ],
    }


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (apparent size; the RocksDB files are written densely)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # a file compacted away between the listing and the stat
                continue
    return total


def memory_map(pid: int, largest: int = 12) -> dict[str, Any]:
    """``smaps_rollup`` in MiB, and the largest mappings by RSS (anonymous ones are the heap, glibc arenas and
    RocksDB's allocations: they cannot be told apart from outside the process)."""
    rollup: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[-1] == "kB":
            rollup[name.strip()] = round(int(parts[0]) / 1024, 1)
    mappings: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            current = {"range": fields[0], "name": fields[5] if len(fields) > 5 else "[anon]", "rss_kib": 0}
            mappings.append(current)
        elif current is not None and fields and fields[0] == "Rss:":
            current["rss_kib"] = int(fields[1])
    by_name: dict[str, int] = {}
    for mapping in mappings:
        label = mapping["name"] if not mapping["name"].startswith("/") else os.path.basename(mapping["name"])
        by_name[label] = by_name.get(label, 0) + mapping["rss_kib"]
    anon = [m for m in mappings if m["name"] == "[anon]"]
    return {
        "rollup_mib": rollup,
        "rss_mib_by_mapping_name": {
            name: round(kib / 1024, 1) for name, kib in sorted(by_name.items(), key=lambda kv: -kv[1])[:largest]
        },
        "anon_mappings": len(anon),
        "largest_anon_mib": sorted((round(m["rss_kib"] / 1024, 1) for m in anon), reverse=True)[:largest],
    }


EVENT_OF_SKIP = {"stale": "release.stale", "early": "release.early", "breaker-open": "breaker.deferred"}


def events(text: str) -> dict[str, float]:
    """The worker's internal counters (``runtime.counters`` names: ``parked``, ``released``, ``release.lag_ms_total``,
    ``outcome.<outcome>``, ``dead.<reason>``, ...) read back from the metrics of ``/metrics``."""
    counters: dict[str, float] = {}

    def add(name: str, value: float) -> None:
        counters[name] = counters.get(name, 0.0) + value

    for name, labels, value in samples(text):
        if name == "rebound_attempts_total":
            add(f"outcome.{labels['outcome']}", value)
            if labels["outcome"] in ("dead", "expired"):
                add(f"dead.{labels['reason']}", value)
        elif name == "rebound_parked_total":
            add("parked", value)
        elif name == "rebound_release_lateness_seconds_count":
            add("released", value)
        elif name == "rebound_release_lateness_seconds_sum":
            add("release.lag_ms_total", value * 1000)
        elif name == "rebound_release_skipped_total" and labels["reason"] in EVENT_OF_SKIP:
            add(EVENT_OF_SKIP[labels["reason"]], value)
        elif name == "rebound_main_received_total":
            add("main.received", value)
        elif name == "rebound_tier_duplicates_total":
            add("tier.duplicates", value)
    return {name: value for name, value in counters.items() if value}
