"""The fixed Kafka schema, as Spark DDL, as a Spark ``StructType`` and as the Arrow schema the readers yield.

Python data sources that yield ``pyarrow.RecordBatch`` skip the slow per-row conversion, but Spark (4.3) compares
the first batch's Arrow schema with the declared one exactly, so this module builds batches with the same types
Spark derives itself (``timestamp[us, tz=UTC]``, ``list<element: struct<...>>``) and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

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
    :meth:`extend` is the reader's fast path: a whole fetched chunk of one topic-partition at a time, one list
    comprehension per column instead of one Python call per record, because the reader's own Python work is what
    separates a Spark read from a bare consumer. ``nbytes`` counts the key, value and header bytes held, so the
    reader can keep a batch of big records from growing to gigabytes.
    """

    def __init__(self, include_headers: bool) -> None:
        self.include_headers = include_headers
        self.schema = kafka_arrow_schema(include_headers)
        self._reset()

    def _reset(self) -> None:
        self._keys: list[bytes | None] = []
        self._values: list[bytes | None] = []
        self._topics: list[str] = []
        self._partitions: list[int] = []
        self._offsets: list[int] = []
        self._timestamps_ms: list[int | None] = []
        self._timestamp_types: list[int | None] = []
        self._headers: list[list[dict[str, Any]] | None] = []
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._offsets)

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
        self._keys.append(key)
        self._values.append(value)
        self._topics.append(topic)
        self._partitions.append(partition)
        self._offsets.append(offset)
        self._timestamps_ms.append(timestamp_ms)
        self._timestamp_types.append(timestamp_type)
        self.nbytes += len(key or b"") + len(value or b"")
        if self.include_headers:
            self._headers.append(_header_structs(headers))
            self.nbytes += _header_bytes(headers)

    def extend(self, records: Sequence[Any], topic: str, partition: int, *, max_rows: int, max_bytes: int) -> int:
        """Add the longest prefix of ``records`` (objects with aiokafka ``ConsumerRecord``'s attributes, all of
        ``topic``/``partition``) that keeps the builder within ``max_rows`` and ``max_bytes``; an empty builder
        always takes at least one record, however big. Returns how many were taken: fewer than given means
        "flush, then call again with the rest"."""
        records = records[: max(0, max_rows - len(self))]
        keys = [r.key for r in records]
        values = [r.value for r in records]
        headers = [r.headers for r in records] if self.include_headers else None
        added = sum(map(len, filter(None, keys))) + sum(map(len, filter(None, values)))
        if headers is not None:
            added += sum(_header_bytes(h) for h in headers if h)
        if self.nbytes + added > max_bytes and records:
            taken, added = self._fit(keys, values, headers, max_bytes - self.nbytes)
            records, keys, values = records[:taken], keys[:taken], values[:taken]
            headers = headers[:taken] if headers is not None else None
        n = len(records)
        self._keys.extend(keys)
        self._values.extend(values)
        self._topics.extend([topic] * n)
        self._partitions.extend([partition] * n)
        self._offsets.extend([r.offset for r in records])
        self._timestamps_ms.extend([r.timestamp for r in records])
        self._timestamp_types.extend([r.timestamp_type for r in records])
        if headers is not None:
            self._headers.extend([_header_structs(h) for h in headers])
        self.nbytes += added
        return n

    def _fit(
        self,
        keys: list[bytes | None],
        values: list[bytes | None],
        headers: list[Any] | None,
        budget: int,
    ) -> tuple[int, int]:
        """How many leading records fit in ``budget`` bytes (at least one into an empty builder), and their bytes."""
        used = 0
        for i, (key, value) in enumerate(zip(keys, values, strict=True)):
            size = len(key or b"") + len(value or b"") + (_header_bytes(headers[i]) if headers is not None else 0)
            if used + size > budget and (i > 0 or len(self) > 0):
                return i, used
            used += size
        return len(keys), used

    def flush(self) -> pa.RecordBatch:
        """The rows held since the last flush, as one batch (possibly empty); the builder starts afresh."""
        millis = pa.array(self._timestamps_ms, type=pa.int64())
        # Kafka's "no timestamp" is -1; Spark's connector gives null. Epoch ms to Arrow's microseconds, vectorised.
        micros = pc.multiply(pc.if_else(pc.less(millis, 0), pa.scalar(None, pa.int64()), millis), 1000)
        arrays = [
            pa.array(self._keys, type=pa.binary()),
            pa.array(self._values, type=pa.binary()),
            pa.array(self._topics, type=pa.string()),
            pa.array(self._partitions, type=pa.int32()),
            pa.array(self._offsets, type=pa.int64()),
            micros.cast(_BASE_FIELDS[5].type),
            pa.array(self._timestamp_types, type=pa.int32()),
        ]
        if self.include_headers:
            arrays.append(pa.array(self._headers, type=_HEADERS_FIELD.type))
        self._reset()
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


def _header_structs(headers: Sequence[tuple[str, bytes | None]] | None) -> list[dict[str, Any]] | None:
    return (
        [{"key": k, "value": v if v is None or isinstance(v, bytes) else bytes(v)} for k, v in headers]
        if headers
        else None
    )


def _header_bytes(headers: Sequence[tuple[str, bytes | None]] | None) -> int:
    return sum(len(k) + len(v or b"") for k, v in headers) if headers else 0


def record_batches(
    chunks: Iterable[Sequence[Any]],
    topic: str,
    partition: int,
    include_headers: bool,
    *,
    max_rows: int = DEFAULT_BATCH_ROWS,
    max_bytes: int,
) -> Iterator[pa.RecordBatch]:
    """Fetched chunks of one topic-partition (aiokafka ``ConsumerRecord`` lists) as Arrow batches of at most
    ``max_rows`` rows and about ``max_bytes`` bytes of keys, values and headers (a single bigger record makes a
    batch of its own)."""
    builder = BatchBuilder(include_headers)
    for chunk in chunks:
        rest: Sequence[Any] = chunk
        while rest:
            taken = builder.extend(rest, topic, partition, max_rows=max_rows, max_bytes=max_bytes)
            rest = rest[taken:]
            if rest or len(builder) >= max_rows or builder.nbytes >= max_bytes:
                yield builder.flush()
    if len(builder):
        yield builder.flush()


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
