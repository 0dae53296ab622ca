"""The Spark side of the ``pykafka`` source: ``DataSource``, batch/stream readers and the batch writer.

Spark pickles these objects to Python workers, so they hold only parsed options (plain dataclasses) and import
the Kafka client inside methods. The format is registered as ``pykafka`` because Spark reserves ``kafka`` for its
JVM connector even when the connector jar is absent (``DATA_SOURCE_ALREADY_EXISTS``).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow

from pipeline.kafka_source import planning
from pipeline.kafka_source.arrow import (
    DEFAULT_BATCH_ROWS,
    BatchBuilder,
    kafka_ddl,
    kafka_spark_schema,
    record_batches,
)
from pipeline.kafka_source.options import (
    EARLIEST,
    KafkaOptionError,
    SinkOptions,
    SourceOptions,
    TopicPartition,
    include_headers,
    offsets_from_json,
    offsets_to_json,
    parse_sink_options,
    parse_source_options,
)

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql.types import Row, StructType

    from pipeline.kafka_source.client import KafkaReader

log = logging.getLogger(__name__)

SparkOffsets = dict[str, dict[str, int]]
"""Spark's offset JSON for this source: ``{"topic": {"0": 23}}`` (the next offset to read per partition)."""

SHORT_NAME = "pykafka"


class KafkaInputPartition(InputPartition):
    """One task's work: ``[start, end)`` of one topic-partition."""

    def __init__(self, topic: str, partition: int, start: int, end: int) -> None:
        super().__init__((topic, partition, start, end))
        self.topic, self.partition, self.start, self.end = topic, partition, start, end


def _partitions(opts: SourceOptions, reader: KafkaReader) -> list[TopicPartition]:
    strategy = opts.strategy
    if strategy.kind == "assign":
        existing = set(reader.partitions(strategy.select_topics(set())))
        missing = [tp for tp in strategy.partitions if tp not in existing]
        if missing:
            raise KafkaOptionError(f"assigned topic-partitions do not exist: {missing}")
        return list(strategy.partitions)
    return reader.partitions(strategy.select_topics(reader.topics()))


def _kafka_partition(partition: InputPartition) -> KafkaInputPartition:
    """Spark hands ``read`` back the partitions ``partitions`` made; narrow the declared ``InputPartition``."""
    if not isinstance(partition, KafkaInputPartition):
        raise TypeError(f"pykafka: expected a KafkaInputPartition, got {type(partition).__name__}")
    return partition


READER_FETCH_PARTITION_BYTES = 4 * 1024 * 1024
"""Default ``max.partition.fetch.bytes`` of the task readers: fewer round trips to a remote broker than aiokafka's
1 MiB (the same speed on the local embedded broker)."""
READER_FETCH_MAX_WAIT_MS = 50
"""Default ``fetch.max.wait.ms`` of the task readers. A task reads offsets that exist, so a long poll only happens
at the end of its range: aiokafka prefetches past it, and the broker holds that fetch for this long. A pooled
reader's next task queues behind it on the same connection, so aiokafka's 500 ms made every reused reader start
late."""
READER_MAX_RECORDS = 10_000
"""Records per ``getmany`` call (``read_range`` takes 2,000 by default): fewer event-loop turns per fetch."""


def reader_fetch_config(client_config: dict[str, str], max_batch_bytes: int) -> dict[str, str]:
    """The task reader's client settings: the user's ``kafka.*`` ones, plus fetch sizes bounded by
    ``maxBatchBytes`` unless the user set them, so one fetch never holds much more than one Arrow batch."""
    defaults = {
        "max.partition.fetch.bytes": str(min(READER_FETCH_PARTITION_BYTES, max_batch_bytes)),
        "fetch.max.bytes": str(min(50 * 1024 * 1024, max_batch_bytes)),
        "fetch.max.wait.ms": str(READER_FETCH_MAX_WAIT_MS),
    }
    return {**defaults, **client_config}


