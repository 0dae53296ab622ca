"""Failure path: the rate of every stage a failing message goes through, as a fraction of the first-try rate.

One worker, a no-op handler (:func:`fail_once`), ``count`` messages (20,000; ``--messages`` for a quicker run), two
phases on the same worker:

1. ``count`` messages that succeed on their first try: the **first-try** rate
   (``rebound_attempts_total{tier="main",outcome="succeeded"}``);
2. ``count`` messages whose first try fails retryably and whose retry succeeds, policy ``<delay>s``: the **forward**
   rate (``outcome="scheduled"``: the failure sent to its tier and acknowledged), the **park** rate
   (``rebound_parked_total``) and the **release** rate (``outcome="succeeded"`` of a tier), with the release
   lateness percentiles (``rebound_release_lateness_seconds``, read as the upper bound of the bucket they fall in).

Each rate is taken between the samples (``GET /metrics`` four times a second) where its counter passed 10 % and 90 %
of ``count``. Releases come due at the pace the failures were forwarded (due = failure + delay), so the release rate
is at most the forward rate: it measures whether releases keep up, and the lateness says by how much they do not.
The delay (``BENCH_FAILURE_DELAY_S``, default ``max(20, count / 250)`` s) is long enough that at 250 forwards/s the
first release comes due after the last forward.

A/B in one invocation: ``BENCH_FAILURE_TREES=/tmp/base,/work/main`` runs the worker from each source tree in turn
(each tree's ``app`` package wins in its worker: the worker's working directory is the tree), ``BENCH_FAILURE_ROUNDS``
times (default 1), interleaved (A, B, A, B, ...); the summary gives each tree's median and spread.

The floor in one invocation: ``BENCH_FAILURE_VARIANTS=rebound,bare-faust`` runs, in each round, Rebound's worker
(from each tree) and then ``bench/baselines/bare_retry.py`` (from this tree: the least bare Faust does on the same
surface, no Rebound guarantees; ``bare-faust-no-events`` is the same without an attempt event per attempt;
``stock-faust`` the same floor on stock Faust, ``bench/baselines/stock.py``, instead of Rebound's app and consumer), the
same messages, handler and delay. ``by_variant`` gives each variant's medians and [range] (Rebound's: the last tree's),
``floor`` Rebound's CPU per message and rate per stage as a multiple of each bare variant's in the same round (median
and range of the rounds). Every run records the load average at its start. Other knobs:
``BENCH_FAILURE_HANDLER_MS`` (the handler awaits that long, e.g. 20) and ``BENCH_FAILURE_CONCURRENCY``
(``REBOUND_CONCURRENCY`` of the worker, default the worker's own).

The worker's CPU (user + system, ``/proc``) is sampled with the counters: ``*_cpu_us`` is its CPU per message between
a stage's 10 % and 90 % marks (forwards and parks overlap, so they are counted together, per failed message, from
the forwards' 10 % mark to the parks' 90 % mark). ``BENCH_FAILURE_PROFILE=<dir>``: py-spy records the worker (raw
folded stacks, 200 Hz, only the samples py-spy finds on a CPU: a thread
waiting for the GIL or in a select is left out) from the start of the failing phase until every message is parked, then
(``-release`` in the name) from the first release until every message is released: two files per run in ``<dir>``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from app.errors import RetryableError
from bench.common import (
    REPO,
    FaustProcess,
    baseline_worker,
    cpu_seconds,
    follow_counters,
    produce_batch,
    rate_between,
    rebound_worker,
    running,
    wait_until,
)
from bench.scenarios.base import PARTITIONS, PRODUCTION_BATCH, Context, new_topic
from bench.scenarios.parked_memory import metrics_text, ready, samples
from demo.embedded_broker import EmbeddedBroker
from demo.harness import create_topics

DELAY_ENV = "BENCH_FAILURE_DELAY_S"
TREES_ENV = "BENCH_FAILURE_TREES"
ROUNDS_ENV = "BENCH_FAILURE_ROUNDS"
HANDLER_MS_ENV = "BENCH_FAILURE_HANDLER_MS"
CONCURRENCY_ENV = "BENCH_FAILURE_CONCURRENCY"
PROFILE_ENV = "BENCH_FAILURE_PROFILE"
VARIANTS_ENV = "BENCH_FAILURE_VARIANTS"
VARIANTS: dict[str, dict[str, str]] = {
    "rebound": {},
    "bare-faust": {"BENCH_ATTEMPT_EVENTS": "1"},
    "bare-faust-no-events": {"BENCH_ATTEMPT_EVENTS": "0"},
    "stock-faust": {"BENCH_ATTEMPT_EVENTS": "1", "BENCH_STOCK_FAUST": "1"},
}
HANDLER = "bench.scenarios.failure_path:fail_once"
FAIL = b"fail"
STAGES = ("first_try", "forward", "park", "release")
TARGET = 0.8


async def fail_once(event: Any) -> None:
    """The benchmark's handler: does nothing (or awaits ``BENCH_FAILURE_HANDLER_MS``), and fails the first try of a
    record whose value is ``fail`` retryably."""
    pause_ms = float(os.environ.get(HANDLER_MS_ENV) or 0)
    if pause_ms:
        await asyncio.sleep(pause_ms / 1000)
    if event.attempt == 0 and event.value == FAIL:
        raise RetryableError("bench: the first try fails")


def trees() -> list[Path]:
    listed = [Path(part.strip()) for part in os.environ.get(TREES_ENV, "").split(",") if part.strip()]
    return listed or [REPO]


def parse_variants(text: str) -> tuple[str, ...]:
    """The variants ``BENCH_FAILURE_VARIANTS`` names, in its order (empty: Rebound alone); unknown or repeated names
    are an error."""
    chosen = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in chosen if name not in VARIANTS]
    if unknown or len(set(chosen)) != len(chosen):
        raise SystemExit(f"{VARIANTS_ENV}: choose among {list(VARIANTS)}, each once (got {list(chosen)})")
    return chosen or ("rebound",)


def commit_of(tree: Path) -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True, check=False, timeout=10
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=tree,
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = done.stdout.strip() or None
    return f"{commit}+changes" if commit and status.stdout.strip() else commit


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    count = ctx.size(default=20_000, quick=2_000)
    delay_s = int(os.environ.get(DELAY_ENV) or max(20, count // 250))
    rounds = max(1, int(os.environ.get(ROUNDS_ENV) or 1))
    sources = trees()
    chosen = parse_variants(os.environ.get(VARIANTS_ENV, ""))
    runs: list[dict[str, Any]] = []
    for index in range(rounds):
        for variant in chosen:
            for tree in sources if variant == "rebound" else [REPO]:
                load = round(os.getloadavg()[0], 2)
                result = run_once(ctx, broker, tree, count, delay_s, f"r{index + 1}", variant)
                result.update(
                    round=index + 1, variant=variant, tree=str(tree), commit=commit_of(tree), loadavg_1m_at_start=load
                )
                print(
                    f"  failure-path round {index + 1} {variant} {tree} (load {load}): {result['summary']}", flush=True
                )
                runs.append(result)
    mine = [r for r in runs if r["variant"] == "rebound"]
    by_tree = {str(tree): summarize([r for r in mine if r["tree"] == str(tree)]) for tree in sources} if mine else {}
    last_tree = [r for r in mine if r["tree"] == str(sources[-1])]
    by_variant = {
        variant: summarize(last_tree if variant == "rebound" else [r for r in runs if r["variant"] == variant])
        for variant in chosen
    }
    failed = [f"{r['variant']} {r['tree']} round {r['round']}: {r['verdict']}" for r in runs if r["verdict"] != "ok"]
    return {
        "params": {
            "messages": count,
            "retry_sequence": f"{delay_s}s",
            "partitions": PARTITIONS,
            "rounds": rounds,
            "variants": list(chosen),
            "trees": [str(tree) for tree in sources],
            "handler_ms": float(os.environ.get(HANDLER_MS_ENV) or 0),
            "concurrency": os.environ.get(CONCURRENCY_ENV),
            "target_of_first_try": TARGET,
        },
        "summary": by_variant[chosen[0]],
        "by_tree": by_tree,
        "by_variant": by_variant,
        "floor": {
            f"rebound_of_{variant}": of_floor(last_tree, [r for r in runs if r["variant"] == variant])
            for variant in chosen
            if variant != "rebound" and last_tree
        },
        "runs": runs,
        "verdict": "; ".join(failed) or "ok",
    }


def of_floor(mine: list[dict[str, Any]], floor: list[dict[str, Any]]) -> dict[str, Any]:
    """Rebound's CPU per message and rate per stage as a multiple of the floor's in the same round: the median of the
    rounds' multiples, with the lowest and highest."""
    figures = [*CPU_STAGES, *(f"{stage}_per_s" for stage in STAGES)]
    floor_by_round = {r["round"]: r["summary"] for r in floor}
    out: dict[str, Any] = {}
    for name in figures:
        multiples = [
            round(r["summary"][name] / theirs, 3)
            for r in mine
            if (theirs := floor_by_round.get(r["round"], {}).get(name)) and r["summary"].get(name) is not None
        ]
        out[name] = round(statistics.median(multiples), 3) if multiples else None
        out[f"{name}_range"] = [min(multiples), max(multiples)] if multiples else None
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each rate and ratio: the median over the runs, with the lowest and highest."""
    out: dict[str, Any] = {"runs": len(runs), "commit": runs[0].get("commit") if runs else None}
    out["loadavg_1m_at_start"] = [r.get("loadavg_1m_at_start") for r in runs]
    cpu = [*CPU_STAGES, "release_cpu_of_first_try"]
    for name in [f"{stage}_per_s" for stage in STAGES] + [f"{stage}_of_first_try" for stage in STAGES[1:]] + cpu:
        values = [r["summary"][name] for r in runs if r["summary"].get(name) is not None]
        out[name] = round(statistics.median(values), 3) if values else None
        out[f"{name}_range"] = [min(values), max(values)] if values else None
    return out


def run_once(
    ctx: Context,
    broker: EmbeddedBroker,
    tree: Path,
    count: int,
    delay_s: int,
    label: str,
    variant: str = "rebound",
) -> dict[str, Any]:
    topic = new_topic(broker, "fp")
    if variant == "rebound":
        worker = rebound_under_test(ctx, broker, tree, topic, delay_s, label)
    else:
        worker = floor_under_test(ctx, broker, topic, delay_s, variant)
        tree = Path(variant)  # (names the profiles)
    with running(worker):
        if not wait_until(lambda: ready(worker), 90, check=[worker]):
            raise RuntimeError(f"worker never became ready:\n{worker.log_tail()}")
        started = time.monotonic()
        asyncio.run(produce_batch(broker.bootstrap, topic, ((f"ok{i}".encode(), b"ok") for i in range(count))))
        healthy = follow_counters(
            worker,
            started,
            lambda: sampled(worker),
            lambda c: c["first_try"] >= count,
            timeout=60 + count / 50,
        )
        started = time.monotonic()
        spies = [start_profile(worker.pid, label, tree)]

        def switch_profile(found: dict[str, float]) -> None:
            # The forward and park phase's recording ends when every message is parked, the release phase's begins
            # with the first release (not the wait before it).
            if spies[0] is None:
                return
            if found["park"] >= count:
                stop_profile(spies[0])
            if len(spies) == 1 and found["park"] >= count and found["release"] > 0:
                spies.append(start_profile(worker.pid, f"{label}-release", tree))

        asyncio.run(produce_batch(broker.bootstrap, topic, ((f"f{i}".encode(), FAIL) for i in range(count))))
        failing = follow_counters(
            worker,
            started,
            lambda: sampled(worker, switch_profile),
            lambda c: c["release"] >= count,
            timeout=delay_s + 120 + count / 20,
        )
        for spy in spies:
            stop_profile(spy)
        lateness = lateness_buckets(metrics_text(worker))
    first = rate_between(healthy, "first_try", count)
    rates = {
        "first_try_per_s": first,
        "forward_per_s": rate_between(failing, "forward", count),
        "park_per_s": rate_between(failing, "park", count),
        "release_per_s": rate_between(failing, "release", count),
    }
    summary: dict[str, Any] = dict(rates)
    for stage in STAGES[1:]:
        rate = rates[f"{stage}_per_s"]
        summary[f"{stage}_of_first_try"] = round(rate / first, 3) if rate is not None and first else None
    first_cpu = cpu_us_between(healthy, "first_try", count)
    release_cpu = cpu_us_between(failing, "release", count)
    summary["first_try_cpu_us"] = first_cpu
    summary["forward_park_cpu_us"] = cpu_us_between(failing, "forward", count, end="park")
    summary["release_cpu_us"] = release_cpu
    summary["release_cpu_of_first_try"] = round(release_cpu / first_cpu, 2) if release_cpu and first_cpu else None
    last = failing[-1]
    summary["all_forwarded_after_s"] = first_time(failing, "forward", count)
    summary["all_parked_after_s"] = first_time(failing, "park", count)
    summary["all_released_after_s"] = first_time(failing, "release", count)
    summary["release_lateness_s"] = {q: bucket_percentile(lateness, q) for q in (50, 90, 99)}
    verdict = "ok" if last["release"] >= count else f"FAILED: {last['release']} of {count} released"
    return {"summary": summary, "verdict": verdict, "raw": {"healthy": healthy, "failing": failing}}


CPU_STAGES = ("first_try_cpu_us", "forward_park_cpu_us", "release_cpu_us")


def rebound_under_test(
    ctx: Context, broker: EmbeddedBroker, tree: Path, topic: str, delay_s: int, label: str
) -> FaustProcess:
    """Rebound's worker on ``topic``, run from ``tree`` (not started)."""
    extra = {}
    if os.environ.get(CONCURRENCY_ENV):
        extra["REBOUND_CONCURRENCY"] = os.environ[CONCURRENCY_ENV]
    base = rebound_worker(
        broker,
        ctx.root,
        f"fp-{label}-{tree.name}",
        REBOUND_APP_ID=topic,
        REBOUND_MAIN_TOPICS=topic,
        REBOUND_RETRY_SEQUENCE=f"{delay_s}s",
        REBOUND_HANDLER=HANDLER,
        **PRODUCTION_BATCH,
        **extra,
    )
    return dataclasses.replace(base, cwd=tree)


