"""A worker woken past its session timeout usually reads its changelog confirm's answer before the heartbeat's that
tells it it was evicted (aiokafka blanks the member id only when a heartbeat answer arrives): ``evicted`` is still
False, the assignor still lists the partition, and only the session lease is stale. The ownership checks before a
send (first try, release intent, settle) wait for the group's word first (``Dispatcher.lease_gate``): renewed, the
send goes; the revocation coming first, nothing is sent (review finding: a fork otherwise)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agents.runtime import Runtime
from rebound.errors import PermanentError
from rebound.event import RetryEvent
from tests.agents.conftest import FakeClock
from tests.agents.support import (
    VALUE,
    Agents,
    StaleLease,
    at_each_confirm,
    dead_letters,
    first,
    park_one_due,
    per_call,
    request_its_release,
    run_first_try,
    scripted,
    state_of,
)


def first_try_revoked(runtime: Runtime) -> float | None:
    """``rebound_first_try_revoked_total{when="before-send"}`` as ``/metrics`` serves it (``agents/metrics.py``)."""
    for family in text_string_to_metric_families(runtime.metrics.exposition()[0].decode()):
        for sample in family.samples:
            if sample.name == "rebound_first_try_revoked_total" and sample.labels == {"when": "before-send"}:
                return float(sample.value)
    return None


def stale_after_the_next_confirm(runtime: Runtime, monkeypatch: pytest.MonkeyPatch, lease: StaleLease) -> None:
    """SIGSTOP past the session timeout during the next confirm, SIGCONT: the confirm's answer is read first."""
    runtime.dispatcher.__dict__["session_lease"] = lease  # (a cached_property)
    at_each_confirm(runtime, monkeypatch, lambda: setattr(lease, "stale", True))


@pytest.mark.parametrize("ordering", ["none", "key"])
@pytest.mark.parametrize("outcome", ["permanent", "fail"])
async def test_a_first_try_woken_after_its_eviction_before_the_heartbeat_answer_sends_nothing(
    make_runtime: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    ordering: str,
    outcome: str,
) -> None:
    runtime: Runtime = make_runtime(ordering=ordering)
    lease = StaleLease()
    stale_after_the_next_confirm(runtime, monkeypatch, lease)
    caplog.set_level(logging.WARNING)
    made, acked = await run_first_try(runtime, monkeypatch, outcome)
    assert made == [(0, 0)]
    sent = dead_letters(runtime) + runtime.tier_topics["items.retry.1s"].sent
    assert sent == [], f"sent by a worker the group may have evicted: {len(sent)} record(s)"
    assert acked == [], "the record was acknowledged"
    assert "internal error" not in caplog.text, "the lapsed lease was routed as an internal error"
    assert runtime.counters["main.revoked_before_send"] == 1
    assert lease.waits == 1
    assert first_try_revoked(runtime) == 1.0, "not exported as release.revoked is"


@pytest.mark.parametrize("outcome", ["permanent", "fail"])
async def test_a_first_try_whose_lease_is_renewed_sends(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch, outcome: str
) -> None:
    """The heartbeat's word is that this worker is still a member (or none came within ``max_wait_s``: the lease's
    wait then answers True as well): the send goes, once."""
    runtime: Runtime = make_runtime()
    lease = StaleLease(renewed=True)
    stale_after_the_next_confirm(runtime, monkeypatch, lease)
    await run_first_try(runtime, monkeypatch, outcome)
    sent = dead_letters(runtime) + runtime.tier_topics["items.retry.1s"].sent
    assert len(sent) == 1 and lease.waits >= 1
    assert runtime.counters["main.revoked_before_send"] == 0


