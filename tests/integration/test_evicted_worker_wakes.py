"""A worker stopped (SIGSTOP) past its session timeout runs none of its queued records when it wakes (issue 22).

In chaos runs (docs/guarantees.md, "Runs of 2026-12-05") nearly every dead letter sent twice came from a worker that
had been stopped past its session timeout: when it ran again it went on with the records it had queued, which the
partitions' new owner had already run. The group has evicted it; its dispatcher must drop that queue at the
revocation (``Dispatcher.revoke``, ``ReboundConsumer.evicted``, ``ReboundConsumer.on_partitions_revoked``), and nothing
it had queued may start before then either.

Real workers on the embedded broker: a slow handler (50 ms) and ``REBOUND_CONCURRENCY=2`` in front of a backlog keep
hundreds of records queued in the first worker (one partition; the second worker joins as its standby). The first is
stopped until the second runs the partition, then woken. From the handler's call log (pid, start time): the woken
worker starts no call between the wake and the next assignment the group gives it (after which it reads from the
committed offsets, not from its old queue); calls running at the stop may finish (they logged their start before it).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from datetime import datetime
from typing import Any

import pytest

from demo.harness import FAST_GROUP_TIMEOUTS, produce
from tests.integration.conftest import Deployment, wait_for

pytestmark = pytest.mark.broker

MESSAGES = 1500
"""A backlog the two workers cannot finish during the test (about 40 calls a second each): records stay queued."""
HANDLER_S = 0.05
CONCURRENCY = "2"
SESSION_TIMEOUT_S = float(FAST_GROUP_TIMEOUTS["REBOUND_SESSION_TIMEOUT"])
AFTER_WAKE_S = 5.0
"""How long the woken worker is watched: its heartbeat learns of the eviction at once, and it rejoins within ~4 s."""


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def log_times_ms(log: str, text: str) -> list[int]:
    """When the worker logged lines holding ``text``, in epoch ms (its log stamps are local time, as ours)."""
    stamps = re.findall(rf"^\[(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}})\][^\n]*{re.escape(text)}", log, re.MULTILINE)
    return [int(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() * 1000) for stamp in stamps]


def calls_of(deployment: Deployment, pid: int, since_ms: int = 0) -> list[dict[str, Any]]:
    return [call for call in deployment.calls() if call["pid"] == pid and call["now_ms"] >= since_ms]


def test_a_worker_woken_after_its_eviction_runs_none_of_the_records_it_had_queued(deploy: Any) -> None:
    deployment: Deployment = deploy(partitions=1, REBOUND_CONCURRENCY=CONCURRENCY)
    asyncio.run(
        produce(
            deployment.broker.bootstrap,
            deployment.topic,
            [
                (f"wake-{index:04d}".encode(), json.dumps({"sleep": HANDLER_S}).encode(), [])
                for index in range(MESSAGES)
            ],
        )
    )
    first = deployment.start_worker("first")
    assert first.process is not None
    first_pid = first.process.pid
    print(f"deployment in {deployment.root}")
    wait_for(lambda: len(calls_of(deployment, first_pid)) >= 20, 60, "the first worker running", [first], interval=0.05)

    second = deployment.start_worker("second")
    assert second.process is not None
    second_pid = second.process.pid
    # The second worker has joined (its web server answers once it is up) and the first runs on after the rebalance.
    wait_for(lambda: "Worker ready" in second.log_text(), 60, "the second worker up", [first], interval=0.05)
    joined_ms = now_ms()
    wait_for(
        lambda: len(calls_of(deployment, first_pid, since_ms=joined_ms + 2000)) >= 20,
        60,
        "the first worker running after the second joined",
        [first, second],
        interval=0.05,
    )
    assert not calls_of(deployment, second_pid), "the second worker took the partition before the stop"

    stopped_ms = now_ms()
    first.process.send_signal(signal.SIGSTOP)
    try:
        wait_for(
            lambda: len(calls_of(deployment, second_pid, since_ms=stopped_ms)) >= 10,
            SESSION_TIMEOUT_S + 40,
            "the second worker running the partition",
            [second],
            interval=0.05,
        )
        assert now_ms() - stopped_ms > SESSION_TIMEOUT_S * 1000
    finally:
        woken_ms = now_ms()
        first.process.send_signal(signal.SIGCONT)
    time.sleep(AFTER_WAKE_S)

    # Once the group assigns it partitions again (it rejoined), it reads from the committed offsets: not its queue.
    assigned_again = [t for t in log_times_ms(first.log_text(), "Setting newly assigned partitions") if t >= woken_ms]
    until_ms = min(assigned_again, default=now_ms())
    after_wake = [call for call in calls_of(deployment, first_pid, since_ms=stopped_ms) if call["now_ms"] < until_ms]
    second_calls = calls_of(deployment, second_pid)
    print(
        f"stopped {woken_ms - stopped_ms} ms; the second worker's first call "
        f"{min(call['now_ms'] for call in second_calls) - stopped_ms} ms after the stop; the first worker's calls "
        f"after the wake (offset, ms after it): {[(c['offset'], c['now_ms'] - woken_ms) for c in after_wake]}; "
        f"assigned partitions again {until_ms - woken_ms} ms after the wake"
    )
    # Records were queued at the stop: the dispatcher held more than the two calls running (it logs its pauses).
    held = [int(count) for count in re.findall(r"pausing \S+ partition=0\): (\d+) records taken", first.log_text())]
    assert held and max(held) > int(CONCURRENCY), f"no queue in the first worker:\n{first.log_text()[-4000:]}"
    twice = sorted({c["offset"] for c in after_wake} & {c["offset"] for c in second_calls})
    assert not after_wake, (
        f"the woken worker started {len(after_wake)} handler calls for records it had queued, the first "
        f"{after_wake[0]['now_ms'] - woken_ms} ms after the wake: offsets {[c['offset'] for c in after_wake]}, "
        f"{len(twice)} of them run by the new owner too"
    )
