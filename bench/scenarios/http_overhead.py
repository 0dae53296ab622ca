"""The HTTP push handler's own cost: one worker draining a backlog through it to a no-op service, next to the same
worker with a Python no-op handler.

Both variants drain a backlog of ``messages`` produced before the worker starts, at the default concurrency; the
rate runs from the first to the last ``succeeded`` attempt event (as ``noop-ratio`` measures it, so group formation
is not in it). The service is the reference service (``demo/reference_service.py``, its own process) with room for
every call at once and no service time: what is left is the request, its answer and the service's own Python. The
two are interleaved in rounds (Python, HTTP; again: ``BENCH_HTTP_OVERHEAD_ROUNDS``, default 3) and the figure is the
median of the rounds' ratios (HTTP / Python), with their spread. Target: at least 0.5 (reported, not enforced).

The service runs on the same two cores as the worker and the broker, so the rate ratio also pays for the service's
CPU; the worker's CPU per message (its own threads, from ``/proc``) is reported beside it, with the service's.

``python -m bench.scenarios.http_overhead [--calls N] [--in-flight C ...]`` is the handler alone: this process calls
:class:`app.http_handler.HttpHandler` ``N`` times against a reference service of its own (no broker, no worker) with
``C`` calls in flight, and prints its CPU per call (what the handler and its HTTP client cost, a Rebound worker's own
share of a call left out). ``--baseline REF`` compares it with ``app/http_handler.py`` as it was at the git commit
``REF``, loaded beside it in the same process: ``--blocks`` blocks of ``N`` calls each, the two alternating (which goes
first alternates too), so the machine's load falls on both alike; it prints each one's median CPU per call and range.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import produce_batch, rebound_worker, running
from bench.scenarios.base import PARTITIONS, PRODUCTION_BATCH, Context, new_topic
from bench.scenarios.http_service import ServiceProcess, serving
from bench.scenarios.noop_ratio import CpuSampler
from bench.scenarios.throughput import collect
from demo.embedded_broker import EmbeddedBroker

TARGET = 0.5
VARIANTS = ("python-noop", "http-noop")


def run_variant(ctx: Context, broker: EmbeddedBroker, variant: str, count: int, index: int) -> dict[str, Any]:
    topic = new_topic(broker, f"ho-{variant}")
    records = ((f"k{i}".encode(), json.dumps({"i": i}).encode()) for i in range(count))
    asyncio.run(produce_batch(broker.bootstrap, topic, records))
    service = ServiceProcess(
        ["--capacity", "4096", "--service-time-ms", "0", "--queue-bound", "0", "--keys-kept", "0"],
        ctx.root / f"service-{variant}-{index}.log",
    )
    handler = f"{service.url}/noop" if variant == "http-noop" else "bench.handlers:noop"
    worker = rebound_worker(
        broker,
        ctx.root,
        f"{variant}-{index}",
        REBOUND_APP_ID=topic,
        REBOUND_MAIN_TOPICS=topic,
        REBOUND_RETRY_SEQUENCE="1m",
        REBOUND_HANDLER=handler,
        **PRODUCTION_BATCH,
    )
    load = round(os.getloadavg()[0], 2)
    with serving(service), running(worker), CpuSampler(worker) as sampler:
        service_cpu_start = service.cpu_seconds()
        # "rebound-" makes collect read succeeded attempt events (its Rebound branch)
        times = asyncio.run(collect(broker.bootstrap, f"{topic}.attempts", count, f"rebound-{variant}", worker))
        service_cpu = service.cpu_seconds() - service_cpu_start
        served = service.stats()["served"]
    first, last = min(times), max(times)
    span_ms = max(1, last - first)
    cpu = sampler.between(first, last)
    handled = max(1, len(times) - 1)
    summary = {
        "messages": len(times),
        "span_ms": span_ms,
        "messages_per_s": round((len(times) - 1) * 1000 / span_ms, 1),
        "worker_cpu_us_per_message": None if cpu is None else round(cpu * 1e6 / handled, 1),
        # the service's CPU over its whole life in the run (idle before the first call): an upper bound
        "service_cpu_us_per_message": round(service_cpu * 1e6 / handled, 1) if variant == "http-noop" else None,
        "service_calls_served": served if variant == "http-noop" else None,
        "loadavg_1m_at_start": load,
    }
    print(f"  http-overhead round {index} {variant}: {summary}", flush=True)
    return summary


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    count = ctx.size(default=20_000, quick=2_000)
    rounds = max(1, int(os.environ.get("BENCH_HTTP_OVERHEAD_ROUNDS", "1" if ctx.quick else "3")))
    runs = []
    for index in range(1, rounds + 1):
        results = {variant: run_variant(ctx, broker, variant, count, index) for variant in VARIANTS}
        python, http = results["python-noop"], results["http-noop"]
        ratio = round(http["messages_per_s"] / max(1e-9, python["messages_per_s"]), 3)
        mine, theirs = http["worker_cpu_us_per_message"], python["worker_cpu_us_per_message"]
        cpu_ratio = None if not mine or not theirs else round(theirs / mine, 3)
        print(f"  http-overhead round {index}: http/python {ratio} (worker CPU ratio {cpu_ratio})", flush=True)
        runs.append({"round": index, "variants": results, "http_vs_python": ratio, "http_vs_python_cpu": cpu_ratio})
    ratios = spread([r["http_vs_python"] for r in runs])
    variants = {
        variant: {
            "summary": {
                "messages_per_s": spread([r["variants"][variant]["messages_per_s"] for r in runs]),
                "worker_cpu_us_per_message": spread(
                    [c for r in runs if (c := r["variants"][variant]["worker_cpu_us_per_message"]) is not None]
                ),
            }
        }
        for variant in VARIANTS
    }
    return {
        "params": {"messages": count, "partitions": PARTITIONS, "rounds": rounds, "order": list(VARIANTS)},
        "rounds": runs,
        "variants": variants,
        "summary": {
            "http_vs_python": ratios,
            "http_vs_python_cpu": spread([c for r in runs if (c := r["http_vs_python_cpu"]) is not None]),
            "service_cpu_us_per_message": spread(
                [c for r in runs if (c := r["variants"]["http-noop"]["service_cpu_us_per_message"]) is not None]
            ),
            "target": TARGET,
            "target_met": ratios["median"] is not None and ratios["median"] >= TARGET,
        },
    }


def chart(payload: dict[str, Any]) -> Any:
    """Each round's rate of both handlers, and the ratio with the target."""
    import matplotlib.pyplot as plt

    fig, (rates, ratios) = plt.subplots(1, 2, figsize=(11, 4.2))
    rounds = [r["round"] for r in payload["rounds"]]
    width = 0.38
    for offset, variant in ((-width / 2, "python-noop"), (width / 2, "http-noop")):
        values = [r["variants"][variant]["messages_per_s"] for r in payload["rounds"]]
        rates.bar([x + offset for x in rounds], values, width, label=variant)
    rates.set_xticks(rounds)
    rates.set_xlabel("round")
    rates.set_ylabel("messages/s, one worker")
    rates.legend()
    ratios.plot(rounds, [r["http_vs_python"] for r in payload["rounds"]], "o-", label="rate ratio")
    cpu = [r["http_vs_python_cpu"] for r in payload["rounds"]]
    if all(c is not None for c in cpu):
        ratios.plot(rounds, cpu, "s--", label="worker CPU ratio")
    ratios.axhline(payload["summary"]["target"], color="grey", linestyle="--", label="target")
    ratios.set_ylim(0, 1.2)
    ratios.set_xticks(rounds)
    ratios.set_xlabel("round")
    ratios.set_ylabel("HTTP / Python no-op")
    ratios.legend()
    return fig


