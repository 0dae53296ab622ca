"""Shared job plumbing: the common flags, the SparkSession, and reading Rebound topics through ``pykafka``."""

from __future__ import annotations

import argparse
import datetime as dt
import io
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.kafka_source import register
from pipeline.storage import Location

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import Column, DataFrame, DataFrameReader, SparkSession

FAILED_SUFFIX = ".failed"  # mirrors rebound.topics.failed_topic; the pipeline must not import the Faust app


KAFKA_PROPERTIES_ENV = "REBOUND_PIPELINE_KAFKA_PROPERTIES"
"""A Java-style client properties file (``security.protocol=SASL_SSL`` ...) used by every job, like ``--kafka-properties``."""


@dataclass(frozen=True)
class JobConfig:
    master: str | None
    bootstrap: str
    app_id: str
    main_topics: tuple[str, ...]
    out: Location
    kafka_options: Mapping[str, str] = field(default_factory=dict)
    """Kafka client settings by their Java names (``sasl.mechanism``...), for the source, the sink and redrive."""

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
    parser.add_argument(
        "--out",
        default="./out/pipeline",
        help="output directory or URL: a path, file://, s3a://, gs://, abfss://, hdfs:// (default: %(default)s)",
    )
    parser.add_argument(
        "--kafka-properties",
        metavar="FILE",
        default=os.environ.get(KAFKA_PROPERTIES_ENV) or None,
        help=f"Kafka client properties file (Java names: security.protocol, sasl.mechanism, ssl.cafile ...) for "
        f"reading, writing and redrive (default: ${KAFKA_PROPERTIES_ENV})",
    )
    parser.add_argument(
        "--kafka-option",
        metavar="NAME=VALUE",
        action="append",
        default=[],
        help="one Kafka client setting, repeatable; wins over --kafka-properties (prefer the file for secrets: "
        "command lines are visible to other users of the machine)",
    )


def parse_properties(text: str) -> dict[str, str]:
    """The subset of Java ``.properties`` syntax client files use: ``name=value`` or ``name: value`` lines,
    ``#``/``!`` comments, blank lines; a backslash at the end of a line continues it."""
    props: dict[str, str] = {}
    pending = ""
    for raw in io.StringIO(text):
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\") and not line.endswith("\\\\"):
            pending = line[:-1]
            continue
        if not line or line[0] in "#!":
            continue
        cut = min((i for i in (line.find("="), line.find(":")) if i > 0), default=-1)
        if cut < 0:
            raise SystemExit(f"Kafka properties: expected name=value, got {line!r}")
        props[line[:cut].strip()] = line[cut + 1 :].strip()
    return props


def kafka_options_from_args(args: argparse.Namespace) -> dict[str, str]:
    options: dict[str, str] = {}
    if getattr(args, "kafka_properties", None):
        path = Location(args.kafka_properties)
        try:
            options.update(parse_properties(path.read_text()))
        except FileNotFoundError:
            raise SystemExit(f"--kafka-properties: no such file: {path}") from None
    for item in getattr(args, "kafka_option", None) or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--kafka-option expects NAME=VALUE, got {item!r}")
        options[name.strip()] = value.strip()
    if "bootstrap.servers" in options:
        raise SystemExit("set the brokers with --bootstrap (or $REBOUND_BROKER), not as a Kafka option")
    return options


