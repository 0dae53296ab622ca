"""The pause state's reader and answers (``agents/control.py``, ``/ready``, pause/resume), and replay's error answers
(``app/replay.py``), without a broker."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError

from agents.control import WARN_EVERY_S, Written, control_board, pause_state_known, set_paused
from agents.runtime import Runtime
from app import replay
from app.views import ready_answer
from app.web.admin import pause_answer
from rebound import headers as h
from rebound.dead_letters import dead_letter_records
from rebound.pause import PauseState
from tests.app_under_test import build_runtime


@pytest.fixture
async def runtime(tmp_path: Path) -> Runtime:
    return build_runtime(tmp_path, web_enabled=False)


def test_ready_is_503_until_the_pause_state_is_known() -> None:
    assert ready_answer(rebalancing=False, has_partitions=True, pause_state_known=False) == (
        {"ready": False, "rebalancing": False, "pause_state_known": False},
        503,
    )
    assert ready_answer(rebalancing=False, has_partitions=True, pause_state_known=True)[1] == 200
    assert ready_answer(rebalancing=True, has_partitions=True, pause_state_known=True)[1] == 503


async def test_the_pause_state_is_unknown_until_the_control_partition_was_read(runtime: Runtime) -> None:
    assert not pause_state_known(runtime)
    board = control_board(runtime)
    assert board.view()["known"] is False
    board.apply(PauseState(paused=False))
    assert pause_state_known(runtime)


async def test_a_failing_reader_logs_its_first_failure_with_the_traceback_then_once_a_minute(
    runtime: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    board = control_board(runtime)
    board.position, board.end = 3, 7
    caplog.set_level(logging.WARNING, logger="agents.control")
    error = KafkaConnectionError("broker down")
    for second in range(0, 130):  # one failure a second for 130 s
        board.reader_failed(error, now=1000.0 + second)
    records = [r for r in caplog.records if r.name == "agents.control"]
    assert len(records) == 1 + 2  # the first, then at 60 s and 120 s
    assert records[0].exc_info is not None and "stay held until it is read" in records[0].getMessage()
    assert all(r.exc_info is None for r in records[1:])
    assert "position 3 of end 7" in records[1].getMessage() and "broker down" in records[1].getMessage()
    assert WARN_EVERY_S == 60.0 and board.view()["reader_failures"] == 130
    board.reader_caught_up()
    assert board.failures == 0


class FakeTopic:
    """Sends at ``offset``; the worker reads it, then (``later``) another action at the next offset, before
    confirming."""

    def __init__(self, runtime: Runtime, later: PauseState | None, offset: int) -> None:
        self.runtime, self.later, self.offset = runtime, later, offset

    async def send(self, **kwargs: Any) -> Any:
        board = control_board(self.runtime)
        written = PauseState.from_json(kwargs["value"])

        async def read_back() -> None:
            await asyncio.sleep(0.01)
            board.apply(written)
            board.read(self.offset)
            if self.later is not None:
                board.apply(self.later)
                board.read(self.offset + 1)

        asyncio.get_running_loop().create_task(read_back())
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(SimpleNamespace(offset=self.offset))
        return future


async def test_an_overtaken_pause_is_not_confirmed_and_answers_409(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    board = control_board(runtime)
    monkeypatch.setattr(type(board), "applied_here", lambda self: True)
    resume = PauseState(paused=False, by="bob", at_ms=9, action_id="r")
    written = await set_paused(
        runtime, paused=True, by="alice", source="x", timeout=2, topic=FakeTopic(runtime, resume, 5)
    )
    assert (written.confirmed, written.overtaken) == (False, True)
    body, status = pause_answer("pause", written, board.view())
    assert status == 409 and body["overtaken"] is True and body["state"]["paused"] is False
    assert body["state"]["by"] == "bob"

    alone = await set_paused(runtime, paused=True, by="alice", source="x", timeout=2, topic=FakeTopic(runtime, None, 7))
    assert (alone.confirmed, alone.overtaken) == (True, False)
    assert pause_answer("pause", alone, board.view())[1] == 200
    assert pause_answer("pause", Written(alone.state, confirmed=False), board.view())[1] == 202


def failed_record(group: str) -> replay.FailedRecord:
    provenance = h.Provenance(topic="items", partition=0, offset=1, timestamp_ms=1, first_received_at_ms=1)
    record = dead_letter_records(
        key=b"k",
        value=b"v",
        own_headers=[],
        provenance=provenance,
        group=group,
        attempt=1,
        reason="permanent",
        error_class="E",
        error_message="m",
        trace=None,
        limit=1_048_576,
    )[0].record
    return replay.FailedRecord(record.key, record.value, list(record.headers), 1)


async def test_replay_answers_503_on_a_broker_error_and_504_says_the_record_may_have_been_sent(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broker_down(*args: Any, **kwargs: Any) -> Any:
        raise KafkaConnectionError("no broker")

    monkeypatch.setattr(replay, "read_one", broker_down)
    answer = await replay.replay_one(runtime, "items.failed", 0, 1, max_redrives=3, by="a", source="s")
    assert answer.status == 503 and "nothing was sent" in answer.body["error"]

    async def found(*args: Any, **kwargs: Any) -> Any:
        return failed_record(runtime.group)

    async def never(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(10)

    monkeypatch.setattr(replay, "read_one", found)
    monkeypatch.setattr(replay, "deliver", never)
    monkeypatch.setattr(replay, "SEND_TIMEOUT_S", 0.05)
    answer = await replay.replay_one(runtime, "items.failed", 0, 1, max_redrives=3, by="a", source="s")
    assert answer.status == 504 and answer.body["maybe_sent"] is True
    assert "may still have been written" in answer.body["error"] and "check items" in answer.body["error"]


async def test_replay_refuses_another_group_s_dead_letter_unless_forced(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def found(*args: Any, **kwargs: Any) -> Any:
        return failed_record("billing")

    async def delivered(*args: Any, **kwargs: Any) -> Any:
        return SimpleNamespace(partition=0, offset=8)

    monkeypatch.setattr(replay, "read_one", found)
    monkeypatch.setattr(replay, "deliver", delivered)
    answer = await replay.replay_one(runtime, "items.failed", 0, 1, max_redrives=3, by="a", source="s")
    assert answer.status == 409 and answer.body["refused"] == "other-group"
    forced = await replay.replay_one(
        runtime, "items.failed", 0, 1, max_redrives=3, by="a", source="s", force_other_group=True
    )
    assert forced.status == 200 and forced.body["forced_other_group"] is True


async def test_the_replay_audit_line_names_the_key_and_the_time_as_the_other_audit_lines(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Reported: ``... (key 'k', ...) ... at 1746093600000``: epoch ms where the control reader says
    ``2025-05-01T10:00:00Z``; the key named as every admin audit line names it (``rebound/display.py``)."""

    async def found(*args: Any, **kwargs: Any) -> Any:
        return failed_record(runtime.group)

    async def delivered(*args: Any, **kwargs: Any) -> Any:
        return SimpleNamespace(partition=0, offset=8)

    monkeypatch.setattr(replay, "read_one", found)
    monkeypatch.setattr(replay, "deliver", delivered)
    monkeypatch.setattr(runtime, "clock", lambda: 1_746_093_600_000)
    with caplog.at_level(logging.WARNING, logger="app.replay"):
        answer = await replay.replay_one(runtime, "items.failed", 0, 1, max_redrives=3, by="a", source="s")
    assert answer.status == 200
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("admin replay")]
    assert "(key 'k', reason permanent)" in line and line.endswith("by a from s at 2025-05-01T10:00:00Z"), line
