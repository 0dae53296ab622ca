"""``python -m bench.schedule_micro [--base COMMIT] [--rounds N]``: the backlog figures' cost, in-process.

Times ``ReleaseSchedule.tier_stats`` (what every ``/metrics`` scrape, ``/retry/backlog`` request and 2 s status tick
asks the schedule) on the real class, with 8 partitions x 2 tier topics, 100,000 slots due in the next hour and 0,
1,000 or 100,000 overdue (due in the past hour), in two states: **waiting** (nothing sent: a breaker open) and
**windows full** (``pop_due`` first: each partition's window of ``max_in_flight`` = 1,000 requests in flight, the
rest overdue in the heaps, as when a paced release drains a backlog).

Each measurement builds a fresh schedule, then calls ``tier_stats`` 21 times with the clock 250 ms later each time
(a 4 Hz scrape): the median of the last 20 (``steady``), the first call alone (``first``: the first figures after
an adoption) and, for scale, the adoption of the 8 partitions' slots. ``--base COMMIT``
loads ``rebound/schedule.py`` of that commit too and runs both, interleaved (base, then this tree, each round), so
that the machine's noise falls on both alike. Prints per variant the median over the rounds and [min, max].

A second table times what the figures' bookkeeping adds to the tick: ``pop_due`` sending 1,000 due slots (125 a
partition, all within the windows) with the 100,000 future ones parked, on a schedule fresh from adoption and on one
that has given its figures once (the state a running worker is in: the status tick asks every 2 s).

A third, **stream**: 100,000 overdue (and nothing later) with each partition's window full, then a new slot every
100 ms (5 s delay, partitions and tiers in turn) for 60 s, the figures asked every 2 s: the median of those calls
but the first. Each call moves the few slots that came due since the last, whatever is overdue behind them.

``--base`` may be given more than once (e.g. the walk and an earlier version of the kept figures).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PARTITIONS = 8
TIERS = ("5m", "30m")
FUTURE = 100_000
OVERDUE = (0, 1_000, 100_000)
HOUR_MS = 3_600_000
NOW = 1_700_000_000_000
CALLS = 21
SCRAPE_MS = 250


def load_base(commit: str, index: int = 0) -> ModuleType:
    """``rebound/schedule.py`` as it was at ``commit``, as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{commit}:rebound/schedule.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="schedule-base-")) / f"schedule_base{index}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"schedule_base{index}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"schedule_base{index}"] = module
    spec.loader.exec_module(module)
    return module


