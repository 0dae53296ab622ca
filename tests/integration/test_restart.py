"""Parked messages survive a killed worker: the state table is recovered from its changelog by a new worker."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from typing import Any

import pytest

from demo.harness import produce
from tests.integration.conftest import Deployment, attempts_by_key, has_outcomes

pytestmark = [pytest.mark.broker, pytest.mark.every_kafka]


def get_json(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return json.loads(response.read())


MESSAGES = 12


def test_worker_killed_while_messages_are_parked_loses_nothing_and_releases_nothing_early(deploy: Any) -> None:
    deployment: Deployment = deploy(REBOUND_RETRY_SEQUENCE="6s")
    first = deployment.start_worker("first")
    keys = [f"parked-{index}".encode() for index in range(MESSAGES)]
    asyncio.run(
        produce(
            deployment.broker.bootstrap,
            deployment.topic,
            [(key, json.dumps({"succeed_on": 1}).encode(), []) for key in keys],
        )
    )
    # Every key's own scheduled event (its due time is read below), not a count of events.
    scheduled = deployment.collect(
        lambda seen: has_outcomes(seen, {key.decode(): ["scheduled"] for key in keys}), timeout=60
    )
    time.sleep(1.5)  # let the tier agent park and the changelog flush, well before the 6s delay is over
    backlog = get_json(first.web_port, "/retry/backlog")
    tier = backlog["tiers"][f"{deployment.topic}.retry.6s"]
    assert (tier["waiting"], tier["overdue"]) == (MESSAGES, 0)
    assert 0 < tier["next_release_in_ms"] <= 6000
    key_state = get_json(first.web_port, "/retry/keys/parked-0")
    assert key_state["found"] and key_state["pending"][0]["attempt"] == 1
    assert "value" not in key_state["pending"][0]  # payloads stay hidden unless switched on
    first.kill()  # SIGKILL: no graceful shutdown, no final commit
    # A fresh data directory: the new worker has only the changelog, as when a partition moves to another machine.
    deployment.start_worker("second")
    records = deployment.collect(
        lambda seen: all(
            any(e["outcome"] == "succeeded" for e in attempts_by_key(seen).get(key.decode(), [])) for key in keys
        ),
        timeout=90,
    )
    due = {
        event["key"]: event["due_at"]
        for events in attempts_by_key(scheduled).values()
        for event in events
        if event["outcome"] == "scheduled"
    }
    retries = [call for call in deployment.calls() if call["attempt"] == 1]
    assert {call["key"] for call in retries} == {key.decode() for key in keys}  # none lost
    assert all(call["now_ms"] >= due[call["key"]] for call in retries)  # none early
    succeeded = [e for events in attempts_by_key(records).values() for e in events if e["outcome"] == "succeeded"]
    assert {event["key"] for event in succeeded} == {key.decode() for key in keys}
    assert not any(event["outcome"] == "dead" for events in attempts_by_key(records).values() for event in events)
    # The second worker found the parked messages in the recovered table, not only by re-reading the tier topic.
    adopted = re.findall(r"adopted partitions \[[\d, ]*\] \((\d+) parked\)", deployment.workers[1].log_text())
    assert sum(int(count) for count in adopted) >= 1, adopted
