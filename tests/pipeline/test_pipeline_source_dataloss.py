"""Data loss in the pykafka source: offsets that vanish between batches or under a read, on real brokers.

The embedded Tansu broker deletes and recreates topics (its log restarts at offset 0) but does not implement
DeleteRecords (it closes the connection), and neither does the librdkafka mock cluster; so "the offsets went
backwards" is made real with a recreated topic, and the mock cluster (which, like Kafka, answers a fetch past the
log end with OFFSET_OUT_OF_RANGE) covers the out-of-range path of a read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.kafka_source.client import confirmed_end, recover_lost_offsets
from pipeline.kafka_source.datasource import KafkaBatchReader, KafkaInputPartition
from pipeline.kafka_source.options import parse_source_options
from pipeline.kafka_source.planning import DataLossError, OffsetRange, check_ranges
from tests.pipeline.conftest import create_topics, produce, unique


def recreate_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    """Delete a topic and create it again: its offsets restart at 0, as after an operator's delete + create."""
    from aiokafka.admin import AIOKafkaAdminClient

    async def delete() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.delete_topics([topic])
        finally:
            await admin.close()

    asyncio.run(delete())
    deadline = time.monotonic() + 10
    while True:
        try:
            create_topics(bootstrap, {topic: partitions})
            break
        except Exception:  # the deletion may still be in progress
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def values(n: int, prefix: str) -> list[dict[str, Any]]:
    return [{"value": f"{prefix}{i}".encode()} for i in range(n)]