def _read_partition(opts: SourceOptions, part: KafkaInputPartition) -> Iterator[pa.RecordBatch]:
    """Shared by the batch and stream readers: fetch one offset range, yield Arrow batches of the Kafka schema.

    The Kafka client comes from this Python worker's pool (:mod:`pipeline.kafka_source.pool`), so the tasks a
    worker runs one after another share one connection; batches are cut at 4,096 rows or ``maxBatchBytes``.
    """
    from pipeline.kafka_source.pool import pooled_reader

    config = reader_fetch_config(opts.client_config, opts.max_batch_bytes)
    with pooled_reader(opts.bootstrap_servers, config) as reader:
        chunks = reader.read_range(
            part.topic,
            part.partition,
            part.start,
            part.end,
            poll_timeout_ms=opts.poll_timeout_ms,
            fail_on_data_loss=opts.fail_on_data_loss,
            max_records=READER_MAX_RECORDS,
        )
        yield from record_batches(
            chunks,
            part.topic,
            part.partition,
            opts.include_headers,
            max_rows=DEFAULT_BATCH_ROWS,
            max_bytes=opts.max_batch_bytes,
        )
        reader.release()


class KafkaBatchReader(DataSourceReader):
    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts

    def partitions(self) -> list[KafkaInputPartition]:
        from pipeline.kafka_source.client import KafkaReader

        opts = self.opts
        with KafkaReader(opts.bootstrap_servers, opts.client_config) as reader:
            tps = _partitions(opts, reader)
            earliest = reader.earliest(tps)
            latest = reader.latest(tps)
            start_times = reader.offsets_for_times(opts.starting.times_for(tps), earliest, latest)
            end_times = reader.offsets_for_times(opts.ending.times_for(tps), earliest, latest)
        start = planning.resolve(opts.starting, tps, earliest, latest, default=EARLIEST, found_by_time=start_times)
        end = planning.resolve(opts.ending, tps, earliest, latest, default=-1, found_by_time=end_times)
        planning.check_time_window(start, end, opts.starting, opts.ending)
        ranges = planning.check_ranges(start, end, earliest, fail_on_data_loss=opts.fail_on_data_loss)
        parts = [
            KafkaInputPartition(r.topic, r.partition, r.start, r.end)
            for r in planning.split_ranges(ranges, opts.min_partitions)
        ]
        # Spark needs at least one partition to build a (possibly empty) DataFrame.
        return parts or [KafkaInputPartition("", -1, 0, 0)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        part = _kafka_partition(partition)
        if part.end <= part.start:
            yield BatchBuilder(self.opts.include_headers).flush()
            return
        yield from _read_partition(self.opts, part)


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch reader; offsets are Spark's JSON layout ``{"topic": {"0": 23}}`` (next offset to read).

    Offsets live in Spark's checkpoint only: :meth:`commit` does not write to Kafka, which is why consumer-group
    options are refused. ``maxOffsetsPerTrigger`` is the default read limit; ``Trigger.AvailableNow`` reads up to the
    offsets seen when the query starts (split by that limit), then stops.
    """

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._target: dict[TopicPartition, int] | None = None

    def _snapshot(self) -> tuple[list[TopicPartition], dict[TopicPartition, int], dict[TopicPartition, int]]:
        from pipeline.kafka_source.client import KafkaReader

        with KafkaReader(self.opts.bootstrap_servers, self.opts.client_config) as reader:
            tps = _partitions(self.opts, reader)
            return tps, reader.earliest(tps), reader.latest(tps)

    def initialOffset(self) -> SparkOffsets:
        tps, earliest, latest = self._snapshot()
        found_by_time = None
        if self.opts.starting.kind == "timestamp":
            from pipeline.kafka_source.client import KafkaReader

            with KafkaReader(self.opts.bootstrap_servers, self.opts.client_config) as reader:
                found_by_time = reader.offsets_for_times(self.opts.starting.times_for(tps), earliest, latest)
        start = planning.resolve(self.opts.starting, tps, earliest, latest, default=-1, found_by_time=found_by_time)
        return offsets_to_json(start)

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.opts.max_offsets_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._snapshot()[2]

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> SparkOffsets:
        """The broker's end offsets as they are, like Spark: an end below the start (a recreated topic) or a
        partition missing from it (a deleted topic) reaches :meth:`partitions`, which reports the data loss."""
        begin = offsets_from_json(start)
        _, earliest, latest = self._snapshot()
        if self._target is not None:
            latest = planning.cap(latest, self._target)
        if isinstance(limit, ReadMaxRows):
            # A partition that appeared after the query started is read from its beginning.
            origin = {tp: begin.get(tp, earliest.get(tp, 0)) for tp in latest}
            latest = planning.rate_limit(origin, latest, limit.max_rows)
        return offsets_to_json(latest)

    def reportLatestOffset(self) -> SparkOffsets | None:
        return offsets_to_json(self._snapshot()[2])

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[KafkaInputPartition]:
        from pipeline.kafka_source.client import KafkaReader

        begin, stop = offsets_from_json(start), offsets_from_json(end)
        # The broker's log start of every partition, not the batch's start: records that aged out since the last
        # batch, or a log that restarted at 0, must be noticed here.
        with KafkaReader(self.opts.bootstrap_servers, self.opts.client_config) as reader:
            earliest = reader.earliest(list(stop))
        ranges = planning.check_ranges(begin, stop, earliest, fail_on_data_loss=self.opts.fail_on_data_loss)
        return [
            KafkaInputPartition(r.topic, r.partition, r.start, r.end)
            for r in planning.split_ranges(ranges, self.opts.min_partitions)
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from _read_partition(self.opts, _kafka_partition(partition))

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: the processed offsets are in Spark's checkpoint, never committed to a group."""


@dataclass
class KafkaCommitMessage(WriterCommitMessage):
    records: int


def _as_bytes(value: Any, column: str) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    raise TypeError(f"column '{column}' must be string or binary, got {type(value).__name__}")


WRITER_COLUMN_TYPES = {
    "topic": ("string",),
    "key": ("string", "binary"),
    "value": ("string", "binary"),
    "headers": ("array<struct<key:string,value:binary>>",),
    "partition": ("int",),
    "timestamp": ("timestamp",),
}
"""The columns the writer uses and their accepted types (``simpleString``); other columns are ignored, as in Spark."""


def check_writer_schema(schema: StructType, topic_option: str | None) -> None:
    """Validate the columns on the driver with the rules and wording of Spark's ``KafkaWriter.validateQuery``."""
    types = {f.name: f.dataType.simpleString() for f in schema.fields}  # no nullability, as Spark's sameType
    if "value" not in types:
        raise KafkaOptionError("Required attribute 'value' not found")
    if topic_option is None and "topic" not in types:
        raise KafkaOptionError(
            "topic option required when no 'topic' attribute is present. Use the topic option for setting a topic."
        )
    for name, accepted in WRITER_COLUMN_TYPES.items():
        got = types.get(name)
        if got is None or (name == "topic" and topic_option is not None):
            continue
        if got not in accepted:
            extra = " (a double timestamp is not supported by pykafka)" if name == "timestamp" else ""
            raise KafkaOptionError(
                f"{name} attribute unsupported type {got}. {name} must be a(n) {' or '.join(accepted)}{extra}"
            )


def _timestamp_ms(value: dt.datetime | None) -> int | None:
    """A ``timestamp`` cell (PySpark gives a naive local datetime, or an aware one) as epoch milliseconds."""
    if value is None:
        return None
    return round(value.timestamp() * 1000)


class KafkaBatchWriter(DataSourceWriter):
    """Sends each row to Kafka with ``acks=all``; a failed send fails the task (and so the job).

    Columns, as in Spark's connector: ``value`` (required), ``key``, ``headers`` (array of struct key/value),
    ``topic``, ``partition``, ``timestamp`` (record timestamp; default: the producer's time); any other column is
    ignored. The ``topic`` option, when set, overrides the column. Kafka writes are at-least-once: a retried task
    may write its records twice.
    """

    def __init__(self, opts: SinkOptions, schema: StructType) -> None:
        self.opts = opts
        check_writer_schema(schema, opts.topic)

    def write(self, iterator: Iterator[Row]) -> KafkaCommitMessage:
        from pipeline.kafka_source.client import KafkaWriter

        with KafkaWriter(self.opts.bootstrap_servers, self.opts.client_config) as producer:
            for row in iterator:
                data = row.asDict()
                topic = self.opts.topic or data.get("topic")
                if not topic:
                    raise KafkaOptionError("null topic present in the data. Use the topic option for setting a topic.")
                headers = data.get("headers")
                producer.send(
                    topic,
                    value=_as_bytes(data.get("value"), "value"),
                    key=_as_bytes(data.get("key"), "key"),
                    partition=data.get("partition"),
                    headers=[(h["key"], _as_bytes(h["value"], "headers.value")) for h in headers] if headers else None,
                    timestamp_ms=_timestamp_ms(data.get("timestamp")),
                )
            producer.flush()
            return KafkaCommitMessage(records=producer.sent)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        total = sum(m.records for m in messages if isinstance(m, KafkaCommitMessage))
        log.info("pykafka: wrote %d records", total)


OVERWRITE_REFUSED = (
    "Save mode Overwrite not allowed for Kafka. Allowed save modes are Append and ErrorIfExists (default). "
    "The pykafka data source accepts only Append: Spark refuses ErrorIfExists and Ignore for every Python data "
    'source, so write with .mode("append").'
)


class KafkaDataSource(DataSource):
    """``spark.read.format("pykafka")``: Spark's Kafka source and sink, in Python, without the JVM connector.

    Same schema and option names as ``format("kafka")``; see docs/pipeline.md for the differences.
    """

    @classmethod
    def name(cls) -> str:
        return SHORT_NAME

    def schema(self) -> str:
        return kafka_ddl(include_headers(self.options))

    def _check_schema(self, schema: StructType | None) -> None:
        expected = kafka_spark_schema(include_headers(self.options))
        if schema is not None and json.loads(schema.json()) != json.loads(expected.json()):
            raise KafkaOptionError("Kafka source has a fixed schema and cannot be set with a custom one")

    def reader(self, schema: StructType) -> KafkaBatchReader:
        self._check_schema(schema)
        return KafkaBatchReader(parse_source_options(self.options, streaming=False))

    def streamReader(self, schema: StructType) -> KafkaStreamReader:
        self._check_schema(schema)
        return KafkaStreamReader(parse_source_options(self.options, streaming=True))

    def writer(self, schema: StructType, overwrite: bool) -> KafkaBatchWriter:
        """Append only: Kafka cannot truncate a topic, so ``mode("overwrite")`` is refused instead of appending.

        Spark hands a Python data source only Append (``overwrite=False``) and Overwrite (``True``); it refuses
        ErrorIfExists (its default mode) and Ignore itself, before this method, with UNSUPPORTED_DATA_SOURCE_SAVE_MODE.
        """
        if overwrite:
            raise KafkaOptionError(OVERWRITE_REFUSED)
        return KafkaBatchWriter(parse_sink_options(self.options), schema)


def register(spark: Any) -> str:
    """Register the source on ``spark`` (idempotent) and return its format name."""
    try:
        spark.dataSource.register(KafkaDataSource)
    except Exception as exc:  # already registered in this session
        if "ALREADY_EXISTS" not in str(exc):
            raise
    return SHORT_NAME
