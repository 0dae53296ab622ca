"""``facts``: the attempts topic into a Parquet dataset partitioned by UTC date, one row per distinct event id.

Incremental through Structured Streaming with ``Trigger.AvailableNow`` and a checkpoint under ``<out>/checkpoints``:
each run reads only the offsets after the previous run's, then stops. Attempt events are at-least-once (an outcome
re-emitted after a crash keeps its event id), so every micro-batch is de-duplicated within itself and against the
event ids already written for the dates it touches. That also makes a micro-batch replayed after a crash between
"Parquet written" and "checkpoint committed" harmless.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.common import JobConfig

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

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


def facts_path(cfg: JobConfig) -> Path:
    return cfg.out / "facts"


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


def read_facts(spark: SparkSession, path: Path) -> DataFrame:
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


def _write_batch(batch: DataFrame, batch_id: int, target: Path, stats: dict[str, int]) -> None:
    # Cached so that Kafka is read once per micro-batch, although the batch feeds several actions.
    batch = batch.persist()
    try:
        stats["records_read"] += batch.count()
        facts = parse_attempts(batch).dropDuplicates(["event_id"])
        dates = [r["date"] for r in facts.select("date").distinct().collect()]
        if dates:
            _append(facts, dates, target, batch.sparkSession)
            log.info("facts: micro-batch %d written for dates %s", batch_id, dates)
    finally:
        batch.unpersist()


def _append(facts: DataFrame, dates: list[dt.date], target: Path, spark: SparkSession) -> None:
    from pyspark.sql import functions as F

    if (target / "_SUCCESS").exists() or any(target.glob("date=*")):
        existing = spark.read.parquet(str(target)).where(F.col("date").isin(dates)).select("event_id")
        facts = facts.join(existing, "event_id", "left_anti")
    facts.write.mode("append").partitionBy("date").parquet(str(target))


def run(args: argparse.Namespace, cfg: JobConfig, spark: SparkSession) -> dict[str, Any]:
    target = facts_path(cfg)
    stats = {"records_read": 0}
    checkpoint = cfg.out / "checkpoints" / "facts"
    reader = (
        spark.readStream.format("pykafka")
        .option("kafka.bootstrap.servers", cfg.bootstrap)
        .option("subscribe", cfg.attempts_topic)
        .option("startingOffsets", args.starting_offsets)
    )
    if args.max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(args.max_offsets_per_trigger))
    query = (
        reader.load()
        .writeStream.foreachBatch(lambda df, bid: _write_batch(df, bid, target, stats))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    rows_read = stats["records_read"]
    total = read_facts(spark, target).count() if any(target.glob("date=*")) else 0
    summary = {"topic": cfg.attempts_topic, "records_read": rows_read, "facts_total": total, "path": str(target)}
    print(f"facts: read {rows_read} new attempt records from {cfg.attempts_topic}; {total} facts in {target}")
    return summary
