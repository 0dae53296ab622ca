"""Operator actions through real workers on the embedded broker: pause and resume of the main topics, replay of one
failed record, and the command line against a running worker."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from demo.harness import Tail, Worker, produce
from tests.integration.conftest import Deployment, attempts_by_key, failed_records, wait_for

pytestmark = [pytest.mark.broker]

TOKEN = "it-admin-token"
NOT_UP = (OSError, ValueError)
"""What a look at a worker's web server raises while it is not up yet."""
ROOT = Path(__file__).resolve().parents[2]


def get_json(worker: Worker, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.web_port}{path}", timeout=10) as response:
        return json.loads(response.read())


def post(worker: Worker, path: str, *, token: str = TOKEN, operator: str = "it-test") -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{worker.web_port}{path}",
        method="POST",
        headers={"Authorization": f"Bearer {token}", "X-Rebound-Operator": operator},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def settled(workers: list[Worker], partitions: int) -> bool:
    """Every worker ready and the partitions shared among them, each owned once."""
    owned: list[int] = []
    for worker in workers:
        view = get_json(worker, "/retry/backlog?scope=worker")
        if not view["paused"]["known"] or not view["owned_partitions"]:
            return False
        owned += view["owned_partitions"]
    return sorted(owned) == list(range(partitions))


def scripted(keys: list[str], **script: Any) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    return [(key.encode(), json.dumps(script).encode(), []) for key in keys]


def called(deployment: Deployment, prefix: str) -> list[dict[str, Any]]:
    return [call for call in deployment.calls() if call["key"] and call["key"].startswith(prefix)]


def test_pause_holds_first_tries_on_every_worker_and_late_joiners_while_retries_are_released(deploy: Any) -> None:
    deployment: Deployment = deploy(partitions=4, REBOUND_RETRY_SEQUENCE="3s", REBOUND_ADMIN_TOKEN=TOKEN)
    first, second = deployment.start_worker("a"), deployment.start_worker("b")
    wait_for(
        lambda: settled([first, second], 4), 60, "two workers sharing the partitions", deployment.workers, ignore=NOT_UP
    )

    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, scripted(["parked"], succeed_on=1)))
    deployment.collect(lambda seen: any(e["outcome"] == "scheduled" for e in attempts_by_key(seen).get("parked", [])))

    status, body = post(first, "/retry/admin/pause")
    assert status == 200, body
    assert (body["paused"], body["by"], body["confirmed"], body["topics"]) == (
        True,
        "it-test",
        True,
        [deployment.topic],
    )
    wait_for(
        lambda: all(get_json(w, "/retry/backlog?scope=worker")["paused"]["applied_here"] for w in (first, second)),
        10,
        "both workers applying the pause",
        deployment.workers,
        ignore=NOT_UP,
    )
    cluster = get_json(second, "/retry/backlog")["paused"]
    assert (cluster["paused"], cluster["by"], cluster["at"]) == (True, "it-test", body["at"])

    new = [f"new-{index}" for index in range(20)]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, scripted(new)))
    # The parked retry is released while the main topics are paused...
    deployment.collect(lambda seen: any(e["outcome"] == "succeeded" for e in attempts_by_key(seen).get("parked", [])))
    time.sleep(1.0)
    assert called(deployment, "new-") == []  # ...and no first try ran

    late = deployment.start_worker("c")  # a rebalance: every worker gets partitions it did not have
    wait_for(
        lambda: settled([first, second, late], 4),
        60,
        "three workers sharing the partitions",
        deployment.workers,
        ignore=NOT_UP,
    )
    assert get_json(late, "/retry/backlog?scope=worker")["paused"] | {"source": None} == {
        "paused": True,
        "by": "it-test",
        "source": None,
        "at": body["at"],
        "topics": [deployment.topic],
        "known": True,
        "applied_here": True,
        "reader_failures": 0,
    }
    time.sleep(2.0)
    assert called(deployment, "new-") == [], "a worker fetched the main topic while paused"
    assert "are paused (by it-test" in late.log_text()

    status, resumed = post(late, "/retry/admin/resume", operator="it-resume")
    resumed_at = time.time_ns() // 1_000_000
    assert status == 200 and resumed["paused"] is False and resumed["by"] == "it-resume", resumed
    records = deployment.collect(
        lambda seen: all(any(e["outcome"] == "succeeded" for e in attempts_by_key(seen).get(key, [])) for key in new),
        timeout=60,
    )
    assert not [e for e in attempts_by_key(records).get("new-0", []) if e["outcome"] != "succeeded"]
    calls = called(deployment, "new-")
    assert sorted({call["key"] for call in calls}) == sorted(new)  # nothing lost
    assert min(call["now_ms"] for call in calls) >= resumed_at - 1000  # (the worker applies it before answering)
    for worker in (first, second, late):
        assert get_json(worker, "/retry/backlog?scope=worker")["paused"]["paused"] is False
    assert "admin pause of the main topics" in first.log_text() and "by it-test" in first.log_text()
    assert "admin resume of the main topics" in late.log_text()


