"""A changelog write of an evicted worker that lands after the new owner's claim never rolls a key back.

In chaos runs a worker stopped (SIGSTOP) past its session timeout sent its buffered changelog records when it ran
again, after the new owner had written the same keys: parked retries vanished from the state the next owner rebuilt.
Here the late records are produced the way that worker would have sent them (its writer epoch in the header), after a
second worker has claimed the partitions; a third worker, with an empty data directory, must ignore them.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import pytest

from demo.harness import produce
from rebound.fencing import decode_epoch, describe_epoch, epoch_key, record_epoch
from rebound.headers import WRITER_EPOCH
from tests.integration.conftest import Deployment, attempts_by_key, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.every_kafka]

MESSAGES = 6


async def read_all(bootstrap: str, topic: str) -> list[Any]:
    """Every record of ``topic``, read from the start of each partition to its end."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()  # as demo.harness.Tail: the worker may have just made it
        partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not partitions:
            return []
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        records: list[Any] = []
        while [tp for tp in partitions if await consumer.position(tp) < ends[tp]]:
            for batch in (await consumer.getmany(timeout_ms=1000)).values():
                records.extend(batch)
        return records
    finally:
        await consumer.stop()


def claims(records: list[Any], partition: int) -> list[int]:
    return [
        epoch
        for record in records
        if record.partition == partition and record.key == epoch_key(partition)
        for epoch in [decode_epoch(record.value)]
        if epoch is not None
    ]


def test_a_late_write_of_an_evicted_owner_is_ignored_by_the_next_owner(deploy: Any) -> None:
    deployment: Deployment = deploy(REBOUND_RETRY_SEQUENCE="40s")
    first = deployment.start_worker("first")
    keys = [f"late-{index}".encode() for index in range(MESSAGES)]
    bootstrap = deployment.broker.bootstrap
    asyncio.run(
        produce(bootstrap, deployment.topic, [(key, json.dumps({"succeed_on": 1}).encode(), []) for key in keys])
    )
    deployment.collect(
        lambda seen: (
            sum(e["outcome"] == "scheduled" for events in attempts_by_key(seen).values() for e in events) >= MESSAGES
        ),
        timeout=60,
    )
    changelog = f"{deployment.app_id}-retry_state-changelog"
    deadline = time.monotonic() + 60
    parked: dict[bytes, Any] = {}
    written: list[Any] = []
    while set(parked) != set(keys):  # the tier agent parks them once their tier records arrive
        assert time.monotonic() < deadline, f"parked only {sorted(parked)} of {[(r.key, r.value) for r in written]}"
        time.sleep(0.5)
        written = asyncio.run(read_all(bootstrap, changelog))
        parked = {r.key: r for r in written if r.key in keys and r.value}
    first_epochs = {record_epoch(record.headers) for record in parked.values()}
    assert None not in first_epochs and len(first_epochs) == 1
    first.kill()

    second = deployment.start_worker("second")
    wait_for(lambda: "writer epochs claimed" in second.log_text(), 90, "writer epochs claimed", [second], interval=0.5)
    # What the first worker would have sent had it settled the keys just before it froze: their deletions.
    partitions = {record.partition for record in parked.values()}
    after_claim = asyncio.run(read_all(bootstrap, changelog))
    for partition in partitions:
        assert claims(after_claim, partition)[-1] > next(iter(first_epochs))
    late_epoch = str(next(iter(first_epochs))).encode()
    asyncio.run(
        produce_to_partitions(
            bootstrap, changelog, [(record.partition, record.key, late_epoch) for record in parked.values()]
        )
    )
    second.kill()

    third = deployment.start_worker("third")
    records = deployment.collect(
        lambda seen: all(
            any(e["outcome"] == "succeeded" for e in attempts_by_key(seen).get(key.decode(), [])) for key in keys
        ),
        timeout=120,
    )
    succeeded = [e for events in attempts_by_key(records).values() for e in events if e["outcome"] == "succeeded"]
    assert {event["key"] for event in succeeded} == {key.decode() for key in keys}
    retries = [call for call in deployment.calls() if call["attempt"] == 1]
    assert {call["key"] for call in retries} == {key.decode() for key in keys}
    skipped = re.findall(r"skipped a write of epoch ([\d.]+)", third.log_text())
    assert len(skipped) >= MESSAGES and set(skipped) == {describe_epoch(int(late_epoch))}


async def produce_to_partitions(bootstrap: str, topic: str, tombstones: list[tuple[int, bytes, bytes]]) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for partition, key, epoch in tombstones:
            await producer.send_and_wait(
                topic, key=key, value=None, partition=partition, headers=[(WRITER_EPOCH, epoch)]
            )
    finally:
        await producer.stop()