def rows(payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    out = [
        (variant, "msg/s (median)", f"{result['summary']['messages_per_s']['median']}")
        for variant, result in payload["variants"].items()
    ]
    s = payload["summary"]
    out.append(("http-noop", "vs python-noop", f"{s['http_vs_python']['median']} (target {s['target']})"))
    return out


async def handler_cpu_per_call(
    url: str, calls: int, in_flight: int, module: Any = None, warm_up: int = 500
) -> dict[str, Any]:
    """The handler (``module``'s, by default ``app.http_handler``'s) called ``calls`` times, ``in_flight`` at once,
    after ``warm_up`` calls: CPU µs per call."""
    from rebound.event import RetryEvent
    from rebound.http_mapping import DEFAULT_STATUS_MAPPING

    if module is None:
        import app.http_handler as module
    handler = module.HttpHandler(
        module.HttpHandlerConfig(url=url, group="bench", request_timeout_s=9.0, statuses=DEFAULT_STATUS_MAPPING)
    )

    def event(i: int) -> RetryEvent:
        return RetryEvent(
            key=f"k{i}".encode(),
            value=json.dumps({"i": i}).encode(),
            headers={},
            topic="ho-http-noop",
            partition=i % PARTITIONS,
            offset=i,
            attempt=0,
            timestamp_ms=1_700_000_000_000 + i,
            first_received_at_ms=1_700_000_000_000 + i,
        )

    async def caller(numbers: Any) -> None:
        for i in numbers:
            await handler(event(i))

    try:
        await caller(range(warm_up))
        numbers = iter(range(warm_up, warm_up + calls))
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(caller(numbers) for _ in range(in_flight)))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        await handler.aclose()
    return {
        "calls": calls,
        "in_flight": in_flight,
        "cpu_us_per_call": round(cpu * 1e6 / calls, 1),
        "calls_per_s": round(calls / wall),
    }