def run_available_now(spark: Any, bootstrap: str, topic: str, checkpoint: Path, **options: str) -> list[str]:
    """One ``Trigger.AvailableNow`` run of a streaming query over ``topic``; returns the values it processed."""
    seen: list[str] = []

    def collect(batch: Any, _batch_id: int) -> None:
        seen.extend(row.value for row in batch.selectExpr("CAST(value AS STRING) AS value").collect())

    reader = (
        spark.readStream.format("pykafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
    )
    for name, value in options.items():
        reader = reader.option(name, value)
    query = (
        reader.load()
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert query.awaitTermination(120), "the availableNow query did not finish"
    finally:
        query.stop()
    return sorted(seen)


# --- streaming: a recreated topic between two runs of a query -------------------------------------------------


def test_stream_fails_when_the_topic_was_recreated(spark: Any, broker: Any, tmp_path: Path) -> None:
    from pyspark.errors import StreamingQueryException

    topic = unique("dataloss-stream")
    create_topics(broker.bootstrap, {topic: 1})
    produce(broker.bootstrap, topic, values(5, "old"))
    assert run_available_now(spark, broker.bootstrap, topic, tmp_path / "ckpt") == [f"old{i}" for i in range(5)]

    recreate_topic(broker.bootstrap, topic)
    produce(broker.bootstrap, topic, values(2, "new"))
    with pytest.raises(StreamingQueryException, match=r"offset was changed from 5 to 2"):
        run_available_now(spark, broker.bootstrap, topic, tmp_path / "ckpt")


def test_stream_skips_to_the_new_end_without_fail_on_data_loss(spark: Any, broker: Any, tmp_path: Path) -> None:
    """As Spark: offsets that went backwards are logged and the query goes on from the new end, without reading the
    new log from its start (a whole retained partition in one batch, or records already read after a truncation).
    The warning is logged in Spark's planning worker, out of caplog's reach: its text is checked by
    test_check_ranges_reports_what_a_stream_lost."""
    topic = unique("dataloss-stream-lenient")
    create_topics(broker.bootstrap, {topic: 1})
    produce(broker.bootstrap, topic, values(5, "old"))
    first = run_available_now(spark, broker.bootstrap, topic, tmp_path / "ckpt", failOnDataLoss="false")
    assert first == [f"old{i}" for i in range(5)]

    recreate_topic(broker.bootstrap, topic)
    produce(broker.bootstrap, topic, values(2, "new"))
    second = run_available_now(spark, broker.bootstrap, topic, tmp_path / "ckpt", failOnDataLoss="false")
    assert second == []  # new0, new1 (offsets 0..1 of the new log) are skipped, as Spark does
    # The query goes on from the new end: a third run reads only what arrives after.
    produce(broker.bootstrap, topic, values(1, "later"))
    assert run_available_now(spark, broker.bootstrap, topic, tmp_path / "ckpt", failOnDataLoss="false") == ["later0"]


def test_stream_fails_when_the_topic_is_gone(spark: Any, broker: Any, tmp_path: Path) -> None:
    from aiokafka.admin import AIOKafkaAdminClient
    from pyspark.errors import StreamingQueryException

    topic = unique("dataloss-gone")
    create_topics(broker.bootstrap, {topic: 1})
    produce(broker.bootstrap, topic, values(3, "old"))
    assert len(run_available_now(spark, broker.bootstrap, topic, tmp_path / "ckpt")) == 3

    async def delete() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
        await admin.start()
        try:
            await admin.delete_topics([topic])
        finally:
            await admin.close()

    asyncio.run(delete())
    with pytest.raises(StreamingQueryException, match=rf"Partitions {topic}-0 are gone"):
        run_available_now(spark, broker.bootstrap, topic, tmp_path / "ckpt")


# --- a task's read: the range vanishes between planning and reading ------------------------------------------


def plan_batch(bootstrap: str, topic: str, **options: str) -> tuple[KafkaBatchReader, list[KafkaInputPartition]]:
    opts = parse_source_options(
        {"kafka.bootstrap.servers": bootstrap, "subscribe": topic, "kafkaConsumer.pollTimeoutMs": "20000", **options},
        streaming=False,
    )
    reader = KafkaBatchReader(opts)
    return reader, reader.partitions()


def read_rows(reader: KafkaBatchReader, part: KafkaInputPartition) -> list[str]:
    return [v.decode() for batch in reader.read(part) for v in batch.column("value").to_pylist()]


def test_read_fails_when_the_planned_range_vanished(broker: Any) -> None:
    topic = unique("dataloss-read")
    create_topics(broker.bootstrap, {topic: 1})
    produce(broker.bootstrap, topic, values(10, "old"))
    reader, parts = plan_batch(broker.bootstrap, topic)
    assert [(p.start, p.end) for p in parts] == [(0, 10)]

    recreate_topic(broker.bootstrap, topic)
    produce(broker.bootstrap, topic, values(3, "new"))
    began = time.monotonic()
    with pytest.raises(DataLossError, match=rf"{topic}-0: offset 3 is past the end of the log \(3\)"):
        read_rows(reader, parts[0])
    # Noticed from the broker's answer, not after kafkaConsumer.pollTimeoutMs (20 s) without records.
    assert time.monotonic() - began < 15


def test_read_logs_the_skipped_offsets_without_fail_on_data_loss(broker: Any, caplog: pytest.LogCaptureFixture) -> None:
    topic = unique("dataloss-read-lenient")
    create_topics(broker.bootstrap, {topic: 1})
    produce(broker.bootstrap, topic, values(10, "old"))
    reader, parts = plan_batch(broker.bootstrap, topic, failOnDataLoss="false")

    recreate_topic(broker.bootstrap, topic)
    produce(broker.bootstrap, topic, values(3, "new"))
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pipeline.kafka_source"):
        rows = read_rows(reader, parts[0])
    assert rows == ["new0", "new1", "new2"]  # what is left at the planned offsets
    assert time.monotonic() - began < 15
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"{topic}-0" in w and "Skipping offsets 3..9" in w for w in warnings), warnings


def test_read_out_of_range_on_a_kafka_that_reports_it(mock_kafka: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Kafka (and the mock cluster) answer a fetch past the log end with OFFSET_OUT_OF_RANGE; no automatic reset."""
    topic = unique("dataloss-oor")
    mock_kafka.server.create_topics([topic], 1)
    produce(mock_kafka.bootstrap, topic, values(10, "v"))
    for fail in ("true", "false"):
        opts = parse_source_options(
            {
                "kafka.bootstrap.servers": mock_kafka.bootstrap,
                "subscribe": topic,
                "kafkaConsumer.pollTimeoutMs": "20000",
                "failOnDataLoss": fail,
            },
            streaming=False,
        )
        # A range planned when the partition was longer (a truncated or recreated log).
        part = KafkaInputPartition(topic, 0, 20, 30)
        began = time.monotonic()
        if fail == "true":
            with pytest.raises(DataLossError, match=rf"{topic}-0: offset 20 is past the end of the log \(10\)"):
                read_rows(KafkaBatchReader(opts), part)
        else:
            with caplog.at_level(logging.WARNING, logger="pipeline.kafka_source"):
                assert read_rows(KafkaBatchReader(opts), part) == []
            assert any("Skipping offsets 20..29" in r.getMessage() for r in caplog.records)
        assert time.monotonic() - began < 15


# --- the decisions themselves ---------------------------------------------------------------------------------


def test_recover_lost_offsets_decisions(caplog: pytest.LogCaptureFixture) -> None:
    # Inside the log: nothing lost, the read goes on where it is.
    assert recover_lost_offsets("t", 0, 5, 10, 0, 10, fail_on_data_loss=True) == 5
    # The log start moved past the position (retention, DeleteRecords).
    with pytest.raises(DataLossError, match=r"t-0: offsets 5\.\.7 are no longer in Kafka"):
        recover_lost_offsets("t", 0, 5, 10, 8, 20, fail_on_data_loss=True)
    with caplog.at_level(logging.WARNING, logger="pipeline.kafka_source"):
        assert recover_lost_offsets("t", 0, 5, 10, 8, 20, fail_on_data_loss=False) == 8
        # The whole rest of the range aged out: stop at the end.
        assert recover_lost_offsets("t", 0, 5, 10, 12, 20, fail_on_data_loss=False) == 10
    assert "Skipping offsets 5..7" in caplog.text and "Skipping offsets 5..9" in caplog.text
    # A first record above the position while the log start moved: said in the message.
    with pytest.raises(DataLossError, match="first record returned has offset 9"):
        recover_lost_offsets("t", 0, 5, 10, 8, None, fail_on_data_loss=True, first_record=9)
    # Past the log end: the offsets went backwards.
    with pytest.raises(DataLossError, match=r"recreated"):
        recover_lost_offsets("t", 0, 5, 10, 0, 3, fail_on_data_loss=True)


def test_check_ranges_reports_what_a_stream_lost(caplog: pytest.LogCaptureFixture) -> None:
    a0, b0 = ("a", 0), ("b", 0)
    # Offsets went backwards (truncated log, recreated topic): fail, or skip the partition and go on from the new end.
    with pytest.raises(DataLossError, match=r"Partition a-0's offset was changed from 9 to 4"):
        check_ranges({a0: 9}, {a0: 4}, {a0: 0}, fail_on_data_loss=True)
    with caplog.at_level(logging.WARNING, logger="pipeline.kafka_source"):
        assert check_ranges({a0: 9}, {a0: 4}, {a0: 0}, fail_on_data_loss=False) == []
    assert "goes on from offset 4; the records it read at offsets 4..8 are no longer in Kafka" in caplog.text
    assert "records now at offsets 0..3 (a recreated topic) are skipped" in caplog.text
    # An unclean leader election truncating 1,000,000 to 999,990 with a long retained log: no re-read of the log.
    assert check_ranges({a0: 1_000_000}, {a0: 999_990}, {a0: 0}, fail_on_data_loss=False) == []
    # A partition known at the start is gone.
    with pytest.raises(DataLossError, match=r"Partitions b-0 are gone"):
        check_ranges({a0: 1, b0: 3}, {a0: 2}, {a0: 0}, fail_on_data_loss=True)
    assert check_ranges({a0: 1, b0: 3}, {a0: 2}, {a0: 0}, fail_on_data_loss=False) == [OffsetRange("a", 0, 1, 2)]
    # A new partition whose log does not start at 0 lost its head before the query saw it.
    with pytest.raises(DataLossError, match=r"Added partition b-0 starts from 4 instead of 0"):
        check_ranges({a0: 1}, {a0: 2, b0: 9}, {a0: 0, b0: 4}, fail_on_data_loss=True)


def test_read_committed_batch_ends_at_the_last_stable_offset_of_the_fetch(spark: Any, mock_kafka: Any) -> None:
    """The read_committed end comes from the fetch's last stable offset (the mock cluster supports transactions,
    though it reports the last stable offset equal to the high watermark, so an open transaction cannot be shown
    to stay out here: see test_read_committed_end_is_the_last_stable_offset)."""
    from aiokafka import AIOKafkaProducer

    from pipeline.kafka_source.client import KafkaReader

    topic = unique("read-committed")
    mock_kafka.server.create_topics([topic], 1)
    produce(mock_kafka.bootstrap, topic, values(5, "plain"))

    async def transaction() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=mock_kafka.bootstrap, transactional_id=unique("tx"))
        await producer.start()
        try:
            async with producer.transaction():
                for i in range(3):
                    await producer.send_and_wait(topic, f"tx{i}".encode())
        finally:
            await producer.stop()

    asyncio.run(transaction())
    # The mock cluster writes transaction markers with a CRC aiokafka rejects; Kafka's are valid.
    committed = {"isolation.level": "read_committed", "check.crcs": "false"}
    with KafkaReader(mock_kafka.bootstrap, committed) as reader:
        assert reader.read_committed
        end = reader.latest([(topic, 0)])[(topic, 0)]
    assert end >= 8  # 5 plain records, 3 transactional ones and the commit marker
    rows = (
        spark.read.format("pykafka")
        .option("kafka.bootstrap.servers", mock_kafka.bootstrap)
        .option("kafka.isolation.level", "read_committed")
        .option("kafka.check.crcs", "false")
        .option("subscribe", topic)
        .load()
        .selectExpr("CAST(value AS STRING) AS value")
        .collect()
    )
    assert sorted(r.value for r in rows) == [*(f"plain{i}" for i in range(5)), *(f"tx{i}" for i in range(3))]


def test_read_committed_end_is_the_last_stable_offset() -> None:
    # An open transaction holds offsets 10..12: the high watermark is 13, the last stable offset 10.
    assert confirmed_end(10, 13, 10, read_committed=True) == 10
    assert confirmed_end(10, 13, 10, read_committed=False) == 13
    # A broker that under-reports ListOffsets (Tansu) is corrected by the fetch either way.
    assert confirmed_end(8, 13, 13, read_committed=True) == 13
    assert confirmed_end(8, None, None, read_committed=False) is None