def floor_under_test(ctx: Context, broker: EmbeddedBroker, topic: str, delay_s: int, variant: str) -> FaustProcess:
    """``bench/baselines/bare_retry.py`` on ``topic`` (not started), its tier, release and attempts topics created
    with the main topic's partitions. Agent concurrency 1: ``BENCH_FAILURE_CONCURRENCY`` does not apply."""
    internal = [f"{topic}.retry.{delay_s}s", f"{topic}.release", f"{topic}.attempts"]
    asyncio.run(create_topics(broker.bootstrap, internal, PARTITIONS))
    return baseline_worker(
        broker,
        ctx.root,
        "bare_retry",
        f"{topic}-{variant}",
        BENCH_TOPIC=topic,
        BENCH_PARTITIONS=str(PARTITIONS),
        BENCH_RETRY_DELAY_S=str(delay_s),
        BENCH_HANDLER=HANDLER,
        BENCH_DATA_DIR=str(ctx.root / f"data-{topic}-{variant}"),
        **PRODUCTION_BATCH,
        **VARIANTS[variant],
    )


def sampled(worker: Any, then: Any = None) -> dict[str, float]:
    """The worker's counters and its CPU seconds so far (``then(counters)`` is called with them)."""
    found = counters(metrics_text(worker))
    found["cpu"] = cpu_seconds(worker.pid)
    if then is not None:
        then(found)
    return found


