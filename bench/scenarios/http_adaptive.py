"""Adaptive concurrency against fixed limits, one worker pushing to the reference service over HTTP.

The service (``demo/reference_service.py``, its own process) serves 32 calls at once for 10 ms each, so its limit is
3,200 calls/s; up to ``BENCH_HTTP_QUEUE_BOUND`` (64) more wait in its queue, and past that it answers 503 (or, with
``BENCH_HTTP_OVERFLOW=hold``, holds the call until the client times out). One Rebound worker with the HTTP handler
drains a backlog larger than the run can finish, at ``REBOUND_CONCURRENCY`` 8, 64, 256 and ``auto``, interleaved in
rounds (8, 64, 256, auto; again: ``BENCH_HTTP_ROUNDS``), each run on a broker of its own (its memory storage only
grows, and a run writes a few hundred thousand records).

Each run: the worker starts, its first calls arrive, ``warm`` seconds pass (an adaptive limit finds its level), then
three phases, each read from the service's ``/stats`` (reset at each phase's start) and the worker's ``/metrics``:

- **steady** (capacity 32): goodput (calls answered 2xx per second), the service's latency p50/p99 (its queue wait
  plus its service time: what the calls cost the service), the share of calls rejected (503) and timed out, and
  retries generated (``scheduled`` attempt outcomes) per second;
- **drop** (capacity 8 for ``BENCH_HTTP_DROP_S``, 30 s: the limit is 800 calls/s): the same, and the same over the
  phase's part from 10 s after the change (the target's "within 10 s");
- **after** (capacity 32 again): how many seconds until goodput is back at 0.9 of 3,200 for 3 seconds in a row, and
  at 0.9 of the setting's own steady goodput (a worker short of CPU never reaches the first).

The goodput per second of every phase is kept (the service's own per-second count of 2xx answers), and, with
``auto``, the worker's limit every second. Retries go to a ``1s`` tier, so a rejected call comes back as load a
second later, as it would in production with short first delays. Targets (reported, not enforced): ``auto`` at
least 0.9 of the capacity as goodput with at most 1 % of calls timing out, in steady state and from 10 s after a
change.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from typing import Any

from bench.common import (
    FaustProcess,
    Sampler,
    cpu_seconds,
    fresh_broker,
    produce_batch,
    rebound_worker,
    running,
    wait_until,
)
from bench.scenarios.base import PARTITIONS, PRODUCTION_BATCH, Context, new_topic
from bench.scenarios.http_service import ServiceProcess, counters, gauges, histogram_quantile, serving
from demo.embedded_broker import EmbeddedBroker

CAPACITY = 32
SERVICE_TIME_MS = 10
DROPPED_CAPACITY = 8
LIMIT_PER_S = CAPACITY * 1000 // SERVICE_TIME_MS
DROPPED_LIMIT_PER_S = DROPPED_CAPACITY * 1000 // SERVICE_TIME_MS
TARGET_GOODPUT = 0.9
TARGET_TIMED_OUT = 0.01
FOLLOW_AFTER_S = 10
VARIANTS = {"fixed-8": "8", "fixed-64": "64", "fixed-256": "256", "auto": "auto"}
RETRY_SEQUENCE = "1s,1s,1s,1s,1s,1s,1s,1s"
HANDLER_TIMEOUT = "2s"
# Metric names of the adaptive limit, sampled once a second when the worker exposes them.
LIMIT_GAUGES = ("rebound_concurrency_limit", "rebound_handler_in_flight")


def knob(name: str, default: float, quick: float, ctx: Context) -> float:
    value = os.environ.get(name)
    return float(value) if value else (quick if ctx.quick else default)


def phases(ctx: Context) -> dict[str, float]:
    return {
        "warm": knob("BENCH_HTTP_WARM_S", 6, 4, ctx),
        "steady": knob("BENCH_HTTP_STEADY_S", 20, 8, ctx),
        "drop": knob("BENCH_HTTP_DROP_S", 30, 12, ctx),
        "after": knob("BENCH_HTTP_AFTER_S", 15, 8, ctx),
    }


class GaugeSampler(Sampler):
    """The worker's limit and in-flight gauges once a second (epoch s), in a thread, while a run lasts."""

    def __init__(self, worker: FaustProcess) -> None:
        super().__init__()
        self.worker = worker
        self.samples: list[dict[str, float]] = []

    def sample(self) -> bool:
        try:
            values = gauges(self.worker, LIMIT_GAUGES)
        except (OSError, ValueError):
            values = {}
        if values:
            self.samples.append({"t": round(time.time(), 2), **values})
        return True


