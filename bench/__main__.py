"""``python -m bench [scenario ...] [--messages N] [--out bench/results] [--quick]``.

Each scenario gets a fresh embedded broker (stopped afterwards) and a scratch directory for worker data and logs;
its figures go to ``<out>/<scenario>.json`` and ``<out>/<scenario>.png``, and a table is printed at the end.
Without matplotlib (``make demo``'s install) the JSON and the table are still written; only the charts are skipped.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import charts
from bench.common import fresh_broker, machine, write_result
from bench.scenarios.base import Context

SCENARIOS = {
    "healthy-throughput": "bench.scenarios.throughput",
    "head-of-line": "bench.scenarios.head_of_line",
    "release-lag": "bench.scenarios.release_lag",
    "parked-memory": "bench.scenarios.parked_memory",
    "mixed-delays": "bench.scenarios.mixed_delays",
    "long-delay": "bench.scenarios.long_delay",
    "concurrency": "bench.scenarios.concurrency",
    "noop-ratio": "bench.scenarios.noop_ratio",
    "key-order": "bench.scenarios.key_order",
    "breaker-outage": "bench.scenarios.breaker_outage",
    "hot-key": "bench.scenarios.hot_key",
    "recovery": "bench.scenarios.recovery",
    "scale-parked": "bench.scenarios.scale_parked",
    "release-lateness": "bench.scenarios.release_lateness",
    "spark-read": "bench.scenarios.spark_read",
    "rebalance-memory": "bench.scenarios.rebalance_memory",
    "park-rate": "bench.scenarios.park_rate",
    "release-burst": "bench.scenarios.release_burst",
    "failure-path": "bench.scenarios.failure_path",
    "failure-mixed": "bench.scenarios.failure_mixed",
    "http-adaptive": "bench.scenarios.http_adaptive",
    "http-overhead": "bench.scenarios.http_overhead",
}


def run_scenario(name: str, ctx: Context, out: Path) -> dict[str, Any]:
    module = importlib.import_module(SCENARIOS[name])
    started = time.monotonic()
    facts = machine()
    with fresh_broker(ctx.root) as broker:
        figures = module.run(ctx, broker)
    payload = {
        "scenario": name,
        "quick": ctx.quick,
        "machine": facts,
        "duration_s": round(time.monotonic() - started, 1),
        **figures,
    }
    write_result(out, name, payload)
    chart(name, payload, out)
    return payload


def chart(name: str, payload: dict[str, Any], out: Path) -> None:
    if not charts.UNAVAILABLE:
        charts.draw(name, payload, out / f"{name}.png")


def note_missing_charts() -> None:
    if charts.UNAVAILABLE:
        print(f"charts skipped: {charts.UNAVAILABLE}; `make install` installs it", file=sys.stderr, flush=True)


def redraw(names: list[str], out: Path) -> int:
    """Charts are a view of the JSON: redrawing them never needs a new run."""
    results = {}
    for name in names:
        path = out / f"{name}.json"
        if path.exists():
            results[name] = json.loads(path.read_text())
            chart(name, results[name], out)
    print(charts.table(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("scenarios", nargs="*", metavar="scenario", help="any of: " + ", ".join(SCENARIOS))
    parser.add_argument("--messages", type=int, default=None, help="override each scenario's message count")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of about 20 s per scenario")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory (worker logs, call logs)")
    parser.add_argument("--redraw", action="store_true", help="only redraw the charts and table from <out>/*.json")
    args = parser.parse_args(argv)
    names = args.scenarios or list(SCENARIOS)
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    note_missing_charts()
    if args.redraw:
        return redraw(names, args.out)
    root = Path(tempfile.mkdtemp(prefix="rebound-bench-"))
    results: dict[str, dict[str, Any]] = {}
    failed = False
    try:
        for name in names:
            print(f"== {name}", flush=True)
            ctx = Context(root=root / name, quick=args.quick, messages=args.messages)
            ctx.root.mkdir(parents=True)
            try:
                results[name] = run_scenario(name, ctx, args.out)
            except Exception as exc:  # one broken scenario must not hide the others' figures
                failed = True
                print(f"  {name} FAILED: {exc}", file=sys.stderr, flush=True)
    finally:
        if args.keep:
            print(f"scratch kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(charts.table(results))
    verdicts = [r.get("verdict") for r in results.values() if r.get("verdict")]
    failed = failed or any(v != "ok" for v in verdicts)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
