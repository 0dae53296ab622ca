"""``python -m bench.profile_hot_path``: where a healthy message's time goes in a Rebound worker.

A backlog of no-op messages is drained by one worker while ``py-spy`` samples it (wall-clock samples of the worker's
threads, idle ones left out). Each sample is put in the first bucket whose marker appears in its stack, innermost frame
first, so the table answers "what was the worker doing": running the handler machinery, emitting the attempt event,
dispatching, Faust's consumer and stream plumbing, aiokafka's fetching and producing, or the event loop itself.
Writes ``bench/results/hot-path-profile.json`` and the collapsed stacks next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import follow_topic, fresh_broker, machine, produce_batch, rebound_worker, running, write_result
from bench.scenarios.base import PARTITIONS, PRODUCTION_BATCH, new_topic

# (bucket, markers): a sample goes to the first bucket one of whose markers is in one of its frames, innermost first.
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("attempt event (JSON + send)", ("emit_attempt",)),
    ("handler call (task, timeout, RetryEvent)", ("call_handler", "_guarded_call", "run_attempt")),
    ("dispatcher (lanes, acks, tasks)", ("agents/dispatcher.py", "rebound/dispatch.py")),
    ("main agent (provenance, headers)", ("agents/main.py", "agents/records.py")),
    ("Rebound's consumer (read cursors)", ("app/consumer.py", "rebound/read_cursors.py")),
    ("aiokafka producer", ("aiokafka/producer",)),
    ("aiokafka consumer and fetcher", ("aiokafka/consumer", "aiokafka/record", "aiokafka/conn")),
    ("Faust streams, topics and consumer", ("faust/",)),
    ("mode and asyncio event loop", ("mode/", "asyncio/")),
]


# Rebound's consumer awaits Faust's hand-over to the streams in its own frame: what runs inside that call is Faust's.
HANDS_OVER_TO = ("faust/", "mode/")


def bucket_of(frames: list[str]) -> str:
    for name, markers in BUCKETS:
        for depth in range(len(frames) - 1, -1, -1):
            if any(marker in frames[depth] for marker in markers):
                inner = frames[depth + 1 :]
                if name.startswith("Rebound's consumer") and any(m in f for f in inner for m in HANDS_OVER_TO):
                    break  # Faust's work under Rebound's consumer: let a later bucket have it
                return name
    return "other"


def summarise(raw: Path) -> dict[str, Any]:
    """Collapsed stacks (``frame;frame;... count``) to shares per bucket."""
    counts: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        counts[bucket_of(stack.split(";"))] += count
        total += count
    return {
        "samples": total,
        "buckets": [
            {"bucket": name, "samples": counts[name], "share": round(counts[name] / max(1, total), 3)}
            for name, _ in [*BUCKETS, ("other", ())]
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--env", action="append", default=[], help="extra worker setting NAME=VALUE")
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if py_spy is None:
        raise SystemExit("py-spy is not installed (pip install py-spy)")
    extra = dict(item.split("=", 1) for item in args.env)
    root = Path(tempfile.mkdtemp(prefix="rebound-profile-"))
    facts = machine()
    with fresh_broker(root) as broker:
        topic = new_topic(broker, "profile")
        records = [(f"k{i}".encode(), json.dumps({"i": i}).encode()) for i in range(args.messages)]
        worker = rebound_worker(
            broker,
            root,
            "profile",
            REBOUND_APP_ID=topic,
            REBOUND_MAIN_TOPICS=topic,
            REBOUND_RETRY_SEQUENCE="1m",
            REBOUND_HANDLER="bench.handlers:noop",
            **PRODUCTION_BATCH,
            **extra,
        )
        with running(worker):
            # Warm up: the group forms and every partition flows before the backlog is produced.
            asyncio.run(produce_batch(broker.bootstrap, topic, [(b"warmup", b"{}")] * PARTITIONS))
            asyncio.run(follow_topic(broker.bootstrap, f"{topic}.attempts", PARTITIONS, worker, 120))
            asyncio.run(produce_batch(broker.bootstrap, topic, records))
            raw = args.out / "hot-path-profile.txt"
            args.out.mkdir(parents=True, exist_ok=True)
            spy = subprocess.Popen(
                [
                    py_spy,
                    "record",
                    "--pid",
                    str(worker.pid),
                    "--format",
                    "raw",
                    "--rate",
                    str(args.rate),
                    "--output",
                    str(raw),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            _, took = asyncio.run(
                follow_topic(broker.bootstrap, f"{topic}.attempts", PARTITIONS + args.messages, worker, 300)
            )
            spy.send_signal(2)  # SIGINT: py-spy writes what it sampled and exits
            spy.wait(30)
    profile = summarise(raw)
    payload = {
        "scenario": "hot-path-profile",
        "machine": facts,
        "params": {"messages": args.messages, "partitions": PARTITIONS, "rate_hz": args.rate, "settings": extra},
        "drain_s": round(took, 2),
        "messages_per_s": round(args.messages / took, 1),
        **profile,
    }
    write_result(args.out, "hot-path-profile", payload)
    width = max(len(name) for name, _ in BUCKETS)
    print(f"drained {args.messages} in {took:.1f}s ({payload['messages_per_s']} msg/s), {profile['samples']} samples")
    for row in profile["buckets"]:
        print(f"  {row['bucket']:<{width}}  {row['share'] * 100:5.1f}%")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
