"""Paths seen to lose or wedge a message, tried end to end: a real worker on the embedded broker, our own handler.

Each case here failed before its fix (issue 6): the agent-level twins are in ``tests/agents/test_agent_fault_paths.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from demo.harness import Record, Tail, create_topics, produce
from rebound import headers as h
from tests.integration.conftest import Deployment, attempts_by_key, failed_records

pytestmark = pytest.mark.broker
LIMIT = 65_536
HEALTHY = 50


def script(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def padded_script(size: int, **fields: object) -> bytes:
    """A script of exactly ``size`` bytes: fits a record of its own under LIMIT, not with the retry headers."""
    empty = script(**fields, padding="")
    return script(**fields, padding="x" * (size - len(empty)))


async def produce_with_timestamp(bootstrap: str, topic: str, key: bytes, value: bytes, headers: Any, ts: int) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=key, headers=headers, timestamp_ms=ts, partition=0)
    finally:
        await producer.stop()


def produce_null_key_and_value(bootstrap: str, topic: str) -> None:
    """Java and librdkafka clients produce a record with neither key nor value (aiokafka refuses to)."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    delivered: list[Any] = []
    producer.produce(topic, value=None, key=None, on_delivery=lambda err, msg: delivered.append(err))
    producer.flush(30)
    assert delivered == [None], delivered


def final_outcome(records: list[Record], key: str) -> str | None:
    events = attempts_by_key(records).get(key)
    return events[-1]["outcome"] if events else None


@pytest.fixture(scope="module")
def hostile(deploy: Any) -> tuple[Deployment, list[Record], int]:
    """One worker, fed every hostile input at once; returns the records seen and the worker's web port."""
    deployment: Deployment = deploy(REBOUND_RETRY_SEQUENCE="1s", REBOUND_PRODUCER_MAX_REQUEST_BYTES=str(LIMIT))
    tier = f"{deployment.topic}.retry.1s"
    asyncio.run(create_topics(deployment.broker.bootstrap, [tier], 2))
    now_ms = int(time.time() * 1000)
    forged = h.retry_headers(
        [],
        provenance=h.Provenance(deployment.topic, 0, 3, 0, now_ms),
        group=deployment.app_id,
        attempt=1,
        due_at_ms=now_ms + 365 * 86_400_000,  # a year away: would sit in the key's backlog for ever
        error_class="x",
        error_message="forged",
    )
    asyncio.run(produce_with_timestamp(deployment.broker.bootstrap, tier, b"forged-ts-0", b"forged", forged, 0))
    big = padded_script(65_300, succeed_on=1)
    records = [
        (b"big", big, []),
        *[(f"healthy-{index}".encode(), script(succeed_on=0), []) for index in range(HEALTHY)],
        (b"exit", script(abort="SystemExit", succeed_on=1), []),
        (b"interrupt", script(abort="KeyboardInterrupt", succeed_on=1), []),
        (b"abort", script(abort="Abort", succeed_on=1), []),
        (b"\x00orders/0/7", script(succeed_on=1), []),
        (b"after-aborts", script(succeed_on=0), []),
    ]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    produce_null_key_and_value(deployment.broker.bootstrap, deployment.topic)
    worker = deployment.start_worker()
    expected = [
        *(f"healthy-{index}" for index in range(HEALTHY)),
        "exit",
        "interrupt",
        "abort",
        "after-aborts",
        "\x00orders/0/7",
    ]

    def done(seen: list[Record]) -> bool:
        failed = {record.key for record in failed_records(seen)}
        null_null = any(h.NULL_VALUE in record.headers for record in failed_records(seen))
        succeeded = all(final_outcome(seen, key) == "succeeded" for key in expected)
        return succeeded and null_null and {b"big", b"forged-ts-0"} <= failed

    return deployment, deployment.collect(done, timeout=120), worker.web_port


def test_a_record_too_large_with_retry_headers_goes_to_failed_and_healthy_ones_keep_flowing(hostile: Any) -> None:
    deployment, records, _ = hostile
    [big] = [record for record in failed_records(records) if record.key == b"big"]
    assert big.headers[h.REASON] == b"too-large"
    assert big.headers[h.ORIGINAL_TOPIC] == deployment.topic.encode()
    assert big.value in (None, padded_script(65_300, succeed_on=1))  # byte-exact, or left out if even that is too big
    assert all(final_outcome(records, f"healthy-{index}") == "succeeded" for index in range(HEALTHY))
    log = deployment.workers[0].log_text()
    assert "retrying in" not in log, "a send was retried: the partition stalled behind it"


@pytest.mark.parametrize("key", ["exit", "interrupt", "abort"])
def test_a_base_exception_from_the_handler_is_retried_not_acked_and_lost(hostile: Any, key: str) -> None:
    deployment, records, _ = hostile
    events = attempts_by_key(records)[key]
    assert [(event["attempt"], event["outcome"]) for event in events] == [(0, "scheduled"), (1, "succeeded")]
    expected_class = {"exit": "SystemExit", "interrupt": "KeyboardInterrupt", "abort": "Abort"}[key]
    assert events[0]["error_class"].endswith(expected_class)
    assert not deployment.workers[0].crashed


def test_a_key_starting_with_nul_keeps_its_bytes_through_the_retry(hostile: Any) -> None:
    deployment, _, _ = hostile
    calls = [call for call in deployment.calls() if call["key"] == "\x00orders/0/7"]
    assert [call["attempt"] for call in calls] == [0, 1]


