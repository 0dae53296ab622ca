"""``redrive``: send chosen failed-topic records back to their original topic, safely.

* Dry run by default: the plan (every matching record and what would happen to it, with a digest of its key, value
  and headers) and the counts are printed and written; ``--execute`` sends. ``--execute --plan FILE`` sends exactly
  the ``send`` records of a reviewed plan, after checking that each is still on its failed topic unchanged.
* The target is the ``rebound.original-topic`` header, and only when it is one of the configured main topics: a
  forged or stale header can never make the pipeline write into a topic Rebound does not serve.
* Key and value are the original bytes; ``rebound.*`` headers are removed so the main agent sees a fresh message,
  user headers are kept, and ``rebound.redrive-count`` is set to the previous count + 1. Records already redriven
  ``--max-redrives`` times are skipped (a poison message must not loop forever).
* Never a tombstone by accident: a ``too-large`` or ``payload-missing`` dead letter (its value was left out or
  lost) is never sent, a record without a value only with ``--include-empty-values`` (and never without a key
  either: Kafka refuses a record with neither), an ``undecodable`` one only with ``--include-undecodable``.
* Only from its own failed topic: a dead letter on ``items.failed`` goes back to ``items`` only, whatever other main
  topic its header names (as ``rebound.replay`` checks).
* Once per original message: of several dead letters of one message (``rebound.original-topic/-partition/-offset``;
  one per consumer group, or a dead letter written twice) only the newest goes; a message an earlier run already
  redrove is skipped (see :func:`decide` for the rule), using the ledger (:mod:`pipeline.ledger`).
* One executing run per ``--out`` (a lock), and an audit record when a run starts and when it ends or fails.
* Filtering, the ledger anti-join, the de-duplication and ``--max-records`` run in Spark; only the resulting records
  come to the driver, one partition at a time, and the plan is written as they arrive.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import getpass
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from pipeline.common import JobConfig, parse_time, read_failed
from pipeline.ledger import (
    acquire_lock,
    holds_lock,
    lock_path,
    mark_lock_incomplete,
    read_ledger,
    release_lock,
    write_audit,
    write_ledger_chunk,
)
from pipeline.storage import Location

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, Row, SparkSession

    from pipeline.kafka_source.client import KafkaWriter

REDRIVE_COUNT = "rebound.redrive-count"
NULL_VALUE = "rebound.null-value"  # mirrors rebound.headers.NULL_VALUE: b"" standing for a null value
PREFIX = "rebound."
VALUE_LEFT_OUT = ("too-large", "payload-missing")  # mirrors rebound.routing.Reason: the dead letter has no payload
UNDECODABLE = "undecodable"
FAILED_SUFFIX = ".failed"  # mirrors rebound.topics.failed_topic

SEND = "send"
SKIP_NOT_MAIN = "skipped_not_a_main_topic"
SKIP_OTHER_FAILED_TOPIC = "skipped_not_from_its_failed_topic"
SKIP_DONE = "skipped_already_redriven"
SKIP_CAP = "skipped_max_redrives"
SKIP_VALUE_LEFT_OUT = "skipped_value_left_out"
SKIP_EMPTY = "skipped_empty_value"
SKIP_NO_KEY_NO_VALUE = "skipped_null_key_and_value"
SKIP_UNDECODABLE = "skipped_undecodable"
SKIP_DUPLICATE = "skipped_duplicate_of_message"
SKIP_MAX_RECORDS = "skipped_max_records"
GONE = "gone"
"""Counted, not a plan action: a record of a reviewed plan that passed the digest check but was no longer on its
failed topic when it was read again to be sent (retention), so it was not sent."""

CHUNK = 100
"""Records per acknowledged chunk, i.e. per ledger object: the most a crash can make a later run send again."""

IDS = ["topic", "partition", "offset"]
ORDER = ["timestamp", "topic", "partition", "offset"]
FILTER_FLAGS = ("reason", "error_class", "original_topic", "since", "until", "key_pattern", "max_records")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default_out = parser.get_default("out")
    if isinstance(default_out, str):
        parser.set_defaults(out=_DefaultOut(default_out))
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
    parser.add_argument(
        "--include-empty-values",
        action="store_true",
        help="also send dead letters without a value: sent back they are tombstones, which delete the key on a "
        "compacted topic (too-large and payload-missing dead letters are never sent: their value was left out or "
        "lost; nor a record with neither key nor value)",
    )
    parser.add_argument(
        "--include-undecodable",
        action="store_true",
        help="also send reason=undecodable dead letters (only useful once the consumer can decode them)",
    )
    parser.add_argument(
        "--plan",
        metavar="FILE",
        help="send exactly the 'send' records of this plan (from an earlier dry run, reviewed), re-read and checked "
        "against the plan's digests; filters are not allowed with it",
    )
    parser.add_argument("--execute", action="store_true", help="really send (default: dry run)")
    parser.add_argument("--rate", type=float, default=100.0, help="records per second when executing")
    parser.add_argument(
        "--break-lock",
        action="store_true",
        help="remove the run lock left by a run that died (check first that it is gone: the refusal names it)",
    )


def outgoing_headers(
    headers: list[tuple[str, bytes | None]] | None, previous_count: int
) -> list[tuple[str, bytes | None]]:
    """User headers kept in order (a null value stays null: Kafka allows it, Java producers send it), every
    ``rebound.*`` header dropped, the redrive count set to previous + 1."""
    own = [(k, v) for k, v in (headers or []) if not k.startswith(PREFIX)]
    return [*own, (REDRIVE_COUNT, str(previous_count + 1).encode("ascii"))]


# --- Spark: what each record is, and what happens to it ------------------------------------------------------------


def identify(failed: DataFrame) -> DataFrame:
    """Add ``message`` (which original message a dead letter stands for), ``has_value`` and ``digest``.

    ``message`` is the original ``(topic, partition, offset)`` from the headers, or the failed record itself when a
    header is missing (it can then only be matched with itself). ``digest`` covers key, value and every header, so
    a plan's record can be recognised, or found changed, when the plan is executed later.
    """
    from pyspark.sql import functions as F

    original_known = (
        F.col("original_topic").isNotNull()
        & F.col("original_partition").isNotNull()
        & F.col("original_offset").isNotNull()
    )

    def key_of(kind: str, *columns: str) -> Column:
        return F.to_json(F.array(F.lit(kind), *(F.col(c).cast("string") for c in columns)))

    null_marker = F.exists(
        F.coalesce(F.col("headers"), F.array()),
        lambda h: (h["key"] == NULL_VALUE) & (h["value"].cast("string") == "1"),
    )
    headers_b64 = F.transform("headers", lambda h: F.struct(h["key"].alias("k"), F.base64(h["value"]).alias("v")))
    return failed.select(
        "*",
        F.when(original_known, key_of("original", "original_topic", "original_partition", "original_offset"))
        .otherwise(key_of("failed", "topic", "partition", "offset"))
        .alias("message"),
        (~(F.col("value").isNull() | ((F.length("value") == 0) & null_marker))).alias("has_value"),
        F.sha2(
            F.to_json(F.struct(F.base64("key").alias("k"), F.base64("value").alias("v"), headers_b64.alias("h"))),
            256,
        ).alias("digest"),
    )


def select(failed: DataFrame, args: argparse.Namespace) -> DataFrame:
    """The operator's filters (the time window is applied when reading, see :func:`pipeline.common.read_failed`)."""
    from pyspark.sql import functions as F

    df = failed
    if args.reason:
        df = df.where(F.col("reason").isin(*args.reason))
    if args.error_class:
        df = df.where(F.col("error_class").isin(*args.error_class))
    if args.original_topic:
        df = df.where(F.col("original_topic").isin(*args.original_topic))
    if args.key_pattern:
        try:
            re.compile(args.key_pattern)
        except re.error as exc:
            raise SystemExit(f"--key-pattern: not a regular expression: {exc}") from None
        df = df.where(F.col("key_text").rlike(args.key_pattern))
    return df


