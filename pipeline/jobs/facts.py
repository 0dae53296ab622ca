"""``facts``: the attempts topic into a Parquet dataset partitioned by UTC date, one row per distinct event id.

Structured Streaming with a checkpoint under ``<out>/checkpoints/facts``. By default a run is incremental
(``Trigger.AvailableNow``): it reads only the offsets after the previous run's, then stops. With ``--trigger "1
minute"`` the same query keeps running, one micro-batch per interval, until SIGTERM or Ctrl-C, which let the current
micro-batch finish and exit 0. Both modes share the checkpoint: a team can switch between them at any time.

Attempt events are at-least-once: an outcome re-emitted after a crash keeps its event id but gets a new
``event_time``, possibly on another UTC date than the first copy. Every micro-batch is therefore de-duplicated within
itself (the earliest copy wins) and anti-joined with the event ids already written in the date partitions where an
earlier copy can be: from the UTC date of the message's ``first_received_at`` (an hour earlier, for clocks that
disagree) to the event's own date, never more than ``--dedup-lookback-days`` back. Every event of a message happens
after its first receipt, so that range holds the first copy of any re-emitted event; its cost is bounded by how long
messages are retried, not by the size of the table. The same anti-join makes a micro-batch replayed after a crash
between "Parquet written" and "checkpoint committed" harmless.

The query stays stateless on purpose (no ``dropDuplicatesWithinWatermark``): a stateful operator would make every
checkpoint written by earlier versions unusable, and the sink needs the anti-join anyway for replayed micro-batches.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import re
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from pipeline.common import JobConfig, kafka_source_options, parse_time, quiet_py4j_disconnects
from pipeline.storage import Location

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

log = logging.getLogger(__name__)

ATTEMPT_FIELDS: tuple[tuple[str, str], ...] = (
    ("event_id", "string"),
    ("group", "string"),
    ("key", "string"),
    ("original_topic", "string"),
    ("original_partition", "int"),
    ("original_offset", "long"),
    ("attempt", "int"),
    ("tier", "string"),
    ("outcome", "string"),
    ("reason", "string"),
    ("error_class", "string"),
    ("error_message", "string"),
    ("first_received_at", "long"),
    ("due_at", "long"),
    ("event_time", "long"),
    ("next_tier", "string"),  # added later: facts written before it have no such column (see read_facts)
)
"""The attempt event (``rebound.attempts.AttemptEvent``) as stored; fields only ever grow, appended at the end."""
ATTEMPT_SCHEMA = ", ".join(f"`{name}` {kind}" for name, kind in ATTEMPT_FIELDS)

CLOCK_SKEW_MS = 3_600_000
"""How much earlier than ``first_received_at`` a first copy is still looked for: the worker that first received a
message and the one that emitted the event may not agree on the time."""
DEFAULT_DEDUP_LOOKBACK_DAYS = 30
_TRIGGER = re.compile(r"^\s*(\d+)\s*([a-z]+)\s*$", re.IGNORECASE)
_TRIGGER_UNITS = {
    **dict.fromkeys(("ms", "millisecond", "milliseconds"), "milliseconds"),
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), "seconds"),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), "minutes"),
    **dict.fromkeys(("h", "hour", "hours"), "hours"),
}


def facts_path(cfg: JobConfig) -> Location:
    return cfg.out / "facts"


def parse_trigger(text: str) -> str:
    """``--trigger`` as Spark's processing-time interval (``"1 minute"`` -> ``"1 minutes"``), checked up front so
    that a typo is reported with the flag's name instead of as a Spark interval error."""
    match = _TRIGGER.match(text)
    unit = _TRIGGER_UNITS.get(match.group(2).lower()) if match else None
    if not match or unit is None or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"--trigger expects an interval like '1 minute', '30 seconds', '5m'; got {text!r}"
        )
    return f"{int(match.group(1))} {unit}"


