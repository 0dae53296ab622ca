"""An operator's ``dead-letter`` stopped partway by an error (review of 27a47d8), not by a refusal
(``test_lease_after_an_await.py``): its answer and its audit log line still say what was sent, what was not, and on
which partition, and the command line reads it as not complete."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import agents.admin as admin_agent
from agents.runtime import Runtime
from app.cli import format_key_action
from tests.agents.conftest import FakeClock
from tests.agents.support import operators_dead_letter, park_two_due, state_of


def fail_the_second_dead_letter(monkeypatch: pytest.MonkeyPatch) -> None:
    send = admin_agent.dead_letter_entry
    calls: list[int] = []

    async def second_one_unsendable(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the smallest stand-in refused too")  # (dead_letter re-raises UnsendableRecordError)
        return await send(*args, **kwargs)

    monkeypatch.setattr(admin_agent, "dead_letter_entry", second_one_unsendable)


async def dead_letter_failing_at_the_second(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The operator's dead-letter of key ``k``, its second send failing; its result."""
    fail_the_second_dead_letter(monkeypatch)
    return await operators_dead_letter(runtime)


@pytest.fixture
async def two_due(make_runtime: Any, clock: FakeClock) -> Runtime:
    """A runtime with key ``k``'s ``items/0/7`` and ``items/0/8`` parked and due (:func:`park_two_due`)."""
    runtime: Runtime = make_runtime()
    await park_two_due(runtime, clock)
    return runtime


def origins(messages: list[dict[str, Any]]) -> list[str]:
    return [message["origin"] for message in messages]


async def test_an_operator_dead_letter_failing_after_a_send_says_what_was_sent(
    two_due: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = two_due
    result = await dead_letter_failing_at_the_second(runtime, monkeypatch)
    assert len(runtime.failed_topics["items"].sent) == 1  # one dead letter went out
    text = format_key_action("dead-letter", 200, {"key": "k", "count": result.get("count", 0), "results": [result]})
    assert "partition None" not in text, text
    assert [m["origin"] for m in result.get("messages", [])] == ["items/0/7"], result


async def test_the_answer_lists_the_ones_not_sent_and_that_all_are_still_parked_here(
    two_due: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = two_due
    result = await dead_letter_failing_at_the_second(runtime, monkeypatch)
    assert (result["partition"], result["count"], result["incomplete"]) == (0, 1, True), result
    assert origins(result["messages"]) == ["items/0/7"] and origins(result["not_sent"]) == ["items/0/8"]
    assert "RuntimeError" in result["error"], result
    warning = result["warning"]
    assert "1 of 2" in warning and "sent: items/0/7" in warning and "not sent: items/0/8" in warning, warning
    assert "still parked here" in warning, warning
    assert len(state_of(runtime, b"k").pending) == 2  # the key's state was not written
    text = format_key_action("dead-letter", 200, {"key": "k", "count": result["count"], "results": [result]})
    assert (
        text.splitlines()[0]
        == "dead-letter of key k: NOT COMPLETE (partition 0): 1 message(s) sent, 1 not sent; see below"
    )
    assert "partition 0: failed: RuntimeError" in text, text


async def test_a_dead_letter_failing_at_its_first_send_says_nothing_was_sent_and_lists_them(
    two_due: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = two_due

    async def unsendable(*_: Any, **__: Any) -> None:
        raise RuntimeError("refused")

    monkeypatch.setattr(admin_agent, "dead_letter_entry", unsendable)
    result = await operators_dead_letter(runtime)
    assert runtime.failed_topics["items"].sent == []
    assert (result["partition"], result["count"], result["messages"]) == (0, 0, []), result
    assert origins(result["not_sent"]) == ["items/0/7", "items/0/8"]
    assert "incomplete" not in result  # nothing went out: the error says it failed
    assert "0 of 2" in result["warning"], result


@pytest.mark.parametrize("where", ["confirm", "record_outcome"])
async def test_a_dead_letter_failing_after_all_its_sends_keeps_them_in_its_answer(
    two_due: Runtime, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The store's confirm of the write that removes the entries, or an ended mark after it, raises: every dead
    letter went out, and the answer says so (it said 0 messages, with no partition)."""
    runtime = two_due

    async def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError(f"{where} failed")

    if where == "confirm":
        monkeypatch.setattr(runtime.store, "confirm", broken)
    else:
        monkeypatch.setattr(admin_agent, "record_outcome", broken)
    result = await operators_dead_letter(runtime)
    assert len(runtime.failed_topics["items"].sent) == 2
    assert (result["partition"], result["count"], result["incomplete"]) == (0, 2, True), result
    assert origins(result["messages"]) == ["items/0/7", "items/0/8"] and "not_sent" not in result
    assert f"{where} failed" in result["error"], result
    assert "all 2 dead letters were sent" in result["warning"], result


async def test_the_audit_line_of_a_failed_dead_letter_names_what_was_sent_and_not(
    two_due: Runtime, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=admin_agent.log.name):
        await dead_letter_failing_at_the_second(two_due, monkeypatch)
    audit = [r.getMessage() for r in caplog.records if r.getMessage().startswith("admin action dead-letter")]
    assert len(audit) == 1, audit
    assert "1 message(s) ['items/0/7']" in audit[0] and "NOT COMPLETE, not sent ['items/0/8']" in audit[0], audit


async def test_a_refusal_with_no_message_of_the_key_does_not_speak_of_messages(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key with nothing pending on the partition (a command for its held messages only), refused after the first
    check: there are no messages for the new owner to have."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    answers = iter([True, False])

    async def owned_then_not(*_: Any) -> bool:
        return next(answers)

    monkeypatch.setattr(admin_agent, "still_owns", owned_then_not)
    result = await operators_dead_letter(runtime)
    assert (result["partition"], result["count"], result["messages"]) == (0, 0, []), result
    assert "these messages" not in result["warning"] and "nothing done" in result["warning"], result
