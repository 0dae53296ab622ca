"""No-op ratio: Rebound's healthy throughput as a fraction of a bare Faust agent's, with and without concurrency.

The ``healthy-throughput`` measurement (``bench/scenarios/throughput.py``, whose ``run_variant`` this reuses): a
backlog produced before the worker starts, all succeeding, rate from the first to the last output record. Four
variants on one broker: Rebound at its default concurrency (``REBOUND_CONCURRENCY`` left unset), Rebound with
``REBOUND_CONCURRENCY=1``, and two bare agents doing the least a healthy message costs (consume, call a no-op, produce
one small record; ``bench/baselines/bare.py``, the same agent in both):

- ``stock-faust``: stock Faust, a plain ``faust.App`` with Faust's own consumer, hand-over and producer path; only
  its hard-coded fetch wait is replaced, which the embedded broker needs (``bench/baselines/stock.py`` says how). Its
  worker logs the classes it runs and stops itself if any is Rebound's; each run's list is in ``stock_faust_paths``.
  This is "bare Faust", the baseline issue 23's target names, so ``target_met`` is measured against it when it ran.
- ``bare-faust``: the same agent on Faust with Rebound's app and consumer (``bench/baselines/_app.py``), which carry
  Rebound's own speed-ups of Faust's per-record path (the hand-over without mode's ``wait_first``,
  ``maybe_start_producer`` without its ``stampede``): the ratio to it says what Rebound adds per message on top of a
  Faust agent with the same plumbing.

The summary gives Rebound's ratio to each (``rebound_vs_stock``, ``rebound_vs_bare``, the same at concurrency 1, and
``bare_vs_stock``), by rate and by CPU, each the median of the rounds with its spread. After each run the group's
committed offsets, read while the worker still runs, must add up to the backlog (``offsets_covered``).

The machine is shared and one run's rate moves by a tenth or more with what else runs, so the variants are
interleaved in rounds (each round runs every variant once, in ``BENCH_NOOP_VARIANTS``' order, by default
``rebound``, ``bare-faust``, ``stock-faust``, ``rebound-c1``; ``BENCH_NOOP_ROUNDS`` rounds, default 3): each round's ratio compares runs a few seconds
apart, and the figure is the median of the rounds' ratios, reported with their spread (lowest and highest). Each run
records the load average when it started, and the payload the commit and whether the tree had uncommitted changes.
The target (0.9) is reported, never enforced.

Beside the rates, each run samples the worker process's CPU time (all its threads, from ``/proc``) and reports the
CPU it spent per message between the first and the last output record: what a message costs the worker, which moves
far less with the machine's load than a rate does (a run that waited for a core costs no more CPU). The ratio of
a bare agent's CPU per message to Rebound's is the rate ratio a worker with a core to itself would see.

A/B in one invocation: ``BENCH_NOOP_TREES=/tmp/base,/work/main`` runs every variant from each source tree in turn
within each round (the worker's working directory is the tree, so its packages win), and the summary gives each
tree's medians and spread (``by_tree``; ``summary`` is the last tree's). ``BENCH_NOOP_VARIANTS=rebound,bare-faust``
leaves out the others (at least one of the bare agents is needed; each name once).
"""

from __future__ import annotations

import ast
import asyncio
import bisect
import dataclasses
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, FaustProcess, Sampler, cpu_seconds, running
from bench.scenarios.base import PARTITIONS, Context
from bench.scenarios.throughput import collect, prepare_variant, rate_summary
from demo.embedded_broker import EmbeddedBroker