def phase_figures(
    stats: dict[str, Any], before: dict[str, float], after: dict[str, float], seconds: float
) -> dict[str, Any]:
    calls = after["calls"] - before["calls"]
    timeouts = after["timeouts"] - before["timeouts"]
    service_calls = max(1, stats["calls"])
    return {
        "seconds": round(seconds, 2),
        "goodput_per_s": round(stats["served"] / seconds, 1),
        "latency_ms": stats["latency_ms"],
        "worker_call_p99_at_most_ms": None if (p99 := histogram_quantile(before, after, 0.99)) is None else p99 * 1000,
        "queue_wait_ms": stats["queue_wait_ms"],
        "service_calls": stats["calls"],
        "served": stats["served"],
        "rejected": stats["rejected"],
        "rejected_share": round(stats["rejected"] / service_calls, 4),
        "abandoned": stats["abandoned"],
        "max_concurrent_seen": stats["max_concurrent_seen"],
        "worker_calls": calls,
        "timed_out": timeouts,
        "timed_out_share": round(timeouts / calls, 4) if calls else None,
        "retries_generated": after["scheduled"] - before["scheduled"],
        "retries_per_s": round((after["scheduled"] - before["scheduled"]) / seconds, 1),
        "dead_letters": after["dead"] - before["dead"],
        "served_per_second": stats["served_per_second"],
        "rejected_per_second": stats["rejected_per_second"],
    }


def whole_seconds(series: list[list[int]], start: float, end: float) -> list[tuple[int, int]]:
    """The per-second counts of the seconds wholly inside [start, end) (epoch s); a missing second counted 0."""
    counts = {int(second): int(count) for second, count in series}
    return [(second, counts.get(second, 0)) for second in range(int(start) + 1, int(end))]


def seconds_until(series: list[tuple[int, int]], level: float, since: float) -> float | None:
    """Seconds from ``since`` to the first of 3 whole seconds in a row at ``level`` or more (None: never)."""
    for index in range(len(series) - 2):
        if all(count >= level for _, count in series[index : index + 3]):
            return round(series[index][0] - since, 1)
    return None


def follow_figures(
    steady: dict[str, Any], drop: dict[str, Any], after: dict[str, Any], marks: dict[str, float]
) -> dict[str, Any]:
    """From 10 s after the drop to the restore: goodput and rejections; after it: seconds to 0.9 of the capacity,
    and to 0.9 of the setting's own steady goodput (a worker short of CPU never reaches the capacity)."""
    settled = whole_seconds(drop["served_per_second"], marks["drop"] + FOLLOW_AFTER_S, marks["restore"])
    rejected = whole_seconds(drop["rejected_per_second"], marks["drop"] + FOLLOW_AFTER_S, marks["restore"])
    goodput = statistics.mean(count for _, count in settled) if settled else None
    served = sum(count for _, count in settled)
    refused = sum(count for _, count in rejected)
    back = whole_seconds(after["served_per_second"], marks["restore"], marks["end"])
    recovered_s = seconds_until(back, TARGET_GOODPUT * LIMIT_PER_S, marks["restore"])
    own_s = seconds_until(back, TARGET_GOODPUT * steady["goodput_per_s"], marks["restore"])
    return {
        "drop_goodput_after_10s_per_s": None if goodput is None else round(goodput, 1),
        "drop_goodput_after_10s_share": None if goodput is None else round(goodput / DROPPED_LIMIT_PER_S, 3),
        "drop_rejected_share_after_10s": round(refused / max(1, served + refused), 4),
        "seconds_to_recover": recovered_s,
        "seconds_to_own_steady": own_s,
    }


