"""The fixed Kafka schema, as Spark DDL, as a Spark ``StructType`` and as the Arrow schema the readers yield.

Python data sources that yield ``pyarrow.RecordBatch`` skip the slow per-row conversion, but Spark (4.3) compares
the first batch's Arrow schema with the declared one exactly, so this module builds batches with the same types
Spark derives itself (``timestamp[us, tz=UTC]``, ``list<element: struct<...>>``) and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa

KAFKA_DDL = "key binary, value binary, topic string, partition int, offset long, timestamp timestamp, timestampType int"
HEADERS_DDL = "headers array<struct<key:string,value:binary>>"

HEADER_TYPE = pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())])
_BASE_FIELDS = [
    pa.field("key", pa.binary()),
    pa.field("value", pa.binary()),
    pa.field("topic", pa.string()),
    pa.field("partition", pa.int32()),
    pa.field("offset", pa.int64()),
    pa.field("timestamp", pa.timestamp("us", tz="UTC")),
    pa.field("timestampType", pa.int32()),
]
_HEADERS_FIELD = pa.field("headers", pa.list_(pa.field("element", HEADER_TYPE)))

DEFAULT_BATCH_ROWS = 4096


def kafka_ddl(include_headers: bool) -> str:
    return f"{KAFKA_DDL}, {HEADERS_DDL}" if include_headers else KAFKA_DDL


def kafka_arrow_schema(include_headers: bool) -> pa.Schema:
    return pa.schema([*_BASE_FIELDS, _HEADERS_FIELD] if include_headers else _BASE_FIELDS)


def kafka_spark_schema(include_headers: bool) -> Any:
    """The same schema as a ``pyspark.sql.types.StructType`` (built without a SparkSession)."""
    from pyspark.sql.types import (
        ArrayType,
        BinaryType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
        TimestampType,
    )

    fields = [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("timestampType", IntegerType()),
    ]
    if include_headers:
        header = StructType([StructField("key", StringType()), StructField("value", BinaryType())])
        fields.append(StructField("headers", ArrayType(header)))
    return StructType(fields)


class BatchBuilder:
    """Accumulates records column by column and emits RecordBatches of the exact Kafka Arrow schema.

    ``append`` takes plain values (so it is independent of the Kafka client); ``headers`` is a sequence of
    ``(name, bytes)`` pairs, and an empty or missing header list becomes null, as in Spark's connector.
    """

    def __init__(self, include_headers: bool) -> None:
        self.include_headers = include_headers
        self.schema = kafka_arrow_schema(include_headers)
        self._reset()

    def _reset(self) -> None:
        self._cols: dict[str, list[Any]] = {f.name: [] for f in self.schema}

    def __len__(self) -> int:
        return len(self._cols["offset"])

    def append(
        self,
        *,
        key: bytes | None,
        value: bytes | None,
        topic: str,
        partition: int,
        offset: int,
        timestamp_ms: int | None,
        timestamp_type: int | None,
        headers: Sequence[tuple[str, bytes | None]] | None = None,
    ) -> None:
        cols = self._cols
        cols["key"].append(key)
        cols["value"].append(value)
        cols["topic"].append(topic)
        cols["partition"].append(partition)
        cols["offset"].append(offset)
        cols["timestamp"].append(None if timestamp_ms is None or timestamp_ms < 0 else timestamp_ms * 1000)
        cols["timestampType"].append(timestamp_type)
        if self.include_headers:
            cols["headers"].append([{"key": k, "value": v} for k, v in headers] if headers else None)

    def flush(self) -> pa.RecordBatch:
        """The rows appended since the last flush, as one batch (possibly empty); the builder starts afresh."""
        arrays = [pa.array(self._cols[f.name], type=f.type) for f in self.schema]
        self._reset()
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


def batches(
    records: Iterable[dict[str, Any]], include_headers: bool, rows: int = DEFAULT_BATCH_ROWS
) -> Iterator[pa.RecordBatch]:
    """Convenience: turn dicts with :meth:`BatchBuilder.append`'s keyword names into batches of ``rows`` rows."""
    builder = BatchBuilder(include_headers)
    for record in records:
        builder.append(**record)
        if len(builder) >= rows:
            yield builder.flush()
    if len(builder):
        yield builder.flush()
