"""Shared job plumbing: the common flags, the SparkSession, and reading Rebound topics through ``pykafka``."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.kafka_source import register

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import Column, DataFrame, DataFrameReader, SparkSession

FAILED_SUFFIX = ".failed"  # mirrors rebound.topics.failed_topic; the pipeline must not import the Faust app


@dataclass(frozen=True)
class JobConfig:
    master: str | None
    bootstrap: str
    app_id: str
    main_topics: tuple[str, ...]
    out: Path

    @property
    def attempts_topic(self) -> str:
        return f"{self.app_id}.attempts"

    @property
    def failed_topics(self) -> list[str]:
        return [f"{t}{FAILED_SUFFIX}" for t in self.main_topics]


class Job(Protocol):
    """What ``python -m pipeline`` needs from a job module (``pipeline.jobs.*``)."""

    __doc__: str | None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace, cfg: JobConfig, spark: SparkSession) -> dict[str, Any]: ...


def default_bootstrap() -> str:
    raw = os.environ.get("REBOUND_BROKER", "").strip()
    if not raw:
        return "127.0.0.1:9092"
    return ",".join(part.strip().removeprefix("kafka://") for part in raw.split(",") if part.strip())


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--master", default=None, help="Spark master URL (default: the one spark-submit gives, else local[*])"
    )
    parser.add_argument(
        "--bootstrap",
        default=default_bootstrap(),
        help="Kafka bootstrap servers (default: $REBOUND_BROKER without kafka://, else 127.0.0.1:9092)",
    )
    parser.add_argument(
        "--app-id",
        default=os.environ.get("REBOUND_APP_ID", "rebound"),
        help="Rebound app id; attempt events are read from <app id>.attempts (default: %(default)s)",
    )
    parser.add_argument(
        "--main-topics",
        default=os.environ.get("REBOUND_MAIN_TOPICS", "items"),
        help="comma-separated main topics; their failed topics are <topic>.failed (default: %(default)s)",
    )
    parser.add_argument("--out", default="./out/pipeline", help="output directory (default: %(default)s)")


def config_from_args(args: argparse.Namespace) -> JobConfig:
    topics = tuple(t.strip() for t in str(args.main_topics).split(",") if t.strip())
    if not topics:
        raise SystemExit("--main-topics is empty")
    return JobConfig(
        master=args.master, bootstrap=args.bootstrap, app_id=args.app_id, main_topics=topics, out=Path(args.out)
    )


def spark_session(cfg: JobConfig, app_name: str) -> SparkSession:
    """A session in UTC (dates and hours in the outputs are UTC) with the ``pykafka`` source registered."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark import SparkConf
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(f"rebound-{app_name}")
    if cfg.master:
        builder = builder.master(cfg.master)
    elif not SparkConf().contains("spark.master"):
        builder = builder.master("local[*]")
    conf = SparkConf()
    builder = builder.config("spark.sql.session.timeZone", "UTC").config("spark.ui.showConsoleProgress", "false")
    if not conf.contains("spark.sql.shuffle.partitions"):
        builder = builder.config("spark.sql.shuffle.partitions", "8")
    spark = builder.getOrCreate()
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    register(spark)
    return spark


def kafka_reader(spark: SparkSession, cfg: JobConfig, *, include_headers: bool = True) -> DataFrameReader:
    return (
        spark.read.format("pykafka")
        .option("kafka.bootstrap.servers", cfg.bootstrap)
        .option("includeHeaders", "true" if include_headers else "false")
    )


def read_failed(spark: SparkSession, cfg: JobConfig) -> DataFrame:
    """Every record of the failed topics, with the ``rebound.*`` headers as typed columns (see failed_columns)."""
    df = kafka_reader(spark, cfg).option("subscribe", ",".join(cfg.failed_topics)).load()
    return failed_columns(df)


def failed_columns(df: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

    def header(name: str) -> Column:
        found = F.filter(F.coalesce(F.col("headers"), F.array()), lambda h: h["key"] == name)
        return F.when(F.size(found) > 0, F.element_at(found, -1)["value"].cast("string"))

    return df.select(
        "topic",
        "partition",
        "offset",
        "timestamp",
        "key",
        "value",
        "headers",
        F.col("key").cast("string").alias("key_text"),
        header("rebound.reason").alias("reason"),
        header("rebound.error-class").alias("error_class"),
        header("rebound.error-message").alias("error_message"),
        header("rebound.original-topic").alias("original_topic"),
        header("rebound.original-partition").cast("int").alias("original_partition"),
        header("rebound.original-offset").cast("long").alias("original_offset"),
        header("rebound.first-received-at").cast("long").alias("first_received_at"),
        header("rebound.attempt").cast("int").alias("attempt"),
        header("rebound.group").alias("group"),
        F.coalesce(header("rebound.redrive-count").cast("int"), F.lit(0)).alias("redrive_count"),
    )


def write_table(pdf: pd.DataFrame, directory: Path, name: str) -> None:
    """One small result table as both Parquet and JSON (records), for machines and for people."""
    directory.mkdir(parents=True, exist_ok=True)
    pdf.to_parquet(directory / f"{name}.parquet", index=False)
    pdf.to_json(directory / f"{name}.json", orient="records", indent=1, date_format="iso")
