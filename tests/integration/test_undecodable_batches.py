"""A record batch that cannot be decoded (a corrupt CRC) on the embedded broker: what aiokafka does with it, what the
fetch guard makes of it (``app/fetch_guard.py``), and a real worker stopping that partition only, loudly, until the
operator moves the group's offset past it (docs/undecodable-batches.md)."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.errors import CorruptRecordException
from aiokafka.structs import OffsetAndMetadata

from app.fetch_guard import guard_fetcher
from demo.embedded_broker import EmbeddedBroker
from demo.harness import create_topics
from tests.integration.conftest import Deployment, wait_for
from tests.raw_batches import batch, produce_raw, with_bad_crc, with_header_name_not_utf8

pytestmark = pytest.mark.broker


def script(**fields: object) -> bytes:
    return json.dumps(fields).encode()


async def write_partition_zero_with_a_bad_batch(bootstrap: str, topic: str, *, before: int, after: int) -> int:
    """Partition 0: ``before`` good records, a two-record batch with a corrupt CRC, ``after`` good records, each
    good one in its own batch, keyed ``p0-<n>``; answer the bad batch's base offset."""
    for n in range(before):
        await produce_raw(bootstrap, topic, 0, bytes(batch([(f"p0-{n}".encode(), script(succeed_on=0))])))
    bad = await produce_raw(
        bootstrap, topic, 0, with_bad_crc(batch([(b"bad-0", script(succeed_on=0)), (b"bad-1", script())]))
    )
    for n in range(before, before + after):
        await produce_raw(bootstrap, topic, 0, bytes(batch([(f"p0-{n}".encode(), script(succeed_on=0))])))
    return bad


async def drain(consumer: AIOKafkaConsumer, rounds: int) -> tuple[list[tuple[int, int, bytes]], list[Exception]]:
    got: list[tuple[int, int, bytes]] = []
    errors: list[Exception] = []
    for _ in range(rounds):
        try:
            batches = await consumer.getmany(timeout_ms=300)
        except CorruptRecordException as exc:
            errors.append(exc)
            continue
        got += [(m.partition, m.offset, m.key or b"") for messages in batches.values() for m in messages]
    return got, errors


async def read_once(bootstrap: str, topic: str, *, guarded: bool) -> dict[str, Any]:
    """Read both partitions from the start with a plain aiokafka consumer, the fetch guard installed or not."""
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=100)
    await consumer.start()
    try:
        consumer.assign([tp0, tp1])
        await consumer.seek_to_beginning(tp0, tp1)
        calls: list[tuple[int, int, int | None, Exception]] = []

        def stop(tp: TopicPartition, offset: int, next_offset: int | None, exc: Exception) -> None:
            calls.append((tp.partition, offset, next_offset, exc))
            consumer.pause(tp)  # as the consumer thread does

        if guarded:
            guard_fetcher(consumer._fetcher, stop)
        got, errors = await drain(consumer, 12)
        return {"got": got, "errors": errors, "calls": calls, "position": await consumer.position(tp0)}
    finally:
        await consumer.stop()


async def read_with_and_without_guard(bootstrap: str, topic: str) -> dict[str, Any]:
    bad = await write_partition_zero_with_a_bad_batch(bootstrap, topic, before=3, after=2)
    for n in range(4):
        await produce_raw(bootstrap, topic, 1, bytes(batch([(f"p1-{n}".encode(), b"x")])))
    return {
        "bad": bad,
        "plain": await read_once(bootstrap, topic, guarded=False),
        "guarded": await read_once(bootstrap, topic, guarded=True),
    }


