"""A header whose value is null (legal in Kafka; Java producers send it) stays null on every hop: main topic to tier
to failed topic, through the parked state and its release, and the handler sees ``None`` for it, never ``b""``."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import pytest

from demo.harness import Worker
from rebound import headers as h
from tests.integration.conftest import Deployment, attempts_by_key, failed_records, has_outcomes

pytestmark = pytest.mark.broker

# The user's own headers, in order: a null one, an empty one and a plain one, the null one twice (Kafka allows
# repeated names) so that order and multiplicity are checked as well.
USER_HEADERS: list[tuple[str, bytes | None]] = [("nil", None), ("empty", b""), ("plain", b"v"), ("nil", None)]


async def produce_raw(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> None:
    """Produce with aiokafka directly: its record builder writes a null header value as length -1, as Java does."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for key, value in records:
            await producer.send_and_wait(topic, key=key, value=value, headers=list(USER_HEADERS))
    finally:
        await producer.stop()


def start_recording_worker(deployment: Deployment, calls: Path) -> Worker:
    env = deployment.worker_env(deployment.root / "data-headers")
    env["REBOUND_HANDLER"] = "tests.header_recording_handler:handle"
    env["HEADER_CALLS"] = str(calls)
    worker = Worker(env, deployment.root / "headers.log").start()
    deployment.workers.append(worker)
    return worker


def recorded_calls(calls: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in calls.read_text().splitlines() if line.strip()] if calls.exists() else []


@pytest.mark.parametrize("release_mode", ["in-place", "republish"])
def test_a_null_header_value_stays_null_through_tier_state_release_and_failed_topic(
    deploy: Any, release_mode: str
) -> None:
    """In republish mode the release also goes back to the main topic, signed: the null value is signed as null."""
    secret = {"REBOUND_HEADER_SECRET": "null-headers"} if release_mode == "republish" else {}
    deployment: Deployment = deploy(REBOUND_RETRY_SEQUENCE="1s", REBOUND_RELEASE_MODE=release_mode, **secret)
    calls = deployment.root / "header-calls.jsonl"
    start_recording_worker(deployment, calls)
    asyncio.run(
        produce_raw(
            deployment.broker.bootstrap,
            deployment.topic,
            [(b"permanent", b'{"permanent": true}'), (b"spent", b'{"fail": "always"}')],
        )
    )

    def done(seen: list[Any]) -> bool:
        dead_lettered = {record.key for record in failed_records(seen)} >= {b"permanent", b"spent"}
        # "spent"'s dead event follows its dead letter (buffered after the send is acknowledged): wait for it too.
        return dead_lettered and has_outcomes(seen, {"spent": ["scheduled", "dead"]})

    records = deployment.collect(done, timeout=90)
    by_key = {record.key: record for record in failed_records(records)}
    assert by_key[b"permanent"].raw_headers[:1] and by_key[b"spent"].raw_headers
    for key, reason in ((b"permanent", "permanent"), (b"spent", "exhausted")):
        raw = by_key[key].raw_headers
        own = [(name, value) for name, value in raw if not name.startswith(h.PREFIX)]
        assert own == USER_HEADERS, f"{key!r}: {own!r}"  # None stays None, b"" stays b"", order kept
        assert dict(raw)[h.REASON] == reason.encode()
    events = attempts_by_key(records)
    assert [e["outcome"] for e in events["spent"]] == ["scheduled", "dead"]  # the retry went through the tier

    expected = [[name, None if value is None else base64.b64encode(value).decode()] for name, value in USER_HEADERS]
    seen = {(call["key"], call["attempt"]): call["headers"] for call in recorded_calls(calls)}
    # What the handler saw, on the first try and on the retry released from the parked state. A mapping keeps the
    # last of a repeated name, so "nil" appears once.
    handler_view = [pair for pair in expected if pair[0] != "nil"] + [["nil", None]]
    for call in (("permanent", 0), ("spent", 0), ("spent", 1)):
        assert sorted(map(tuple, seen[call])) == sorted(map(tuple, handler_view)), call


def test_a_replayed_dead_letter_keeps_its_null_header_value(deploy: Any) -> None:
    """Replay (the admin action) reads the failed topic with a raw consumer and sends the record back to its main
    topic: the null value goes back null, and the handler sees None again."""
    from tests.integration.test_operator_actions import TOKEN, post

    deployment: Deployment = deploy(partitions=1, REBOUND_ADMIN_TOKEN=TOKEN)
    calls = deployment.root / "header-calls.jsonl"
    worker = start_recording_worker(deployment, calls)
    asyncio.run(produce_raw(deployment.broker.bootstrap, deployment.topic, [(b"poison", b'{"permanent": true}')]))
    [dead] = failed_records(deployment.collect(lambda seen: len(failed_records(seen)) >= 1))

    status, body = post(worker, f"/retry/admin/replay/{deployment.topic}.failed/0/{dead.offset}")
    assert status == 200, body
    again = failed_records(deployment.collect(lambda seen: len(failed_records(seen)) >= 2))
    second = next(record for record in again if record.offset != dead.offset)
    own = [(name, value) for name, value in second.raw_headers if not name.startswith(h.PREFIX)]
    assert own == USER_HEADERS
    assert dict(second.raw_headers)[h.REDRIVE_COUNT] == b"1"
    replayed_call = [call for call in recorded_calls(calls) if call["key"] == "poison"][-1]
    assert dict(map(tuple, replayed_call["headers"]))["nil"] is None