@pytest.mark.parametrize("ordering", ["none", "key"])
async def test_an_unchanged_dead_letter_intent_still_asks_ownership(
    make_runtime: Any, clock: Any, monkeypatch: pytest.MonkeyPatch, ordering: str
) -> None:
    """Nothing to write (the intent is there already): no save nor confirm, but the check still runs, so an
    eviction during the handler call is seen before the dead letter is sent."""
    runtime: Runtime = make_runtime(ordering=ordering)
    runtime.schedule.adopt(0, [])
    made, hooks = per_call(runtime, "permanent")
    monkeypatch.setattr("agents.lifecycle.with_dead_letter_intent", lambda state, *args, **kwargs: state)
    consumer_type = type(runtime.app.consumer)

    async def evicted_during_the_call() -> None:
        monkeypatch.setattr(consumer_type, "evicted", property(lambda self: True))

    hooks.append(evicted_during_the_call)
    async with Agents(runtime) as agents_:
        await first(agents_, VALUE)
        await runtime.dispatcher.wait_idle()
    assert made == [(0, 0)]
    assert dead_letters(runtime) == [], "a dead letter was sent by an evicted worker"
    assert runtime.counters["main.revoked_before_send"] == 1


async def test_a_release_woken_after_its_eviction_before_the_heartbeat_answer_sends_nothing(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Stopped during its intent's confirm: the entry keeps its intent for the new owner, counted release.revoked."""
    runtime: Runtime = make_runtime()
    scripted(runtime, PermanentError("no"))
    await park_one_due(runtime, clock)
    lease = StaleLease()
    stale_after_the_next_confirm(runtime, monkeypatch, lease)
    caplog.set_level(logging.WARNING)
    await request_its_release(runtime, lambda: "revoked" in caplog.text)
    assert runtime.failed_topics["items"].sent == [], "a release's dead letter sent by a worker maybe evicted"
    assert runtime.counters["release.revoked"] == 1
    [entry] = runtime.store.load(b"k", entries=True).pending
    assert entry.intent is not None and entry.intent.dead, "the intent the new owner sends again"


async def test_a_release_stopped_during_its_handler_call_does_not_settle(
    make_runtime: Any, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A succeeding release (no intent, no confirm before its settle) stopped past the session timeout during the
    handler call: its settle would write this worker's view on a partition maybe another's; it is left parked."""
    runtime: Runtime = make_runtime()
    lease = StaleLease()
    runtime.dispatcher.__dict__["session_lease"] = lease
    calls: list[int] = []

    async def stopped_during_the_call(event: RetryEvent) -> None:
        calls.append(event.attempt)
        lease.stale = True

    runtime.handler = stopped_during_the_call
    await park_one_due(runtime, clock)
    caplog.set_level(logging.WARNING)
    await request_its_release(runtime, lambda: bool(calls) and "revoked" in caplog.text)
    assert calls == [1]
    assert len(runtime.store.load(b"k", entries=True).pending) == 1, "settled by a worker maybe evicted"


async def test_a_held_message_stopped_during_its_handler_call_stays_held(
    make_runtime: Any, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Key-ordered mode: a held message that succeeds (nothing to send) while its worker is stopped past the session
    timeout: taking it off the held list would write this worker's view on a partition maybe another's. The write
    waits for the group's word as a send does (``agents/ordering.py`` ``run_held``); the revocation coming first, the
    message is left held for the new owner, which runs it again (at-least-once)."""
    runtime: Runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    made, hooks = per_call(runtime, "fail")  # offset 0 fails once; its retry and the held offset 1 succeed
    lease = StaleLease()
    runtime.dispatcher.__dict__["session_lease"] = lease

    async def running() -> None:
        return None

    async def stopped_during_the_call() -> None:
        lease.stale = True

    caplog.set_level(logging.WARNING)
    async with Agents(runtime) as agents_:
        await first(agents_, VALUE)
        await first(agents_, VALUE)  # held behind offset 0
        await agents_.park_tier_records()
        clock.advance(1000)
        hooks.extend([running, stopped_during_the_call])  # (call 2: the retry of offset 0; call 3: the held one)
        await agents_.release_due()
        await runtime.dispatcher.wait_idle()
    assert made == [(0, 0), (0, 1), (1, 0)]
    assert [entry.origin for entry in state_of(runtime, b"k").held] == ["items/0/1"], (
        "taken off by a maybe-evicted worker"
    )
    assert runtime.counters["ordering.released"] == 0
    assert lease.waits == 1