def test_a_corrupt_batch_stops_its_partition_only_and_the_records_before_it_are_read(broker: EmbeddedBroker) -> None:
    topic = "undecodable-plain"
    asyncio.run(create_topics(broker.bootstrap, [topic], 2))
    result = asyncio.run(read_with_and_without_guard(broker.bootstrap, topic))
    bad = result["bad"]
    assert bad == 3  # offsets 0-2 good, 3-4 the bad batch, 5-6 good

    # aiokafka alone: every fetch of partition 0 raises, its records before the batch are never returned and the
    # position never moves.
    plain = result["plain"]
    assert plain["errors"] and all("Invalid CRC" in str(exc) for exc in plain["errors"])
    assert not [offset for partition, offset, _ in plain["got"] if partition == 0]
    assert plain["position"] == 0

    # Guarded: partition 1 whole, partition 0 up to the batch, the position at the batch's first offset (not past
    # it), the error reported once with the batch's end, nothing raised.
    guarded = result["guarded"]
    assert guarded["errors"] == []
    assert sorted(key for partition, _, key in guarded["got"] if partition == 1) == [b"p1-0", b"p1-1", b"p1-2", b"p1-3"]
    assert [(offset, key) for partition, offset, key in guarded["got"] if partition == 0] == [
        (0, b"p0-0"),
        (1, b"p0-1"),
        (2, b"p0-2"),
    ]
    assert guarded["position"] == bad
    ((partition, offset, next_offset, exc),) = guarded["calls"]
    assert (partition, offset, next_offset) == (0, bad, bad + 2)
    assert isinstance(exc, CorruptRecordException) and "Invalid CRC" in str(exc)


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return 0, ""


def handled_keys(deployment: Deployment) -> set[str]:
    return {call["key"] for call in deployment.calls()}


class AsFaust(RoundRobinPartitionAssignor):
    """Joins a group whose (stopped) members spoke Faust's assignor protocol: the broker refuses another name."""

    name = "faust"


async def move_group_offset(bootstrap: str, group: str, tp: TopicPartition, offset: int) -> int | None:
    """Commit ``offset`` for ``tp`` in the worker's group while every worker is stopped, as the operator does with
    ``kafka-consumer-groups --reset-offsets --to-offset`` (docs/undecodable-batches.md); answers the committed offset
    read back.

    On real Kafka that tool's commit (generation -1, no member id) is accepted once the group is empty. The embedded
    broker (Tansu) keeps a stopped member for ever and refuses it with UNKNOWN_MEMBER_ID (tried: still refused
    after the session timeout), so here the commit is made by a consumer that joins the group, which takes the
    stopped member's place, and leaves it again: the worker then starts from the same committed offset either way."""
    consumer = AIOKafkaConsumer(
        tp.topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        session_timeout_ms=6000,
        rebalance_timeout_ms=4000,
        partition_assignment_strategy=(AsFaust,),
    )
    await consumer.start()
    try:
        deadline = time.monotonic() + 60
        while tp not in consumer.assignment():
            assert time.monotonic() < deadline, "never assigned"
            await consumer.getmany(timeout_ms=500)
        await consumer.commit({tp: OffsetAndMetadata(offset, "")})
        return await consumer.committed(tp)
    finally:
        await consumer.stop()