def handler_at(ref: str, scratch: Path) -> Any:
    """``app/http_handler.py`` as it was at the git commit ``ref``, loaded as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{ref}:app/http_handler.py"],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
    ).stdout
    path = scratch / "baseline_http_handler.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_http_handler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def side_by_side(url: str, calls: int, in_flight: int, blocks: int, ref: str, baseline: Any) -> dict[str, Any]:
    """Alternate blocks of this tree's handler and ``baseline``'s: their CPU µs per call, medians and ranges."""
    import app.http_handler as current

    seen: dict[str, list[float]] = {"this tree": [], ref: []}
    for block in range(blocks):
        order = [("this tree", current), (ref, baseline)]
        for name, module in order if block % 2 == 0 else reversed(order):
            result = asyncio.run(handler_cpu_per_call(url, calls, in_flight, module, warm_up=200))
            seen[name].append(result["cpu_us_per_call"])
    return {
        "calls_per_block": calls,
        "in_flight": in_flight,
        "blocks": blocks,
        "cpu_us_per_call": {name: spread(values) for name, values in seen.items()},
    }


def main() -> None:
    from tempfile import TemporaryDirectory

    parser = argparse.ArgumentParser(prog="python -m bench.scenarios.http_overhead", description=__doc__)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 40])
    parser.add_argument("--baseline", metavar="REF", help="compare with app/http_handler.py at this git commit")
    parser.add_argument("--blocks", type=int, default=10, help="with --baseline: blocks per handler")
    args = parser.parse_args()
    with TemporaryDirectory() as scratch:
        baseline = handler_at(args.baseline, Path(scratch)) if args.baseline else None
        service = ServiceProcess(
            ["--capacity", "4096", "--service-time-ms", "0", "--queue-bound", "0", "--keys-kept", "0"],
            Path(scratch) / "service.log",
        )
        with serving(service):
            for in_flight in args.in_flight:
                load = round(os.getloadavg()[0], 2)
                if baseline is not None:
                    result = side_by_side(
                        f"{service.url}/noop", args.calls, in_flight, args.blocks, args.baseline, baseline
                    )
                else:
                    result = asyncio.run(handler_cpu_per_call(f"{service.url}/noop", args.calls, in_flight))
                print(
                    json.dumps({**result, "loadavg_1m": load, "loadavg_1m_after": round(os.getloadavg()[0], 2)}),
                    flush=True,
                )


if __name__ == "__main__":
    main()
