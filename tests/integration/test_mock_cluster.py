"""librdkafka's mock cluster as a second Kafka implementation: it starts, plain clients work on it, and so does Rebound.

Also pins down what the other integration tests rely on when they run on it (``every_kafka``): which requests it
implements, and that its ListOffsets answers are exact with multi-record batches.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import struct
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from demo.harness import produce
from demo.mock_cluster import MockCluster, start_mock_cluster
from rebound.errors import BrokerStartError
from tests.integration.conftest import Deployment, attempts_by_key
from tests.kafka_under_test import MOCK, Kafka, selected_kafkas

pytest.importorskip("confluent_kafka", reason="the librdkafka mock cluster comes with confluent-kafka")
if MOCK not in selected_kafkas():
    pytest.skip("REBOUND_TEST_KAFKA leaves out the librdkafka mock cluster", allow_module_level=True)

pytestmark = pytest.mark.broker

# Kafka API keys
PRODUCE, FETCH, LIST_OFFSETS, METADATA, OFFSET_COMMIT, OFFSET_FETCH, FIND_COORDINATOR = 0, 1, 2, 3, 8, 9, 10
JOIN_GROUP, HEARTBEAT, LEAVE_GROUP, SYNC_GROUP, CREATE_TOPICS, DELETE_TOPICS, DESCRIBE_CONFIGS = (
    11,
    12,
    13,
    14,
    19,
    20,
    32,
)
LIST_GROUPS, DESCRIBE_GROUPS = 16, 15


@pytest.fixture(scope="module")
def kafka(mock_kafka: Kafka) -> Kafka:
    """``deploy`` in this module runs on the mock cluster only."""
    return mock_kafka


def api_keys(bootstrap: str) -> set[int]:
    """The request types a broker announces (ApiVersions v0)."""
    host, port = bootstrap.split(",", maxsplit=1)[0].rsplit(":", 1)
    client_id = b"rebound-test"
    body = struct.pack(">hhih", 18, 0, 7, len(client_id)) + client_id
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        (size,) = struct.unpack(">i", sock.recv(4, socket.MSG_WAITALL))
        payload = sock.recv(size, socket.MSG_WAITALL)
    correlation_id, error_code, count = struct.unpack(">ihi", payload[:10])
    assert (correlation_id, error_code) == (7, 0)
    return {struct.unpack(">h", payload[10 + 6 * index : 12 + 6 * index])[0] for index in range(count)}


def test_the_mock_cluster_has_three_brokers_and_the_embedded_brokers_surface(mock_cluster: MockCluster) -> None:
    assert len(mock_cluster.brokers) == 3
    assert mock_cluster.bootstrap == ",".join(mock_cluster.brokers)
    assert mock_cluster.url == ",".join(f"kafka://{broker}" for broker in mock_cluster.brokers)
    assert mock_cluster.port == int(mock_cluster.brokers[0].rsplit(":", 1)[1])
    assert mock_cluster.process.poll() is None


def test_the_mock_cluster_implements_what_faust_needs_but_not_the_admin_requests(mock_cluster: MockCluster) -> None:
    keys = api_keys(mock_cluster.bootstrap)
    needed = {PRODUCE, FETCH, LIST_OFFSETS, METADATA, OFFSET_COMMIT, OFFSET_FETCH, FIND_COORDINATOR}
    needed |= {JOIN_GROUP, HEARTBEAT, LEAVE_GROUP, SYNC_GROUP}
    assert needed <= keys
    # Why the tests create topics through the mock's control channel and run workers with REBOUND_PROVISION_TOPICS=false.
    # If this fails, librdkafka gained these requests and the work-around in tests/kafka_under_test.py can go.
    assert not keys & {CREATE_TOPICS, DELETE_TOPICS, DESCRIBE_CONFIGS, LIST_GROUPS, DESCRIBE_GROUPS}


def test_aiokafka_produces_with_acks_all_and_consumes_with_a_group_that_commits(mock_cluster: MockCluster) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    topic, group, count = f"direct-{uuid.uuid4().hex[:8]}", f"group-{uuid.uuid4().hex[:8]}", 60
    mock_cluster.create_topics([topic], partitions=3, replication=1)
    partitions = [TopicPartition(topic, p) for p in range(3)]

    async def run() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=mock_cluster.bootstrap)
        await admin.start()
        try:
            [description] = await admin.describe_topics([topic])
        finally:
            await admin.close()
        assert sorted(p["leader"] for p in description["partitions"]) == [1, 2, 3]  # one leader per broker

        producer = AIOKafkaProducer(bootstrap_servers=mock_cluster.bootstrap, acks="all", linger_ms=50)
        await producer.start()
        try:
            pending = [
                await producer.send(topic, key=f"k{i}".encode(), value=f"v{i}".encode(), headers=[("n", b"%d" % i)])
                for i in range(count)
            ]
            sent = await asyncio.gather(*pending)
        finally:
            await producer.stop()
        per_partition = Counter(result.partition for result in sent)
        for tp in partitions:  # offsets are dense from 0 in every partition
            assert sorted(r.offset for r in sent if r.partition == tp.partition) == list(
                range(per_partition[tp.partition])
            )

        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=mock_cluster.bootstrap,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        await consumer.start()
        try:
            # ListOffsets(latest) counts records, not batches (the embedded broker's quirk), with linger-built batches.
            assert await consumer.end_offsets(partitions) == {tp: per_partition[tp.partition] for tp in partitions}
            seen: list[Any] = []
            deadline = time.monotonic() + 60
            while len(seen) < count and time.monotonic() < deadline:
                for messages in (await consumer.getmany(timeout_ms=500)).values():
                    seen += messages
            assert sorted(m.value for m in seen) == sorted(f"v{i}".encode() for i in range(count))
            assert all(m.headers == (("n", m.value[1:]),) for m in seen)  # headers arrive intact
            assert consumer.assignment() == set(partitions)
            await consumer.commit()
            assert {tp: await consumer.committed(tp) for tp in partitions} == {
                tp: per_partition[tp.partition] for tp in partitions
            }
        finally:
            await consumer.stop()

    asyncio.run(run())


def script(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_a_rebound_worker_retries_then_succeeds_on_the_mock_cluster(deploy: Any) -> None:
    deployment: Deployment = deploy(REBOUND_RETRY_SEQUENCE="1s")
    assert deployment.settings["REBOUND_PRODUCER_MAX_BATCH_BYTES"] == "16384"  # normal batching, no work-around
    worker = deployment.start_worker()
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, [(b"flaky", script(succeed_on=1), [])]))
    records = deployment.collect(
        lambda seen: any(e["outcome"] == "succeeded" for e in attempts_by_key(seen).get("flaky", [])), timeout=60
    )
    events = attempts_by_key(records)["flaky"]
    assert [(e["attempt"], e["tier"], e["outcome"]) for e in events] == [(0, None, "scheduled"), (1, "1s", "succeeded")]
    [retry] = [call for call in deployment.calls() if call["attempt"] == 1]
    assert retry["now_ms"] >= events[0]["due_at"]
    assert "Creating topic" not in worker.log_text()  # Faust used the topics made beforehand


def test_stop_ends_the_child_cleanly_and_sigterm_does_too(tmp_path: Path) -> None:
    first = start_mock_cluster(brokers=1, log_path=tmp_path / "first.log")
    first.stop()
    assert first.process.returncode == 0
    second = start_mock_cluster(brokers=1)
    second.process.send_signal(signal.SIGTERM)
    assert second.process.wait(10) == 0
    second.stop()  # already gone: nothing to do


def test_a_child_that_never_announces_its_brokers_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    silent = tmp_path / "silent-python"
    silent.write_text("#!/bin/sh\nexec sleep 30\n")
    silent.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(silent))
    started = time.monotonic()
    with pytest.raises(BrokerStartError, match=r"did not announce its bootstrap servers within 1.0s"):
        start_mock_cluster(startup_timeout=1.0)
    assert time.monotonic() - started < 10  # and the child was stopped, not waited for


def test_a_child_that_dies_at_once_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failing = tmp_path / "failing-python"
    failing.write_text("#!/bin/sh\necho 'No module named confluent_kafka' >&2\nexit 2\n")
    failing.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(failing))
    with pytest.raises(BrokerStartError, match=r"exited with code 2 before announcing"):
        start_mock_cluster(startup_timeout=10.0)