def test_a_worker_stops_only_the_partition_with_a_corrupt_batch_says_so_and_goes_on_once_moved_past(
    deploy: Any,
) -> None:
    deployment: Deployment = deploy(partitions=2, REBOUND_RETRY_SEQUENCE="1s")
    bootstrap = deployment.broker.bootstrap
    topic = deployment.topic
    bad = asyncio.run(write_partition_zero_with_a_bad_batch(bootstrap, topic, before=3, after=2))
    for n in range(4):
        asyncio.run(produce_raw(bootstrap, topic, 1, bytes(batch([(f"p1-{n}".encode(), script(succeed_on=0))]))))
    worker = deployment.start_worker()

    before_the_batch = {"p0-0", "p0-1", "p0-2", "p1-0", "p1-1", "p1-2", "p1-3"}
    wait_for(
        lambda: before_the_batch <= handled_keys(deployment), 90, "records around the bad batch", deployment.workers
    )
    _, body = wait_for(
        lambda: (answer := get(worker.web_port, "/ready"))[0] == 503 and "undecodable" in answer[1] and answer,
        30,
        "/ready naming the stopped partition",
        deployment.workers,
    )
    ((stuck,),) = [json.loads(body)["undecodable"]]
    assert (stuck["topic"], stuck["partition"], stuck["offset"], stuck["next_offset"]) == (topic, 0, bad, bad + 2)
    assert "Invalid CRC" in stuck["error"]
    _, metrics = get(worker.web_port, "/metrics")
    assert f'rebound_undecodable_offset{{partition="0",topic="{topic}"}} {float(bad)}' in metrics
    failed = re.search(rf'rebound_undecodable_batches_total{{partition="0",topic="{topic}"}} (\S+)', metrics)
    assert failed is not None and float(failed.group(1)) >= 1
    log_line = f"rebound: {topic}[0] offset {bad}: a record batch that cannot be decoded"
    # Logged by the consumer thread just after it notes the stop that /ready shows (``_on_undecodable``): waited for.
    wait_for(lambda: log_line in worker.log_text(), 10, "the stop logged", deployment.workers)
    assert "ERROR" in next(line for line in worker.log_text().splitlines() if log_line in line)
    time.sleep(3)  # records after the batch stay unread, and the batch's records never reach the handler
    assert handled_keys(deployment) == before_the_batch
    assert "fetching failed" not in worker.log_text()

    # The operator's way past it: every worker stopped, the group's offset moved to the batch's end, started again.
    worker.stop(timeout=30)
    committed = asyncio.run(move_group_offset(bootstrap, deployment.app_id, TopicPartition(topic, 0), bad + 2))
    assert committed == bad + 2
    again = deployment.start_worker("w2")
    wait_for(lambda: {"p0-3", "p0-4"} <= handled_keys(deployment), 90, "records after the batch", deployment.workers)
    wait_for(lambda: get(again.web_port, "/ready")[0] == 200, 30, "/ready again", deployment.workers)
    assert not {"bad-0", "bad-1"} & handled_keys(deployment)
    assert "cannot be decoded" not in again.log_text()


def test_a_header_name_that_is_not_utf8_stops_its_partition_only_instead_of_crashing_the_worker(
    deploy: Any,
) -> None:
    """Kafka stores header names as bytes; librdkafka, sarama and franz-go let a producer write any, and the embedded
    broker stores such a batch (valid CRC) as it is. aiokafka decodes the name as UTF-8: the ``UnicodeDecodeError``
    left the fetch and ended the worker (and would end every worker that took the partition over)."""
    deployment: Deployment = deploy(partitions=2, REBOUND_RETRY_SEQUENCE="1s")
    bootstrap = deployment.broker.bootstrap
    topic = deployment.topic
    for n in range(2):
        asyncio.run(produce_raw(bootstrap, topic, 0, bytes(batch([(f"p0-{n}".encode(), script(succeed_on=0))]))))
    bad = asyncio.run(
        produce_raw(
            bootstrap,
            topic,
            0,
            with_header_name_not_utf8([(b"bad-0", script(succeed_on=0)), (b"bad-1", script(succeed_on=0))]),
        )
    )
    asyncio.run(produce_raw(bootstrap, topic, 0, bytes(batch([(b"p0-2", script(succeed_on=0))]))))
    for n in range(3):
        asyncio.run(produce_raw(bootstrap, topic, 1, bytes(batch([(f"p1-{n}".encode(), script(succeed_on=0))]))))
    worker = deployment.start_worker()

    handled = {"p0-0", "p0-1", "p1-0", "p1-1", "p1-2"}
    wait_for(lambda: handled <= handled_keys(deployment), 90, "records around the bad batch", deployment.workers)
    _, body = wait_for(
        lambda: (answer := get(worker.web_port, "/ready"))[0] == 503 and "undecodable" in answer[1] and answer,
        30,
        "/ready naming the stopped partition",
        deployment.workers,
    )
    ((stuck,),) = [json.loads(body)["undecodable"]]
    assert (stuck["topic"], stuck["partition"], stuck["offset"], stuck["next_offset"]) == (topic, 0, bad, bad + 2)
    assert "UnicodeDecodeError" in stuck["error"]
    time.sleep(3)  # the worker is still up (wait_for checks), and nothing at or after the batch was handled
    assert not worker.crashed
    assert handled_keys(deployment) == handled
