"""A record read again from a lower offset runs in its key's offset order, through a real worker and broker.

One key, three records: K@0 takes a while, K@1 is lost on its way to the dispatcher (the worker-side injection in
:mod:`tests.reread_injection` stands in for a stream queue Faust clears as it resumes the flow), K@2 waits on K's
lane behind K@0; the consumer then reads the partition again from offset 1. K@1 must run before K@2, each once.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from demo.harness import Worker, produce
from tests.integration.conftest import Deployment, attempts_by_key

pytestmark = [pytest.mark.broker]


def start_with_injection(deployment: Deployment) -> Worker:
    env = deployment.worker_env(deployment.root / "data-w")
    env["REBOUND_HANDLER"] = "tests.reread_injection:handle"
    worker = Worker(env, deployment.root / "w.log").start()
    deployment.workers.append(worker)
    return worker


def run_key(deployment: Deployment, scripts: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Produce ``scripts`` as key K's records from offset 0, run a worker with the injection until each succeeded,
    and return K's handler calls as (offset, attempt), in call order."""
    records: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]] = [
        (b"K", json.dumps({**script, "n": n}).encode(), []) for n, script in enumerate(scripts)
    ]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    worker = start_with_injection(deployment)

    def all_succeeded(seen: Any) -> bool:
        events = attempts_by_key(seen).get("K", [])
        succeeded = {event["original_offset"] for event in events if event["outcome"] == "succeeded"}
        return succeeded == set(range(len(scripts)))

    deployment.collect(all_succeeded, timeout=90)
    log = worker.log_text()
    assert "reread-injection: reading" in log, log[-4000:]  # the fault was injected as planned
    return [(call["offset"], call["attempt"]) for call in deployment.calls() if call["key"] == "K"]


def test_a_record_read_again_runs_before_the_later_record_of_its_key_waiting_behind_a_slow_one(deploy: Any) -> None:
    deployment: Deployment = deploy(partitions=1, REREAD_LOSE="1", REREAD_AFTER="2")
    calls = run_key(deployment, [{"sleep": 4}, {}, {}])
    assert calls == [(0, 0), (1, 0), (2, 0)]


def test_in_key_order_a_record_read_again_that_fails_holds_the_later_one(deploy: Any) -> None:
    """Key-ordered mode: K@1, read again, fails once; K@2 is held behind its retry instead of running first."""
    deployment: Deployment = deploy(
        partitions=1, REREAD_LOSE="1", REREAD_AFTER="2", REBOUND_ORDERING="key", REBOUND_RETRY_SEQUENCE="1s"
    )
    calls = run_key(deployment, [{"sleep": 4}, {"succeed_on": 1}, {}])
    assert calls == [(0, 0), (1, 0), (1, 1), (2, 0)]


def test_in_key_order_a_record_read_again_that_fails_below_a_retrying_one_succeeds_first(deploy: Any) -> None:
    """Key-ordered mode: K@2 fails and retries; K@1, lost and read again once K@2 ran, fails once too. K@2's retry
    comes due first and waits for K@1's: the handler's successes come in offset order."""
    deployment: Deployment = deploy(
        partitions=1,
        REREAD_LOSE="1",
        REREAD_AFTER="2",
        REREAD_ON_CALL="1",
        REBOUND_ORDERING="key",
        REBOUND_RETRY_SEQUENCE="3s",
    )
    calls = run_key(deployment, [{}, {"succeed_on": 1}, {"succeed_on": 1}])
    assert calls == [(0, 0), (2, 0), (1, 0), (1, 1), (2, 1)]
    topic = deployment.topic
    assert f"retry 1 of {topic}/0/2 deferred: {topic}/0/1, below it, is unsettled" in deployment.workers[0].log_text()
