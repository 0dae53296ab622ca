"""An evicted worker owns nothing (issue 22, chaos run e-keyrandom1): Faust's assignor keeps its last assignment
through an eviction (only ``on_assignment`` sets it), so a worker stopped past its session timeout and woken still
read its partitions as its own. Handler calls already waiting on a changelog confirm then sent their dead letter or
next retry while the partition was another worker's (4 forks). Ownership now answers "not owned" for every partition
while the consumer says it was evicted (``ReboundConsumer.evicted``), whatever the assignor still holds."""

from __future__ import annotations

from typing import Any

import pytest

from agents.ownership import owned_partitions, owns
from agents.runtime import Runtime
from rebound.errors import PermanentError
from tests.agents.conftest import FakeClock
from tests.agents.support import (
    at_each_confirm,
    dead_letters,
    park_one_due,
    request_its_release,
    run_first_try,
    scripted,
)


def evicted_during_confirm(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The group evicts this worker while the next confirmed write is on its way; the assignor is left as it was."""
    consumer_type = type(runtime.app.consumer)
    at_each_confirm(
        runtime, monkeypatch, lambda: monkeypatch.setattr(consumer_type, "evicted", property(lambda _: True))
    )


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
    monkeypatch: pytest.MonkeyPatch,
    ordering: str,
    outcome: str,
) -> None:
    runtime: Runtime = make_runtime(ordering=ordering)
    evicted_during_confirm(runtime, monkeypatch)
    made, acked = await run_first_try(runtime, monkeypatch, outcome)
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
    await park_one_due(runtime, clock)
    evicted_during_confirm(runtime, monkeypatch)
    await request_its_release(runtime, lambda: "revoked" in caplog.text)
    assert runtime.failed_topics["items"].sent == [], "a dead letter was sent by an evicted worker"
    assert runtime.counters["release.revoked"] == 1
    [entry] = runtime.store.load(b"k", entries=True).pending
    assert entry.intent is not None and entry.intent.dead, "the intent the new owner sends again"