def test_a_worker_started_after_the_whole_cluster_stopped_paused_stays_paused(deploy: Any) -> None:
    """The pause is read from the dedicated control topic (one partition), not the admin topic: a worker started
    after every worker stopped holds its main topics from the start and stays paused until a resume."""
    deployment: Deployment = deploy(partitions=2, REBOUND_ADMIN_TOKEN=TOKEN)
    first = deployment.start_worker("a")
    wait_for(lambda: settled([first], 2), 60, "the worker owning the partitions", deployment.workers, ignore=NOT_UP)
    status, body = post(first, "/retry/admin/pause")
    assert status == 200 and body["confirmed"] is True, body
    first.stop()

    async def topic_records(topic: str, wanted: int) -> list[Any]:
        async with Tail(deployment.broker.bootstrap, [topic]) as tail:
            await tail.until(lambda seen: len(seen) >= wanted, timeout=3)
            return tail.records

    control = asyncio.run(topic_records(f"{deployment.app_id}.control", 1))
    assert [(r.partition, r.key) for r in control] == [(0, b"rebound.control/main-topics")]
    assert asyncio.run(topic_records(f"{deployment.app_id}.admin", 1)) == []  # nothing on the admin topic

    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, scripted(["after-0", "after-1"])))
    restarted = deployment.start_worker("b")
    wait_for(
        lambda: settled([restarted], 2),
        60,
        "the restarted worker owning the partitions",
        deployment.workers,
        ignore=NOT_UP,
    )
    paused = get_json(restarted, "/retry/backlog?scope=worker")["paused"]
    assert (paused["paused"], paused["by"], paused["at"], paused["applied_here"]) == (True, "it-test", body["at"], True)
    assert get_json(restarted, "/ready")["pause_state_known"] is True
    time.sleep(2.0)
    assert called(deployment, "after-") == [], "the restarted worker fetched the main topic while paused"

    status, resumed = post(restarted, "/retry/admin/resume")
    assert status == 200 and resumed["paused"] is False, resumed
    deployment.collect(
        lambda seen: all(
            any(e["outcome"] == "succeeded" for e in attempts_by_key(seen).get(key, []))
            for key in ("after-0", "after-1")
        ),
        timeout=60,
    )


def faust_cli(*args: str, worker: Worker) -> subprocess.CompletedProcess[str]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REBOUND_")},
        "REBOUND_WEB_URL": f"http://127.0.0.1:{worker.web_port}",
        "REBOUND_ADMIN_TOKEN": TOKEN,
    }
    return subprocess.run(
        [sys.executable, "-m", "faust", "-A", "app", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_replay_sends_a_dead_letter_back_to_its_handler_and_refuses_what_it_cannot_replay(deploy: Any) -> None:
    deployment: Deployment = deploy(
        partitions=1,
        REBOUND_RETRY_SEQUENCE="1s",
        REBOUND_ADMIN_TOKEN=TOKEN,
        REBOUND_PRODUCER_MAX_REQUEST_BYTES="4096",
    )
    worker = deployment.start_worker("solo")
    records = [
        (b"poison", json.dumps({"permanent": True}).encode(), [("trace-id", b"t-1")]),
        (b"huge", json.dumps({"permanent": True, "pad": "x" * 6000}).encode(), []),
    ]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    dead = failed_records(deployment.collect(lambda seen: len(failed_records(seen)) >= 2))
    poison = next(record for record in dead if record.key == b"poison")
    huge = next(record for record in dead if record.key == b"huge")
    assert huge.value is None and huge.headers["rebound.reason"] == b"too-large"
    failed_topic = f"{deployment.topic}.failed"

    # Through the command line, against the running worker:
    done = faust_cli("replay", failed_topic, "0", str(poison.offset), worker=worker)
    assert done.returncode == 0, done.stderr
    assert (
        f"replayed {failed_topic} partition 0 offset {poison.offset} -> {deployment.topic} partition 0" in done.stdout
    )
    assert "redrive-count 1 of at most 3" in done.stdout

    # The handler runs it again, as a fresh message with the user's headers; failing again, it carries its count.
    again = failed_records(deployment.collect(lambda seen: len(failed_records(seen)) >= 3))
    second = next(record for record in again if record.key == b"poison" and record.offset != poison.offset)
    assert second.headers["rebound.redrive-count"] == b"1" and second.value == poison.value
    calls = [call for call in deployment.calls() if call["key"] == "poison"]
    assert len(calls) == 2 and calls[1]["attempt"] == 0
    assert calls[1]["headers"] == ["rebound.redrive-count", "trace-id"]  # the one rebound.* header carried

    async def main_topic_records() -> list[Any]:
        async with Tail(deployment.broker.bootstrap, [deployment.topic]) as tail:
            await tail.until(lambda seen: len(seen) >= 3, timeout=10)
            return tail.records

    replayed = asyncio.run(main_topic_records())[-1]
    assert (replayed.key, replayed.value) == (b"poison", poison.value)
    assert replayed.raw_headers == [("trace-id", b"t-1"), ("rebound.redrive-count", b"1")]

    status, body = post(worker, f"/retry/admin/replay/{failed_topic}/0/{huge.offset}")
    assert status == 409 and body["refused"] == "value-left-out", body
    assert f"partition 0 offset {huge.headers['rebound.original-offset'].decode()}" in body["error"]
    status, body = post(worker, f"/retry/admin/replay/{failed_topic}/0/{second.offset}?max_redrives=1")
    assert status == 409 and body["refused"] == "redrive-cap", body
    status, body = post(worker, f"/retry/admin/replay/{failed_topic}/0/999")
    assert status == 404, body
    status, body = post(worker, f"/retry/admin/replay/{deployment.topic}/0/0")
    assert status == 404 and body["failed_topics"] == [failed_topic], body
    status, body = post(worker, f"/retry/admin/replay/{failed_topic}/0/{poison.offset}", token="wrong")
    assert status == 401, body

    refused = faust_cli("replay", failed_topic, "0", str(huge.offset), worker=worker)
    assert refused.returncode == 1 and "HTTP 409: the dead letter's value was left out" in refused.stderr
    shown = faust_cli("failed", worker=worker)
    assert shown.returncode == 0 and failed_topic in shown.stdout, shown.stderr
    assert "admin replay of" in worker.log_text() and "refused (value-left-out)" in worker.log_text()
