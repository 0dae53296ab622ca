"""The worker's long-running parts run as mode services: restarted after a failure, stopped with the app."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agents.services import Closing, Restarting


async def test_a_failing_body_is_reported_and_run_again_until_it_stays_up() -> None:
    runs: list[int] = []
    failures: list[str] = []
    up = asyncio.Event()

    async def body() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise ConnectionError(f"broker gone ({len(runs)})")
        up.set()
        await asyncio.Event().wait()  # a reader that keeps reading

    service = Restarting("reader", body, lambda exc: failures.append(str(exc)), restart_after_s=0.01)
    await service.start()
    await asyncio.wait_for(up.wait(), 5)
    assert failures == ["broker gone (1)", "broker gone (2)"] and service.failures == 2
    await service.stop()
    assert len(runs) == 3  # stopping ends the body; it is not run again


async def test_stopping_during_the_pause_after_a_failure_does_not_wait_for_it() -> None:
    async def body() -> None:
        raise RuntimeError("always")

    service = Restarting("reader", body, lambda exc: None, restart_after_s=60)
    await service.start()
    await asyncio.sleep(0.05)
    await asyncio.wait_for(service.stop(), 5)  # Service.sleep returns early on stop
    assert service.failures == 1


async def test_closing_closes_its_resource_when_stopped() -> None:
    closed = asyncio.Event()

    async def close() -> None:
        closed.set()

    service = Closing("failed-topic reader", close)
    await service.start()
    assert not closed.is_set()
    await service.stop()
    assert closed.is_set()


async def test_a_service_logs_under_its_own_name(caplog: pytest.LogCaptureFixture) -> None:
    """mode prefixes a service's log lines with its label: ``[^--Restarting: release timer]: Starting...`` and
    ``[^--Closing: failed-call log]: Starting...`` read like a restart and a close going on at start-up."""
    caplog.set_level(logging.DEBUG)

    async def body() -> None:
        await asyncio.Event().wait()

    async def close() -> None:
        pass

    timer = Restarting("release timer", body, lambda exc: None)
    log = Closing("failed-call log", close)
    assert (timer.label, timer.shortlabel, log.label, log.shortlabel) == (
        "release timer", "release timer", "failed-call log", "failed-call log"
    )  # fmt: skip
    for service in (timer, log):
        await service.start()
        await service.stop()
    messages = [record.getMessage() for record in caplog.records]
    assert "[^release timer]: Starting..." in messages and "[^failed-call log]: Starting..." in messages
    assert not [message for message in messages if "Restarting:" in message or "Closing:" in message]
