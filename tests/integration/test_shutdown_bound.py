"""A worker facing a backlog of slow handler calls exits within ``REBOUND_SHUTDOWN_TIMEOUT`` of SIGTERM, and loses
nothing: the calls the shutdown cut short, and the records it dropped, run again on the next worker.

Scaled down from the default worst case (a 15 s drain, then a call started at its end running for the 30 s handler
timeout): here a 20 s drain and 8 s calls, which kept the worker for 25.7 s before the bound, against an 8 s shutdown
timeout (handler work cut at 4 s). The rebalance timeout is raised to 40 s only because the drain must fit in it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from demo.harness import Worker, produce
from tests.integration.conftest import Deployment, attempts_by_key

pytestmark = pytest.mark.broker

SHUTDOWN_TIMEOUT_S = 8.0
REAPING_S = 0.5
"""Between the worker's exit and ``wait`` returning here."""
RECORDS = 24


def test_sigterm_with_a_backlog_of_slow_calls_exits_within_the_shutdown_timeout_and_loses_nothing(
    deploy: Any,
) -> None:
    deployment: Deployment = deploy(
        partitions=2,
        REBOUND_CONCURRENCY="4",
        REBOUND_REBALANCE_TIMEOUT="40",
        REBOUND_HANDLER_TIMEOUT="10s",
        REBOUND_REVOKE_DRAIN="20",
        REBOUND_SHUTDOWN_TIMEOUT=str(SHUTDOWN_TIMEOUT_S),
        REBOUND_RETRY_SEQUENCE="1s",
    )
    first = deployment.start_worker("first")
    records = [(f"k{n}".encode(), json.dumps({"sleep": 8}).encode(), []) for n in range(RECORDS)]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    deadline = time.monotonic() + 120
    while len(deployment.calls()) < 4:  # four calls running, twenty queued behind them
        assert time.monotonic() < deadline, first.log_text()[-4000:]
        assert not first.crashed, first.log_text()[-4000:]
        time.sleep(0.1)
    assert first.process is not None
    first.stopping = True
    signalled = time.monotonic()
    first.process.send_signal(signal.SIGTERM)
    returncode = first.process.wait(60)
    took = time.monotonic() - signalled
    log = first.log_text()
    assert returncode == 0, log[-4000:]  # (75 if the watchdog had to end it)
    assert took < SHUTDOWN_TIMEOUT_S + REAPING_S, f"exited {took:.1f}s after SIGTERM\n{log[-4000:]}"
    assert "shutdown: 4s for handler work (REBOUND_SHUTDOWN_TIMEOUT less the time to commit and close) is up" in log
    first_pid = deployment.calls()[0]["pid"]
    cut = {(call["partition"], call["offset"]) for call in deployment.calls() if call["pid"] == first_pid}
    assert cut, "the first worker started calls"

    deployment.start_worker("second")
    seen = deployment.collect(
        lambda seen: sum(e["outcome"] == "succeeded" for es in attempts_by_key(seen).values() for e in es) >= RECORDS,
        timeout=120,
    )
    succeeded = [
        event for events in attempts_by_key(seen).values() for event in events if event["outcome"] == "succeeded"
    ]
    assert sorted(event["key"] for event in succeeded) == sorted(f"k{n}" for n in range(RECORDS)), (
        "none lost, none twice"
    )
    again = {(call["partition"], call["offset"]) for call in deployment.calls() if call["pid"] != first_pid}
    assert cut <= again, "every call the shutdown cut short ran again on the next worker"