def run_variant(ctx: Context, variant: str, concurrency: str, index: int, plan: dict[str, float]) -> dict[str, Any]:
    root = ctx.root / f"{variant}-r{index}"
    root.mkdir(parents=True, exist_ok=True)
    overflow = os.environ.get("BENCH_HTTP_OVERFLOW", "reject")
    queue_bound = os.environ.get("BENCH_HTTP_QUEUE_BOUND", "64")
    service = ServiceProcess(
        [
            "--capacity",
            str(CAPACITY),
            "--service-time-ms",
            str(SERVICE_TIME_MS),
            "--queue-bound",
            queue_bound,
            "--overflow",
            overflow,
            "--keys-kept",
            "0",
        ],
        root / "service.log",
    )
    with fresh_broker(root) as broker:
        count = int(LIMIT_PER_S * sum(plan.values()) * 1.2)
        topic = backlog(broker, count)
        worker = rebound_worker(
            broker,
            root,
            variant,
            REBOUND_APP_ID=topic,
            REBOUND_MAIN_TOPICS=topic,
            REBOUND_RETRY_SEQUENCE=RETRY_SEQUENCE,
            REBOUND_HANDLER_TIMEOUT=HANDLER_TIMEOUT,
            REBOUND_CONCURRENCY=concurrency,
            REBOUND_HANDLER=f"{service.url}/events",
            **PRODUCTION_BATCH,
        )
        load = round(os.getloadavg()[0], 2)
        with serving(service), running(worker), GaugeSampler(worker) as sampler:
            if not wait_until(lambda: service.stats()["calls"] > 0, 120, every=0.5, check=[worker]):
                raise RuntimeError(f"{variant}: no call reached the service:\n{worker.log_tail()}")
            time.sleep(plan["warm"])
            figures, marks, cpu = measure_phases(service, worker, plan)
            left = count - sum(phase["served"] for phase in figures.values())
        result = {
            "concurrency": concurrency,
            "round": index,
            "messages": count,
            "loadavg_1m_at_start": load,
            "backlog_exhausted": left <= 0,
            "cpu_pct_steady": cpu,
            "phases": figures,
            "marks": marks,
            "limit_samples": sampler.samples,
            **follow_figures(figures["steady"], figures["drop"], figures["after"], marks),
        }
    steady = figures["steady"]
    print(
        f"  http-adaptive round {index} {variant}: steady goodput {steady['goodput_per_s']}/s, "
        f"p99 {steady['latency_ms']['p99']} ms, rejected {steady['rejected_share']}, "
        f"timed out {steady['timed_out_share']}, retries {steady['retries_per_s']}/s; drop goodput "
        f"{result['drop_goodput_after_10s_per_s']}/s; back in {result['seconds_to_recover']} s (load {load})",
        flush=True,
    )
    return result


def backlog(broker: EmbeddedBroker, count: int) -> str:
    topic = new_topic(broker, "http")
    records = ((f"k{i}".encode(), json.dumps({"i": i}).encode()) for i in range(count))
    asyncio.run(produce_batch(broker.bootstrap, topic, records))
    return topic


