"""A burst of retries due at the same instant, released by two source trees in turn (issue 23: release requests
several to a record).

``release-burst``'s unpaced worker alone, ``count`` messages parked in a ``1h`` tier over 4 partitions and all due at
one ``T0``, run from each tree's own code (``cwd`` = the tree, as ``BENCH_FAILURE_TREES`` does), the trees interleaved
round by round. Per run: the worker's CPU (user + system from ``/proc``) from just before ``T0`` until every retry has
been called, per release; the span from the first to the last call; lateness percentiles; the most calls in one
second; calls before due (must be 0).

    python -m bench.release_burst_ab --trees /tmp/base,/tmp/head --rounds 3 --count 5000 --out /tmp/burst.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TIER = "1h"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(count: int) -> dict[str, Any]:
    """One run from the tree in the current directory (imported from it: that tree's bench and product code)."""
    sys.path.insert(0, os.getcwd())
    from bench.common import fresh_broker, now_ms, produce_placed, rebound_worker, running, wait_until
    from bench.scenarios.base import PRODUCTION_BATCH, new_topic
    from bench.scenarios.parked_memory import ready
    from bench.scenarios.release_burst import succeeded, summarise
    from bench.scenarios.release_lateness import await_parked, tier_records
    from rebound.topics import tier_topic

    root = Path(tempfile.mkdtemp(prefix="burst-ab-"))
    with fresh_broker(root) as broker:
        topic = new_topic(broker, "burst")
        calls = root / "calls.jsonl"
        worker = rebound_worker(
            broker,
            root,
            "w",
            REBOUND_APP_ID=topic,
            REBOUND_MAIN_TOPICS=topic,
            REBOUND_HANDLER="bench.handlers:scripted",
            BENCH_CALLS=str(calls),
            REBOUND_RETRY_SEQUENCE=TIER,
            **PRODUCTION_BATCH,
        )
        with running(worker):
            if not wait_until(lambda: ready(worker), 90, check=[worker]):
                raise RuntimeError(f"worker never became ready:\n{worker.log_tail()}")
            t0 = now_ms() + int((count / 300 + 8) * 1000)
            records = tier_records(topic, 0, count, lambda i: t0, prefix="s")
            asyncio.run(produce_placed(broker.bootstrap, tier_topic(topic, TIER), records))
            await_parked(worker, count)
            slack_s = (t0 - now_ms()) / 1000
            time.sleep(max(0.0, slack_s - 0.3))
            before = cpu_seconds(worker.pid)
            wait_until(lambda: succeeded(calls) >= count, 120, every=0.1)
            after = cpu_seconds(worker.pid)
            time.sleep(1.0)
        summary = summarise(calls, t0, count, {"slack_s": round(slack_s, 1)})
    summary = summary.get("summary", summary)
    return {
        "tree": os.getcwd(),
        "load_average": os.getloadavg()[0],
        "cpu_us_per_release": round((after - before) * 1e6 / count, 1),
        "span_s": summary.get("release_span_s"),
        "lateness_ms": summary.get("lateness_ms"),
        "max_calls_in_1s": summary.get("max_calls_in_1s"),
        "released": summary.get("released"),
        "early": summary.get("early"),
        "slack_s": round(slack_s, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.release_burst_ab", description=__doc__)
    parser.add_argument("--trees", required=True, help="comma-separated source trees, each with .venv")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=5000)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.count)))
        return 0
    trees = [str(Path(tree).resolve()) for tree in args.trees.split(",")]
    runs: list[dict[str, Any]] = []
    for round_number in range(args.rounds):
        for tree in trees:
            me = Path(__file__).resolve()
            done = subprocess.run(
                [sys.executable, str(me), "--one", "--count", str(args.count), "--trees", tree, "--out", "-"],
                cwd=tree,
                capture_output=True,
                text=True,
                check=True,
            )
            run = json.loads(done.stdout.strip().splitlines()[-1]) | {"round": round_number + 1}
            runs.append(run)
            print(json.dumps(run), flush=True)
    medians = {
        tree: {
            figure: statistics.median(r[figure] for r in runs if r["tree"] == tree)
            for figure in ("cpu_us_per_release", "span_s", "max_calls_in_1s")
        }
        for tree in trees
    }
    args.out.write_text(json.dumps({"count": args.count, "runs": runs, "medians": medians}, indent=2))
    print(json.dumps(medians, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
