"""Topics written by transactional producers (Kafka Streams with exactly-once, Flink sinks): a worker reads committed
records only, and steps over transaction markers and aborted transactions without reading anything twice.

Neither Kafka implementation the tests run on answers a read_committed fetch with its aborted transactions (the
protocol's ``AbortedTransactions`` list, from which the client drops aborted batches): Tansu sends an empty list, and
librdkafka's mock cluster always writes 0 (``rd_kafka_mock_handle_Fetch``: "Response: #Aborted"). The first tests pin
that down, so that they fail (and say so) once either implementation gains it. What aborted records do is therefore
shown on the real bytes of a real transactional producer, fetched from Tansu, decoded by aiokafka's own fetcher code
with the aborted-transaction list a Kafka broker sends for them; what markers cost is shown end to end, through a
real worker on Tansu.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from typing import Any

import pytest

from tests.integration.conftest import Deployment, wait_for
from tests.kafka_under_test import MOCK, selected_kafkas

confluent_kafka = pytest.importorskip("confluent_kafka", reason="the transactional producer is librdkafka's")

pytestmark = pytest.mark.broker
needs_mock = pytest.mark.skipif(MOCK not in selected_kafkas(), reason="REBOUND_TEST_KAFKA leaves out the mock cluster")

PER_TRANSACTION = 3
# commit, abort, commit: offsets 0-2 records, 3 commit marker, 4-6 aborted records, 7 abort marker, 8-10, 11.
COMMIT_ABORT_COMMIT = [("a", True), ("b", False), ("c", True)]


def produce_transactions(bootstrap: str, topic: str, plan: list[tuple[str, bool]], value: bytes = b"{}") -> None:
    """One transaction per step of ``plan`` (its name, and whether it commits), all to partition 0."""
    producer = confluent_kafka.Producer(
        {"bootstrap.servers": bootstrap, "transactional.id": f"tx-{uuid.uuid4().hex[:8]}", "linger.ms": 5}
    )
    producer.init_transactions(30)
    for name, commit in plan:
        producer.begin_transaction()
        for index in range(PER_TRANSACTION):
            producer.produce(topic, key=f"{name}{index}".encode(), value=value, partition=0)
        producer.flush(30)
        if commit:
            producer.commit_transaction(30)
        else:
            producer.abort_transaction(30)


async def fetch_partition_zero(bootstrap: str, topic: str, isolation_level: str) -> tuple[list[bytes], list[Any]]:
    """Read partition 0 to its end with aiokafka, keeping what each fetch answer carried: the record bytes, and the
    aborted-transaction list (aiokafka's fetcher reads both from the answer; they are captured where it does)."""
    import aiokafka.consumer.fetcher as fetcher_module
    from aiokafka import AIOKafkaConsumer, TopicPartition

    raw: list[bytes] = []
    aborted: list[Any] = []
    real_memory_records, real_partition_records = fetcher_module.MemoryRecords, fetcher_module.PartitionRecords

    def memory_records(data: bytes) -> Any:
        raw.append(bytes(data))
        return real_memory_records(data)

    def partition_records(tp: Any, records: Any, aborted_transactions: Any, *args: Any) -> Any:
        aborted.extend(aborted_transactions or ())
        return real_partition_records(tp, records, aborted_transactions, *args)

    tp = TopicPartition(topic, 0)
    # No CRC check: the mock cluster writes its control batches with a wrong CRC (see the test below).
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level=isolation_level, check_crcs=False)
    await consumer.start()
    fetcher_module.MemoryRecords, fetcher_module.PartitionRecords = memory_records, partition_records
    try:
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        deadline = time.monotonic() + 15
        while await consumer.position(tp) < end and time.monotonic() < deadline:
            await consumer.getmany(timeout_ms=200)
        assert await consumer.position(tp) == end
    finally:
        fetcher_module.MemoryRecords, fetcher_module.PartitionRecords = real_memory_records, real_partition_records
        await consumer.stop()
    return [data for data in raw if data], aborted


@pytest.mark.parametrize("implementation", ["tansu", pytest.param(MOCK, marks=needs_mock)])
def test_no_kafka_here_sends_its_aborted_transactions(implementation: str, request: pytest.FixtureRequest) -> None:
    kafka = request.getfixturevalue("tansu_kafka" if implementation == "tansu" else "mock_kafka")
    topic = f"txn-{uuid.uuid4().hex[:8]}"
    asyncio.run(kafka.create_topics([topic], 1))
    produce_transactions(kafka.bootstrap, topic, COMMIT_ABORT_COMMIT)
    _, aborted = asyncio.run(fetch_partition_zero(kafka.bootstrap, topic, "read_committed"))
    # A Kafka broker answers [(producer id, 4)] here: the aborted transaction starts at offset 4. If this fails, the
    # implementation gained it: move the aborted-record check of this module to a worker on it, end to end.
    assert aborted == []


@needs_mock
def test_the_mock_cluster_writes_transaction_markers_with_a_wrong_crc(mock_kafka: Any) -> None:
    """Why no worker reads a transactional topic on the mock cluster: aiokafka checks CRCs (Faust's default), so each
    marker would be an undecodable batch there. Pinned so that it is noticed when librdkafka fixes it."""
    from aiokafka.record.memory_records import MemoryRecords

    topic = f"txn-{uuid.uuid4().hex[:8]}"
    asyncio.run(mock_kafka.create_topics([topic], 1))
    produce_transactions(mock_kafka.bootstrap, topic, [("a", True)])
    raw, _ = asyncio.run(fetch_partition_zero(mock_kafka.bootstrap, topic, "read_committed"))
    batches = []
    for data in raw:
        records = MemoryRecords(data)
        while records.has_next():
            batch = records.next_batch()
            batches.append((batch.base_offset, batch.is_control_batch, batch.validate_crc()))
    assert batches == [(0, False, True), (3, True, False)]


