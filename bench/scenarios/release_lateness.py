"""Release lateness at 1,000 due per second with 100,000 parked (issue 9).

How the due times are laid out. The messages are written straight to the worker's ``1h`` tier topic, with the
``rebound.*`` headers Rebound's own forwarder writes (``rebound.headers.retry_headers``: original topic, partition
and offset, group, attempt 1, due time), so the tier agent parks them on exactly the path a failed first try takes;
only the first try itself is skipped. That lets the benchmark choose every due time instead of inheriting it from
the worker's park rate (a policy delay counts from the failed first try, so the due rate would be whatever rate the
worker parked at, about 1,000/s at best on this machine, and the fill would still be running while the first ones
came due). Two groups, spread round-robin over the 4 partitions, one key each:

* the **stream**: ``rate`` x ``window`` messages (1,000/s x 60 s = 60,000; quick: 10 s) due at ``T0 + i / rate``
  for i = 0, 1, ..., i.e. exactly ``rate`` per second, evenly over the partitions, for ``window`` seconds;
* the **background**: the rest of the 100,000 (40,000), due 50 minutes after they are produced: parked during the
  whole window, never released.

Both groups are parked before ``T0``: the background first (its fill also measures the worker's park rate), then the
stream, and ``T0`` is set, when the stream is produced, to 1.5 times the stream's expected fill time plus a margin
ahead; the time between the last stream message parked and ``T0`` is reported (``slack_s``) and a negative slack
fails the run. So the window measures releasing alone: the due rate, the partitions and the handler are the same in
both variants, and nothing else is produced or consumed.

The baseline, in the same run and on the same broker, is a fresh worker with the same stream and no background
(nothing else parked). The handler is ``bench.handlers:scripted``, which succeeds on attempt 1 and logs each call's
wall-clock ms; lateness = that time - the message's due time. A negative lateness would mean a handler call before
its due time: it is counted separately and fails the run. Worker settings are the harness's
(``REBOUND_FETCH_MAX_WAIT_MS=100``: Tansu answers a multi-partition fetch only when the wait is over), with the
16 KiB producer batch all scenarios use. Target: p99 at most 250 ms with 100,000 parked.

During the window the benchmark only sleeps (it reads the call log after the window), so the two cores are the
worker's and the broker's.

The release tick's own cost in the live worker is read from its ``/metrics`` before and after the window
(``rebound_release_tick_seconds``, ``rebound_release_requests_sent_total``): ticks, their mean duration, the bucket
bounds their p50 and p99 are at most, and requests per tick (``tick`` in the summary).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import (
    FaustProcess,
    cpu_seconds,
    now_ms,
    percentile,
    proc_status,
    produce_placed,
    rebound_worker,
    running,
    wait_until,
)
from bench.scenarios.base import PARTITIONS, PRODUCTION_BATCH, Context, new_topic
from bench.scenarios.parked_memory import metrics_text, parked, ready, samples
from bench.scenarios.scale_parked import events
from demo.embedded_broker import EmbeddedBroker
from rebound.headers import Provenance, retry_headers
from rebound.topics import tier_topic

TIER = "1h"
RATE_PER_S = 1000.0
TARGET_P99_MS = 250
BACKGROUND_DUE_IN_MS = 50 * 60 * 1000
DEFAULT_PARK_RATE = 500.0
"""Assumed park rate when no background fill measured one (a run with no background at all)."""
FILL_SAFETY = 1.5
FILL_MARGIN_S = 10.0


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    total = ctx.size(default=100_000, quick=20_000)
    window_s = 10 if ctx.quick else 60
    stream = min(total, int(RATE_PER_S * window_s))
    background = total - stream
    variants: dict[str, dict[str, Any]] = {}
    park_rate = DEFAULT_PARK_RATE
    for name, extra in ((f"{total // 1000}k-parked", background), ("baseline", 0)):
        variants[name] = run_variant(ctx, broker, name, extra, stream, park_rate)
        park_rate = variants[name]["summary"].get("background_park_rate_per_s") or park_rate
        print(f"  release-lateness {name}: {variants[name]['summary']}", flush=True)
    problems = []
    for name, result in variants.items():
        s = result["summary"]
        if s["negative"]:
            problems.append(f"{name}: {s['negative']} calls before their due time")
        if s["released"] < stream:
            problems.append(f"{name}: {s['released']} of {stream} released")
        if s["slack_s"] < 0:
            problems.append(f"{name}: the fill ended {-s['slack_s']} s after the first due time")
    main = next(iter(variants.values()))["summary"]["lateness_ms"]
    target_met = main["p99"] is not None and main["p99"] <= TARGET_P99_MS
    return {
        "params": {
            "parked_total": total,
            "stream": stream,
            "background": background,
            "rate_per_s": RATE_PER_S,
            "window_s": window_s,
            "tier": TIER,
            "partitions": PARTITIONS,
            "handler": "bench.handlers:scripted",
            "target_p99_ms": TARGET_P99_MS,
        },
        "variants": variants,
        "summary": {"target_p99_met": target_met, "p99_ms": main["p99"]},
        "verdict": "ok" if not problems else "FAILED: " + "; ".join(problems),
    }


def run_variant(
    ctx: Context, broker: EmbeddedBroker, name: str, background: int, stream: int, park_rate: float
) -> dict[str, Any]:
    topic = new_topic(broker, f"late-{name}")
    calls_path = ctx.root / f"{name}.calls.jsonl"
    worker = rebound_worker(
        broker,
        ctx.root,
        name,
        REBOUND_APP_ID=topic,
        REBOUND_MAIN_TOPICS=topic,
        REBOUND_RETRY_SEQUENCE=TIER,
        REBOUND_HANDLER="bench.handlers:scripted",
        BENCH_CALLS=str(calls_path),
        **PRODUCTION_BATCH,
    )
    tier = tier_topic(topic, TIER)
    facts: dict[str, Any] = {}
    with running(worker):
        if not wait_until(lambda: ready(worker), 90, check=[worker]):
            raise RuntimeError(f"worker never became ready:\n{worker.log_tail()}")
        if background:
            started = time.monotonic()
            due = now_ms() + BACKGROUND_DUE_IN_MS
            asyncio.run(produce_placed(broker.bootstrap, tier, tier_records(topic, 0, background, lambda i: due)))
            await_parked(worker, background)
            park_rate = background / (time.monotonic() - started)
            facts["background_park_rate_per_s"] = round(park_rate, 1)
        lead_s = stream / park_rate * FILL_SAFETY + FILL_MARGIN_S
        t0 = now_ms() + int(lead_s * 1000)
        due_of = {f"s{i}": t0 + round(i * 1000 / RATE_PER_S) for i in range(stream)}
        started = time.monotonic()
        asyncio.run(
            produce_placed(
                broker.bootstrap,
                tier,
                tier_records(topic, background, stream, lambda i: t0 + round(i * 1000 / RATE_PER_S), prefix="s"),
            )
        )
        await_parked(worker, background + stream)
        facts["stream_park_rate_per_s"] = round(stream / (time.monotonic() - started), 1)
        facts["slack_s"] = round((t0 - now_ms()) / 1000, 1)
        facts["parked_at_window_start"] = parked(worker)
        before = metrics_text(worker)
        time.sleep(max(0.0, (t0 - now_ms()) / 1000))
        cpu = {"worker": cpu_seconds(worker.pid), "broker": cpu_seconds(broker.process.pid)}
        wall = time.monotonic()
        sampler = CpuSampler(worker.pid, broker.process.pid, t0)
        sampler.start()
        spy = profile_window(worker.pid, ctx.root / f"{name}.pyspy.txt")
        time.sleep(stream / RATE_PER_S)  # the window: nothing else runs on the benchmark's side
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
            spy.wait(30)

        def released() -> bool:
            return count_released(calls_path) >= stream

        finished = wait_until(released, 120, every=1.0, check=[worker])
        window_wall = time.monotonic() - wall
        facts["cpu_cores_in_window"] = {
            "worker": round((cpu_seconds(worker.pid) - cpu["worker"]) / window_wall, 2),
            "broker": round((cpu_seconds(broker.process.pid) - cpu["broker"]) / window_wall, 2),
        }
        sampler.stop()
        facts["window_wall_s"] = round(window_wall, 1)
        facts["other_cpu_cores_in_window"] = sampler.other_mean()
        facts["all_released"] = finished
        after = metrics_text(worker)
        facts["parked_after"] = parked(worker)
        facts["worker_rss_mib"] = round(proc_status(worker.pid)["VmRSS"] / 1024, 1)
        facts["worker_hwm_mib"] = round(proc_status(worker.pid)["VmHWM"] / 1024, 1)
    result = summarise(calls_path, due_of, t0, facts, before, after)
    result["cpu_timeline"] = sampler.rows
    return result


def tick_figures(text: str) -> dict[str, float]:
    """From a ``/metrics`` text: ``rebound_release_tick_seconds`` (``count``, ``sum``, and each bucket's cumulative
    count under its bound, ``le=<bound>``) and ``requests`` (``rebound_release_requests_sent_total``)."""
    figures: dict[str, float] = {}
    for name, labels, value in samples(text):
        if name == "rebound_release_tick_seconds_bucket":
            figures[f"le={float(labels['le'])!r}"] = value
        elif name == "rebound_release_tick_seconds_count":
            figures["count"] = value
        elif name == "rebound_release_tick_seconds_sum":
            figures["sum"] = value
        elif name == "rebound_release_requests_sent_total":
            figures["requests"] = value
    return figures


def tick_cost(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The ticks between two scrapes: how many, their mean duration, the bucket bounds (ms) their p50 and p99 are
    at most (None: past the last bucket, or no ticks), and the requests they sent per tick. Empty if the worker
    exposed no tick histogram (one from before ``rebound_release_tick_seconds``)."""
    if "count" not in after:
        return {}
    ticks = after["count"] - before.get("count", 0.0)
    bounds = sorted(float(key[3:]) for key in after if key.startswith("le="))

    def at_most(quantile: float) -> float | None:
        for bound in bounds:
            key = f"le={bound!r}"
            if ticks and after[key] - before.get(key, 0.0) >= quantile * ticks:
                return None if bound == float("inf") else round(bound * 1000, 2)
        return None

    requests = after.get("requests", 0.0) - before.get("requests", 0.0)
    return {
        "ticks": int(ticks),
        "mean_ms": round((after["sum"] - before.get("sum", 0.0)) / ticks * 1000, 3) if ticks else None,
        "p50_ms_at_most": at_most(0.5),
        "p99_ms_at_most": at_most(0.99),
        "requests_per_tick": round(requests / ticks, 2) if ticks else None,
    }


