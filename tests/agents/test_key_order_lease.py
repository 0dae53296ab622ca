"""Key-ordered mode and the session lease (issue 22): the held messages a release runs after its blocker, one handler
call after another inside one started work, each check the lease (``Dispatcher.lease_gate``), not only the work's
start. The other lease tests are in tests/app/test_session_lease.py; these need the real agents (``test_context``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from agents.dispatcher import Dispatcher
from rebound.event import RetryEvent
from tests.agents.support import Agents, calls, handler_calls, state_of

__all__ = ["calls"]  # the fixture, used here

SESSION_S = 6.0


class Monotonic:
    """The lease's clock, moved by the test: a SIGSTOP is a jump."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_held_messages_released_after_the_worker_was_stopped_past_its_session_timeout_do_not_run(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    """The release of the key's blocker succeeds and the worker is stopped right after, past its session timeout: the
    held messages the same work runs next must wait for the heartbeat's word, and the eviction's revocation leaves
    them to the partition's new owner, still held."""
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    dispatcher: Dispatcher = runtime.dispatcher
    monotonic = Monotonic()
    lease = runtime.app.consumer.session_lease
    lease.clock, lease.poll_s = monotonic, 0.001
    lease.session_timeout_s = lease.max_wait_s = SESSION_S
    lease.renewed(monotonic.now)  # joined
    scripted = runtime.handler

    async def handler(event: RetryEvent) -> None:
        await scripted(event)
        if event.attempt == 1:
            monotonic.now += SESSION_S + 30  # stopped right after the blocker's retry succeeded

    runtime.handler = handler
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 1}')  # offset 0: fails once, blocks the key
        await agents.main(b'{"succeed_on": 0}')  # offset 1: held
        await agents.main(b'{"succeed_on": 0}')  # offset 2: held
        await agents.park_tier_records()
        clock.advance(1000)
        releasing = asyncio.ensure_future(agents.release_due())
        for _ in range(50):
            await asyncio.sleep(0.002)
        assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1)]  # the held ones wait for the lease
        assert not releasing.done()
        dispatcher.revoke()  # the heartbeat after the wake: UnknownMemberId, and the revocation
        await asyncio.wait_for(releasing, 2)
        assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1)]
        assert [entry.origin for entry in state_of(runtime, b"k").held] == ["items/0/1", "items/0/2"]