def start_profile(pid: int, label: str, tree: Path) -> subprocess.Popen[bytes] | None:
    """py-spy recording the worker (``BENCH_FAILURE_PROFILE``), or None."""
    where = os.environ.get(PROFILE_ENV)
    if not where:
        return None
    Path(where).mkdir(parents=True, exist_ok=True)
    out = Path(where) / f"{label}-{tree.name}.txt"
    spy = Path(sys.executable).parent / "py-spy"
    command = [str(spy), "record", "--pid", str(pid), "-r", "200", "-f", "raw", "-o", str(out)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profile(spy: subprocess.Popen[bytes] | None) -> bool:
    if spy is not None and spy.poll() is None:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)
    return True


def counters(text: str) -> dict[str, float]:
    """The four stages' counters from a ``/metrics`` text, summed over topics and tiers."""
    found = dict.fromkeys(STAGES, 0.0)
    for name, labels, value in samples(text):
        if name == "rebound_attempts_total":
            outcome, tier = labels.get("outcome"), labels.get("tier")
            if outcome == "succeeded":
                found["first_try" if tier == "main" else "release"] += value
            elif outcome == "scheduled" and tier == "main":
                found["forward"] += value
        elif name == "rebound_parked_total":
            found["park"] += value
    return found


def cpu_us_between(trace: list[dict[str, float]], name: str, count: int, *, end: str | None = None) -> float | None:
    """The worker's CPU (user + system) per message, in µs, between the samples where ``name`` first reached 10 % and
    ``end`` (``name`` if not given) 90 % of ``count``, over the messages ``end`` counted in between (the stage's own
    CPU only where no other stage overlaps it: first tries, and releases, which come due after the last park with the
    default delay; forwards and parks overlap, and are counted together: ``name="forward", end="park"``)."""
    end = end or name
    low = next((row for row in trace if row[name] >= 0.1 * count), None)
    high = next((row for row in trace if row[end] >= 0.9 * count), None)
    if low is None or high is None or high[end] <= low[end]:
        return None
    return round((high["cpu"] - low["cpu"]) / (high[end] - low[end]) * 1e6, 1)