def measure_phases(
    service: ServiceProcess, worker: FaustProcess, plan: dict[str, float]
) -> tuple[dict[str, Any], dict[str, float], dict[str, float]]:
    marks: dict[str, float] = {}
    figures: dict[str, Any] = {}
    base = counters(worker)
    service.reset()
    marks["steady"] = time.time()
    cpu_start = (cpu_seconds(worker.pid), service.cpu_seconds())
    time.sleep(plan["steady"])
    cpu_end = (cpu_seconds(worker.pid), service.cpu_seconds())
    for phase, following, capacity in (("steady", "drop", DROPPED_CAPACITY), ("drop", "restore", CAPACITY)):
        stats, now = service.stats(), counters(worker)
        service.reset()
        service.set_capacity(capacity)
        marks[following] = time.time()
        figures[phase] = phase_figures(stats, base, now, marks[following] - marks[phase])
        base = now
        time.sleep(plan["drop"] if phase == "steady" else plan["after"])
    stats, now = service.stats(), counters(worker)
    marks["end"] = time.time()
    figures["after"] = phase_figures(stats, base, now, marks["end"] - marks["restore"])
    cpu = {
        "worker": round(100 * (cpu_end[0] - cpu_start[0]) / plan["steady"], 1),
        "service": round(100 * (cpu_end[1] - cpu_start[1]) / plan["steady"], 1),
    }
    return figures, marks, cpu


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(values), 4), "min": min(values), "max": max(values)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def pick(path: str) -> list[float]:
        out = []
        for run in runs:
            value: Any = run
            for part in path.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if isinstance(value, (int, float)):
                out.append(float(value))
        return out

    return {
        "steady_goodput_per_s": spread(pick("phases.steady.goodput_per_s")),
        "steady_goodput_share": spread([v / LIMIT_PER_S for v in pick("phases.steady.goodput_per_s")]),
        "steady_p99_ms": spread(pick("phases.steady.latency_ms.p99")),
        "steady_p50_ms": spread(pick("phases.steady.latency_ms.p50")),
        "steady_worker_call_p99_at_most_ms": spread(pick("phases.steady.worker_call_p99_at_most_ms")),
        "steady_rejected_share": spread(pick("phases.steady.rejected_share")),
        "steady_timed_out_share": spread(pick("phases.steady.timed_out_share")),
        "steady_retries_per_s": spread(pick("phases.steady.retries_per_s")),
        "drop_goodput_after_10s_per_s": spread(pick("drop_goodput_after_10s_per_s")),
        "drop_goodput_after_10s_share": spread(pick("drop_goodput_after_10s_share")),
        "drop_p99_ms": spread(pick("phases.drop.latency_ms.p99")),
        "drop_rejected_share_after_10s": spread(pick("drop_rejected_share_after_10s")),
        "drop_timed_out_share": spread(pick("phases.drop.timed_out_share")),
        "drop_retries_per_s": spread(pick("phases.drop.retries_per_s")),
        "seconds_to_recover": spread(pick("seconds_to_recover")),
        "seconds_to_own_steady": spread(pick("seconds_to_own_steady")),
        "own_steady_runs": sum(1 for run in runs if run.get("seconds_to_own_steady") is not None),
        "recovered_runs": sum(1 for run in runs if run.get("seconds_to_recover") is not None),
        "runs": len(runs),
        "backlog_exhausted_runs": sum(1 for run in runs if run["backlog_exhausted"]),
        "cpu_pct_worker": spread(pick("cpu_pct_steady.worker")),
        "cpu_pct_service": spread(pick("cpu_pct_steady.service")),
    }


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    """``broker`` (the runner's) is left idle: each run takes a fresh one, see the module's docstring."""
    plan = phases(ctx)
    rounds = max(1, int(knob("BENCH_HTTP_ROUNDS", 2, 1, ctx)))
    chosen = [name.strip() for name in os.environ.get("BENCH_HTTP_VARIANTS", ",".join(VARIANTS)).split(",")]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    for index in range(1, rounds + 1):
        for name in chosen:
            runs[name].append(run_variant(ctx, name, VARIANTS[name], index, plan))
    variants: dict[str, dict[str, Any]] = {
        name: {"summary": summarise(results), "runs": results} for name, results in runs.items()
    }
    auto: dict[str, Any] | None = variants["auto"]["summary"] if "auto" in variants else None
    verdict: dict[str, Any] | None = None
    if auto is not None:
        verdict = {
            "steady_goodput_share": auto["steady_goodput_share"]["median"],
            "steady_timed_out_share": auto["steady_timed_out_share"]["median"],
            "drop_goodput_after_10s_share": auto["drop_goodput_after_10s_share"]["median"],
            "drop_timed_out_share": auto["drop_timed_out_share"]["median"],
        }
        verdict["target_met"] = bool(
            (verdict["steady_goodput_share"] or 0) >= TARGET_GOODPUT
            and (verdict["drop_goodput_after_10s_share"] or 0) >= TARGET_GOODPUT
            and (verdict["steady_timed_out_share"] or 0) <= TARGET_TIMED_OUT
            and (verdict["drop_timed_out_share"] or 0) <= TARGET_TIMED_OUT
        )
    return {
        "params": {
            "capacity": CAPACITY,
            "service_time_ms": SERVICE_TIME_MS,
            "limit_per_s": LIMIT_PER_S,
            "dropped_capacity": DROPPED_CAPACITY,
            "queue_bound": int(os.environ.get("BENCH_HTTP_QUEUE_BOUND", "64")),
            "overflow": os.environ.get("BENCH_HTTP_OVERFLOW", "reject"),
            "phases_s": plan,
            "rounds": rounds,
            "order": chosen,
            "retry_sequence": RETRY_SEQUENCE,
            "handler_timeout": HANDLER_TIMEOUT,
            "partitions": PARTITIONS,
        },
        "variants": variants,
        "summary": {
            "targets": {"goodput_share": TARGET_GOODPUT, "timed_out_share": TARGET_TIMED_OUT},
            "auto": verdict,
        },
    }