TARGET = 0.9
ROUNDS_ENV = "BENCH_NOOP_ROUNDS"
DEFAULT_ROUNDS = 3
TREES_ENV = "BENCH_NOOP_TREES"
VARIANTS_ENV = "BENCH_NOOP_VARIANTS"
VARIANTS: dict[str, dict[str, str]] = {
    "rebound": {},  # the worker's default concurrency
    "bare-faust": {},  # Faust on Rebound's app and consumer
    "stock-faust": {"BENCH_STOCK_FAUST": "1"},  # stock Faust, the fetch wait alone set
    "rebound-c1": {"REBOUND_CONCURRENCY": "1"},
}
DESCRIPTIONS = {
    "rebound": "Rebound, default concurrency",
    "bare-faust": "bare agent on Faust with Rebound's app and consumer",
    "stock-faust": "bare agent on stock Faust (its fetch wait alone set)",
    "rebound-c1": "Rebound, REBOUND_CONCURRENCY=1",
}
BASELINES = ("bare-faust", "stock-faust")
RATIOS: dict[str, tuple[str, str]] = {
    "rebound_vs_bare": ("rebound", "bare-faust"),
    "rebound_c1_vs_bare": ("rebound-c1", "bare-faust"),
    "rebound_vs_stock": ("rebound", "stock-faust"),
    "rebound_c1_vs_stock": ("rebound-c1", "stock-faust"),
    "bare_vs_stock": ("bare-faust", "stock-faust"),
}
"""Each ratio's variant and the baseline it is divided by (rate: variant / baseline; CPU: baseline / variant)."""
TARGET_BASELINE = "stock-faust"
"""The issue's target (0.9) is a ratio to bare Faust: stock Faust's agent when it ran, else the other bare agent."""
CPU_SAMPLE_S = 0.02
COMMIT_WAIT_S = 15.0


class CpuSampler(Sampler):
    """The CPU seconds a process has used, sampled every ``CPU_SAMPLE_S`` with the wall clock (epoch ms)."""

    interval = CPU_SAMPLE_S

    def __init__(self, process: FaustProcess) -> None:
        super().__init__()
        self.process = process
        self.samples: list[tuple[float, float]] = []

    def sample(self) -> bool:
        try:
            self.samples.append((time.time_ns() / 1e6, cpu_seconds(self.process.pid)))
        except (OSError, IndexError, ValueError):
            return False  # the process has gone
        return True

    def at(self, ms: float) -> float | None:
        """CPU seconds used by ``ms`` (epoch), interpolated between the samples around it."""
        times = [t for t, _ in self.samples]
        i = bisect.bisect_left(times, ms)
        if i == 0 or i >= len(times):
            return None
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        return c0 + (c1 - c0) * (ms - t0) / max(1e-9, t1 - t0)

    def between(self, first_ms: float, last_ms: float) -> float | None:
        start, end = self.at(first_ms), self.at(last_ms)
        return None if start is None or end is None else end - start


def run_variant(
    ctx: Context, broker: EmbeddedBroker, variant: str, count: int, tree: Path = REPO, **env: str
) -> dict[str, Any]:
    """``bench.scenarios.throughput.run_variant`` (the same workers, backlog and rate), with the worker's CPU; the
    worker runs from ``tree``."""
    worker, output = prepare_variant(ctx, broker, variant, count, **env)
    worker = dataclasses.replace(worker, cwd=tree)
    group = worker.env["REBOUND_APP_ID" if variant.startswith("rebound") else "BENCH_APP_ID"]
    source_topic = output.rsplit(".", 1)[0]  # <topic>.attempts or <topic>.done
    with running(worker), CpuSampler(worker) as sampler:
        times = asyncio.run(collect(broker.bootstrap, output, count, variant, worker))
        committed = asyncio.run(committed_total(broker.bootstrap, group, source_topic, count))
    summary = rate_summary(times)
    cpu = sampler.between(min(times), max(times))
    summary["worker_cpu_s"] = None if cpu is None else round(cpu, 3)
    summary["cpu_us_per_message"] = None if cpu is None else round(cpu * 1e6 / max(1, len(times) - 1), 1)
    # The group's committed offsets, read while the worker ran: they cover the backlog when they add up to it.
    summary["committed_offsets"] = committed
    summary["offsets_covered"] = committed == count
    if committed != count:
        print(f"  noop-ratio {variant}: committed offsets add up to {committed}, not {count}", flush=True)
    if variant == "stock-faust":
        summary["path"] = path_line(worker.log_path)
    return {"summary": summary}