def first_time(trace: list[dict[str, float]], name: str, count: int) -> float | None:
    return next((row["t"] for row in trace if row[name] >= count), None)


def lateness_buckets(text: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of the release lateness histogram, summed over topics and tiers."""
    buckets: dict[float, float] = {}
    for name, labels, value in samples(text):
        if name == "rebound_release_lateness_seconds_bucket":
            bound = float(labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + value
    return sorted(buckets.items())


def bucket_percentile(buckets: list[tuple[float, float]], q: float) -> float | str | None:
    """The upper bound of the bucket the ``q``-th percentile falls in (``"> <last bound>"`` above the last one)."""
    if not buckets or not buckets[-1][1]:
        return None
    wanted = buckets[-1][1] * q / 100
    bound = next(bound for bound, cumulative in buckets if cumulative >= wanted)
    if bound == float("inf"):
        finite = [b for b, _ in buckets if b != float("inf")]
        return f"> {finite[-1]}" if finite else None
    return bound


def rows(payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The summary table's lines: each tree's (an A/B run) and each variant's medians [range], the floor multiples."""
    groups: dict[str, dict[str, Any]] = {}
    by_tree = payload.get("by_tree") or {}
    if len(by_tree) > 1:
        for tree, summary in by_tree.items():
            label = f"rebound {summary.get('commit') or tree}"
            groups[label if label not in groups else f"{label} {tree}"] = summary
    for variant, summary in (payload.get("by_variant") or {}).items():
        if not (variant == "rebound" and len(by_tree) > 1):  # Rebound's is the last tree's, listed above
            groups[variant] = summary
    if not groups:
        groups["rebound"] = payload["summary"]
    out = []
    for label, s in groups.items():
        out.append((label, "first try msg/s", _median_range(s, "first_try_per_s")))
        for stage in STAGES[1:]:
            rate, share = _median_range(s, f"{stage}_per_s"), _median_range(s, f"{stage}_of_first_try")
            out.append((label, f"{stage} msg/s, of first try", f"{rate}, {share}"))
        if s.get("first_try_cpu_us") is not None:
            cpu = " / ".join(_median_range(s, name) for name in CPU_STAGES)
            out.append((label, "CPU µs/msg first try / forward+park / release", cpu))
    for name, multiples in (payload.get("floor") or {}).items():
        cpu = " / ".join(_median_range(multiples, stage) for stage in CPU_STAGES)
        out.append((name.replace("_", " "), "CPU first try / forward+park / release", cpu))
    out.append(("all", "verdict", payload["verdict"]))
    return out


def _median_range(summary: dict[str, Any], name: str) -> str:
    value, spread = summary.get(name), summary.get(f"{name}_range")
    if value is None:
        return "-"
    return f"{value} [{spread[0]}-{spread[1]}]" if spread and spread[0] != spread[1] else f"{value}"
