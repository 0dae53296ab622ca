"""A first try still running when a second worker joins and its partition moves ends at one owner (issue 22).

Real workers on librdkafka's mock cluster: one partition, a handler (``tests/gated_handler.py``) whose call for one
record waits on a file the test creates. While the first worker's call waits, a second worker joins. The rebalance
revokes the first worker's partition, and its revocation waits for its streams (Faust's ``stream_wait_empty``), so for
the held call; the group waits for a member's revocation only for the rebalance timeout (4 s here), then completes the
rebalance without it and gives the partition to the second worker, which reads the record again from the committed
offset and runs it (it succeeds). Then the test lets the held call end: it fails (permanently, or retryably), and the
dead letter or retry it would send must not go out, because the partition is now the second worker's: its ownership
check before the send (``agents/lifecycle.py`` ``still_owned``, after the confirmed mark; ``agents/ownership.py``)
refuses it, counted in ``rebound_first_try_revoked_total`` and logged. Otherwise the message forks: it succeeded on
the second worker and is dead-lettered or forwarded by the first (seen with ``still_owned`` returning at once).

What decides it here is the eviction: the held call ends inside the revocation callback (Faust waits for it), after
the group removed the worker, so the session lease (stale by then: no heartbeat since the eviction) or
``ReboundConsumer.evicted`` answers "not owned". The revocation-to-assignment window (``between_assignments``) opens
only once the callback returns, after the held call: with the lease and the eviction rule taken out and the window rule
kept, the dead letter and the retry went out (both cases). The window rule guards what runs outside the streams after
a revocation; a first try never does, since the revocation waits for it.

Why not the embedded broker (Tansu): it never completes that rebalance. A member still in its revocation callback
goes on heartbeating (aiokafka heartbeats through the callback, answered "rebalancing") and Tansu keeps waiting for it,
past the rebalance timeout, for as long as it heartbeats; the joining worker's join never completes (it logs a join
every ~8 s; tried: the second worker never ran the record in 90 s). Kafka and the mock cluster remove a member that has not rejoined
when the rebalance timeout is up.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from demo.harness import Record, Tail, produce
from tests.integration.conftest import Deployment, attempts_by_key, wait_for
from tests.kafka_under_test import MOCK, Kafka, selected_kafkas

pytest.importorskip("confluent_kafka", reason="the librdkafka mock cluster comes with confluent-kafka")
if MOCK not in selected_kafkas():
    pytest.skip("REBOUND_TEST_KAFKA leaves out the librdkafka mock cluster", allow_module_level=True)

pytestmark = pytest.mark.broker

KEY = "held-first-try"
OTHERS = ("before-0", "before-1", "after-0", "after-1")
"""Records around the held one in its partition: each must succeed (nothing lost, whoever runs it)."""
SENT = {"permanent": "dead-lettered", "retryable": "forwarded to a retry"}
DELAY = "5m"
"""The first retry delay: a retry the first worker sent would stay parked for the whole test."""


@pytest.fixture(scope="module")
def kafka(mock_kafka: Kafka) -> Kafka:
    """``deploy`` in this module runs on the mock cluster only (see the module's docstring for Tansu)."""
    return mock_kafka


def collect(deployment: Deployment, topics: list[str], until: Callable[[list[Record]], bool]) -> list[Record]:
    """Read ``topics`` from the start until ``until`` holds (``Deployment.collect``, with the tier topic too)."""

    async def run() -> list[Record]:
        async with Tail(deployment.broker.bootstrap, topics) as tail:
            if not await tail.until(until, 90):
                logs = "\n".join(worker.log_text()[-4000:] for worker in deployment.workers)
                raise AssertionError(f"not settled in 90 s; {len(tail.records)} records\n{logs}")
            return tail.records

    return asyncio.run(run())


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def first_try_revoked(port: int) -> float:
    """The worker's ``rebound_first_try_revoked_total{when="before-send"}`` (refused before the send)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.search(r'^rebound_first_try_revoked_total\{when="before-send"\} (\S+)$', text, re.MULTILINE)
    assert found, "no rebound_first_try_revoked_total in /metrics"
    return float(found.group(1))


def outcomes(seen: list[Record], key: str) -> list[tuple[int, str]]:
    return [(event["attempt"], event["outcome"]) for event in attempts_by_key(seen).get(key, [])]


@pytest.mark.parametrize("failure", ["permanent", "retryable"])
def test_a_first_try_running_when_its_partition_moves_sends_nothing_and_the_new_owner_runs_the_message(
    deploy: Any, tmp_path: Path, failure: str
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    deployment: Deployment = deploy(
        partitions=1,
        REBOUND_RETRY_SEQUENCE=DELAY,
        REBOUND_HANDLER_TIMEOUT="120s",  # the held call is not cut short while the test holds it
    )

    print(f"deployment in {deployment.root}")
    (gate / "hold").touch()
    first = deployment.start_gated_worker("first", gate)
    assert first.process is not None
    first_pid = first.process.pid
    records: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]]
    records = [(key.encode(), b"{}", []) for key in OTHERS[:2]]
    records.append((KEY.encode(), json.dumps({"gated": failure}).encode(), []))
    records += [(key.encode(), b"{}", []) for key in OTHERS[2:]]
    offset = asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))[2].offset
    wait_for((gate / f"held-{first_pid}").exists, 90, "the first worker's call of the held record", [first])

    joined_ms = now_ms()
    second = deployment.start_gated_worker("second", gate)
    assert second.process is not None
    second_pid = second.process.pid
    runs_on_second = wait_for(
        lambda: [c for c in deployment.calls() if c["pid"] == second_pid and c["key"] == KEY],
        90,
        "the second worker running the held record (the partition moved)",
        [first, second],
        interval=0.05,
    )
    moved_ms = runs_on_second[0]["now_ms"]

    released_ms = now_ms()
    (gate / "release").touch()
    refused = f"partition 0 revoked before {deployment.topic}[0]@{offset} attempt 0 was sent"
    tier = f"{deployment.topic}.retry.{DELAY}"

    def sent_by_the_first(seen: list[Record]) -> list[Record]:
        """What the held call would send: its dead letter or retry (the key's record on the failed or the tier topic;
        the key's other calls succeed) and the attempt event that follows it."""
        ends = (f"{deployment.topic}.failed", tier)
        return [
            record
            for record in seen
            if (record.topic in ends and record.key == KEY.encode())
            or (
                record.topic.endswith(".attempts")
                and record.json()["key"] == KEY
                and record.json()["outcome"] != "succeeded"
            )
        ]

    def settled(seen: list[Record]) -> bool:
        """Every message succeeded somewhere, and the held call ended: refused (logged) or something sent."""
        succeeded = {
            event["key"]
            for events in attempts_by_key(seen).values()
            for event in events
            if event["outcome"] == "succeeded"
        }
        return succeeded >= {KEY, *OTHERS} and (refused in first.log_text() or bool(sent_by_the_first(seen)))

    seen = collect(deployment, [f"{deployment.app_id}.attempts", f"{deployment.topic}.failed", tier], settled)
    revoked = first_try_revoked(first.web_port)
    ends = outcomes(seen, KEY)
    forked = sent_by_the_first(seen)
    held_calls = [c for c in deployment.calls() if c.get("held")]
    print(
        f"held call on {first_pid} at +0 ms; second worker started at +{joined_ms - held_calls[0]['now_ms']} ms, ran "
        f"the record at +{moved_ms - held_calls[0]['now_ms']} ms; released at +{released_ms - held_calls[0]['now_ms']}"
        f" ms; rebound_first_try_revoked_total on the first worker {revoked:g}; the key's attempt events {ends}; "
        f"calls of the key {[(c['pid'], c['attempt']) for c in deployment.calls() if c['key'] == KEY]}"
    )

    assert [c["pid"] for c in held_calls] == [first_pid]
    # One lifecycle: the message succeeded (on its new owner; once more if read again: at-least-once) and nothing
    # else: no dead letter, no retry, no second attempt.
    assert not forked, f"the message succeeded and was {SENT[failure]} too: {forked}"
    assert set(ends) == {(0, "succeeded")}, f"the message forked: {ends}"
    # The first worker's send was refused by its ownership check, said so and counted it.
    assert refused in first.log_text(), first.log_text()[-4000:]
    assert revoked >= 1
