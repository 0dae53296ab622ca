"""One message, one lifecycle, through real workers on the embedded broker (issue 22, defect 4).

The redeliveries are real: the workers commit only every 10 minutes and are killed (SIGKILL), so the next worker
reads the main record and the tier record again from the group's committed offsets, with the state table recovered
from its changelog. Before the fix the main record ran attempt 0 again while its retry was parked, and the tier
record, read again after its retry had settled, ran the retry again.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from demo.harness import Record, Tail, produce
from tests.integration.conftest import Deployment, attempts_by_key, wait_for

pytestmark = pytest.mark.broker

KEY = "one-lifecycle"
DELAY = "20s"
"""Long enough for the retry to be still parked when the next worker has joined and reads the main record again."""


def parked(port: int) -> bool:
    """Whether the worker on ``port`` has the key's retry parked (the view answers 404 when nothing is)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/retry/keys/{KEY}", timeout=5) as response:
            return bool(json.loads(response.read())["pending"])
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return False
        raise


def calls_of(deployment: Deployment, attempt: int) -> int:
    return sum(1 for call in deployment.calls() if call["key"] == KEY and call["attempt"] == attempt)


def test_records_read_again_after_a_kill_neither_start_the_message_over_nor_run_its_settled_retry_again(
    deploy: Any,
) -> None:
    deployment: Deployment = deploy(partitions=1, REBOUND_RETRY_SEQUENCE=DELAY, REBOUND_COMMIT_INTERVAL="600")
    first = deployment.start_worker("first")
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, [(KEY.encode(), b'{"succeed_on": 1}', [])]))
    deployment.collect(
        lambda seen: any(event["outcome"] == "scheduled" for event in attempts_by_key(seen).get(KEY, [])),
        timeout=90,
    )
    wait_for(lambda: parked(first.web_port), 15, "the retry parked on the first worker", ignore=(OSError,))
    first.kill()  # nothing committed: the main record and the tier record are read again

    second = deployment.start_worker("second")
    deployment.collect(
        lambda seen: any(
            event["outcome"] == "succeeded" and event["attempt"] == 1 for event in attempts_by_key(seen).get(KEY, [])
        ),
        timeout=90,
    )
    wait_for(
        lambda: "not started over" in second.log_text() or calls_of(deployment, 0) > 1,
        30,
        "the second worker read the main record again",
    )
    assert calls_of(deployment, 0) == 1, "the main record read again ran attempt 0 again while its retry was parked"
    wait_for(lambda: not parked(second.web_port), 15, "the retry settled on the second worker", ignore=(OSError,))
    second.kill()  # the settled retry's tier record is read again by the next worker

    third = deployment.start_worker("third")
    wait_for(
        lambda: "its message ended already" in third.log_text() or calls_of(deployment, 1) > 1,
        60,
        "the third worker read the tier record again",
    )
    wait_for(
        lambda: "the message ended: not started over" in third.log_text() or calls_of(deployment, 0) > 1,
        30,
        "the third worker read the main record again",
    )
    time.sleep(2)  # anything parked again would be due at once: give it the time to run
    assert calls_of(deployment, 1) == 1, "the tier record read again after its retry settled ran the retry again"
    assert calls_of(deployment, 0) == 1, "the main record of a message that ended ran attempt 0 again"
    third.stop()


async def tier_records(deployment: Deployment, tier: str) -> list[Record]:
    async with Tail(deployment.broker.bootstrap, [f"{deployment.topic}.retry.{tier}"]) as tail:
        assert await tail.until(lambda seen: len(seen) >= 1, 30), "no tier record"
        return tail.records


async def write_again(deployment: Deployment, record: Record) -> None:
    """The tier record once more, as a forward repeated after a crash writes it: same key, bytes, headers, time."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=deployment.broker.bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(
            record.topic,
            key=record.key,
            value=record.value,
            headers=record.raw_headers,
            partition=record.partition,
            timestamp_ms=record.timestamp_ms,
        )
    finally:
        await producer.stop()


def test_a_copy_of_a_tier_record_arriving_after_its_retry_settled_does_not_run_the_retry_again(deploy: Any) -> None:
    deployment: Deployment = deploy(partitions=1, REBOUND_RETRY_SEQUENCE="2s")
    worker = deployment.start_worker("only")
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, [(KEY.encode(), b'{"succeed_on": 1}', [])]))
    deployment.collect(
        lambda seen: any(
            event["outcome"] == "succeeded" and event["attempt"] == 1 for event in attempts_by_key(seen).get(KEY, [])
        ),
        timeout=90,
    )
    wait_for(lambda: not parked(worker.web_port), 15, "the retry settled", ignore=(OSError,))
    [record] = asyncio.run(tier_records(deployment, "2s"))
    asyncio.run(write_again(deployment, record))
    wait_for(
        lambda: "its message ended already" in worker.log_text() or calls_of(deployment, 1) > 1,
        30,
        "the worker read the copy",
    )
    time.sleep(2)  # a copy parked again would be due at once: give it the time to run
    assert calls_of(deployment, 1) == 1, "the copy of the tier record ran the settled retry again"
    assert calls_of(deployment, 0) == 1
    worker.stop()
