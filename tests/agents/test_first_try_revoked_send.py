"""A first try whose partition is revoked while its retry's or dead letter's mark is confirmed sends nothing (issue 22,
review note O1), as a release does (``tests/agents/test_release_intent.py``): the new owner may have read the
changelog before the mark was in it and runs the record itself. The record is left unacknowledged for that owner,
never dead-lettered ``internal-error``."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from agents.runtime import Runtime
from tests.agents.support import (
    VALUE,
    Agents,
    at_each_confirm,
    dead_letters,
    first,
    per_call,
    record_acks,
    revoke,
    run_first_try,
)


def revoke_during_confirm(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The partition is revoked while the next confirmed write is on its way."""
    at_each_confirm(runtime, monkeypatch, lambda: revoke(runtime))


@pytest.mark.parametrize("ordering", ["none", "key"])
@pytest.mark.parametrize("outcome", ["permanent", "fail"])
async def test_a_first_try_revoked_while_its_mark_is_confirmed_sends_nothing_and_is_not_acknowledged(
    make_runtime: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    ordering: str,
    outcome: str,
) -> None:
    """``permanent``: the dead letter's intent (a *dead-lettering* mark) is confirmed, then the partition is gone;
    ``fail``: the retry's *sending* mark (key order: the key's block). Before the fix the dead letter or retry went
    out from the old owner while the new one may run the record too (two ends, or a fork)."""
    runtime: Runtime = make_runtime(ordering=ordering)
    revoke_during_confirm(runtime, monkeypatch)
    caplog.set_level(logging.WARNING)
    made, acked = await run_first_try(runtime, monkeypatch, outcome)
    assert made == [(0, 0)], "the handler did not run once"
    assert dead_letters(runtime) == [], "a dead letter was sent on a partition revoked before the send"
    assert runtime.tier_topics["items.retry.1s"].sent == [], "a retry was sent on a partition revoked before the send"
    assert "internal error" not in caplog.text, "the revocation was routed as an internal error"
    assert acked == [], "the record was acknowledged: its new owner would not read it again"
    assert runtime.counters["main.revoked_before_send"] == 1
    [warning] = [record for record in caplog.records if "revoked" in record.getMessage()]
    assert warning.levelno == logging.WARNING and warning.exc_info is None, "not one warning without a traceback"


async def test_a_held_message_revoked_while_its_block_is_confirmed_sends_no_retry(
    make_runtime: Any, clock: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Key-ordered mode's held message runs its first try from the release request that lifted its key's block: the
    same check after its block's confirm (``agents/ordering.py`` ``run_held``), and the request is not acknowledged."""
    runtime: Runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    made, hooks = per_call(runtime, "fail", "ok", "fail")  # offset 0 fails, its retry succeeds, held offset 1 fails
    caplog.set_level(logging.WARNING)
    async with Agents(runtime) as agents_:
        await first(agents_, VALUE)
        await first(agents_, VALUE)  # held behind offset 0
        await agents_.park_tier_records()
        clock.advance(1000)

        async def revoke_at_the_next_confirm() -> None:
            revoke_during_confirm(runtime, monkeypatch)

        hooks.extend([_nothing, revoke_at_the_next_confirm])  # (call 2: the retry; call 3: the held one)
        acked = record_acks(monkeypatch)
        await agents_.release_due()
        await runtime.dispatcher.wait_idle()
    assert made == [(0, 0), (0, 1), (1, 0)]
    assert runtime.tier_topics["items.retry.1s"].sent == [], "the held message's retry was sent after the revocation"
    assert "internal error" not in caplog.text and runtime.counters["main.revoked_before_send"] == 1
    assert acked == [], "the release request was acknowledged"


async def _nothing() -> None:
    return None
