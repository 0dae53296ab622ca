"""A record read again below later records of its key, through the real agents in key-ordered mode.

The consumer reads a partition again from a lower offset after records were lost on their way to the dispatcher (a
stream queue cleared when the flow resumed, a hand-over cut short); the records it took already come again and are
let go, the lost ones come for the first time, after later records of their key. Here K@100 runs, K@107 waits on
K's lane, and K@105 arrives: it must run before 107, so that in key-ordered mode 107 is the one held behind 105's
retry, not 105 run behind 107's first try as if it were a redelivery.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.agents.conftest import eventually, nothing_waits
from tests.agents.support import Agents, handler_calls, state_of
from tests.scripted_handler import CALLS_ENV


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "calls.jsonl"
    monkeypatch.setenv(CALLS_ENV, str(path))
    return path


async def offer_at(agents: Agents, offset: int, value: bytes) -> asyncio.Task[None]:
    """Put a main record of key ``k`` at ``offset`` without waiting for its work (``put`` waits for the dispatcher
    to be idle); returns once the dispatcher took it."""
    dispatcher = agents.runtime.dispatcher
    taken = dispatcher.in_flight + dispatcher.core.queued
    agents.contexts["main"].sent_offset = offset
    task = asyncio.create_task(agents.main(value))
    await eventually(lambda: dispatcher.in_flight + dispatcher.core.queued == taken + 1)
    return task


async def test_a_record_read_again_below_a_queued_later_one_of_its_key_runs_first_and_blocks_it(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        tasks = [
            await offer_at(agents, 100, b'{"sleep": 0.3}'),  # running
            await offer_at(agents, 107, b'{"succeed_on": 1}'),  # queued behind it on K's lane
            await offer_at(agents, 105, b'{"succeed_on": 1}'),  # read again: lost on its way the first time
        ]
        await asyncio.gather(*tasks)
        assert handler_calls(calls) == [("k", 100, 0), ("k", 105, 0)]
        state = state_of(runtime, b"k")
        assert state.blocked_by == "items/0/105"
        assert [entry.origin for entry in state.held] == ["items/0/107"]

        await agents.park_tier_records()
        clock.advance(1000)
        await agents.release_due()  # 105's retry succeeds; 107 runs, fails, and blocks the key
        await agents.park_tier_records()
        clock.advance(1000)
        await agents.release_due()
        assert handler_calls(calls) == [("k", 100, 0), ("k", 105, 0), ("k", 105, 1), ("k", 107, 0), ("k", 107, 1)]
        state = state_of(runtime, b"k")
        assert (state.pending, state.held, state.blocked_by) == ((), (), None)


async def run_at(agents: Agents, offset: int, value: bytes) -> None:
    """A main record of key ``k`` at ``offset``, run to its end (a record read again comes below later ones)."""
    agents.contexts["main"].sent_offset = offset
    await agents.main(value)


async def test_a_record_read_again_that_fails_below_a_retrying_one_succeeds_first(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    """K@107 failed and retries (due first); K@105, read again, runs and fails too: two messages of K retry, and 105,
    the lowest, blocks the key. 107's retry comes due while 105's is still on its way to the tier: deferred. 105's
    settle releases it at the next tick, before the deferral's own recheck: K's successes come in offset order."""
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await run_at(agents, 107, b'{"succeed_on": 1}')
        await agents.park_tier_records()
        clock.advance(500)
        await run_at(agents, 105, b'{"succeed_on": 1}')  # read again: runs at once (below 107), fails
        assert state_of(runtime, b"k").blocked_by == "items/0/105"

        clock.advance(500)  # 107's retry is due; 105's is not parked yet
        await agents.release_due()
        assert handler_calls(calls) == [("k", 107, 0), ("k", 105, 0)]
        assert runtime.counters["ordering.deferred"] == 1
        await agents.park_tier_records()
        state = state_of(runtime, b"k")
        assert sorted(entry.origin for entry in state.pending) == ["items/0/105", "items/0/107"]

        clock.advance(500)  # 105's retry is due (107's recheck is 500 ms later): it succeeds, then 107's runs
        await agents.release_due()
        await agents.release_due()
        assert handler_calls(calls) == [("k", 107, 0), ("k", 105, 0), ("k", 105, 1), ("k", 107, 1)]
        assert nothing_waits(runtime, b"k")


async def test_a_record_held_between_two_retrying_ones_of_its_key_runs_before_the_later_one(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    """107 retries; 100, read again, fails too and blocks; 103, read again, is held behind 100. 107 comes due
    first and is deferred; 100's retry succeeds, then 103 runs (107, parked above it, waits for it rather than it
    for 107: no deadlock), then 107's retry: every success in offset order."""
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await run_at(agents, 107, b'{"succeed_on": 1}')
        await agents.park_tier_records()
        clock.advance(100)
        await run_at(agents, 100, b'{"succeed_on": 1}')
        await agents.park_tier_records()
        clock.advance(100)
        await run_at(agents, 103, b'{"succeed_on": 0}')
        state = state_of(runtime, b"k")
        assert (state.blocked_by, [entry.origin for entry in state.held]) == ("items/0/100", ["items/0/103"])

        clock.advance(800)  # 107 due
        await agents.release_due()
        assert handler_calls(calls) == [("k", 107, 0), ("k", 100, 0)]
        clock.advance(100)  # 100 due
        await agents.release_due()
        await agents.release_due()
        assert handler_calls(calls)[2:] == [("k", 100, 1), ("k", 103, 0), ("k", 107, 1)]
        assert nothing_waits(runtime, b"k")