def decode(raw: list[bytes], aborted: list[tuple[int, int]], isolation_level: str) -> tuple[list[int], list[Any]]:
    """Decode fetched bytes as aiokafka's fetcher does (its ``PartitionRecords``), through the worker's hole reporter:
    the offsets handed over, and the ranges reported as shown empty."""
    from aiokafka.consumer.fetcher import READ_COMMITTED, READ_UNCOMMITTED, PartitionRecords
    from aiokafka.record.memory_records import MemoryRecords
    from aiokafka.structs import TopicPartition

    from app.fetch_holes import HoleReportingRecords

    tp = TopicPartition("items", 0)
    holes: list[tuple[int, int]] = []
    offsets: list[int] = []
    level = READ_COMMITTED if isolation_level == "read_committed" else READ_UNCOMMITTED
    position = 0
    for data in raw:
        records = PartitionRecords(tp, MemoryRecords(data), aborted, position, None, None, True, level)
        reporting = HoleReportingRecords(tp, records, lambda _tp, first, last: holes.append((first, last)))
        offsets += [record.offset for record in reporting]
        position = reporting.next_fetch_offset
    assert position == 12  # the fetcher's position ends past the last marker either way
    return offsets, holes


def test_aborted_records_are_dropped_and_every_skipped_offset_reported_on_a_real_producers_bytes(
    tansu_kafka: Any,
) -> None:
    """What a worker's fetcher does with a transactional topic on a Kafka broker, which sends the aborted
    transaction (producer id, first offset) with the fetch answer."""
    from aiokafka.record.memory_records import MemoryRecords

    topic = f"txn-{uuid.uuid4().hex[:8]}"
    asyncio.run(tansu_kafka.create_topics([topic], 1))
    produce_transactions(tansu_kafka.bootstrap, topic, COMMIT_ABORT_COMMIT)
    raw, _ = asyncio.run(fetch_partition_zero(tansu_kafka.bootstrap, topic, "read_committed"))
    producer_id = MemoryRecords(raw[0]).next_batch().producer_id
    kafka_answer = [(producer_id, 4)]  # the aborted transaction "b" starts at offset 4

    committed, holes = decode(raw, kafka_answer, "read_committed")
    assert committed == [0, 1, 2, 8, 9, 10]  # "b" (4-6) never reaches a handler
    assert holes == [(3, 7), (11, 11)]  # marker, aborted records and marker in one range; the last marker

    uncommitted, holes = decode(raw, kafka_answer, "read_uncommitted")
    assert uncommitted == [0, 1, 2, 4, 5, 6, 8, 9, 10]  # what the worker read before: aborted records included
    assert holes == [(3, 3), (7, 7), (11, 11)]  # the markers alone


def handled(deployment: Deployment) -> list[str]:
    return [call["key"] for call in deployment.calls()]


async def committed_offset(bootstrap: str, group: str, topic: str) -> int | None:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        return await consumer.committed(TopicPartition(topic, 0))  # type: ignore[no-any-return]
    finally:
        await consumer.stop()


def test_a_worker_reads_committed_transactions_only_and_steps_over_markers_without_reading_again(
    deploy: Any,
) -> None:
    """Two committed transactions, then one left open: the worker handles the six committed records, waits at the
    last stable offset while the third is open (read_uncommitted ran its records at once), runs them once it
    commits, and commits past every marker; no marker made it read anything again."""
    deployment: Deployment = deploy(partitions=1)
    worker = deployment.start_worker()
    producer = confluent_kafka.Producer(
        {"bootstrap.servers": deployment.broker.bootstrap, "transactional.id": f"tx-{uuid.uuid4().hex[:8]}"}
    )
    producer.init_transactions(30)
    for name in ("a", "b", "c"):
        producer.begin_transaction()
        for index in range(PER_TRANSACTION):
            producer.produce(deployment.topic, key=f"{name}{index}".encode(), value=b"{}", partition=0)
        producer.flush(30)
        if name != "c":
            producer.commit_transaction(30)
    first_two = ["a0", "a1", "a2", "b0", "b1", "b2"]
    wait_for(lambda: handled(deployment) == first_two, 90, "the committed transactions handled", deployment.workers)
    time.sleep(3)  # more than a fetch wait and a commit interval: an open transaction's records would have run
    assert handled(deployment) == first_two  # held at the last stable offset (3 + 1 + 3 + 1 = 8)
    producer.commit_transaction(30)
    wait_for(lambda: len(handled(deployment)) == 9, 30, "the third transaction handled", deployment.workers)
    assert handled(deployment) == [*first_two, "c0", "c1", "c2"]  # once each, in order

    # Committed past the markers at 3 and 7, the last record (10) and the last marker (11): the group's lag is 0.
    wait_for(
        lambda: asyncio.run(committed_offset(deployment.broker.bootstrap, deployment.app_id, deployment.topic)) == 12,
        30,
        "the group's commit past the last marker",
        deployment.workers,
    )
    log = worker.log_text()
    assert "the worker reads with isolation level read_committed" in log
    assert not re.findall(r"reading again|reading them again", log), re.findall(r".*reading.*again.*", log)