async def committed_total(bootstrap: str, group: str, topic: str, count: int) -> int:
    """The sum of ``group``'s committed offsets on ``topic`` (a fresh topic of ``count`` records: the backlog is
    covered when it is ``count``), waiting up to ``COMMIT_WAIT_S`` for the worker's commits to reach it."""
    from chaos.observe import committed_offsets

    deadline = time.monotonic() + COMMIT_WAIT_S
    while True:
        total = sum((await committed_offsets(bootstrap, group, topic)).values())
        if total >= count or time.monotonic() > deadline:
            return total
        await asyncio.sleep(0.5)


def path_line(log: Path) -> dict[str, Any] | None:
    """What the stock-Faust baseline printed of the classes it ran (``bench/baselines/stock.py``), or None."""
    from bench.baselines.stock import PATH_LINE

    text = log.read_text(errors="replace") if log.exists() else ""
    for line in text.splitlines():
        if PATH_LINE in line:
            try:
                found = ast.literal_eval(line.split(PATH_LINE, 1)[1].strip())
            except (ValueError, SyntaxError):
                return None
            return found if isinstance(found, dict) else None
    return None


def default_concurrency() -> int | None:
    """What the worker runs with when the variable is unset (None: this Rebound has no such setting yet)."""
    from rebound.settings import Settings

    field = Settings.model_fields.get("concurrency")
    return None if field is None else field.default


def trees() -> list[Path]:
    listed = [Path(part.strip()) for part in os.environ.get(TREES_ENV, "").split(",") if part.strip()]
    return listed or [REPO]


def variants(text: str | None = None) -> dict[str, dict[str, str]]:
    """The variants ``BENCH_NOOP_VARIANTS`` (or ``text``) names, in its order (each round runs them so), all of them
    when empty; at least one bare agent (``BASELINES``), no unknown or repeated name."""
    if text is None:
        text = os.environ.get(VARIANTS_ENV, "")
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in chosen if name not in VARIANTS]
    if unknown or len(set(chosen)) != len(chosen) or (chosen and not set(chosen) & set(BASELINES)):
        raise SystemExit(
            f"{VARIANTS_ENV}: choose from {list(VARIANTS)}, each once, with {' or '.join(BASELINES)} (got {chosen})"
        )
    return {name: VARIANTS[name] for name in chosen} if chosen else dict(VARIANTS)


def round_ratios(rates: dict[str, float], cpu: dict[str, float | None]) -> dict[str, float | None]:
    """One round's ratios (``RATIOS``) of the variants it ran: by rate (variant / baseline) and, as ``<name>_cpu``,
    by CPU per message (baseline / variant: the rate ratio a worker with a core to itself would see)."""
    ratios: dict[str, float | None] = {}
    for name, (variant, baseline) in RATIOS.items():
        if variant not in rates or baseline not in rates:
            continue
        ratios[name] = round(rates[variant] / max(1e-9, rates[baseline]), 3)
        mine, theirs = cpu.get(variant), cpu.get(baseline)
        ratios[f"{name}_cpu"] = None if not mine or not theirs else round(theirs / mine, 3)
    return ratios