def config_from_args(args: argparse.Namespace) -> JobConfig:
    topics = tuple(t.strip() for t in str(args.main_topics).split(",") if t.strip())
    if not topics:
        raise SystemExit("--main-topics is empty")
    return JobConfig(
        master=args.master,
        bootstrap=args.bootstrap,
        app_id=args.app_id,
        main_topics=topics,
        out=Location(args.out),
        kafka_options=kafka_options_from_args(args),
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
    quiet_accumulator_disconnects()
    spark = builder.getOrCreate()
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    register(spark)
    return spark


def quiet_accumulator_disconnects() -> None:
    """Let PySpark's accumulator server take a JVM going away (a stopping job's process group) without a traceback.

    The driver's accumulator server reads updates from the JVM; when the JVM exits under it (SIGTERM to the whole
    process group, which the facts stream takes as a clean stop) its handler reads end-of-stream and socketserver
    prints the ``EOFError``'s traceback on stderr: noise on a clean stop that looks like a failure. A dropped
    connection is now one line at debug level; any other error is reported as before.
    """
    import logging

    from pyspark import accumulators

    servers = [accumulators.AccumulatorTCPServer, getattr(accumulators, "AccumulatorUnixServer", None)]
    for server in servers:
        if server is None or getattr(server, "_rebound_quiet_disconnects", False):
            continue
        report = server.handle_error

        def handle_error(self: Any, request: Any, client_address: Any, report: Any = report) -> None:
            error = sys.exc_info()[1]
            if isinstance(error, (EOFError, ConnectionError)):
                logging.getLogger(__name__).debug("accumulator connection closed by the JVM: %r", error)
                return
            report(self, request, client_address)

        setattr(server, "handle_error", handle_error)  # noqa: B010 (mypy: a method assigned on purpose)
        setattr(server, "_rebound_quiet_disconnects", True)  # noqa: B010


@contextmanager
def quiet_py4j_disconnects() -> Iterator[None]:
    """Within this scope, py4j's report of a lost JVM connection is one debug line instead of an ERROR traceback.

    py4j reports a failed command with ``logging.exception`` on the root logger and then raises the same error to
    its caller (``java_gateway.py``, ``send_command``). A caller in this scope reports that error itself, or takes it as
    Spark's shutdown under a requested stop (the facts stream stopped with its whole process group: the JVM can be
    gone between two polls of the query), so the root logger's copy only made a clean stop look like a failure. Only
    records from py4j's own files carrying a network error are touched.
    """
    import logging

    from py4j.protocol import Py4JNetworkError

    marker = f"{os.sep}py4j{os.sep}"
    log = logging.getLogger(__name__)

    def keep(record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if marker in record.pathname and isinstance(error, (Py4JNetworkError, ConnectionError)):
            log.debug("py4j: %s (%r); its caller reports the error", record.getMessage(), error)
            return False
        return True

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


def kafka_source_options(cfg: JobConfig) -> dict[str, str]:
    """``kafka.*`` options for the pykafka source or sink: the brokers and every common client setting."""
    return {"kafka.bootstrap.servers": cfg.bootstrap, **{f"kafka.{k}": v for k, v in cfg.kafka_options.items()}}


def kafka_reader(spark: SparkSession, cfg: JobConfig, *, include_headers: bool = True) -> DataFrameReader:
    return (
        spark.read.format("pykafka")
        .options(**kafka_source_options(cfg))
        .option("includeHeaders", "true" if include_headers else "false")
    )


def epoch_ms(value: dt.datetime) -> int:
    return int(value.timestamp() * 1000)


def parse_time(text: str) -> dt.datetime:
    """``--since``/``--until``: an ISO date (midnight UTC), an ISO date-time (naive means UTC) or epoch ms."""
    text = text.strip()
    try:
        if text.isdigit():
            return dt.datetime.fromtimestamp(int(text) / 1000, tz=dt.UTC)
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an ISO date or date-time in UTC (2024-05-01, 2024-05-01T10:00) or epoch ms; got {text!r}"
        ) from None
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def check_window(since: dt.datetime | None, until: dt.datetime | None) -> None:
    if since is not None and until is not None and since >= until:
        raise SystemExit(f"--since ({since.isoformat()}) must be before --until ({until.isoformat()})")


def read_failed(
    spark: SparkSession, cfg: JobConfig, *, since: dt.datetime | None = None, until: dt.datetime | None = None
) -> DataFrame:
    """The failed topics' records (all, or those with ``since <= timestamp < until``), with the ``rebound.*``
    headers as typed columns (see failed_columns).

    A window is pushed to the broker as ``startingTimestamp``/``endingTimestamp`` so that only that part of each
    partition is fetched, and then applied exactly on the record timestamps: offsets-for-times answers with the
    first offset whose timestamp is at or after the time, which with producer-set timestamps out of order can
    include a few records outside the window.
    """
    from pyspark.sql import functions as F

    reader = kafka_reader(spark, cfg).option("subscribe", ",".join(cfg.failed_topics))
    if since is not None:
        # A partition with nothing since then is read from its end, not an error (Spark's default strategy).
        reader = reader.option("startingTimestamp", str(epoch_ms(since))).option(
            "startingOffsetsByTimestampStrategy", "latest"
        )
    if until is not None:
        reader = reader.option("endingTimestamp", str(epoch_ms(until)))
    df = reader.load()
    if since is not None:
        df = df.where(F.col("timestamp") >= F.lit(since))
    if until is not None:
        df = df.where(F.col("timestamp") < F.lit(until))
    return failed_columns(df)


def failed_columns(df: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

    def header(name: str) -> Column:
        found = F.filter(F.coalesce(F.col("headers"), F.array()), lambda h: h["key"] == name)
        return F.when(F.size(found) > 0, F.element_at(found, -1)["value"].cast("string"))

    def number(name: str, kind: str) -> Column:
        """A decimal header as ``kind``, null unless it is plain digits that fit: a cast under Spark's ANSI rules
        would fail the whole job on one forged or garbled header, and ``-5`` must not read as a number."""
        text = header(name)
        digits = 9 if kind == "int" else 18
        return F.when(text.rlike(f"^[0-9]{{1,{digits}}}$"), text.cast(kind))

    def redrive_count() -> Column:
        """As ``rebound.replay.redrive_count`` reads it: surrounding whitespace ignored, up to 20 digits (a count too
        big for an int is still at least any cap), anything else is 0."""
        text = F.regexp_replace(header("rebound.redrive-count"), r"^\s+|\s+$", "")
        return (
            F.when(text.rlike("^[0-9]{1,9}$"), text.cast("int"))
            .when(text.rlike("^[0-9]{10,20}$"), F.lit(2**31 - 1))
            .otherwise(F.lit(0))
        )

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
        number("rebound.original-partition", "int").alias("original_partition"),
        number("rebound.original-offset", "long").alias("original_offset"),
        number("rebound.first-received-at", "long").alias("first_received_at"),
        number("rebound.attempt", "int").alias("attempt"),
        header("rebound.group").alias("group"),
        redrive_count().alias("redrive_count"),
    )


def write_table(pdf: pd.DataFrame, directory: Location, name: str) -> None:
    """One small result table as both Parquet and JSON (records), for machines and for people; through fsspec, so
    it lands wherever ``--out`` points."""
    parquet = io.BytesIO()
    pdf.to_parquet(parquet, index=False)
    (directory / f"{name}.parquet").write_bytes(parquet.getvalue())
    text = pdf.to_json(orient="records", indent=1, date_format="iso")
    (directory / f"{name}.json").write_text(text or "[]")