def chart(payload: dict[str, Any]) -> Any:
    """Left: steady goodput per setting (median, whiskers to the rounds' lowest and highest). Right: the first
    round's goodput per second through the drop, with the service's limit, and ``auto``'s limit."""
    import matplotlib.pyplot as plt

    fig, (bars, series) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = list(payload["variants"])
    medians, lows, highs = [], [], []
    for name in names:
        s = payload["variants"][name]["summary"]["steady_goodput_per_s"]
        medians.append(s["median"] or 0)
        lows.append((s["median"] or 0) - (s["min"] or 0))
        highs.append((s["max"] or 0) - (s["median"] or 0))
    bars.bar(names, medians, yerr=[lows, highs], capsize=4, color="tab:blue")
    bars.axhline(payload["params"]["limit_per_s"], color="grey", linestyle="--", label="service limit")
    bars.set_ylabel("goodput, calls/s (steady, capacity 32)")
    bars.legend(loc="lower right")
    limit_axis = series.twinx()
    for name in names:
        run = payload["variants"][name]["runs"][0]
        start = run["marks"]["steady"]
        points: list[tuple[float, int]] = []
        for phase in ("steady", "drop", "after"):
            points += [(second - start, count) for second, count in run["phases"][phase]["served_per_second"]]
        points.sort()
        series.plot([p[0] for p in points], [p[1] for p in points], label=name)
        limits = [
            (s["t"] - start, s["rebound_concurrency_limit"])
            for s in run["limit_samples"]
            if "rebound_concurrency_limit" in s
        ]
        if limits and run["concurrency"] == "auto":  # a fixed setting's limit is a flat line at its value
            limit_axis.plot(
                [p[0] for p in limits], [p[1] for p in limits], color="black", linewidth=0.8, label=f"{name} limit"
            )
    first = payload["variants"][names[0]]["runs"][0]
    start = first["marks"]["steady"]
    series.axvspan(first["marks"]["drop"] - start, first["marks"]["restore"] - start, color="grey", alpha=0.15)
    series.set_xlabel("seconds (grey: capacity 8)")
    series.set_ylabel("goodput, calls/s")
    limit_axis.set_ylabel("auto: concurrency limit (black)")
    series.legend(loc="upper right", fontsize=8)
    return fig


def rows(payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    out = []
    for name, result in payload["variants"].items():
        s = result["summary"]
        out.append((name, "steady goodput/s (median)", f"{s['steady_goodput_per_s']['median']}"))
        out.append((name, "steady p99 ms", f"{s['steady_p99_ms']['median']}"))
        out.append(
            (
                name,
                "steady rejected / timed out",
                f"{s['steady_rejected_share']['median']} / {s['steady_timed_out_share']['median']}",
            )
        )
        out.append((name, "drop goodput/s from 10 s", f"{s['drop_goodput_after_10s_per_s']['median']}"))
        out.append((name, "seconds to recover", f"{s['seconds_to_recover']['median']}"))
        out.append((name, "seconds to 0.9 of its steady", f"{s['seconds_to_own_steady']['median']}"))
    return out
