"""An evicted worker owns nothing (issue 22, chaos run e-keyrandom1): Faust's assignor keeps its last assignment
through an eviction (only ``on_assignment`` sets it), so a worker stopped past its session timeout and woken still
read its partitions as its own. Handler calls already waiting on a changelog confirm then sent their dead letter or
next retry while the partition was another worker's (4 forks). Ownership now answers "not owned" for every partition
while the consumer says it was evicted (``ReboundConsumer.evicted``), whatever the assignor still holds."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from agents.ownership import owned_partitions, owns
from agents.runtime import Runtime
from rebound.errors import PermanentError
from tests.agents.conftest import FakeClock, eventually
from tests.agents.test_dead_letter_intent import VALUE, dead_letters, per_call
from tests.agents.test_first_try_revoked_send import record_acks
from tests.agents.test_key_order import Agents
from tests.agents.test_lifecycle_agents import first
from tests.agents.test_release_intent import REQUEST, scripted
from tests.agents.test_tier_and_release import tier_headers


def evicted_during_confirm(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The group evicts this worker while the next confirmed write is on its way; the assignor is left as it was."""
    confirm = runtime.store.confirm
    consumer_type = type(runtime.app.consumer)

    async def evicted_meanwhile() -> None:
        await confirm()
        monkeypatch.setattr(consumer_type, "evicted", property(lambda self: True))

    monkeypatch.setattr(runtime.store, "confirm", evicted_meanwhile)


def test_an_evicted_worker_owns_nothing_its_assignor_still_lists(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: Runtime = make_runtime()
    assert owned_partitions(runtime) == frozenset({0}) and owns(runtime, 0)
    monkeypatch.setattr(type(runtime.app.consumer), "evicted", property(lambda self: True))
    assert owned_partitions(runtime) == frozenset() and not owns(runtime, 0)


@pytest.mark.parametrize("ordering", ["none", "key"])
@pytest.mark.parametrize("outcome", ["permanent", "fail"])
async def test_a_first_try_evicted_while_its_mark_is_confirmed_sends_nothing_and_is_not_acknowledged(
    make_runtime: Any,
    clock: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    ordering: str,
    outcome: str,
) -> None:
    runtime: Runtime = make_runtime(ordering=ordering)
    runtime.schedule.adopt(0, [])
    made, _ = per_call(runtime, outcome)
    evicted_during_confirm(runtime, monkeypatch)
    acked = record_acks(monkeypatch)
    caplog.set_level(logging.WARNING)
    async with Agents(runtime) as agents_:
        await first(agents_, VALUE)
        await runtime.dispatcher.wait_idle()
    assert made == [(0, 0)], "the handler did not run once"
    assert dead_letters(runtime) == [], "a dead letter was sent by an evicted worker"
    assert runtime.tier_topics["items.retry.1s"].sent == [], "a retry was sent by an evicted worker"
    assert acked == [], "the record was acknowledged"
    assert runtime.counters["main.revoked_before_send"] == 1


async def test_a_release_evicted_while_its_intent_is_confirmed_sends_nothing(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The entry keeps its intent for the new owner, which sends the same dead letter (at-least-once)."""
    runtime: Runtime = make_runtime()
    scripted(runtime, PermanentError("no"))
    runtime.schedule.adopt(0, [])
    async with runtime.agents["items.retry.1s"].test_context() as tier:
        await tier.put(b'{"any": 1}', key=b"k", headers=tier_headers(clock), partition=0)
    clock.advance(1000)
    evicted_during_confirm(runtime, monkeypatch)
    async with runtime.agents["release"].test_context() as releaser:
        await releaser.put(REQUEST, key=b"k", partition=0)
        await eventually(lambda: "revoked" in caplog.text)
    assert runtime.failed_topics["items"].sent == [], "a dead letter was sent by an evicted worker"
    assert runtime.counters["release.revoked"] == 1
    [entry] = runtime.store.load(b"k", entries=True).pending
    assert entry.intent is not None and entry.intent.dead, "the intent the new owner sends again"
