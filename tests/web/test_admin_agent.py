"""The admin agent through Faust's ``test_context``: dead-letter and retry-now change the table inside the stream."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from agents.admin import admin_channel
from rebound import headers as h
from rebound.commands import AdminCommand
from rebound.schedule import Slot
from tests.agents.conftest import RecordingTopic, eventually, nothing_waits
from tests.agents.support import tier_headers


async def park_two(runtime: Any, clock: Any) -> None:
    async with runtime.agents["items.retry.1s"].test_context() as tier:
        await tier.put(b'{"succeed_on": 9}', key=b"k", headers=tier_headers(clock), partition=0)
        other = dict(tier_headers(clock, due_in_ms=500))
        other[h.ORIGINAL_OFFSET] = b"8"
        await tier.put(b"second", key=b"k", headers=list(other.items()), partition=0)
        third = dict(tier_headers(clock))
        third[h.ORIGINAL_OFFSET] = b"9"
        await tier.put(b"keep", key=b"other", headers=list(third.items()), partition=0)


def command(action: str, key: bytes = b"k", command_id: str = "c1") -> bytes:
    return AdminCommand(command_id, action, key, "test", 0).to_json()


async def test_dead_letter_moves_every_pending_message_of_the_key_with_reason_admin(
    make_runtime: Any, clock: Any
) -> None:
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    await park_two(runtime, clock)
    assert runtime.schedule.waiting() == 3
    channel = admin_channel(runtime)
    waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    channel.waiters["c1"] = waiter
    async with runtime.agents["admin"].test_context() as admin:
        await admin.put(command("dead-letter"), key=b"k", partition=0)
        result = await asyncio.wait_for(waiter, 5)
    assert result["count"] == 2 and result["action"] == "dead-letter"
    assert sorted(m["origin"] for m in result["messages"]) == ["items/0/7", "items/0/8"]
    failed = runtime.failed_topics["items"].sent
    assert sorted(sent.value for sent in failed) == [b"second", b'{"succeed_on": 9}']  # byte-exact values
    assert {sent.headers[h.REASON] for sent in failed} == {b"admin"}
    assert all(sent.key == b"k" and sent.headers["trace-id"] == b"abc" for sent in failed)
    assert nothing_waits(runtime, b"k")  # gone from the table (only the ended marks of the two stay)
    assert runtime.table.get(b"other") is not None  # other keys untouched
    assert runtime.schedule.waiting() == 1  # the key's slots left the schedule too (heap rebuilt)
    outcomes = [json.loads(sent.value) for sent in runtime.attempts_topic.sent]
    assert [(o["outcome"], o["reason"]) for o in outcomes] == [("dead", "admin"), ("dead", "admin")]
    assert runtime.counters["admin.dead_lettered"] == 2


async def test_retry_now_makes_the_key_due_and_the_release_runs_it(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    await park_two(runtime, clock)
    assert runtime.schedule.pop_due(clock.now_ms) == []  # nothing due yet
    async with runtime.agents["admin"].test_context() as admin:
        await admin.put(command("retry-now", command_id="c2"), key=b"k", partition=0)
        await eventually(lambda: runtime.counters["admin.retry_now"] == 2)
    state = runtime.store.load(b"k", entries=True)
    assert {entry.due_at_ms for entry in state.pending} == {clock.now_ms}
    due = runtime.schedule.pop_due(clock.now_ms)
    assert sorted((slot.table_key, slot.origin) for _p, slot in due) == [(b"k", "items/0/7"), (b"k", "items/0/8")]
    assert runtime.schedule.waiting() == 3  # no stale future slot of the key left beside the due ones
    [(partition, slot)] = [item for item in due if item[1].origin == "items/0/7"]
    assert isinstance(slot, Slot) and partition == 0
    async with runtime.agents["release"].test_context() as releaser:
        await releaser.put(json.dumps({"origin": slot.origin, "attempt": slot.attempt}).encode(), key=b"k", partition=0)
        await eventually(lambda: runtime.counters["released"] == 1)
    assert runtime.counters["release.early"] == 0  # the release agent accepted the operator's due time


async def test_unknown_key_and_malformed_command_change_nothing(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    await park_two(runtime, clock)
    waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    admin_channel(runtime).waiters["c3"] = waiter
    async with runtime.agents["admin"].test_context() as admin:
        await admin.put(b"not json", key=b"k", partition=0)
        await admin.put(json.dumps({"id": "x", "action": "drop-table", "key": "aw=="}).encode(), key=b"k", partition=0)
        await admin.put(command("dead-letter", key=b"nobody", command_id="c3"), key=b"nobody", partition=0)
        result = await asyncio.wait_for(waiter, 5)
    assert result["count"] == 0 and result["messages"] == []
    assert runtime.failed_topics["items"].sent == []
    assert len(runtime.store.load(b"k", entries=True).pending) == 2


async def test_a_command_no_reader_can_read_is_logged_and_the_next_one_applied(
    make_runtime: Any, clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``1e999`` makes ``int()`` raise OverflowError, deep nesting makes ``json.loads`` raise RecursionError: neither
    is a ValueError, and either stopped the admin agent (as they stopped the release agent). Each is a malformed
    command, as any other unreadable one."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    await park_two(runtime, clock)
    waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    admin_channel(runtime).waiters["c4"] = waiter
    overflow = b'{"id": "x", "action": "retry-now", "key": "aw==", "requested_at": 1e999}'
    with caplog.at_level(logging.ERROR, logger="agents.admin"):
        async with runtime.agents["admin"].test_context() as admin:
            for raw in (overflow, b"[" * 100_000 + b"]" * 100_000):
                await admin.put(raw, key=b"k", partition=0)
            await admin.put(command("retry-now", command_id="c4"), key=b"k", partition=0)
            result = await asyncio.wait_for(waiter, 5)
    assert result["count"] == 2 and result["action"] == "retry-now"
    assert caplog.text.count("ignoring malformed admin command") == 2


async def test_channel_submit_sends_to_the_key_partition_and_returns_the_agent_answer(make_runtime: Any) -> None:
    runtime = make_runtime()
    channel = admin_channel(runtime)
    channel.topic = RecordingTopic("agent-test.admin")

    async def answer() -> None:
        await eventually(lambda: bool(channel.topic.sent))
        sent = AdminCommand.from_json(channel.topic.sent[0].value)
        channel.resolve(sent.command_id, {"id": sent.command_id, "count": 0})

    responder = asyncio.create_task(answer())
    command_id, result = await channel.submit("retry-now", b"k", 0, timeout=5)
    await responder
    assert result == {"id": command_id, "count": 0}
    assert channel.topic.sent[0].partition == 0 and channel.topic.sent[0].key == b"k"
    _, late = await channel.submit("retry-now", b"k", 0, timeout=0.05)  # nobody answers: accepted, unconfirmed
    assert late is None


def audit_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("admin action")]


@pytest.mark.parametrize("requested_at", [10**20, -(10**17), 2**63])
async def test_a_requested_time_that_is_no_time_still_gets_its_answer_and_its_audit_line(
    make_runtime: Any, clock: Any, caplog: pytest.LogCaptureFixture, requested_at: int
) -> None:
    """Review of the audit lines: the line, built after the action ran, called ``time.gmtime`` on ``requested_at``
    (any int the command's JSON holds), which raised for these (``OSError`` 75, ``OverflowError``): the answer was
    never resolved and the admin agent stopped. The line shows the number as it came now."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    await park_two(runtime, clock)
    waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    admin_channel(runtime).waiters["c5"] = waiter
    with caplog.at_level(logging.WARNING, logger="agents.admin"):
        async with runtime.agents["admin"].test_context() as admin:
            raw = AdminCommand("c5", "retry-now", b"k", "test", requested_at).to_json()
            await admin.put(raw, key=b"k", partition=0)
            result = await asyncio.wait_for(waiter, 2)
    assert result["count"] == 2 and result["action"] == "retry-now"
    [line] = audit_lines(caplog)
    assert f"(partition 0, requested by test at {requested_at}, command c5)" in line, line


async def test_a_command_without_a_requested_time_says_it_is_not_known(
    make_runtime: Any, clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: a command without ``requested_at`` (0) was said to be requested at the worker's time of logging."""
    runtime = make_runtime()
    waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    admin_channel(runtime).waiters["c6"] = waiter
    with caplog.at_level(logging.WARNING, logger="agents.admin"):
        async with runtime.agents["admin"].test_context() as admin:
            await admin.put(json.dumps({"id": "c6", "action": "retry-now", "key": "aw=="}).encode(), key=b"k")
            await asyncio.wait_for(waiter, 2)
    [line] = audit_lines(caplog)
    assert "requested by ? at ?, command c6)" in line, line


async def test_an_audit_line_that_cannot_be_written_neither_stops_the_agent_nor_loses_the_answer(
    make_runtime: Any, clock: Any
) -> None:
    """The audit line runs after the action: whatever writing it raises (here a logging filter of the application's)
    the answer is still handed back and the next command applied."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    await park_two(runtime, clock)
    channel = admin_channel(runtime)
    answers = {name: asyncio.get_running_loop().create_future() for name in ("c7", "c8")}
    channel.waiters.update(answers)

    def refuse(record: logging.LogRecord) -> bool:
        raise RuntimeError("a filter that raises")

    logger = logging.getLogger("agents.admin")
    logger.addFilter(refuse)
    try:
        async with runtime.agents["admin"].test_context() as admin:
            await admin.put(command("retry-now", command_id="c7"), key=b"k", partition=0)
            first = await asyncio.wait_for(answers["c7"], 2)
            await admin.put(command("dead-letter", command_id="c8"), key=b"k", partition=0)
            second = await asyncio.wait_for(answers["c8"], 2)
    finally:
        logger.removeFilter(refuse)
    assert (first["action"], first["count"]) == ("retry-now", 2)
    assert (second["action"], second["count"]) == ("dead-letter", 2)
