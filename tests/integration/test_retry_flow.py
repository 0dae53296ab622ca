"""The retry flow end to end on each Kafka implementation, with a real worker subprocess."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from demo.harness import Record, produce
from rebound import headers as h
from tests.integration.conftest import Deployment, attempts_by_key, failed_records
from tests.kafka_under_test import create_topics

pytestmark = [pytest.mark.broker, pytest.mark.every_kafka]
TERMINAL = {"succeeded", "dead", "expired"}


def script(**fields: object) -> bytes:
    return json.dumps(fields).encode()


UNDECODABLE = b"\xff\x00\xfe not json at all"


@pytest.fixture(scope="module")
def flow(deploy: Any) -> tuple[Deployment, list[Record]]:
    deployment: Deployment = deploy(REBOUND_RETRY_SEQUENCE="1s,1s,2s")
    forged = [(h.ATTEMPT, b"5"), (h.ORIGINAL_TOPIC, b"somewhere-else"), (h.FIRST_RECEIVED_AT, b"1")]
    records = [
        (b"ok", script(succeed_on=0), []),
        (b"retry-twice", script(succeed_on=2), [("trace-id", b"t-1")]),
        (b"never", script(fail="always"), []),
        (b"bad-data", script(permanent=True), []),
        (b"garbage", UNDECODABLE, []),
        (b"forged-main", script(succeed_on=1), forged),
        (None, script(succeed_on=1), []),
        (b"redriven", script(permanent=True), [(h.REDRIVE_COUNT, b"2")]),
    ]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    tier = f"{deployment.topic}.retry.1s"
    asyncio.run(create_topics(deployment.broker.bootstrap, [tier], 2))  # before anything auto-creates it
    valid_elsewhere = h.retry_headers(
        [],
        provenance=h.Provenance("not-a-main-topic", 0, 1, 1, 1),
        group=deployment.app_id,
        attempt=1,
        due_at_ms=2,
        error_class="x",
        error_message="y",
    )
    asyncio.run(
        produce(
            deployment.broker.bootstrap,
            tier,
            [
                (b"forged-tier-1", b"payload-1", [("rebound.attempt", b"x")]),
                (b"forged-tier-2", b"payload-2", valid_elsewhere),
            ],
        )
    )
    deployment.start_worker()

    def done(seen: list[Record]) -> bool:
        by_key = attempts_by_key(seen)
        expected = {
            "ok",
            "retry-twice",
            "never",
            "bad-data",
            "garbage",
            "forged-main",
            None,
            "forged-tier-1",
            "forged-tier-2",
            "redriven",
        }
        return all(key in by_key and by_key[key][-1]["outcome"] in TERMINAL for key in expected)

    return deployment, deployment.collect(done, timeout=90)


def outcomes(flow: Any, key: str | None) -> list[tuple[int, str | None, str]]:
    return [(event["attempt"], event["tier"], event["outcome"]) for event in attempts_by_key(flow[1])[key]]


def failed_by_key(flow: Any) -> dict[bytes | None, Record]:
    return {record.key: record for record in failed_records(flow[1])}


def test_success_first_time(flow: Any) -> None:
    assert outcomes(flow, "ok") == [(0, None, "succeeded")]


def test_retry_then_success(flow: Any) -> None:
    assert outcomes(flow, "retry-twice") == [(0, None, "scheduled"), (1, "1s", "scheduled"), (2, "1s", "succeeded")]
    calls = [call for call in flow[0].calls() if call["key"] == "retry-twice"]
    assert [call["attempt"] for call in calls] == [0, 1, 2]
    assert all(call["headers"] == ["trace-id"] for call in calls)  # the user's header, never ours


def test_every_tier_visited_then_exhausted(flow: Any) -> None:
    assert outcomes(flow, "never") == [
        (0, None, "scheduled"),
        (1, "1s", "scheduled"),
        (2, "1s", "scheduled"),
        (3, "2s", "dead"),
    ]
    record = failed_by_key(flow)[b"never"]
    assert record.headers[h.REASON] == b"exhausted"
    assert record.headers[h.ATTEMPT] == b"3"
    assert record.value == script(fail="always")


def test_no_retry_runs_before_its_due_time(flow: Any) -> None:
    scheduled = {
        (event["key"], event["attempt"] + 1): event["due_at"]
        for events in attempts_by_key(flow[1]).values()
        for event in events
        if event["outcome"] == "scheduled"
    }
    retries = [call for call in flow[0].calls() if call["attempt"] > 0]
    assert len(retries) >= 6
    for call in retries:
        assert call["now_ms"] >= scheduled[(call["key"], call["attempt"])], call


def test_permanent_error_goes_straight_to_failed(flow: Any) -> None:
    assert outcomes(flow, "bad-data") == [(0, None, "dead")]
    record = failed_by_key(flow)[b"bad-data"]
    assert record.headers[h.REASON] == b"permanent"
    assert record.headers[h.ERROR_CLASS] == b"rebound.errors.PermanentError"


def test_undecodable_value_is_dead_lettered_byte_exact(flow: Any) -> None:
    record = failed_by_key(flow)[b"garbage"]
    assert record.value == UNDECODABLE
    assert record.headers[h.REASON] == b"undecodable"
    deployment = flow[0]
    assert record.headers[h.ORIGINAL_TOPIC] == deployment.topic.encode()
    assert record.headers[h.ORIGINAL_OFFSET].isdigit()


def test_failed_headers_are_set_once_and_decimal(flow: Any) -> None:
    for record in failed_records(flow[1]):
        names = [name for name, _ in record.raw_headers if name.startswith("rebound.")]
        assert len(names) == len(set(names)), names
        for name in (h.ORIGINAL_PARTITION, h.ORIGINAL_OFFSET, h.FIRST_RECEIVED_AT, h.ATTEMPT):
            assert record.headers[name].decode("utf-8").isdigit(), (name, record.headers[name])
        assert len(record.headers[h.ERROR_MESSAGE]) <= h.MAX_ERROR_MESSAGE_BYTES
        assert len(record.headers.get(h.ERROR_TRACE, b"")) <= h.MAX_ERROR_TRACE_BYTES


def test_forged_headers_on_main_topic_are_ignored(flow: Any) -> None:
    assert outcomes(flow, "forged-main") == [(0, None, "scheduled"), (1, "1s", "succeeded")]


def test_forged_or_foreign_tier_records_go_to_failed(flow: Any) -> None:
    failed = failed_by_key(flow)
    for key, payload in ((b"forged-tier-1", b"payload-1"), (b"forged-tier-2", b"payload-2")):
        assert failed[key].headers[h.REASON] == b"invalid-retry-headers"
        assert failed[key].value == payload


def test_null_key_is_retried_like_any_other(flow: Any) -> None:
    assert outcomes(flow, None) == [(0, None, "scheduled"), (1, "1s", "succeeded")]


def test_max_duration_expires_a_message(deploy: Any) -> None:
    deployment: Deployment = deploy(REBOUND_RETRY_SEQUENCE="1s,1s,1s,1s,1s", REBOUND_MAX_RETRY_DURATION="2500ms")
    deployment.start_worker()
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, [(b"slow", script(fail="always"), [])]))
    records = deployment.collect(
        lambda seen: (
            any(r.topic.endswith(".failed") for r in seen)
            and bool(attempts_by_key(seen).get("slow"))
            and attempts_by_key(seen)["slow"][-1]["outcome"] == "expired"
        ),
        timeout=60,
    )
    events = attempts_by_key(records)["slow"]
    assert events[-1]["outcome"] == "expired"
    assert 1 <= events[-1]["attempt"] < 5  # stopped by the cap, not by running out of retries
    [record] = failed_records(records)
    assert record.headers[h.REASON] == b"expired"
    first = int(record.headers[h.FIRST_RECEIVED_AT])
    assert all(event["first_received_at"] == first for event in events)


def test_redrive_count_survives_to_the_failed_topic(flow: Any) -> None:
    record = failed_by_key(flow)[b"redriven"]
    assert [value for name, value in record.raw_headers if name == h.REDRIVE_COUNT] == [b"2"]


def test_tiers_of_an_earlier_retry_sequence_keep_draining(deploy: Any) -> None:
    deployment: Deployment = deploy(REBOUND_RETRY_SEQUENCE="1s")
    old_tier = f"{deployment.topic}.retry.7s"
    asyncio.run(create_topics(deployment.broker.bootstrap, [old_tier], 2))
    now_ms = int(time.time() * 1000)
    headers = h.retry_headers(
        [],
        provenance=h.Provenance(deployment.topic, 0, 41, now_ms - 7000, now_ms - 7000),
        group=deployment.app_id,
        attempt=1,
        due_at_ms=now_ms + 1000,
        error_class="RetryableError",
        error_message="sent under the old sequence 7s",
    )
    asyncio.run(produce(deployment.broker.bootstrap, old_tier, [(b"old-tier", script(succeed_on=1), headers)]))
    deployment.start_worker()  # configured with 1s only: 7s is a tier nobody would read without draining
    records = deployment.collect(lambda seen: bool(attempts_by_key(seen).get("old-tier")), timeout=60)
    assert outcomes((deployment, records), "old-tier") == [(1, "7s", "succeeded")]