def profile_window(pid: int, output: Path) -> subprocess.Popen[bytes] | None:
    """With ``BENCH_PROFILE=1``, py-spy samples the worker through the window (collapsed stacks next to the call
    log). Off by default: the sampler costs the worker a few per cent of a core."""
    if os.environ.get("BENCH_PROFILE") != "1":
        return None
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if py_spy is None:
        raise RuntimeError("BENCH_PROFILE=1 needs py-spy (pip install py-spy)")
    command = [py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "200", "--output", str(output)]
    return subprocess.Popen([*command, "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def tier_records(
    topic: str, first: int, count: int, due: Any, prefix: str = "b"
) -> list[tuple[int, bytes, bytes, list[tuple[str, bytes]]]]:
    """Tier records as the forwarder writes them; message ``n`` (``first + i``) sits on partition ``n % 4`` at
    original offset ``n // 4``, so origins are unique across both groups."""
    fail_until = 1 if prefix == "s" else 99  # the stream succeeds on its first retry; the background never runs
    now = now_ms()
    records = []
    for i in range(count):
        n = first + i
        partition = n % PARTITIONS
        provenance = Provenance(topic, partition, n // PARTITIONS, now, now)
        headers = retry_headers(
            [],
            provenance=provenance,
            group=topic,
            attempt=1,
            due_at_ms=due(i),
            error_class="RetryableError",
            error_message="bench: parked on purpose",
        )
        value = json.dumps({"t": now, "fail_until": fail_until}).encode()
        records.append((partition, f"{prefix}{i}".encode(), value, headers))
    return records


def await_parked(worker: FaustProcess, count: int) -> None:
    if not wait_until(lambda: parked(worker) >= count, 120 + count / 100, every=1.0, check=[worker]):
        raise RuntimeError(f"only {parked(worker)} of {count} parked:\n{worker.log_tail()}")


def count_released(path: Path) -> int:
    """Stream calls logged so far (attempt 1 of an ``s`` key): a byte count, cheap enough to poll."""
    if not path.exists():
        return 0
    return path.read_bytes().count(b'"a":1,')


def summarise(
    calls_path: Path,
    due_of: dict[str, int],
    t0: int,
    facts: dict[str, Any],
    before_metrics: str,
    after_metrics: str,
) -> dict[str, Any]:
    """The window's figures from the call log, with the worker's ``/metrics`` read before and after it."""
    before, after = events(before_metrics), events(after_metrics)
    first_call: dict[str, int] = {}
    duplicates = 0
    other = 0
    for line in calls_path.read_text().splitlines() if calls_path.exists() else []:
        try:
            call = json.loads(line)
        except ValueError:
            continue
        key = call.get("k")
        if key not in due_of or call.get("a") != 1:
            other += 1
            continue
        if key in first_call:
            duplicates += 1
            continue
        first_call[key] = int(call["t"])
    lateness = [first_call[key] - due_of[key] for key in due_of if key in first_call]
    negative = [value for value in lateness if value < 0]
    seconds = int(max(due_of.values(), default=t0) - t0) // 1000 + 1
    by_second: list[list[int]] = [[] for _ in range(seconds)]
    for key, called in first_call.items():
        by_second[(due_of[key] - t0) // 1000].append(called - due_of[key])
    calls_per_s: dict[int, int] = {}
    for called in first_call.values():
        second = (called - t0) // 1000
        calls_per_s[second] = calls_per_s.get(second, 0) + 1
    released = after.get("released", 0) - before.get("released", 0)
    lag_sum = after.get("release.lag_ms_total", 0) - before.get("release.lag_ms_total", 0)
    summary = {
        "released": len(first_call),
        "lateness_ms": {
            "count": len(lateness),
            "min": min(lateness, default=None),
            "p50": percentile(lateness, 50),
            "p95": percentile(lateness, 95),
            "p99": percentile(lateness, 99),
            "max": max(lateness, default=None),
        },
        "negative": len(negative),
        "duplicate_calls": duplicates,
        "other_calls": other,
        "product_release_lag_mean_ms": round(lag_sum / released, 1) if released else None,
        "counters_in_window": {
            name: after.get(name, 0) - before.get(name, 0)
            for name in ("released", "release.early", "release.stale", "parked")
        },
        "tick": tick_cost(tick_figures(before_metrics), tick_figures(after_metrics)),
        **facts,
    }
    timeline = [
        {
            "second": s,
            "due": len(values),
            "p50": percentile(values, 50),
            "p99": percentile(values, 99),
            "max": max(values, default=None),
        }
        for s, values in enumerate(by_second)
    ]
    return {
        "summary": summary,
        "timeline": timeline,
        "calls_per_s": [calls_per_s.get(s, 0) for s in range(max(calls_per_s, default=-1) + 1)],
        "raw": {"lateness_ms": lateness, "negative_ms": negative},
    }


class CpuSampler(threading.Thread):
    """Once a second: CPU (cores) of the worker, of the broker and of everything else on the machine (``/proc/stat``
    less those two and this process), so a stall can be told apart from another process taking the cores."""

    def __init__(self, worker_pid: int, broker_pid: int, t0_ms: int) -> None:
        super().__init__(daemon=True)
        self.pids = {"worker": worker_pid, "broker": broker_pid, "bench": os.getpid()}
        self.t0_ms = t0_ms
        self.rows: list[dict[str, float]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        ticks = os.sysconf("SC_CLK_TCK")
        previous = self._read(ticks)
        while not self._stop_event.wait(1.0):
            current = self._read(ticks)
            wall = current["wall"] - previous["wall"]
            delta = {name: (current[name] - previous[name]) / wall for name in ("machine", *self.pids)}
            self.rows.append(
                {
                    "t_s": round((now_ms() - self.t0_ms) / 1000, 1),
                    "worker": round(delta["worker"], 2),
                    "broker": round(delta["broker"], 2),
                    "other": round(max(0.0, delta["machine"] - delta["worker"] - delta["broker"] - delta["bench"]), 2),
                }
            )
            previous = current

    def _read(self, ticks: int) -> dict[str, float]:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
        values = {"wall": time.monotonic(), "machine": (user + nice + system + irq + softirq + steal) / ticks}
        for name, pid in self.pids.items():
            values[name] = cpu_seconds(pid)
        return values

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)

    def other_mean(self) -> float | None:
        if not self.rows:
            return None
        return round(sum(row["other"] for row in self.rows) / len(self.rows), 2)
