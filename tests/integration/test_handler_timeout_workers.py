"""Rebound's handler timeout and a handler's own ``TimeoutError``, through a real worker on the embedded broker.

With ``REBOUND_PERMANENT_ERRORS=TimeoutError``, a handler that sleeps past ``REBOUND_HANDLER_TIMEOUT`` is still
retried (Rebound's own ``rebound.errors.HandlerTimeout``, retryable unless listed by that name), while a handler that
raises its own ``TimeoutError`` is dead-lettered ``permanent`` with its own class and message.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from demo.harness import Record, Tail, produce
from rebound import headers as h
from tests.integration.conftest import Deployment, has_outcomes

pytestmark = pytest.mark.broker


def test_rebounds_timeout_is_retried_and_a_handlers_own_timeout_follows_the_lists(deploy: Any) -> None:
    deployment: Deployment = deploy(
        partitions=1,
        REBOUND_HANDLER_TIMEOUT="1s",
        REBOUND_PERMANENT_ERRORS="TimeoutError",
        REBOUND_RETRY_SEQUENCE="1s",
    )
    worker = deployment.start_worker()
    records = [
        (b"hangs", json.dumps({"sleep": 3}).encode(), []),  # past the 1 s timeout on its first try only
        (b"own", json.dumps({"raise": "TimeoutError"}).encode(), []),
    ]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    tier, failed = f"{deployment.topic}.retry.1s", f"{deployment.topic}.failed"
    attempts = f"{deployment.app_id}.attempts"

    def done(seen: list[Record]) -> bool:
        assert not worker.crashed, worker.log_text()[-4000:]
        # "own"'s dead event follows its dead letter (buffered after the send is acknowledged): both are waited for.
        outcomes = {"hangs": ["scheduled", "succeeded"], "own": ["dead"]}
        return any(r.topic == failed for r in seen) and has_outcomes(seen, outcomes)

    async def collect() -> list[Record]:
        async with Tail(deployment.broker.bootstrap, [tier, failed, attempts]) as tail:
            assert await tail.until(done, 90), worker.log_text()[-4000:]
            return tail.records

    seen = asyncio.run(collect())
    [retry] = [r for r in seen if r.topic == tier]
    assert retry.key == b"hangs"
    assert retry.headers[h.ERROR_CLASS] == b"rebound.errors.HandlerTimeout"
    assert retry.headers[h.ERROR_MESSAGE] == b"handler ran longer than 1s"
    [dead] = [r for r in seen if r.topic == failed]
    assert dead.key == b"own"
    assert dead.headers[h.REASON] == b"permanent"
    assert dead.headers[h.ERROR_CLASS] == b"TimeoutError"
    assert dead.headers[h.ERROR_MESSAGE] == b"the handler's own call timed out"
    events = [r.json() for r in seen if r.topic == attempts]
    outcomes = {(event["key"], event["outcome"], event.get("error_class")) for event in events}
    assert ("hangs", "scheduled", "rebound.errors.HandlerTimeout") in outcomes
    assert ("hangs", "succeeded", None) in outcomes
    assert ("own", "dead", "TimeoutError") in outcomes
