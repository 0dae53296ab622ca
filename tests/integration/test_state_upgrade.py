"""State written by the previous layout (version 2: a key's state lists every parked message's metadata, the bytes
sit alone under the same payload keys) is recovered by a worker of this version, released on time, byte-exact,
and settled in the new layout.

The version 2 records are produced straight into the two changelog topics before any worker runs, exactly as a
worker of that version left them (without writer epochs, which every replay applies): the new worker knows them only
from its recovery, as after an upgrade with a rolling restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import urllib.request
from typing import Any

import pytest

from demo.harness import create_topics
from rebound.headers import Provenance
from rebound.state import PendingMessage, payload_key
from tests.integration.conftest import Deployment, attempts_by_key, outcome_offsets

pytestmark = pytest.mark.broker

KEYS = {b"single": 1, b"hot": 3, b"\x00\xffbinary": 1}  # key -> parked messages of the key


def version_2_records(deployment: Deployment, now_ms: int) -> tuple[list[Any], list[Any], dict[str, bytes]]:
    """(state records, payload records, origin -> value) for every key of :data:`KEYS` on partition 0."""
    states, payloads, values = [], [], {}
    offset = 100
    for key, count in KEYS.items():
        entries = []
        for _ in range(count):
            offset += 1
            provenance = Provenance(deployment.topic, 0, offset, now_ms - 60_000, now_ms - 50_000)
            value = json.dumps({"succeed_on": 1, "n": offset, "note": "é"}, ensure_ascii=False).encode()
            entry = PendingMessage(
                origin=PendingMessage.origin_of(provenance),
                key=key,
                value=value,
                headers=(("trace-id", f"t{offset}".encode()),),
                provenance=provenance,
                attempt=1,
                tier="1s",
                tier_topic=f"{deployment.topic}.retry.1s",
                partition=0,
                due_at_ms=now_ms + 3_000,
                parked_at_ms=now_ms - 1_000,
                error_class="rebound.errors.RetryableError",
                error_message="not yet",
                value_size=len(value),
            )
            entries.append(entry)
            values[entry.origin] = value
            payloads.append((0, payload_key(key, entry.origin), entry.encode_payload()))
        state = {
            "v": 2,
            "pending": [entry.to_dict() for entry in entries],
            "attempts": count,
            "first_failure_ms": now_ms - 50_000,
            "last_error": "not yet",
            "last_error_class": "rebound.errors.RetryableError",
            "released": 0,
            "extra": {},
        }
        states.append((0, key, json.dumps(state, separators=(",", ":")).encode()))
    return states, payloads, values


async def produce_records(bootstrap: str, topic: str, records: list[Any]) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for partition, key, value in records:
            await producer.send_and_wait(topic, key=key, value=value, partition=partition)
    finally:
        await producer.stop()


def test_version_2_state_is_recovered_released_on_time_and_settled(deploy: Any) -> None:
    deployment: Deployment = deploy(partitions=1, REBOUND_RETRY_SEQUENCE="1s,1s")
    now_ms = int(time.time() * 1000)
    states, payloads, values = version_2_records(deployment, now_ms)
    bootstrap = deployment.broker.bootstrap
    changelogs = [f"{deployment.app_id}-retry_payloads-changelog", f"{deployment.app_id}-retry_state-changelog"]
    with contextlib.suppress(Exception):  # made already by the deployment's provisioning
        asyncio.run(create_topics(bootstrap, changelogs, 1))
    asyncio.run(produce_records(bootstrap, changelogs[0], payloads))
    asyncio.run(produce_records(bootstrap, changelogs[1], states))

    worker = deployment.start_worker("upgraded")
    # Messages, not events (a repeated success would count twice): every message's call is asserted on below.
    records = deployment.collect(lambda seen: len(outcome_offsets(seen, "succeeded")) >= len(values), timeout=90)
    calls = {
        f"{call['topic']}/{call['partition']}/{call['offset']}": call
        for call in deployment.calls()
        if call.get("attempt") == 1
    }
    assert set(calls) == set(values)  # every listed message ran, once it was due and not before
    assert all(call["now_ms"] >= now_ms + 3_000 for call in calls.values())
    assert sorted(call["key"] for call in calls.values()) == sorted(
        key.decode("utf-8", "replace") for key, count in KEYS.items() for _ in range(count)
    )
    assert not [e for es in attempts_by_key(records).values() for e in es if e["outcome"] in ("dead", "expired")]
    adopted = re.findall(r"adopted partitions \[0\] \((\d+) parked\)", worker.log_text())
    assert str(len(values)) in adopted, adopted  # found in the recovered version 2 states
    deadline = time.monotonic() + 30
    while True:  # settled: the keys' states are gone
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.web_port}/retry/backlog?scope=worker") as response:
            backlog = json.loads(response.read())
        if all(stats["waiting"] == 0 for stats in backlog["tiers"].values()):
            break
        assert time.monotonic() < deadline, backlog
        time.sleep(0.5)