def add_window_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--since``/``--until`` for the jobs that read the facts: only attempt events in that window are used."""
    parser.add_argument(
        "--since",
        type=parse_time,
        default=None,
        help=f"only {what} at or after this time (ISO date or date-time, UTC; epoch ms)",
    )
    parser.add_argument(
        "--until", type=parse_time, default=None, help=f"only {what} before this time (exclusive; same forms)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--starting-offsets",
        default="earliest",
        help="where the very first run starts (later runs resume from the checkpoint)",
    )
    parser.add_argument(
        "--max-offsets-per-trigger",
        type=int,
        default=None,
        help="cap each micro-batch (the run still reads everything available, in several batches)",
    )
    parser.add_argument(
        "--trigger",
        type=parse_trigger,
        default=None,
        metavar="INTERVAL",
        help="keep running, one micro-batch per INTERVAL ('1 minute'), until SIGTERM/Ctrl-C; default: read what "
        "is available, then stop",
    )
    parser.add_argument(
        "--dedup-lookback-days",
        type=int,
        default=DEFAULT_DEDUP_LOOKBACK_DAYS,
        help="furthest back (in days before an event's date) an earlier copy of it is looked for; events without "
        "first_received_at use all of it (default: %(default)s)",
    )


def parse_attempts(kafka_df: DataFrame) -> DataFrame:
    """Kafka rows of the attempts topic to typed attempt facts (malformed JSON rows are dropped)."""
    from pyspark.sql import functions as F

    parsed = kafka_df.select(
        F.from_json(F.col("value").cast("string"), ATTEMPT_SCHEMA).alias("e"),
        F.col("partition").alias("kafka_partition"),
        F.col("offset").alias("kafka_offset"),
    )
    return (
        parsed.where(F.col("e.event_id").isNotNull())
        .select("e.*", "kafka_partition", "kafka_offset")
        .withColumn("event_ts", F.timestamp_millis("event_time"))
        .withColumn("date", F.to_date(F.timestamp_millis("event_time")))
    )


def read_facts(spark: SparkSession, path: Location | os.PathLike[str] | str) -> DataFrame:
    """The facts dataset with every column of :data:`ATTEMPT_FIELDS`, whatever version of the job wrote it.

    Parquet files written before a field existed are merged with newer ones (``mergeSchema``; the old rows read
    null), and a field that no file has yet (every file older than the field) is added as a null column.
    """
    from pyspark.sql import functions as F

    df = spark.read.option("mergeSchema", "true").parquet(str(path))
    for name, kind in ATTEMPT_FIELDS:
        if name not in df.columns:
            df = df.withColumn(name, F.lit(None).cast(kind))
    return df


def facts_in_window(
    spark: SparkSession,
    path: Location | os.PathLike[str] | str,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
) -> DataFrame:
    """The attempt events with ``since <= event_time < until``.

    The bounds are applied twice: on the ``date`` partition column, which Spark turns into a partition filter so that
    only the dates in the window are listed and read, and exactly on ``event_ts``.
    """
    from pyspark.sql import functions as F

    df = read_facts(spark, path)
    if since is not None:
        start = since.astimezone(dt.UTC)
        df = df.where((F.col("date") >= F.lit(start.date())) & (F.col("event_ts") >= F.lit(start)))
    if until is not None:
        end = until.astimezone(dt.UTC)
        last_date = (end - dt.timedelta(microseconds=1)).date()
        df = df.where((F.col("date") <= F.lit(last_date)) & (F.col("event_ts") < F.lit(end)))
    return df


def lookup_dates(ranges: Iterable[tuple[dt.date | None, dt.date]], lookback_days: int) -> set[dt.date]:
    """The date partitions that can hold an earlier copy of a batch's events.

    ``ranges`` are ``(earliest possible date, event date)`` pairs; the earliest is the date of the message's first
    receipt minus the clock-skew allowance, or None when the event does not say (then the whole lookback applies).
    """
    dates: set[dt.date] = set()
    for earliest, date in ranges:
        floor = date - dt.timedelta(days=lookback_days)
        start = floor if earliest is None else min(max(earliest, floor), date)
        dates.update(start + dt.timedelta(days=n) for n in range((date - start).days + 1))
    return dates


def first_copies(facts: DataFrame) -> DataFrame:
    """One row per event id: the earliest copy (by event time, then Kafka position), so that which copy is kept does
    not depend on how Spark splits the batch."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    order = Window.partitionBy("event_id").orderBy("event_time", "kafka_partition", "kafka_offset")
    return facts.withColumn("_copy", F.row_number().over(order)).where(F.col("_copy") == 1).drop("_copy")


def _write_batch(batch: DataFrame, batch_id: int, target: Location, stats: dict[str, int], lookback_days: int) -> None:
    # Cached so that Kafka is read once per micro-batch, although the batch feeds several actions.
    batch = batch.persist()
    try:
        stats["records_read"] += batch.count()
        facts = first_copies(parse_attempts(batch)).persist()
        try:
            written = _append(facts, target, batch.sparkSession, lookback_days)
        finally:
            facts.unpersist()
        stats["facts_written"] += written
        stats["batches"] += 1
        log.info("facts: micro-batch %d wrote %d new facts", batch_id, written)
    finally:
        batch.unpersist()


def _append(facts: DataFrame, target: Location, spark: SparkSession, lookback_days: int) -> int:
    from pyspark.sql import functions as F

    received = F.col("first_received_at")
    earliest = F.when(received.isNotNull(), F.to_date(F.timestamp_millis(received - F.lit(CLOCK_SKEW_MS))))
    ranges = [(r["earliest"], r["date"]) for r in facts.select(earliest.alias("earliest"), "date").distinct().collect()]
    if not ranges:
        return 0
    wanted = {f"date={d.isoformat()}" for d in lookup_dates(ranges, lookback_days)}
    # Only the partitions that can hold a first copy are listed and read (not the whole, ever-growing table).
    partitions = [str(p) for p in target.glob("date=*") if p.name in wanted]
    if partitions:
        existing = spark.read.option("basePath", str(target)).parquet(*partitions).select("event_id")
        facts = facts.join(existing, "event_id", "left_anti")
    new = facts.persist()
    try:
        count = new.count()
        if count:
            new.write.mode("append").partitionBy("date").parquet(str(target))
        return count
    finally:
        new.unpersist()


