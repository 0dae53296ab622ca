"""``redrive``: send chosen failed-topic records back to their original topic, safely.

* Dry run by default: the plan (every matching record and what would happen to it) and the counts are printed and
  written; ``--execute`` sends.
* The target is the ``rebound.original-topic`` header, and only when it is one of the configured main topics: a
  forged or stale header can never make the pipeline write into a topic Rebound does not serve.
* Key and value are the original bytes; ``rebound.*`` headers are removed so the main agent sees a fresh message,
  user headers are kept, and ``rebound.redrive-count`` is set to the previous count + 1. Records already redriven
  ``--max-redrives`` times are skipped (a poison message must not loop forever).
* The ledger (see :mod:`pipeline.ledger`) makes a second run send nothing twice; each run appends an audit row.
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import json
import re
import socket
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.common import JobConfig, read_failed
from pipeline.ledger import append_audit, append_ledger, ledger_keys

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

REDRIVE_COUNT = "rebound.redrive-count"
PREFIX = "rebound."


class RowLike(Protocol):
    """A failed-topic row as :func:`plan` reads it: a Spark ``Row`` or a plain dict, indexed by column name."""

    def __getitem__(self, name: str, /) -> Any: ...


SEND = "send"
SKIP_NOT_MAIN = "skipped_not_a_main_topic"
SKIP_DONE = "skipped_already_redriven"
SKIP_CAP = "skipped_max_redrives"


def parse_time(text: str) -> dt.datetime:
    """ISO-8601 (``2024-05-01T10:00``, naive means UTC) or epoch milliseconds."""
    if text.isdigit():
        return dt.datetime.fromtimestamp(int(text) / 1000, tz=dt.UTC)
    value = dt.datetime.fromisoformat(text)
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reason", action="append", help="only these rebound.reason values (repeatable)")
    parser.add_argument("--error-class", action="append", help="only these error classes (repeatable)")
    parser.add_argument("--original-topic", action="append", help="only records from these original topics")
    parser.add_argument("--since", type=parse_time, help="failed-topic record time >= this (ISO-8601 UTC or epoch ms)")
    parser.add_argument("--until", type=parse_time, help="failed-topic record time < this")
    parser.add_argument("--key-pattern", help="regular expression searched in the key (UTF-8 text)")
    parser.add_argument("--max-records", type=int, default=None, help="send at most this many (oldest first)")
    parser.add_argument(
        "--max-redrives",
        type=int,
        default=3,
        help="skip records already redriven this many times (default %(default)s)",
    )
    parser.add_argument("--execute", action="store_true", help="really send (default: dry run)")
    parser.add_argument("--rate", type=float, default=100.0, help="records per second when executing")


def outgoing_headers(headers: list[tuple[str, bytes]] | None, previous_count: int) -> list[tuple[str, bytes]]:
    """User headers kept in order, every ``rebound.*`` header dropped, the redrive count set to previous + 1."""
    own = [(k, v) for k, v in (headers or []) if not k.startswith(PREFIX)]
    return [*own, (REDRIVE_COUNT, str(previous_count + 1).encode("ascii"))]


def select(failed: DataFrame, args: argparse.Namespace) -> DataFrame:
    from pyspark.sql import functions as F

    df = failed
    if args.reason:
        df = df.where(F.col("reason").isin(*args.reason))
    if args.error_class:
        df = df.where(F.col("error_class").isin(*args.error_class))
    if args.original_topic:
        df = df.where(F.col("original_topic").isin(*args.original_topic))
    if args.since:
        df = df.where(F.col("timestamp") >= F.lit(args.since))
    if args.until:
        df = df.where(F.col("timestamp") < F.lit(args.until))
    if args.key_pattern:
        re.compile(args.key_pattern)
        df = df.where(F.col("key_text").rlike(args.key_pattern))
    return df.orderBy("timestamp", "topic", "partition", "offset")


def plan(
    rows: Sequence[RowLike], cfg: JobConfig, done: set[tuple[str, int, int]], max_redrives: int, max_records: int | None
) -> list[dict[str, Any]]:
    """Decide, record by record, what happens; ``max_records`` limits how many get :data:`SEND`."""
    main = set(cfg.main_topics)
    out = []
    sends = 0
    for r in rows:
        ident = (r["topic"], int(r["partition"]), int(r["offset"]))
        if ident in done:
            action = SKIP_DONE
        elif r["original_topic"] not in main:
            action = SKIP_NOT_MAIN
        elif int(r["redrive_count"]) >= max_redrives:
            action = SKIP_CAP
        elif max_records is not None and sends >= max_records:
            continue
        else:
            action = SEND
            sends += 1
        out.append(
            {
                "row": r,
                "action": action,
                "failed_topic": ident[0],
                "failed_partition": ident[1],
                "failed_offset": ident[2],
            }
        )
    return out


def _progress(done: int, total: int, started: float) -> None:
    width = 30
    filled = int(width * done / total) if total else width
    rate = done / max(time.monotonic() - started, 1e-6)
    sys.stderr.write(f"\rredrive [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {rate:.1f}/s")
    sys.stderr.flush()


def execute(items: list[dict[str, Any]], cfg: JobConfig, run_id: str, rate: float) -> int:
    from pipeline.kafka_source.client import KafkaWriter

    todo = [i for i in items if i["action"] == SEND]
    interval = 1.0 / rate if rate > 0 else 0.0
    sent = 0
    started = time.monotonic()
    chunk: list[dict[str, Any]] = []
    with KafkaWriter(cfg.bootstrap) as producer:

        def settle() -> None:
            results = producer.flush()
            rows = []
            for item, meta in zip(chunk, results, strict=True):
                rows.append(
                    {
                        "failed_topic": item["failed_topic"],
                        "failed_partition": item["failed_partition"],
                        "failed_offset": item["failed_offset"],
                        "target_topic": item["row"]["original_topic"],
                        "target_partition": meta.partition,
                        "target_offset": meta.offset,
                        "redrive_count": int(item["row"]["redrive_count"]) + 1,
                        "run_id": run_id,
                        "sent_at": dt.datetime.now(dt.UTC).isoformat(),
                    }
                )
            append_ledger(cfg.out, rows)
            chunk.clear()

        for n, item in enumerate(todo, 1):
            due = started + (n - 1) * interval
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            row = item["row"]
            headers = [(h["key"], bytes(h["value"]) if h["value"] is not None else b"") for h in row["headers"] or []]
            producer.send(
                row["original_topic"],
                value=row["value"],
                key=row["key"],
                headers=outgoing_headers(headers, int(row["redrive_count"])),
            )
            chunk.append(item)
            sent += 1
            if len(chunk) >= 100:
                settle()
            _progress(sent, len(todo), started)
        settle()
    if todo:
        sys.stderr.write("\n")
    return sent


def run(args: argparse.Namespace, cfg: JobConfig, spark: SparkSession) -> dict[str, Any]:
    run_id = f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"
    started_at = dt.datetime.now(dt.UTC).isoformat()
    rows = select(read_failed(spark, cfg), args).collect()
    items = plan(rows, cfg, ledger_keys(cfg.out), args.max_redrives, args.max_records)
    counts = Counter(i["action"] for i in items)
    plan_dir = cfg.out / "redrive" / "plans"
    plan_dir.mkdir(parents=True, exist_ok=True)
    plan_file = plan_dir / f"{run_id}.jsonl"
    with plan_file.open("w", encoding="utf-8") as fh:
        for i in items:
            r = i["row"]
            fh.write(
                json.dumps(
                    {
                        "failed_topic": i["failed_topic"],
                        "failed_partition": i["failed_partition"],
                        "failed_offset": i["failed_offset"],
                        "action": i["action"],
                        "target_topic": r["original_topic"],
                        "key": r["key_text"],
                        "reason": r["reason"],
                        "error_class": r["error_class"],
                        "redrive_count": r["redrive_count"],
                        "failed_at": r["timestamp"],
                    },
                    default=str,
                )
                + "\n"
            )
    sent = 0
    if args.execute:
        sent = execute(items, cfg, run_id, args.rate)
    filters = {
        k: getattr(args, k)
        for k in (
            "reason",
            "error_class",
            "original_topic",
            "since",
            "until",
            "key_pattern",
            "max_records",
            "max_redrives",
            "rate",
        )
    }
    audit = {
        "run_id": run_id,
        "user": getpass.getuser(),
        "host": socket.gethostname(),
        "started_at": started_at,
        "finished_at": dt.datetime.now(dt.UTC).isoformat(),
        "dry_run": not args.execute,
        "filters": filters,
        "matched": len(items),
        "counts": dict(counts),
        "sent": sent,
        "plan": str(plan_file),
        "main_topics": list(cfg.main_topics),
    }
    append_audit(cfg.out, audit)
    mode = "EXECUTED" if args.execute else "DRY RUN (add --execute to send)"
    print(
        f"redrive {mode}: matched {len(items)}; "
        + ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
        + f"; sent {sent}; plan {plan_file}"
    )
    return audit