def ledger_frames(spark: SparkSession, ledger_rows: list[dict[str, Any]]) -> tuple[DataFrame, DataFrame]:
    """The ledger as two small tables: failed records already sent, and per message the highest redrive count a
    sent copy carried (rows of the older ledger layout have no ``message`` and only count as failed records)."""
    from pyspark.sql import functions as F

    records = spark.createDataFrame(
        sorted({(r["failed_topic"], int(r["failed_partition"]), int(r["failed_offset"])) for r in ledger_rows}),
        "topic string, partition int, offset long",
    ).withColumn("_sent_record", F.lit(True))
    counts: dict[str, int] = {}
    for r in ledger_rows:
        if r.get("message"):
            counts[r["message"]] = max(counts.get(r["message"], 0), int(r.get("redrive_count") or 0))
    messages = spark.createDataFrame(sorted(counts.items()), "message string, _sent_count int")
    return records, messages


def with_already_redriven(candidates: DataFrame, ledger_rows: list[dict[str, Any]], spark: SparkSession) -> DataFrame:
    """``candidates`` (from :func:`identify`) with ``already_redriven``: the rule of :func:`decide`, shared with
    ``inventory`` so that both count a message the same way."""
    from pyspark.sql import functions as F

    sent_records, sent_messages = ledger_frames(spark, ledger_rows)
    df = candidates.join(F.broadcast(sent_records), IDS, "left").join(F.broadcast(sent_messages), "message", "left")
    return df.withColumn(
        "already_redriven",
        F.coalesce(F.col("_sent_record"), F.lit(False))
        | (F.col("_sent_count").isNotNull() & (F.col("redrive_count") < F.col("_sent_count"))),
    )