def test_a_tier_record_with_timestamp_zero_cannot_park_for_ever(hostile: Any) -> None:
    _, records, _ = hostile
    [forged] = [record for record in failed_records(records) if record.key == b"forged-ts-0"]
    assert forged.headers[h.REASON] == b"invalid-retry-headers"
    assert forged.value == b"forged"


def test_a_record_with_neither_key_nor_value_reaches_the_failed_topic_marked_null(hostile: Any) -> None:
    _, records, _ = hostile
    [null] = [record for record in failed_records(records) if h.NULL_VALUE in record.headers]
    assert (null.key, null.value, null.headers[h.REASON]) == (None, b"", b"undecodable")
    assert h.restore_null_value(null.value, null.raw_headers) is None


@pytest.mark.parametrize("path", ["/table/retry_state/", "/table/retry_payloads/", "/router/", "/graph/", "/stats/"])
def test_fausts_generic_views_are_off(hostile: Any, path: str) -> None:
    _, _, port = hostile
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10)
    assert refused.value.code == 404
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/retry/backlog", timeout=10) as served:
        assert served.status == 200


def test_a_main_topic_named_like_a_tier_prefix_retries_through_its_own_tier(deploy: Any) -> None:
    """``x.retry``'s tier ``x.retry.retry.1s`` used to be split at the first ``.retry.``: KeyError, message lost."""
    base: Deployment = deploy(REBOUND_RETRY_SEQUENCE="1s")
    deployment = dataclasses.replace(base, topic=f"{base.topic}.retry", workers=[])
    asyncio.run(create_topics(base.broker.bootstrap, [deployment.topic], 2))
    asyncio.run(produce(base.broker.bootstrap, deployment.topic, [(b"on-lookalike", script(succeed_on=1), [])]))
    deployment.start_worker()
    try:
        records = deployment.collect(lambda seen: final_outcome(seen, "on-lookalike") == "succeeded", timeout=90)
    finally:
        for worker in deployment.workers:
            worker.stop(timeout=10)
    events = attempts_by_key(records)["on-lookalike"]
    assert [(e["attempt"], e["outcome"]) for e in events] == [(0, "scheduled"), (1, "succeeded")]
    assert events[1]["tier"] == "1s" and events[1]["original_topic"] == deployment.topic
    assert "KeyError" not in deployment.workers[0].log_text()


def test_a_republished_record_replayed_with_another_value_is_not_trusted(deploy: Any) -> None:
    deployment: Deployment = deploy(
        REBOUND_RETRY_SEQUENCE="1s,1s,1s", REBOUND_RELEASE_MODE="republish", REBOUND_HEADER_SECRET="s3cret"
    )
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, [(b"signed", script(succeed_on=1), [])]))
    deployment.start_worker()
    deployment.collect(lambda seen: final_outcome(seen, "signed") == "succeeded", timeout=60)

    async def signed_copy() -> Record:
        async with Tail(deployment.broker.bootstrap, [deployment.topic]) as tail:
            assert await tail.until(lambda seen: any("rebound.signature" in r.headers for r in seen), 30)
            return next(r for r in tail.records if "rebound.signature" in r.headers)

    original = asyncio.run(signed_copy())
    tampered = script(succeed_on=3, tampered=True)  # would claim attempt 1 of a message it is not
    asyncio.run(
        produce(deployment.broker.bootstrap, deployment.topic, [(original.key, tampered, original.raw_headers)])
    )
    records = deployment.collect(
        lambda seen: sum(e["attempt"] == 0 for e in attempts_by_key(seen).get("signed", [])) >= 2, timeout=60
    )
    first_tries = [e for e in attempts_by_key(records)["signed"] if e["attempt"] == 0]
    assert [e["outcome"] for e in first_tries] == ["scheduled", "scheduled"]
    replayed = [call for call in deployment.calls() if call["key"] == "signed"][2:]
    assert replayed and replayed[0]["attempt"] == 0  # a first delivery, not retry 1 of the signed message


def test_demo_kept_running_stops_its_broker_and_worker_and_removes_its_files_on_sigterm(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    demo = subprocess.Popen(
        [sys.executable, "-m", "demo", "--keep-running", "--timeout", "120"],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        assert demo.stdout is not None
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            line = demo.stdout.readline()
            lines.append(line)
            if "still running" in line or not line:
                break
        assert any("still running" in line for line in lines), "".join(lines)
        assert len(list(tmp_path.glob("rebound-demo-*"))) == 1  # its files, in TMPDIR while it runs
        while not any("replay items.failed" in line for line in lines) and time.monotonic() < deadline:
            lines.append(demo.stdout.readline())
        hints = "".join(lines)
        url = re.search(r"REBOUND_WEB_URL=(\S+)", hints)
        assert url and "/dashboard/" in hints and re.search(r"REBOUND_ADMIN_TOKEN=\S+", hints), hints
        # The trickle keeps the charts moving: attempts keep being made after the scenario ended.
        before = attempts_total(url.group(1))
        time.sleep(4)
        assert attempts_total(url.group(1)) > before
        children = child_pids(demo.pid)
        assert len(children) >= 2, children  # the broker and the worker
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(60) == 143
        time.sleep(0.5)
        assert [pid for pid in children if alive(pid)] == []
        assert list(tmp_path.glob("rebound-demo-*")) == []  # and removed when it stops
    finally:
        if demo.poll() is None:
            demo.kill()


def attempts_total(base_url: str) -> float:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("rebound_attempts_total"))


def child_pids(parent: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(parent):
            found.append(int(status.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in state
