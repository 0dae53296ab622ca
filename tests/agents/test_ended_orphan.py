"""A parked entry whose message ended already: a stale copy of the payload table (issue 22, chaos run
``--ordering key --outcome random``).

After a half-read changelog recovery a worker's payload table still held entries whose messages had ended, while
the key's index (complete) said so with an *ended* mark and counted nothing parked. The entry's release request ran
the handler again (a fork); in key-ordered mode a retryable failure of that re-run blocked the key behind a retry
the tier agent then refused as ended, without lifting the block: the key's later messages waited for ever (lost).
Here the stale copy is made by hand: the entry's record put back into the payload table after its message ended.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agents.runtime import Runtime
from agents.tier import current
from rebound.state import payload_key
from tests.agents.support import Agents, handler_calls
from tests.scripted_handler import CALLS_ENV

ORIGIN = "items/0/0"
TIER = "items.retry.1s"


class OfPartition0:
    """Faust's current event for a write made outside an agent (table writes take its partition)."""

    message = SimpleNamespace(topic="agent-test.release", partition=0)


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "calls.jsonl"
    monkeypatch.setenv(CALLS_ENV, str(path))
    return path


async def ended_with_a_stale_copy(runtime: Runtime, agents: Agents, clock: Any) -> tuple[bytes, list[Any]]:
    """Offset 0 of key ``k`` fails once and succeeds on its retry; its parked record is then put back as a stale
    copy would hold it. Returns that record and the retry record sent to the tier."""
    await agents.main(b'{"succeed_on": 1}')
    retry_records = list(runtime.tier_topics[TIER].sent)
    await agents.park_tier_records()
    stale = runtime.store.payloads[payload_key(b"k", ORIGIN)]
    clock.advance(1000)
    await agents.release_due()
    state = runtime.store.load(b"k")
    [mark] = state.marks
    assert (mark.origin, mark.attempt, mark.ended) == (ORIGIN, 1, True) and state.parked == 0
    with current(OfPartition0()):
        runtime.store.payloads[payload_key(b"k", ORIGIN)] = stale  # (the index is left as it is: complete)
    assert runtime.store.entry(b"k", ORIGIN) is not None
    return stale, retry_records


async def request_release(agents: Agents, runtime: Runtime, attempt: int = 1) -> None:
    request = json.dumps({"origin": ORIGIN, "attempt": attempt}).encode()
    await agents.contexts["release"].put(request, key=b"k", partition=0)
    await runtime.dispatcher.wait_idle()


def block_on(runtime: Runtime, origin: str) -> None:
    """The key blocked behind ``origin`` (what the stale copy's re-run wrote before its retry was sent)."""
    before = runtime.store.load(b"k", origin=origin)
    with current(OfPartition0()):
        runtime.store.save(b"k", before, replace(before, blocked_by=origin, blocked_dead=False))


@pytest.mark.parametrize("ordering", ["none", "key"])
async def test_a_stale_entry_of_an_ended_message_is_dropped_not_run_again(
    make_runtime: Any, clock: Any, calls: Path, ordering: str
) -> None:
    runtime: Runtime = make_runtime(ordering=ordering)
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await ended_with_a_stale_copy(runtime, agents, clock)
        await request_release(agents, runtime)
    assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1)], "the ended message's handler ran again (a fork)"
    assert runtime.store.entry(b"k", ORIGIN) is None, "the stale entry is still parked"
    assert payload_key(b"k", ORIGIN) not in runtime.store.payloads, "its bytes are still stored"
    [mark] = runtime.store.load(b"k").marks
    assert (mark.attempt, mark.ended) == (1, True)
    assert runtime.counters["release.ended"] == 1
    assert runtime.counters["released"] == 1  # (the first release only)


async def test_a_stale_entry_blocking_its_key_lifts_the_block_and_its_held_messages_run(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    runtime: Runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await ended_with_a_stale_copy(runtime, agents, clock)
        block_on(runtime, ORIGIN)
        await agents.main(b'{"succeed_on": 0}')  # offset 1: held behind the (wrong) block
        assert [entry.origin for entry in runtime.store.load(b"k").held] == ["items/0/1"]
        await request_release(agents, runtime)
    assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1), ("k", 1, 0)]
    state = runtime.store.load(b"k", entries=True)
    assert not state.is_blocked and state.held == () and state.pending == ()
    assert runtime.counters["release.ended"] == 1


async def test_a_dead_letter_block_of_the_ended_message_stays_when_dead_letters_block(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    runtime: Runtime = make_runtime(ordering="key", ordering_dead_letter_blocks=True)
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await ended_with_a_stale_copy(runtime, agents, clock)
        before = runtime.store.load(b"k", origin=ORIGIN)
        with current(OfPartition0()):
            runtime.store.save(b"k", before, replace(before, blocked_by=ORIGIN, blocked_dead=True))
        await request_release(agents, runtime)
    assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1)]
    state = runtime.store.load(b"k", entries=True)
    assert state.pending == () and (state.blocked_by, state.blocked_dead) == (ORIGIN, True)


async def test_a_retry_of_an_ended_message_blocking_its_key_refused_by_its_tier_lifts_the_block(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    """Key-ordered: the key is blocked behind a message that ended (a stale re-run's retry block) and that retry
    arrives at its tier, which refuses it as ended: the key stops waiting for it, and its held message runs."""
    runtime: Runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        _stale, retry_records = await ended_with_a_stale_copy(runtime, agents, clock)
        with current(OfPartition0()):
            runtime.store.payloads.pop(payload_key(b"k", ORIGIN))  # (only the block here: no stale entry)
        block_on(runtime, ORIGIN)
        await agents.main(b'{"succeed_on": 0}')  # offset 1: held
        assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1)]
        runtime.tier_topics[TIER].sent = retry_records  # the retry of the ended message arrives (again)
        await agents.park_tier_records()
        assert runtime.counters["tier.duplicates_ended"] == 1
        await agents.release_due()
    assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1), ("k", 1, 0)], "the held message never ran"
    state = runtime.store.load(b"k", entries=True)
    assert not state.is_blocked and state.held == () and state.pending == ()