def decide(
    candidates: DataFrame,
    ledger_rows: list[dict[str, Any]],
    spark: SparkSession,
    *,
    main_topics: Iterable[str],
    max_redrives: int,
    max_records: int | None,
    include_empty_values: bool = False,
    include_undecodable: bool = False,
    reviewed: bool = False,
) -> DataFrame:
    """``candidates`` (from :func:`identify`) with an ``action``; payload columns only on the rows to send.

    First rule that applies: not a main topic; not on that topic's own failed topic; already redriven; value left
    out (``too-large``, ``payload-missing``); neither key nor value; no value; ``undecodable``; redrive cap; an other dead letter of the same message is sent; over ``--max-records``; send.
    ``reviewed`` (a plan being executed) keeps only the checks that depend on the ledger and the configuration; the
    content rules were applied when the plan was made, and the digests prove the content has not changed since.

    Already redriven: the failed record itself is in the ledger, or its message is, unless the dead letter carries
    a redrive count at least as high as the copy that was sent. Every dead letter of one message carries the same
    count (the message's own, which the redrive raised by one), so only a dead letter of the redriven copy can reach
    it: that copy failing again is a new failure to be handled, not a duplicate. (Rebound normally gives such a
    dead letter the copy's own offset as its original, a new message; the count rule also covers a copy that kept
    the original's provenance.) The cap then stops a message coming back for ever.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    df = with_already_redriven(candidates, ledger_rows, spark)
    already = F.col("already_redriven")
    mains = list(main_topics)
    action = (
        F.when(F.col("original_topic").isNull() | ~F.col("original_topic").isin(*mains), SKIP_NOT_MAIN)
        .when(F.col("topic") != F.concat(F.col("original_topic"), F.lit(FAILED_SUFFIX)), SKIP_OTHER_FAILED_TOPIC)
        .when(already, SKIP_DONE)
        .when(F.coalesce(F.col("reason").isin(*VALUE_LEFT_OUT), F.lit(False)), SKIP_VALUE_LEFT_OUT)
        .when(F.col("key").isNull() & ~F.col("has_value"), SKIP_NO_KEY_NO_VALUE)
    )
    if not reviewed:
        if not include_empty_values:
            action = action.when(~F.col("has_value"), SKIP_EMPTY)
        if not include_undecodable:
            action = action.when(F.coalesce(F.col("reason") == UNDECODABLE, F.lit(False)), SKIP_UNDECODABLE)
        action = action.when(F.col("redrive_count") >= max_redrives, SKIP_CAP)
    df = df.withColumn("action", action.otherwise(SEND))

    # the newest sendable dead letter of each message is the one that goes
    newest_first = Window.partitionBy("message").orderBy(
        (F.col("action") == SEND).desc(), *(F.col(c).desc() for c in ORDER)
    )
    df = df.withColumn(
        "action",
        F.when((F.col("action") == SEND) & (F.row_number().over(newest_first) > 1), SKIP_DUPLICATE).otherwise(
            F.col("action")
        ),
    )
    if max_records is not None:
        chosen = (
            df.where(F.col("action") == SEND)
            .orderBy(*ORDER)
            .limit(max(max_records, 0))
            .select(*IDS, F.lit(True).alias("_chosen"))
        )
        df = df.join(chosen, IDS, "left").withColumn(
            "action",
            F.when((F.col("action") == SEND) & F.col("_chosen").isNull(), SKIP_MAX_RECORDS).otherwise(F.col("action")),
        )
    sending = F.col("action") == SEND
    return df.select(
        *IDS,
        "timestamp",
        "action",
        F.when(sending, F.col("key")).alias("key"),
        F.when(sending & F.col("has_value"), F.col("value")).alias("value"),
        F.when(sending, F.col("headers")).alias("headers"),
        "key_text",
        "reason",
        "error_class",
        "original_topic",
        "original_partition",
        "original_offset",
        "group",
        "redrive_count",
        "message",
        "digest",
    ).orderBy(*ORDER)


# --- plans ---------------------------------------------------------------------------------------------------------


def plan_line(row: Row | dict[str, Any]) -> dict[str, Any]:
    """One line of a plan file: the record, what happens to it, and what a later ``--plan`` run checks."""
    return {
        "failed_topic": row["topic"],
        "failed_partition": row["partition"],
        "failed_offset": row["offset"],
        "action": row["action"],
        "target_topic": row["original_topic"],
        "key": row["key_text"],
        "reason": row["reason"],
        "error_class": row["error_class"],
        "redrive_count": row["redrive_count"],
        "failed_at": row["timestamp"],
        "original_partition": row["original_partition"],
        "original_offset": row["original_offset"],
        "group": row["group"],
        "digest": row["digest"],
    }


def read_plan(location: Location, failed_topics: Iterable[str]) -> list[tuple[str, int, int, str]]:
    """The ``send`` records of a plan file as ``(topic, partition, offset, digest)``, each once; a line that is not
    a plan line, or names a topic that is not one of the configured failed topics, refuses the whole plan."""
    try:
        text = location.read_text()
    except FileNotFoundError:
        raise SystemExit(f"--plan: no such file: {location}") from None
    allowed = set(failed_topics)
    planned: dict[tuple[str, int, int], str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        where = f"--plan: {location} line {number}"
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            raise SystemExit(f"{where} is not JSON") from None
        if not isinstance(line, dict):
            raise SystemExit(f"{where} is not a plan line (a JSON object)")
        if line.get("action") != SEND:
            continue
        if not line.get("digest"):
            raise SystemExit(f"{where} has no digest (a plan from an older version): make a new dry run")
        try:
            topic, partition, offset = line["failed_topic"], int(line["failed_partition"]), int(line["failed_offset"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SystemExit(
                f"{where}: failed_topic, failed_partition and failed_offset must be a name and two integers ({exc!r})"
            ) from None
        if topic not in allowed:
            raise SystemExit(
                f"{where} names {topic!r}, which is not a failed topic of --main-topics ({', '.join(sorted(allowed))})"
            )
        planned[(str(topic), partition, offset)] = str(line["digest"])
    return [(*ids, digest) for ids, digest in planned.items()]


def read_planned_offsets(spark: SparkSession, cfg: JobConfig, entries: list[tuple[str, int, int, str]]) -> DataFrame:
    """Only the offset range of the plan in each of its partitions, not the whole failed topics; a record that
    retention removed meanwhile is skipped by the source (``failOnDataLoss=false``) and then reported as gone."""
    from pipeline.common import failed_columns, kafka_reader

    if not entries:
        return failed_columns(kafka_reader(spark, cfg).option("subscribe", ",".join(cfg.failed_topics)).load()).limit(0)
    ranges: dict[tuple[str, int], tuple[int, int]] = {}
    for topic, partition, offset, _ in entries:
        low, high = ranges.get((topic, partition), (offset, offset))
        ranges[(topic, partition)] = (min(low, offset), max(high, offset))
    assign: dict[str, list[int]] = {}
    starting: dict[str, dict[str, int]] = {}
    ending: dict[str, dict[str, int]] = {}
    for (topic, partition), (low, high) in sorted(ranges.items()):
        assign.setdefault(topic, []).append(partition)
        starting.setdefault(topic, {})[str(partition)] = low
        ending.setdefault(topic, {})[str(partition)] = high + 1
    reader = (
        kafka_reader(spark, cfg)
        .option("assign", json.dumps(assign))
        .option("startingOffsets", json.dumps(starting))
        .option("endingOffsets", json.dumps(ending))
        .option("failOnDataLoss", "false")
    )
    return failed_columns(reader.load())


def reviewed_candidates(spark: SparkSession, cfg: JobConfig, plan_file: Location) -> tuple[DataFrame, int]:
    """The failed records a plan sends, re-read, and how many the plan has; refuses (before anything is sent) if
    one is gone or changed."""
    from pyspark.sql import functions as F

    entries = read_plan(plan_file, cfg.failed_topics)
    planned = spark.createDataFrame(entries, "topic string, partition int, offset long, planned_digest string")
    current = identify(read_planned_offsets(spark, cfg, entries)).join(F.broadcast(planned), IDS, "inner")
    check = planned.join(current.select(*IDS, "digest"), IDS, "left").where(
        F.col("digest").isNull() | (F.col("digest") != F.col("planned_digest"))
    )
    problems = check.orderBy(*IDS).limit(6).collect()
    if problems:
        total = check.count()
        listed = "; ".join(
            f"{p['topic']}[{p['partition']}]@{p['offset']} " + ("is gone" if p["digest"] is None else "has changed")
            for p in problems[:5]
        )
        raise SystemExit(
            f"--plan {plan_file}: {total} planned record(s) no longer match the failed topics ({listed}"
            f"{'; ...' if total > 5 else ''}); nothing was sent. Make and review a new dry run."
        )
    return current.drop("planned_digest"), len(entries)


# --- sending -------------------------------------------------------------------------------------------------------


class LedgerIncomplete(RuntimeError):
    """The broker acknowledged records that could not be written to the ledger; the run lock stays, marked."""


class LockLost(RuntimeError):
    """Someone broke this run's lock (``--break-lock``) while it was sending."""