def slots(module: ModuleType, overdue: int) -> dict[int, list[Any]]:
    rng = random.Random(overdue)
    per_partition: dict[int, list[Any]] = {partition: [] for partition in range(PARTITIONS)}
    for number in range(FUTURE + overdue):
        partition, tier = number % PARTITIONS, TIERS[(number // PARTITIONS) % len(TIERS)]
        due = NOW - rng.randrange(HOUR_MS) if number >= FUTURE else NOW + 1 + rng.randrange(HOUR_MS)
        per_partition[partition].append(module.Slot(due, b"k%d" % number, f"items/{partition}/{number}", 1, tier))
    return per_partition


def measure(module: ModuleType, parked: dict[int, list[Any]], full: bool) -> tuple[float, float, float]:
    """(first call, median of the next 20, the adoptions before them) in microseconds."""
    schedule = module.ReleaseSchedule()
    copies = {partition: list(entries) for partition, entries in parked.items()}
    started = time.perf_counter_ns()
    for partition, entries in copies.items():
        schedule.adopt(partition, entries)
    adopted = (time.perf_counter_ns() - started) / 1000
    if full:
        schedule.pop_due(NOW, limit=10**9)
    timings = []
    for call in range(CALLS):
        now = NOW + call * SCRAPE_MS
        started = time.perf_counter_ns()
        schedule.tier_stats(now)
        timings.append((time.perf_counter_ns() - started) / 1000)
    return timings[0], statistics.median(timings[1:]), adopted


def overdue_only(module: ModuleType, overdue: int) -> dict[int, list[Any]]:
    rng = random.Random(overdue)
    return {
        partition: [
            module.Slot(NOW - 1 - rng.randrange(HOUR_MS), b"k%d" % n, f"items/{partition}/{n}", 1, TIERS[n % 2])
            for n in range(overdue // PARTITIONS)
        ]
        for partition in range(PARTITIONS)
    }


def measure_stream(module: ModuleType, parked: dict[int, list[Any]]) -> float:
    """The median ``tier_stats`` call, but the first, under a stream of new slots (see the module's doc), in µs."""
    schedule = module.ReleaseSchedule()
    for partition, entries in parked.items():
        schedule.adopt(partition, list(entries))
    schedule.pop_due(NOW, limit=10**9)
    timings = []
    for step in range(600):  # 60 s of 100 ms steps
        now = NOW + step * 100
        partition = step % PARTITIONS
        schedule.add(
            partition, module.Slot(now + 5_000, b"s%d" % step, f"items/{partition}/s{step}", 1, TIERS[step % 2])
        )
        if step % 20 == 0:
            started = time.perf_counter_ns()
            schedule.tier_stats(now)
            timings.append((time.perf_counter_ns() - started) / 1000)
    return statistics.median(timings[1:])


def measure_pop(module: ModuleType, parked: dict[int, list[Any]], figures_first: bool) -> float:
    """``pop_due`` of everything due, in microseconds."""
    schedule = module.ReleaseSchedule()
    for partition, entries in parked.items():
        schedule.adopt(partition, list(entries))
    if figures_first:
        schedule.tier_stats(NOW)
    started = time.perf_counter_ns()
    sent = schedule.pop_due(NOW)
    elapsed = (time.perf_counter_ns() - started) / 1000
    assert len(sent) == sum(1 for entries in parked.values() for slot in entries if slot.due_at_ms <= NOW)
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base", action="append", default=[], help="also time rebound/schedule.py of this commit, interleaved"
    )
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    import rebound.schedule as current

    variants = [(f"base {base}", load_base(base, index)) for index, base in enumerate(args.base)]
    variants.append(("this tree", current))
    print(f"load average at start: {os.getloadavg()}; {args.rounds} rounds, interleaved", flush=True)
    results: dict[tuple[str, int, bool], list[tuple[float, float, float]]] = {}
    for overdue in OVERDUE:
        parked = {name: slots(module, overdue) for name, module in variants}
        for _ in range(args.rounds):
            for full in (False, True):
                for name, module in variants:
                    results.setdefault((name, overdue, full), []).append(measure(module, parked[name], full))
    popped: dict[tuple[str, bool], list[float]] = {}
    parked = {name: slots(module, 1_000) for name, module in variants}
    for _ in range(args.rounds):
        for figures_first in (False, True):
            for name, module in variants:
                popped.setdefault((name, figures_first), []).append(measure_pop(module, parked[name], figures_first))
    streamed: dict[str, list[float]] = {}
    parked = {name: overdue_only(module, 100_000) for name, module in variants}
    for _ in range(args.rounds):
        for name, module in variants:
            streamed.setdefault(name, []).append(measure_stream(module, parked[name]))
    print(f"load average at end: {os.getloadavg()}")
    print("| variant | overdue | state | steady (median of 20 calls) | first call | adopting the 8 partitions |")
    print("|---|---|---|---|---|---|")
    for (name, overdue, full), runs in results.items():
        first, steady, adopted = ([run[index] for run in runs] for index in range(3))
        state = "windows full" if full else "waiting"
        print(f"| {name} | {overdue:,} | {state} | {_spread(steady)} | {_spread(first)} | {_spread(adopted)} |")
    print()
    print("| pop_due of 1,000 due, 100,000 parked | right after adoption | after the figures once |")
    print("|---|---|---|")
    for name, _ in variants:
        print(f"| {name} | {_spread(popped[(name, False)])} | {_spread(popped[(name, True)])} |")

    print()
    print("| stream: 100,000 overdue, windows full, a new slot every 100 ms, figures every 2 s | median call |")
    print("|---|---|")
    for name, _ in variants:
        print(f"| {name} | {_spread(streamed[name])} |")


def _spread(values: list[float]) -> str:
    return f"{_us(statistics.median(values))} [{_us(min(values))}-{_us(max(values))}]"


def _us(value: float) -> str:
    return f"{value / 1000:.2f} ms" if value >= 1000 else f"{value:.0f} µs"


if __name__ == "__main__":
    main()