def test_a_stop_still_running_at_the_shutdown_timeout_is_ended_with_code_75_and_loses_nothing(deploy: Any) -> None:
    """A 1 s bound is shorter than mode alone needs to close its event loop (it sleeps 1 s there): the watchdog
    ends the process at the bound, as it would a stop held by an unreachable broker."""
    from app.shutdown import SHUTDOWN_OVERRUN_EXIT_CODE

    deployment: Deployment = deploy(partitions=1, REBOUND_SHUTDOWN_TIMEOUT="1", REBOUND_RETRY_SEQUENCE="1s")
    first = deployment.start_worker("first")
    records = [(f"k{n}".encode(), json.dumps({"sleep": 5}).encode(), []) for n in range(3)]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    deadline = time.monotonic() + 120
    while len(deployment.calls()) < len(records):
        assert time.monotonic() < deadline, first.log_text()[-4000:]
        assert not first.crashed, first.log_text()[-4000:]
        time.sleep(0.1)
    assert first.process is not None
    first.stopping = True
    signalled = time.monotonic()
    first.process.send_signal(signal.SIGTERM)
    returncode = first.process.wait(60)
    took = time.monotonic() - signalled
    log = first.log_text()
    assert returncode == SHUTDOWN_OVERRUN_EXIT_CODE, log[-4000:]
    assert took < 1.0 + REAPING_S, f"exited {took:.1f}s after SIGTERM\n{log[-4000:]}"
    assert (
        "shutdown: still stopping 1s after the stop began (REBOUND_SHUTDOWN_TIMEOUT); exiting now with code 75" in log
    )

    deployment.start_worker("second")
    keys = {f"k{n}" for n in range(len(records))}

    def succeeded(seen: list[Any]) -> set[str]:
        return {e["key"] for es in attempts_by_key(seen).values() for e in es if e["outcome"] == "succeeded"}

    seen = deployment.collect(lambda seen: succeeded(seen) >= keys, timeout=120)
    assert succeeded(seen) == keys, "every record the ended stop left behind ran on the next worker"


def test_a_stop_after_a_crash_is_bounded_too_and_loses_nothing(deploy: Any, tmp_path: Path) -> None:
    """A crash stops the worker without a signal (mode's ``execute_from_commandline`` goes straight to its
    ``on_worker_shutdown`` and ``stop_and_shutdown``): the bound holds from there, as after SIGTERM. With a 1 s bound
    the watchdog ends it, as in the test above."""
    from app.shutdown import SHUTDOWN_OVERRUN_EXIT_CODE

    marker = tmp_path / "crashed"
    deployment: Deployment = deploy(
        partitions=1, REBOUND_SHUTDOWN_TIMEOUT="1", REBOUND_RETRY_SEQUENCE="1s", CRASH_MARKER=str(marker)
    )
    env = {**deployment.worker_env(deployment.root / "data-first"), "REBOUND_HANDLER": "tests.crashing_handler:handle"}
    first = Worker(env, deployment.root / "first.log").start()
    deployment.workers.append(first)
    first.stopping = True  # it stops by itself, when the handler crashes it
    records = [(f"k{n}".encode(), json.dumps({}).encode(), []) for n in range(3)]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    assert first.process is not None
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert time.monotonic() < deadline, first.log_text()[-4000:]
        assert first.process.poll() is None, first.log_text()[-4000:]
        time.sleep(0.02)
    crashed = time.monotonic()
    returncode = first.process.wait(60)
    took = time.monotonic() - crashed
    log = first.log_text()
    assert returncode == SHUTDOWN_OVERRUN_EXIT_CODE, log[-4000:]
    assert took < 1.0 + REAPING_S, f"exited {took:.1f}s after the crash\n{log[-4000:]}"
    assert "shutdown: the worker is stopping without a signal; it exits within 1s" in log
    assert (
        "shutdown: still stopping 1s after the stop began (REBOUND_SHUTDOWN_TIMEOUT); exiting now with code 75" in log
    )

    deployment.start_worker("second")
    keys = {f"k{n}" for n in range(len(records))}

    def succeeded(seen: list[Any]) -> set[str]:
        return {e["key"] for es in attempts_by_key(seen).values() for e in es if e["outcome"] == "succeeded"}

    seen = deployment.collect(lambda seen: succeeded(seen) >= keys, timeout=120)
    assert succeeded(seen) == keys, "the record being handled at the crash, and those after it, ran on the next worker"
