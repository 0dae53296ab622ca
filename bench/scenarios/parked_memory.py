"""Parked memory and tick cost: what holding many messages in the retry table costs a worker.

A worker parks everything for an hour; at each level (0, then more and more parked) it reads the worker's VmRSS
from ``/proc/<pid>/status`` and its CPU use while idle from ``/proc/<pid>/stat``. The idle CPU is mostly the release
timer (5 ticks a second) and group heartbeats, so it staying flat as the table grows is the live sign that a tick
does not scan what is parked. The tick's selection is timed in-process on the real ``ReleaseSchedule`` with as many
slots parked as the worker held (``GET /metrics`` had no tick timing when this was written; ``release-lateness`` reads
``rebound_release_tick_seconds`` from its worker).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
import urllib.request
from typing import Any

from bench.common import FaustProcess, cpu_seconds, proc_status, produce_batch, rebound_worker, running, wait_until
from bench.scenarios.base import PARTITIONS, PRODUCTION_BATCH, Context, new_topic
from demo.embedded_broker import EmbeddedBroker
from rebound.schedule import ReleaseSchedule, Slot


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    top = ctx.size(default=50_000, quick=2_000)
    levels = [0, top // 5, top]
    idle_window = 3.0 if ctx.quick else 5.0
    topic = new_topic(broker, "parked")
    worker = rebound_worker(
        broker,
        ctx.root,
        "parked",
        REBOUND_APP_ID=topic,
        REBOUND_MAIN_TOPICS=topic,
        REBOUND_RETRY_SEQUENCE="1h",
        REBOUND_HANDLER="bench.handlers:always_fail",
        **PRODUCTION_BATCH,
    )
    measured = []
    with running(worker):
        if not wait_until(lambda: ready(worker), 90, check=[worker]):
            raise RuntimeError(f"worker never became ready:\n{worker.log_tail()}")
        produced = 0
        for level in levels:
            started = time.monotonic()
            records = [(f"p{i}".encode(), b"{}") for i in range(produced, level)]
            asyncio.run(produce_batch(broker.bootstrap, topic, records))
            produced = level
            if not wait_until(lambda lv=level: parked(worker) >= lv, 60 + level / 100, every=1.0, check=[worker]):
                raise RuntimeError(f"only {parked(worker)} of {level} parked:\n{worker.log_tail()}")
            park_s = time.monotonic() - started
            time.sleep(2.0)  # let the commit and RocksDB flush settle before measuring
            row = measure(worker, idle_window)
            row.update(parked=parked(worker), park_s=round(park_s, 1))
            if level:
                row["park_rate_per_s"] = round((level - levels[levels.index(level) - 1]) / park_s, 1)
            measured.append(row)
            print(f"  parked-memory: {row}", flush=True)
        final_metrics = metrics_text(worker)
    micro = tick_micro([0, 1_000, 10_000, top, max(top * 4, 200_000)])
    return {
        "params": {"levels": levels, "idle_window_s": idle_window, "retry_sequence": "1h", "partitions": PARTITIONS},
        "levels": measured,
        "tick_micro": micro,
        "metrics_exposed": sorted(
            {
                line.split("{")[0].split(" ")[0]
                for line in final_metrics.splitlines()
                if line and not line.startswith("#")
            }
        ),
    }


def get(worker: FaustProcess, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.web_port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except OSError as exc:
        status = getattr(exc, "code", 0)
        return int(status or 0), ""


def ready(worker: FaustProcess) -> bool:
    return get(worker, "/ready")[0] == 200


def metrics_text(worker: FaustProcess) -> str:
    return get(worker, "/metrics")[1]


def parked(worker: FaustProcess) -> int:
    """Messages parked on the worker: ``rebound_tier_waiting`` summed over its tiers."""
    return int(sum(value for name, _, value in samples(metrics_text(worker)) if name == "rebound_tier_waiting"))


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a ``/metrics`` text: name, labels, value."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def measure(worker: FaustProcess, window: float) -> dict[str, Any]:
    """RSS now, and CPU used over ``window`` seconds of a worker with nothing to consume and nothing due."""
    cpu_before, wall_before = cpu_seconds(worker.pid), time.monotonic()
    time.sleep(window)
    cpu_used = cpu_seconds(worker.pid) - cpu_before
    status = proc_status(worker.pid)
    return {
        "rss_mib": round(status["VmRSS"] / 1024, 1),
        "hwm_mib": round(status["VmHWM"] / 1024, 1),
        "idle_cpu_pct": round(100 * cpu_used / (time.monotonic() - wall_before), 1),
    }


def tick_micro(sizes: list[int], due_counts: tuple[int, ...] = (0, 100), repeats: int = 50) -> list[dict[str, Any]]:
    """Time ``ReleaseSchedule.pop_due`` (the tick's selection) with ``parked`` future slots and ``due`` due ones."""
    rows = []
    rng = random.Random(7)
    now = 1_000_000_000
    for size in sorted(set(sizes)):
        future = [
            Slot(now + 3_600_000 + rng.randrange(3_600_000), f"k{i}".encode(), f"t:{i % PARTITIONS}:{i}", 1)
            for i in range(size)
        ]
        for due in due_counts:
            timings = []
            for _ in range(repeats if due else 1):
                schedule = ReleaseSchedule()
                for partition in range(PARTITIONS):
                    slots = future[partition::PARTITIONS] + [
                        Slot(now - j, f"d{j}".encode(), f"t:{partition}:d{j}", 1)
                        for j in range(partition, due, PARTITIONS)
                    ]
                    schedule.adopt(partition, slots)
                calls = 1 if due else repeats
                for _ in range(calls):
                    started = time.perf_counter_ns()
                    released = schedule.pop_due(now)
                    timings.append((time.perf_counter_ns() - started) / 1000)
                assert len(released) == due
            rows.append({"parked": size, "due": due, "pop_due_us": round(statistics.median(timings), 1)})
    return rows


def _json(value: Any) -> str:
    return json.dumps(value)
