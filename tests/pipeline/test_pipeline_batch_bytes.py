"""``maxBatchBytes``: the reader's Arrow batches stay near a byte budget, not only 4,096 rows, so big records
cannot build gigabyte batches; and the column-wise batch building keeps the exact Kafka schema."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from aiokafka.structs import ConsumerRecord
from conftest import create_topics, produce, unique

from pipeline.kafka_source.arrow import BatchBuilder, kafka_arrow_schema, kafka_spark_schema, record_batches
from pipeline.kafka_source.datasource import KafkaDataSource, reader_fetch_config
from pipeline.kafka_source.options import DEFAULT_MAX_BATCH_BYTES, KafkaOptionError, parse_source_options


def _record(offset: int, value: bytes | None, key: bytes | None = None, headers: tuple = (), ts: int = 5) -> Any:
    return ConsumerRecord(
        topic="t",
        partition=3,
        offset=offset,
        timestamp=ts,
        timestamp_type=0,
        key=key,
        value=value,
        checksum=None,
        serialized_key_size=len(key or b""),
        serialized_value_size=len(value or b""),
        headers=headers,
    )


def _value_bytes(batch: pa.RecordBatch) -> int:
    return sum(
        len(v or b"") + len(k or b"") for k, v in zip(batch["key"].to_pylist(), batch["value"].to_pylist(), strict=True)
    )


def test_batches_are_cut_at_the_byte_budget_across_fetched_chunks() -> None:
    chunks = [[_record(i, b"x" * 100) for i in range(0, 7)], [_record(i, b"x" * 100) for i in range(7, 10)]]
    out = list(record_batches(chunks, "t", 3, include_headers=False, max_rows=4096, max_bytes=250))
    assert [b.num_rows for b in out] == [2, 2, 2, 2, 2]
    assert all(_value_bytes(b) <= 250 for b in out)
    assert pa.Table.from_batches(out).column("offset").to_pylist() == list(range(10))


def test_a_record_bigger_than_the_budget_is_a_batch_of_its_own() -> None:
    chunks = [[_record(0, b"s"), _record(1, b"B" * 1000), _record(2, b"s"), _record(3, b"s")]]
    out = list(record_batches(chunks, "t", 3, include_headers=False, max_rows=4096, max_bytes=100))
    assert [b["offset"].to_pylist() for b in out] == [[0], [1], [2, 3]]


def test_rows_still_cap_batches_of_small_records() -> None:
    chunks = [[_record(i, b"v") for i in range(10)]]
    out = list(record_batches(chunks, "t", 3, include_headers=False, max_rows=4, max_bytes=DEFAULT_MAX_BATCH_BYTES))
    assert [b.num_rows for b in out] == [4, 4, 2]


def test_keys_and_headers_count_towards_the_budget() -> None:
    headers = (("name", b"h" * 40),)
    chunks = [[_record(i, b"v" * 10, key=b"k" * 10, headers=headers) for i in range(4)]]
    out = list(record_batches(chunks, "t", 3, include_headers=True, max_rows=4096, max_bytes=130))
    assert [b.num_rows for b in out] == [2, 2]  # 64 bytes a record


def test_column_wise_batches_have_the_exact_schema_and_values() -> None:
    chunk = [
        _record(7, b"v0", headers=(("h", b"x"), ("n", None)), ts=1_700_000_000_123),
        _record(8, None, key=b"k", ts=-1),
    ]
    for include_headers in (False, True):
        (batch,) = record_batches([chunk], "t", 3, include_headers=include_headers, max_bytes=1000)
        assert batch.schema.equals(kafka_arrow_schema(include_headers))
        rows = batch.to_pylist()
        assert [(r["key"], r["value"], r["topic"], r["partition"], r["offset"]) for r in rows] == [
            (None, b"v0", "t", 3, 7),
            (b"k", None, "t", 3, 8),
        ]
        assert batch.column("timestamp")[0].value == 1_700_000_000_123_000
        assert rows[1]["timestamp"] is None
        if include_headers:
            assert rows[0]["headers"] == [{"key": "h", "value": b"x"}, {"key": "n", "value": None}]
            assert rows[1]["headers"] is None


def test_append_and_extend_build_the_same_batch() -> None:
    records = [
        _record(i, b"v%d" % i, key=b"k" if i % 2 else None, headers=(("h", b"%d" % i),) if i % 3 else ())
        for i in range(6)
    ]
    by_record = BatchBuilder(include_headers=True)
    for r in records:
        by_record.append(
            key=r.key,
            value=r.value,
            topic=r.topic,
            partition=r.partition,
            offset=r.offset,
            timestamp_ms=r.timestamp,
            timestamp_type=r.timestamp_type,
            headers=r.headers,
        )
    by_chunk = BatchBuilder(include_headers=True)
    assert by_chunk.extend(records, "t", 3, max_rows=4096, max_bytes=10**6) == 6
    assert by_chunk.nbytes == by_record.nbytes
    assert by_chunk.flush().equals(by_record.flush())


def test_max_batch_bytes_option() -> None:
    base = {"kafka.bootstrap.servers": "b:9092", "subscribe": "t"}
    assert parse_source_options(base, streaming=False).max_batch_bytes == DEFAULT_MAX_BATCH_BYTES
    assert parse_source_options({**base, "maxBatchBytes": "1048576"}, streaming=True).max_batch_bytes == 1048576
    for bad in ("0", "-5", "64MB"):
        with pytest.raises(KafkaOptionError, match="maxBatchBytes"):
            parse_source_options({**base, "maxBatchBytes": bad}, streaming=False)


def test_fetch_sizes_follow_the_budget_unless_set() -> None:
    small = reader_fetch_config({}, 200_000)
    assert (small["max.partition.fetch.bytes"], small["fetch.max.bytes"]) == ("200000", "200000")
    default = reader_fetch_config({}, DEFAULT_MAX_BATCH_BYTES)
    assert int(default["fetch.max.bytes"]) <= DEFAULT_MAX_BATCH_BYTES
    mine = reader_fetch_config({"max.partition.fetch.bytes": "123", "fetch.max.wait.ms": "500"}, 200_000)
    assert mine == {"max.partition.fetch.bytes": "123", "fetch.max.bytes": "200000", "fetch.max.wait.ms": "500"}
    # a short broker wait by default: a pooled reader's next task queues behind the long poll past the last range
    assert int(default["fetch.max.wait.ms"]) <= 100


BIG = 100 * 1024


@pytest.mark.broker
def test_the_reader_keeps_batches_of_big_records_within_max_batch_bytes(broker) -> None:
    """Twelve 100 KiB records with ``maxBatchBytes`` 300,000: the partition's reader yields batches of at most two
    records (before the option, one batch of all twelve, as it only counted rows)."""
    topic = unique("bigrecords")
    create_topics(broker.bootstrap, {topic: 1})
    produce(broker.bootstrap, topic, [{"value": bytes([i]) * BIG, "key": b"k%d" % i} for i in range(12)])
    options = {"kafka.bootstrap.servers": broker.bootstrap, "subscribe": topic, "maxBatchBytes": "300000"}
    source = KafkaDataSource(options)
    reader = source.reader(kafka_spark_schema(include_headers=False))
    out = [batch for part in reader.partitions() for batch in reader.read(part)]
    assert sum(b.num_rows for b in out) == 12
    assert max(_value_bytes(b) for b in out) <= 300_000, [b.num_rows for b in out]
    values = [v for b in out for v in b["value"].to_pylist()]
    assert values == [bytes([i]) * BIG for i in range(12)]


@pytest.mark.broker
@pytest.mark.spark
def test_spark_reads_big_records_with_a_small_budget(spark, broker) -> None:
    topic = unique("bigspark")
    create_topics(broker.bootstrap, {topic: 2})
    produce(broker.bootstrap, topic, [{"value": b"v" * BIG, "partition": i % 2} for i in range(10)])
    df = (
        spark.read.format("pykafka")
        .option("kafka.bootstrap.servers", broker.bootstrap)
        .option("subscribe", topic)
        .option("maxBatchBytes", str(BIG + 1))
        .load()
    )
    row = df.selectExpr("count(*) as n", "sum(length(value)) as b", "count(distinct offset, partition) as d").first()
    assert (row["n"], row["b"], row["d"]) == (10, 10 * BIG, 10)
