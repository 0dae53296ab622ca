"""A late write of an evicted owner that lands between the new owner's high watermark and its marker is written over.

Chaos ``--ordering key --outcome random --seed 2`` at 92f73b4 lost 3 messages: a frozen worker's write of a key's block
landed after the high watermark the next owner's recovery read to, and before that owner's writer-epoch marker. The
owner never read it (its copy: the key free) and every later reader from the changelog's start applied it (it precedes
the marker): a key blocked for good by a message that had ended.

Here the first worker parks six retries and is killed; the second recovers, and its claim's marker is held back a
moment after its recovery stopped reading (:mod:`tests.slow_claim_injection`: the moment is a few milliseconds without
it, too short to aim at). Meanwhile the first worker's settles of the six (deletions of their index and entry records,
stamped with its epoch) are produced over and over, so some land before the marker, unread by the second worker, and
the rest after it. A third worker with an empty data directory must still run all six retries: the second worker's
copy, not the settles. Without the claim's reading of that span it ran none (the settles before the marker applied,
the schedule built from entries that were gone).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from demo.harness import Worker, produce
from rebound.fencing import decode_epoch, is_epoch_key, record_epoch
from rebound.headers import WRITER_EPOCH
from tests.integration.conftest import Deployment, attempts_by_key
from tests.integration.test_late_changelog_writes import read_all

pytestmark = [pytest.mark.broker]

MESSAGES = 6
HOLD_S = 1.5
HOLDING = "slow claim: holding"
READY = "Worker ready"


def test_a_late_write_landing_before_the_new_owners_marker_is_written_over(deploy: Any) -> None:
    deployment: Deployment = deploy(REBOUND_RETRY_SEQUENCE="20s")
    bootstrap = deployment.broker.bootstrap
    states = f"{deployment.app_id}-retry_state-changelog"
    payloads = f"{deployment.app_id}-retry_payloads-changelog"
    first = deployment.start_worker("first")
    keys = [f"late-{index}".encode() for index in range(MESSAGES)]
    asyncio.run(
        produce(bootstrap, deployment.topic, [(key, json.dumps({"succeed_on": 1}).encode(), []) for key in keys])
    )
    deadline = time.monotonic() + 60
    indexes: dict[bytes, Any] = {}
    entries: set[tuple[int, bytes]] = set()
    while len(indexes) < MESSAGES or len(entries) < MESSAGES:  # the tier agent parks them: entries, then indexes
        assert time.monotonic() < deadline, f"parked only {sorted(indexes)}, entries {sorted(entries)}"
        time.sleep(0.5)
        indexes = {r.key: r for r in asyncio.run(read_all(bootstrap, states)) if r.key in keys and r.value}
        entries = {
            (r.partition, r.key)
            for r in asyncio.run(read_all(bootstrap, payloads))
            if any(r.key.startswith(len(key).to_bytes(4, "big") + key) for key in keys)
        }
    (epoch,) = {record_epoch(record.headers) for record in indexes.values()}
    assert epoch is not None
    # Read past for good: otherwise a later worker reads the first tries or the tier records again and parks anew.
    read = [deployment.topic, f"{deployment.topic}.retry.20s"]
    while not asyncio.run(committed_to_the_end(bootstrap, deployment.app_id, read)):
        assert time.monotonic() < deadline, "the first worker's offsets were not committed"
        time.sleep(0.5)
    first.kill()

    env = deployment.worker_env(deployment.root / "data-second")
    env.update(REBOUND_HANDLER="tests.slow_claim_injection:handle", SLOW_CLAIM_S=str(HOLD_S))
    second = Worker(env, deployment.root / "second.log").start()
    deployment.workers.append(second)
    settles = [(states, r.partition, r.key) for r in indexes.values()]
    settles += [(payloads, partition, key) for partition, key in sorted(entries)]
    sent = asyncio.run(settle_late(second, bootstrap, settles, str(epoch).encode()))
    second.kill()
    assert all(call["attempt"] == 0 for call in deployment.calls()), "retried before the third worker"
    landed = asyncio.run(read_all(bootstrap, payloads))
    assert settles_before_the_marker(landed, entries, epoch) >= 1, f"no settle of {sent} landed before the marker"

    third = deployment.start_worker("third")
    deployment.collect(
        lambda seen: all(
            any(e["outcome"] == "succeeded" for e in attempts_by_key(seen).get(key.decode(), [])) for key in keys
        ),
        timeout=60,
    )
    assert third.process is not None
    retries = [call for call in deployment.calls() if call["attempt"] == 1]
    assert {call["key"] for call in retries} == {key.decode() for key in keys}
    assert {call["pid"] for call in retries} == {third.process.pid}


def settles_before_the_marker(records: list[Any], settled: set[tuple[int, bytes]], evicted: int) -> int:
    """How many of the evicted owner's settles (deletions of the ``settled`` (partition, key), with its epoch) landed
    before the next owner's first marker of their partition. Each landed after that owner's high watermark:
    :func:`settle_late` sends them only once it holds its claim back, its recovery over."""
    markers: dict[int, int] = {}
    for record in records:
        if is_epoch_key(record.key) and (decode_epoch(record.value) or 0) > evicted:
            markers[record.partition] = min(record.offset, markers.get(record.partition, record.offset))
    return sum(
        1
        for record in records
        if (record.partition, record.key) in settled
        and record.value is None
        and record_epoch(record.headers) == evicted
        and record.offset < markers.get(record.partition, -1)
    )


async def committed_to_the_end(bootstrap: str, group: str, topics: list[str]) -> bool:
    """Whether ``group`` has committed every partition of ``topics`` up to its end (a consumer that never subscribes
    only fetches offsets: it does not join the group)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()
        partitions = [TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t) or ())]
        assert {tp.topic for tp in partitions} == set(topics)
        ends = await consumer.end_offsets(partitions)
        committed = {tp: await consumer.committed(tp) or 0 for tp in partitions}
        return all(committed[tp] >= ends[tp] for tp in partitions)
    finally:
        await consumer.stop()


async def settle_late(worker: Worker, bootstrap: str, settles: list[tuple[str, int, bytes]], epoch: bytes) -> int:
    """The evicted owner's deletions (changelog, partition, key), over and over, from the moment ``worker`` holds its
    claims back until a little after its streams resume (its markers, and what it wrote after them, acknowledged);
    answers how many were sent."""
    from aiokafka import AIOKafkaProducer

    deadline = time.monotonic() + 90
    while HOLDING not in worker.log_text():
        assert time.monotonic() < deadline and not worker.crashed, worker.log_text()[-4000:]
        await asyncio.sleep(0.05)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    sent = 0
    ready_at: float | None = None
    try:
        while ready_at is None or time.monotonic() < ready_at + 0.3:
            assert time.monotonic() < deadline and not worker.crashed, worker.log_text()[-4000:]
            for topic, partition, key in settles:
                await producer.send_and_wait(
                    topic, key=key, value=None, partition=partition, headers=[(WRITER_EPOCH, epoch)]
                )
                sent += 1
            if ready_at is None and READY in worker.log_text():
                ready_at = time.monotonic()
    finally:
        await producer.stop()
    return sent