def serve_until_stopped(
    query: StreamingQuery, stop: threading.Event, spark_stopped: Callable[[], bool], poll_s: int = 1
) -> bool:
    """Keep a long-running query going until ``stop`` is set, then stop it between micro-batches; False when Spark
    itself was shut down under the query instead.

    ``query.stop()`` interrupts a running micro-batch, so it is called once no trigger is active. A micro-batch that
    starts in the instant between that check and the stop is interrupted and, uncommitted, is read again by the
    next run; the de-duplication makes that harmless. The same holds when the signal also reached Spark's JVM (a
    whole process group stopped by a container runtime or a shell, or ``spark-submit``'s JVM being the process that
    got it): the JVM's shutdown hook stops the SparkContext and fails the query, which is then a stop, not an error.
    """
    try:
        while query.isActive and not stop.is_set():
            query.awaitTermination(poll_s)
        while query.isActive and query.status.get("isTriggerActive"):
            query.awaitTermination(poll_s)
        query.stop()
        query.awaitTermination()
    except Exception as exc:  # StreamingQueryException, or py4j's errors once the JVM is gone
        if not (stop.is_set() or spark_stopped()):
            raise
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning(
            "facts: Spark shut down while the query was running (%s); a micro-batch in flight was not committed and "
            "is read again by the next run, which the de-duplication makes harmless",
            first_line[:300],
        )
        return False
    return True


def _spark_stopped(spark: SparkSession) -> Callable[[], bool]:
    def stopped() -> bool:
        try:
            jsc = spark.sparkContext._jsc
            return jsc is None or bool(jsc.sc().isStopped())
        except Exception:  # the JVM is gone altogether
            return True

    return stopped


@contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM (a scheduler, ``kill``) and SIGINT (Ctrl-C) ask for a clean stop instead of killing the driver."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are only delivered to the main thread; an embedding caller sets ``stop`` itself
        return

    def request_stop(signum: int, _frame: object) -> None:
        log.warning("facts: %s received, stopping after the current micro-batch", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(args: argparse.Namespace, cfg: JobConfig, spark: SparkSession) -> dict[str, Any]:
    target = facts_path(cfg)
    stats = {"records_read": 0, "facts_written": 0, "batches": 0}
    checkpoint = cfg.out / "checkpoints" / "facts"
    lookback_days = args.dedup_lookback_days
    if lookback_days < 0:
        raise SystemExit(f"--dedup-lookback-days must be >= 0, got {lookback_days}")
    reader = (
        spark.readStream.format("pykafka")
        .options(**kafka_source_options(cfg))
        .option("subscribe", cfg.attempts_topic)
        .option("startingOffsets", args.starting_offsets)
    )
    if args.max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(args.max_offsets_per_trigger))
    writer = (
        reader.load()
        .writeStream.foreachBatch(lambda df, bid: _write_batch(df, bid, target, stats, lookback_days))
        .option("checkpointLocation", str(checkpoint))
        .queryName(f"rebound-facts-{cfg.app_id}")
    )
    if args.trigger is None:
        writer.trigger(availableNow=True).start().awaitTermination()
    else:
        stop = threading.Event()
        with _stop_on_signals(stop), quiet_py4j_disconnects():
            query = writer.trigger(processingTime=args.trigger).start()
            print(
                f"facts: following {cfg.attempts_topic} every {args.trigger} into {target}; SIGTERM or Ctrl-C stops",
                flush=True,
            )
            if not serve_until_stopped(query, stop, _spark_stopped(spark)):
                print(
                    f"facts: stopped with Spark's shutdown after {stats['batches']} micro-batches, "
                    f"{stats['facts_written']} new facts written to {target}",
                    flush=True,
                )
                return {"topic": cfg.attempts_topic, "records_read": stats["records_read"], "stopped_by_spark": True}
    rows_read = stats["records_read"]
    total = read_facts(spark, target).count() if any(target.glob("date=*")) else 0
    summary = {
        "topic": cfg.attempts_topic,
        "records_read": rows_read,
        "facts_written": stats["facts_written"],
        "micro_batches": stats["batches"],
        "facts_total": total,
        "path": str(target),
    }
    print(
        f"facts: read {rows_read} new attempt records from {cfg.attempts_topic}, wrote {stats['facts_written']} new "
        f"facts; {total} facts in {target}"
    )
    return summary
