"""Two workers share the partitions: each releases only what it owns, and takes over what the other leaves."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from typing import Any

import pytest

from demo.harness import produce
from tests.integration.conftest import Deployment, attempts_by_key, has_outcomes, wait_for

pytestmark = [
    pytest.mark.broker,
    pytest.mark.every_kafka,
]


def wait_for_assignment(deployment: Deployment, workers: int, timeout: float = 60) -> None:
    """Both workers report owned partitions in their logs once the group settled."""
    wait_for(
        lambda: all("release schedule adopted partitions" in w.log_text() for w in deployment.workers[:workers]),
        timeout,
        "the workers settling their assignment",
    )


def scripted(keys: list[bytes]) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    return [(key, json.dumps({"succeed_on": 1}).encode(), []) for key in keys]


def succeeded(records: Any, keys: list[bytes]) -> bool:
    by_key = attempts_by_key(records)
    return all(any(e["outcome"] == "succeeded" for e in by_key.get(key.decode(), [])) for key in keys)


def test_two_workers_release_only_their_partitions_and_take_over_on_leave(deploy: Any) -> None:
    deployment: Deployment = deploy(partitions=4, REBOUND_RETRY_SEQUENCE="3s")
    deployment.start_worker("a")
    deployment.start_worker("b")
    wait_for_assignment(deployment, 2)
    time.sleep(3)  # the second join triggers a rebalance; let it finish before producing

    shared = [f"shared-{index}".encode() for index in range(40)]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, scripted(shared)))
    deployment.collect(lambda seen: succeeded(seen, shared), timeout=60)
    retries = [call for call in deployment.calls() if call["attempt"] == 1 and call["key"].startswith("shared-")]
    assert sorted(call["key"] for call in retries) == sorted(key.decode() for key in shared)  # each ran exactly once
    runners: dict[int, set[int]] = defaultdict(set)
    for call in retries:
        runners[call["partition"]].add(call["pid"])
    assert all(len(pids) == 1 for pids in runners.values()), runners  # one owner per partition
    assert len({pid for pids in runners.values() for pid in pids}) == 2  # and both workers had a share

    handover = [f"handover-{index}".encode() for index in range(20)]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, scripted(handover)))
    # Every key's own scheduled event (its due time is read below), not a count of events.
    scheduled = deployment.collect(
        lambda seen: has_outcomes(seen, {key.decode(): ["scheduled"] for key in handover}), timeout=60
    )
    time.sleep(1)  # parked and flushed to the changelog
    leaving = deployment.workers[1]
    leaving.stop()  # graceful leave: its partitions move to the remaining worker with their changelog
    records = deployment.collect(lambda seen: succeeded(seen, handover), timeout=90)
    due = {
        e["key"]: e["due_at"]
        for events in attempts_by_key(scheduled).values()
        for e in events
        if e["outcome"] == "scheduled"
    }
    late = [call for call in deployment.calls() if call["attempt"] == 1 and call["key"].startswith("handover-")]
    assert {call["key"] for call in late} == {key.decode() for key in handover}  # none lost
    assert all(call["now_ms"] >= due[call["key"]] for call in late)  # none early, also after the handover
    assert not any(e["outcome"] == "dead" for events in attempts_by_key(records).values() for e in events)
