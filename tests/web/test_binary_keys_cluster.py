"""Two workers of one app on the embedded broker: keys that are not UTF-8 (schema-registry style) looked up and
dead-lettered by their base64 on either worker, answered by the worker owning the key's partition.

The keys are chosen so that some land on a partition other than the one their base64 name would hash to: a route by
the path's text (Faust's ``table_route``, as before) sends those to the wrong worker, which has nothing for them.
Other keys are placed as a librdkafka producer places them (``consistent_random``: CRC32), on the partition murmur2
does not give: found only with ``?partition=N``."""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import Iterable
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import murmur2

from demo.harness import Tail, produce
from rebound.key_names import base64_of_key
from tests.integration.conftest import Deployment, deploy
from tests.web.test_web_cluster import call, owned, two_workers_each_owning_a_partition, wait_for

pytestmark = pytest.mark.broker
__all__ = ["deploy"]

TOKEN = "s3cret-token"


def partition_of(data: bytes, partitions: int = 2) -> int:
    return (murmur2(data) & 0x7FFFFFFF) % partitions


KEYS = [b"\x00\x00\x00\x00\x07" + index.to_bytes(2, "big") + b"\xff\xfe" for index in range(6)]
"""Schema-registry style (magic byte 0, schema id 7, a record id) and not UTF-8. By murmur2, keys 0, 3 and 4 land
on partition 1 and 1, 2 and 5 on partition 0; the base64 names of 0, 1 and 5 hash to the other partition."""


def crc32_partition(data: bytes, partitions: int = 2) -> int:
    """librdkafka's ``consistent_random`` partitioner for a non-empty key: CRC32 of its bytes modulo the count."""
    return zlib.crc32(data) % partitions


CRC_KEYS = [key for key in (f"order-{i}".encode() for i in range(8)) if crc32_partition(key) != partition_of(key)]
"""Text keys a librdkafka producer places on the other partition than murmur2 gives (order-0, -1 on 1; -6, -7 on 0)."""


async def produce_like_librdkafka(bootstrap: str, topic: str, records: Iterable[tuple[bytes, bytes]]) -> list[Any]:
    def consistent_random(key: bytes, partitions: list[int], available: list[int]) -> int:
        return partitions[crc32_partition(key, len(partitions))]

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", partitioner=consistent_random)
    await producer.start()
    try:
        return [await producer.send_and_wait(topic, key=key, value=value) for key, value in records]
    finally:
        await producer.stop()


def test_keys_that_are_not_utf8_are_found_and_dead_lettered_by_their_bytes_on_either_worker(deploy: Any) -> None:
    deployment: Deployment = deploy(partitions=2, REBOUND_RETRY_SEQUENCE="40s", REBOUND_ADMIN_TOKEN=TOKEN)
    workers = two_workers_each_owning_a_partition(deployment)
    one, two = workers
    keys = KEYS
    value = json.dumps({"succeed_on": 5}).encode()
    sent = asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, [(key, value, []) for key in keys]))
    partition = {key: metadata.partition for key, metadata in zip(keys, sent, strict=True)}
    assert {partition[key] for key in keys} == {0, 1}  # the producer's partitioner is murmur2 (as Kafka's Java one)
    assert all(partition[key] == partition_of(key) for key in keys)
    misrouted_by_name = {partition[key] for key in keys if partition[key] != partition_of(base64_of_key(key).encode())}
    assert misrouted_by_name == {0, 1}  # a route by the name's text would miss on both workers
    placed = asyncio.run(
        produce_like_librdkafka(deployment.broker.bootstrap, deployment.topic, [(key, value) for key in CRC_KEYS])
    )
    crc_partition = {key: metadata.partition for key, metadata in zip(CRC_KEYS, placed, strict=True)}
    assert {crc_partition[key] for key in CRC_KEYS} == {0, 1}
    assert all(crc_partition[key] == crc32_partition(key) != partition_of(key) for key in CRC_KEYS)
    tier = f"{deployment.topic}.retry.40s"

    def all_parked(worker: Any) -> Any:
        _, body = call(worker.web_port, "/retry/backlog")
        waiting = body["tiers"][tier]["waiting"]
        return body if waiting == len(keys) + len(CRC_KEYS) and len(body["workers"]) == 2 else None

    ids = [wait_for("all parked", lambda w=w: all_parked(w), 30, workers)["this_worker"] for w in workers]
    owner = {p: ids[i] for i, worker in enumerate(workers) for p in owned(worker)}

    for key in keys:
        name = base64_of_key(key)
        for worker in workers:
            status, body = call(worker.web_port, f"/retry/keys/{name}?key_encoding=base64")
            assert status == 200 and body["found"], (key, worker.web_port, body)
            assert body["worker"] == owner[partition[key]]  # answered by the owner, whoever was asked
            assert body["key_base64"] == name and body["key"] == key.decode("utf-8", "backslashreplace")

    # Dead-letter, asked on the worker that does not own the key, of a key whose name hashes to the other partition.
    victim = next(key for key in keys if partition[key] != partition_of(base64_of_key(key).encode()))
    asked = one if owner[partition[victim]] != ids[0] else two
    path = f"/retry/admin/keys/{base64_of_key(victim)}/dead-letter?key_encoding=base64"
    status, done = call(asked.web_port, path, method="POST", token=TOKEN)
    assert status == 200 and done["count"] == 1 and done["key_base64"] == base64_of_key(victim), done
    status, body = call(asked.web_port, f"/retry/keys/{base64_of_key(victim)}?key_encoding=base64")
    assert status == 404 and body["worker"] == owner[partition[victim]]

    async def dead_letters() -> list[Any]:
        async with Tail(deployment.broker.bootstrap, [f"{deployment.topic}.failed"]) as tail:
            await tail.until(lambda seen: any(r.key == victim for r in seen), 20)
            return tail.records

    [dead] = [record for record in asyncio.run(dead_letters()) if record.key == victim]
    assert dead.headers["rebound.reason"] == b"admin" and dead.value == value and dead.partition == partition[victim]
    found_by_partition(workers, ids, owner, crc_partition)


def found_by_partition(
    workers: list[Any], ids: list[str], owner: dict[int, str], crc_partition: dict[bytes, int]
) -> None:
    """Keys a librdkafka producer placed: asked by key, the owner of murmur2's partition has nothing; with
    ``?partition=N`` (their partition, as their failed records and attempt events say) the owner of N answers,
    whoever was asked."""
    for key in CRC_KEYS:
        for worker in workers:
            status, body = call(worker.web_port, f"/retry/keys/{key.decode()}")
            assert status == 404 and body["worker"] == owner[partition_of(key)], (key, body)
            status, body = call(worker.web_port, f"/retry/keys/{key.decode()}?partition={crc_partition[key]}")
            assert status == 200 and body["found"] and body["worker"] == owner[crc_partition[key]], (key, body)
    moved = CRC_KEYS[0]
    asked = workers[0] if owner[crc_partition[moved]] != ids[0] else workers[1]  # not the owner of its partition
    status, done = call(
        asked.web_port,
        f"/retry/admin/keys/{moved.decode()}/retry-now?partition={crc_partition[moved]}",
        method="POST",
        token=TOKEN,
    )
    assert status == 200 and done["count"] == 1, done
    status, done = call(asked.web_port, "/retry/admin/keys/order-0/retry-now?partition=2", method="POST", token=TOKEN)
    assert status == 400 and "partition must be an integer from 0 to 1" in done["error"], done