def source(tree: Path = REPO) -> dict[str, Any]:
    """The commit measured and the tracked files changed on top of it (a run of uncommitted code must say so)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=tree, capture_output=True, text=True, check=False, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = os.environ.get("BENCH_SOURCE_COMMIT") or (git("rev-parse", "HEAD") or "").strip() or None
    status = git("status", "--porcelain", "--untracked-files=no")
    changed = None if status is None else sorted(line[3:] for line in status.splitlines() if line[3:])
    # Unknown (None) without a git checkout, as in a ``git archive`` snapshot: BENCH_SOURCE_COMMIT then says what ran.
    return {"commit": commit, "changed_files": changed, "dirty": None if changed is None else bool(changed)}


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None, "range": None}
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "range": round(max(values) - min(values), 3),
    }


def rounds_to_run(ctx: Context) -> int:
    return max(1, int(os.environ.get(ROUNDS_ENV, DEFAULT_ROUNDS)))


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    count = ctx.size(default=20_000, quick=2_000)
    rounds = rounds_to_run(ctx)
    sources, chosen = trees(), variants()
    inherited = os.environ.get("REBOUND_CONCURRENCY")
    if inherited is not None:
        print(f"  noop-ratio: REBOUND_CONCURRENCY={inherited} in the environment is the 'default' run's", flush=True)
    runs: list[dict[str, Any]] = []
    paths: list[dict[str, Any] | None] = []
    for index in range(rounds):
        for tree in sources:
            rates: dict[str, float] = {}
            cpu: dict[str, float | None] = {}
            load: dict[str, float | None] = {}
            covered: dict[str, bool] = {}
            for variant, env in chosen.items():
                load[variant] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
                summary = run_variant(ctx, broker, variant, count, tree, **env)["summary"]
                rates[variant] = summary["messages_per_s"]
                cpu[variant] = summary["cpu_us_per_message"]
                covered[variant] = summary["offsets_covered"]
                if "path" in summary:
                    paths.append(summary["path"])
                print(
                    f"  noop-ratio round {index + 1}/{rounds} {tree} {variant}: {summary} (load {load[variant]})",
                    flush=True,
                )
            ratios = round_ratios(rates, cpu)
            print(f"  noop-ratio round {index + 1}/{rounds} {tree}: {ratios}", flush=True)
            runs.append(
                {
                    "round": index + 1,
                    "tree": str(tree),
                    "messages_per_s": rates,
                    "cpu_us_per_message": cpu,
                    "loadavg_1m_at_start": load,
                    "offsets_covered": covered,
                    **ratios,
                }
            )
    by_tree = {str(tree): summarize([r for r in runs if r["tree"] == str(tree)], count, chosen) for tree in sources}
    last = by_tree[str(sources[-1])]
    return {
        "params": {
            "messages": count,
            "partitions": PARTITIONS,
            "rounds": rounds,
            "order": list(chosen),
            "trees": [str(tree) for tree in sources],
            "default_concurrency": default_concurrency(),
            "inherited_REBOUND_CONCURRENCY": inherited,
            "descriptions": {name: DESCRIPTIONS[name] for name in chosen},
        },
        "source": source(sources[-1]),
        "sources": {str(tree): source(tree) for tree in sources},
        "rounds": runs,
        "variants": last["variants"],  # each variant's median rate over the rounds (the last tree's)
        "summary": last["summary"],
        "by_tree": by_tree,
        # What each stock-faust run printed of the classes it ran; its worker stops itself on any not Faust's.
        "stock_faust_paths": paths,
    }


def summarize(runs: list[dict[str, Any]], count: int, chosen: dict[str, dict[str, str]]) -> dict[str, Any]:
    """One tree's rounds: each variant's median rate and CPU per message, and the ratios' medians and spread."""
    variants = {
        variant: {
            "summary": {
                "messages": count,
                "messages_per_s": round(statistics.median(r["messages_per_s"][variant] for r in runs), 1),
            },
            "rates": spread([r["messages_per_s"][variant] for r in runs]),
            "cpu_us_per_message": spread([c for r in runs if (c := r["cpu_us_per_message"][variant]) is not None]),
        }
        for variant in chosen
    }
    summary: dict[str, Any] = {}
    for name in RATIOS:
        if not runs or name not in runs[0]:
            summary[name] = None  # its variant or its baseline was left out
            continue
        by_rate = spread([r[name] for r in runs])
        summary[name] = by_rate["median"]  # the median of the rounds' ratios
        summary[f"{name}_spread"] = by_rate
        # bare CPU per message / Rebound's: the ratio with a core to itself, little moved by the machine's load
        summary[f"{name}_cpu"] = spread([c for r in runs if (c := r[f"{name}_cpu"]) is not None])
    against = TARGET_BASELINE if TARGET_BASELINE in chosen else "bare-faust"
    ratio = summary.get("rebound_vs_stock" if against == "stock-faust" else "rebound_vs_bare")
    summary.update(
        target=TARGET,
        target_against=against,
        target_met=ratio is not None and ratio >= TARGET,
        offsets_covered={v: all(r["offsets_covered"].get(v, False) for r in runs) for v in chosen},
    )
    return {"variants": variants, "summary": summary}
