"""Faust's livelock detector and the operator's pause, on a real worker: a pause longer than the detector's threshold
is not reported as a stopped stream once resumed, and a stream really stuck after the resume still is.

Faust logs "Stream stopped processing, or is slow" at ERROR for a partition with records not fetched yet whose stream
took no event for ``stream_processing_timeout`` (``AIOKafkaConsumerThread.verify_event_path``, every 2.5 commit
intervals). Rebound sets that timeout to 60 s or more; :mod:`tests.stream_timeout_injection` makes it 1.5 s and
``REBOUND_COMMIT_INTERVAL`` 0.1 s runs the detector every 0.25 s, so a pause of a few seconds is a long one to it.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from demo.harness import Worker, produce
from tests.integration.conftest import Deployment, attempts_by_key, wait_for
from tests.integration.test_operator_actions import NOT_UP, TOKEN, get_json, post, settled

pytestmark = [pytest.mark.broker]

TIMEOUT_S = 3.0
COMMIT_INTERVAL_S = 0.1
DETECTOR_EVERY_S = 2.5 * COMMIT_INTERVAL_S
STOPPED = ("Stream stopped processing", "Stream has not started processing")
"""Faust's two ERROR lines for a stream that takes no event (after some, or since the start)."""


def short_timeout_deployment(deploy: Any, **settings: str) -> Deployment:
    return deploy(  # type: ignore[no-any-return]
        partitions=2,
        REBOUND_ADMIN_TOKEN=TOKEN,
        REBOUND_COMMIT_INTERVAL=str(COMMIT_INTERVAL_S),
        STREAM_PROCESSING_TIMEOUT_S=str(TIMEOUT_S),
        **settings,
    )


def start_worker(deployment: Deployment) -> Worker:
    worker = deployment.start_worker("w", REBOUND_HANDLER="tests.stream_timeout_injection:handle")
    wait_for(lambda: settled([worker], 2), 60, "the worker owning both partitions", deployment.workers, ignore=NOT_UP)
    return worker


def stopped_lines(worker: Worker, since: int = 0) -> list[str]:
    """Faust's lines for a stopped stream in the worker's log, from its line ``since`` on."""
    return [line for line in worker.log_text().splitlines()[since:] if any(text in line for text in STOPPED)]


def log_length(worker: Worker) -> int:
    return len(worker.log_text().splitlines())


def succeeded(keys: list[str]) -> Any:
    def check(seen: Any) -> bool:
        by_key = attempts_by_key(seen)
        return all(any(e["outcome"] == "succeeded" for e in by_key.get(key, [])) for key in keys)

    return check


def records(keys: list[str], **script: Any) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    return [(key.encode(), json.dumps(script).encode(), []) for key in keys]


def pause(deployment: Deployment, worker: Worker) -> None:
    status, body = post(worker, "/retry/admin/pause")
    assert status == 200 and body["paused"] is True, body
    wait_for(
        lambda: get_json(worker, "/retry/backlog?scope=worker")["paused"]["applied_here"],
        10,
        "the worker applying the pause",
        deployment.workers,
        ignore=NOT_UP,
    )


def resume(worker: Worker) -> None:
    status, body = post(worker, "/retry/admin/resume")
    assert status == 200 and body["paused"] is False, body


def test_a_pause_longer_than_the_stream_timeout_is_not_reported_as_a_stopped_stream(deploy: Any) -> None:
    """Each resume leaves the resumed partitions' streams a moment before they take their first record again (the
    fetch in flight ends first: up to a second, Faust's ``getmany`` wait, with the long-poll wait of production,
    ``REBOUND_FETCH_MAX_WAIT_MS=1500``); a detector run in that moment used to see a stream idle since before the
    pause. Three pauses, so that the detector runs in one such moment for certain."""
    deployment = short_timeout_deployment(deploy, REBOUND_FETCH_MAX_WAIT_MS="1500")
    worker = start_worker(deployment)

    before = [f"before-{n}" for n in range(10)]  # every partition's stream takes events before the pause
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records(before)))
    deployment.collect(succeeded(before))

    for cycle in range(3):
        pause(deployment, worker)
        paused_from = log_length(worker)
        during = [f"during-{cycle}-{n}" for n in range(20)]  # records wait on both partitions while paused
        asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records(during)))
        time.sleep(2 * TIMEOUT_S + 4 * DETECTOR_EVERY_S)  # paused twice the threshold and more, the detector running
        assert stopped_lines(worker, paused_from) == [], "reported while paused"
        resumed_from = log_length(worker)
        resume(worker)
        deployment.collect(succeeded(during))
        time.sleep(TIMEOUT_S + 4 * DETECTOR_EVERY_S)  # the detector runs again after the resume
        assert stopped_lines(worker, resumed_from) == [], f"reported after resume {cycle + 1}"


def test_a_stream_stuck_after_a_resume_is_still_reported(deploy: Any) -> None:
    """The other side: a stream that takes nothing after the resume, its partition lagging, is reported as stopped
    once ``stream_processing_timeout`` has passed. One call at a time (``REBOUND_CONCURRENCY=1``) and a first record
    whose call takes 12 s: its partition and the other take 4 records each (``REBOUND_PARTITION_BUFFER``) and are
    paused for back-pressure, their streams take nothing more, and the records behind wait unfetched."""
    deployment = short_timeout_deployment(deploy, REBOUND_CONCURRENCY="1", REBOUND_PARTITION_BUFFER="4")
    worker = start_worker(deployment)
    before = [f"before-{n}" for n in range(10)]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records(before)))
    deployment.collect(succeeded(before))

    pause(deployment, worker)
    queued = [f"queued-{n}" for n in range(20)]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records(["slow"], sleep=12) + records(queued)))
    time.sleep(2 * TIMEOUT_S + 4 * DETECTOR_EVERY_S)
    resumed_from = log_length(worker)
    resume(worker)
    wait_for(lambda: any(call["key"] == "slow" for call in deployment.calls()), 10, "the slow call", deployment.workers)
    later = [f"later-{n}" for n in range(20)]  # lag behind the stuck stream on both partitions
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records(later)))
    lines = wait_for(
        lambda: stopped_lines(worker, resumed_from), 10, "Faust reporting the stuck stream", deployment.workers
    )
    assert "Stream stopped processing, or is slow" in lines[0], lines
    deployment.collect(succeeded(["slow", *queued, *later]))  # (then everything runs)