class Terminated(BaseException):
    """SIGTERM, raised where the driver is so the run ends like after Ctrl-C: settled, audited, lock handled."""


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """A scheduler stopping the driver (SIGTERM) must not kill it between an acknowledgement and its ledger write."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, _frame: object) -> None:
        raise Terminated(f"{signal.Signals(signum).name} received")

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _progress(done: int, started: float) -> None:
    rate = done / max(time.monotonic() - started, 1e-6)
    sys.stderr.write(f"\rredrive: sent {done} ({rate:.1f}/s)")
    sys.stderr.flush()


class Sender:
    """Sends at ``rate`` per second and writes one ledger object per acknowledged chunk.

    ``fenced`` (the lock was taken with ``--break-lock``) re-reads the lock before each chunk and stops if another
    run has it now. ``unrecorded`` holds the ledger rows of acknowledged records whose ledger write failed even
    after retries: the run must then keep its lock, marked (see :func:`pipeline.ledger.mark_lock_incomplete`).
    """

    WRITE_ATTEMPTS = 4

    def __init__(
        self,
        producer: KafkaWriter,
        cfg: JobConfig,
        run_id: str,
        rate: float,
        *,
        fenced: bool = False,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.producer = producer
        self.cfg = cfg
        self.run_id = run_id
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self.fenced = fenced
        self.sleep = sleep
        self.started = time.monotonic()
        self.sent = 0
        """Acknowledged and in the ledger."""
        self.chunk: list[Row] = []
        self.seq = 0
        self.unrecorded: list[dict[str, Any]] = []

    def send(self, row: Row) -> None:
        if self.fenced and not self.chunk and not holds_lock(self.cfg.out, self.run_id):
            raise LockLost(
                f"redrive: the lock {lock_path(self.cfg.out)} is no longer held by this run ({self.run_id}): another "
                f"run broke it; stopped after {self.sent} sent"
            )
        due = self.started + (self.sent + len(self.chunk)) * self.interval
        pause = due - time.monotonic()
        if pause > 0:
            self.sleep(pause)
        headers = [(h["key"], bytes(h["value"]) if h["value"] is not None else None) for h in row["headers"] or []]
        try:
            self.producer.send(
                row["original_topic"],
                value=bytes(row["value"]) if row["value"] is not None else None,
                key=bytes(row["key"]) if row["key"] is not None else None,
                headers=outgoing_headers(headers, int(row["redrive_count"])),
            )
        except Exception:
            # the records queued before this one still go out when the producer closes: record them first
            self.settle()
            raise
        self.chunk.append(row)
        if len(self.chunk) >= CHUNK:
            self.settle()

    def settle(self) -> None:
        """Wait for the broker's acknowledgements, record the acknowledged records, then raise if a send failed:
        nothing unacknowledged is ever marked sent, and nothing acknowledged is left out."""
        chunk, self.chunk = self.chunk, []
        results = self.producer.settle()
        now = dt.datetime.now(dt.UTC).isoformat()
        rows = [
            {
                "failed_topic": item["topic"],
                "failed_partition": item["partition"],
                "failed_offset": item["offset"],
                "message": item["message"],
                "original_topic": item["original_topic"],
                "original_partition": item["original_partition"],
                "original_offset": item["original_offset"],
                "group": item["group"],
                "target_topic": item["original_topic"],
                "target_partition": meta.partition,
                "target_offset": meta.offset,
                "redrive_count": int(item["redrive_count"]) + 1,
                "digest": item["digest"],
                "run_id": self.run_id,
                "sent_at": now,
            }
            for item, meta in zip(chunk, results, strict=True)
            if not isinstance(meta, BaseException)
        ]
        if rows:
            self._record(rows)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise RuntimeError(
                f"{len(errors)} of {len(results)} Kafka sends failed (the {len(rows)} acknowledged are in the ledger); "
                f"first: {errors[0]!r}"
            ) from errors[0]

    def _record(self, rows: list[dict[str, Any]]) -> None:
        """Write the ledger object, retrying a failing storage; if it never works, keep the rows for the audit."""
        failure: Exception | None = None
        for attempt in range(self.WRITE_ATTEMPTS):
            if attempt:
                self.sleep(0.5 * 2 ** (attempt - 1))
            try:
                write_ledger_chunk(self.cfg.out, self.run_id, self.seq, rows)
            except Exception as exc:
                failure = exc
                continue
            self.seq += 1
            self.sent += len(rows)
            _progress(self.sent, self.started)
            return
        self.unrecorded.extend(rows)
        raise LedgerIncomplete(
            f"redrive: {len(rows)} record(s) the broker acknowledged could not be written to the ledger under "
            f"{self.cfg.out} after {self.WRITE_ATTEMPTS} attempts ({failure!r}); stopped"
        ) from failure


def carry_out(rows: Iterator[Row], plan_file: Location, sender: Sender | None) -> Counter[str]:
    """Write the plan line by line as the records arrive from Spark, and send the ``send`` ones if executing.

    Whatever stops the loop (Ctrl-C, SIGTERM, a Spark error, the plan file) the records already handed to the
    producer are settled and recorded first: the producer would deliver them anyway when it closes."""
    counts: Counter[str] = Counter()
    try:
        with plan_file.open("w", encoding="utf-8") as fh:
            for row in rows:
                counts[row["action"]] += 1
                fh.write(json.dumps(plan_line(row), default=str) + "\n")
                if sender is not None and row["action"] == SEND:
                    sender.send(row)
    except BaseException as exc:
        if sender is not None and sender.chunk:
            try:
                sender.settle()
            except Exception as late:
                exc.add_note(f"redrive: settling the records sent before this error failed too: {late!r}")
        raise
    if sender is not None:
        sender.settle()
        if sender.sent:
            sys.stderr.write("\n")
    return counts


class _DefaultOut(str):
    """``--out`` as defaulted, not given: ``--execute`` refuses it (the ledger would depend on the working directory)."""


def _refuse_default_out(args: argparse.Namespace) -> None:
    if args.execute and isinstance(args.out, _DefaultOut):
        raise SystemExit(
            "redrive --execute needs an explicit --out: the ledger of what was sent lives under it, and only a run "
            f"with the same --out knows not to send a record twice (the default {args.out!r} depends on the "
            "working directory). Give the --out your earlier runs used."
        )


def _record_failure(exc: BaseException, cfg: JobConfig, started: dict[str, Any], sender: Sender | None) -> bool:
    """Write the ``failed`` audit record; when acknowledged records could not be recorded, list them there (or, if
    even that fails, on standard error), mark the lock and return True: the lock must then stay."""
    run_id = started["run_id"]
    failed = {
        **started,
        "status": "failed",
        "error": f"{type(exc).__name__}: {exc}",
        "sent": sender.sent if sender else 0,
        "finished_at": dt.datetime.now(dt.UTC).isoformat(),
    }
    unrecorded = sender.unrecorded if sender else []
    if unrecorded:
        failed["ledger_incomplete"] = True
        failed["unrecorded"] = unrecorded
    try:
        listed_in = str(write_audit(cfg.out, run_id, 1, failed))
    except Exception:
        if not unrecorded:
            raise
        # the storage is gone: the operator's terminal is the last place these rows can go
        listed_in = "the driver's standard error (lines 'redrive unrecorded: ...')"
        for row in unrecorded:
            sys.stderr.write("redrive unrecorded: " + json.dumps(row, default=str) + "\n")
    if not unrecorded:
        return False
    details = {"records": len(unrecorded), "error": f"{type(exc).__name__}: {exc}", "listed_in": listed_in}
    try:
        mark_lock_incomplete(cfg.out, run_id, details)
    except Exception as mark_failed:
        exc.add_note(f"redrive: could not mark the lock {lock_path(cfg.out)} as ledger-incomplete: {mark_failed!r}")
    return True


def run(args: argparse.Namespace, cfg: JobConfig, spark: SparkSession) -> dict[str, Any]:
    if args.plan:
        given = [f"--{k.replace('_', '-')}" for k in FILTER_FLAGS if getattr(args, k) not in (None, [], False)]
        if given:
            raise SystemExit(
                f"--plan sends the records of a reviewed plan; {', '.join(given)} belong to the dry run that made it"
            )
    _refuse_default_out(args)
    run_id = f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"
    who = {"run_id": run_id, "user": getpass.getuser(), "host": socket.gethostname(), "pid": os.getpid()}
    filters = {
        k: getattr(args, k)
        for k in (*FILTER_FLAGS, "max_redrives", "include_empty_values", "include_undecodable", "plan", "rate")
    }
    plan_file = cfg.out / "redrive" / "plans" / f"{run_id}.jsonl"
    started = {
        **who,
        "status": "started",
        "started_at": dt.datetime.now(dt.UTC).isoformat(),
        "dry_run": not args.execute,
        "filters": filters,
        "plan": str(plan_file),
        "main_topics": list(cfg.main_topics),
    }
    write_audit(cfg.out, run_id, 0, started)
    sender: Sender | None = None
    locked = False
    try:
        with _sigterm_raises() if args.execute else contextlib.nullcontext():
            if args.execute:
                acquire_lock(cfg.out, who, break_lock=args.break_lock)
                locked = True
            ledger_rows = read_ledger(cfg.out)
            planned = None
            if args.plan:
                candidates, planned = reviewed_candidates(spark, cfg, Location(args.plan))
            else:
                candidates = identify(select(read_failed(spark, cfg, since=args.since, until=args.until), args))
            decided = decide(
                candidates,
                ledger_rows,
                spark,
                main_topics=cfg.main_topics,
                max_redrives=args.max_redrives,
                max_records=args.max_records,
                include_empty_values=args.include_empty_values,
                include_undecodable=args.include_undecodable,
                reviewed=bool(args.plan),
            )
            rows = decided.toLocalIterator()
            if args.execute:
                from pipeline.kafka_source.client import KafkaWriter

                with KafkaWriter(cfg.bootstrap, cfg.kafka_options) as producer:
                    sender = Sender(producer, cfg, run_id, args.rate, fenced=args.break_lock)
                    counts = carry_out(rows, plan_file, sender)
            else:
                counts = carry_out(rows, plan_file, None)
            if planned is not None and planned > sum(counts.values()):
                counts[GONE] = planned - sum(counts.values())
    except BaseException as exc:
        if _record_failure(exc, cfg, started, sender) and locked:
            locked = False  # kept, marked: the next --execute must not start before the rows are recorded
        raise
    finally:
        if locked:
            release_lock(cfg.out, run_id)
    sent = sender.sent if sender else 0
    audit = {
        **started,
        "status": "finished",
        "matched": sum(n for action, n in counts.items() if action != GONE),
        "counts": dict(counts),
        "sent": sent,
        "finished_at": dt.datetime.now(dt.UTC).isoformat(),
    }
    write_audit(cfg.out, run_id, 1, audit)
    mode = "EXECUTED" if args.execute else "DRY RUN (add --execute to send)"
    print(
        f"redrive {mode}: matched {audit['matched']}; "
        + ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
        + f"; sent {sent}; plan {plan_file}"
    )
    return audit
