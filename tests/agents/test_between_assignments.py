"""Between the end of a revocation and the next assignment this worker owns nothing (issue 22, one lifecycle).

Faust's assignor keeps the last assignment until aiokafka hands it the next one (only ``on_assignment`` sets it), so
after a revocation's drain and commit the worker still read the partitions it had just given up as its own. A first
try or a release still waiting on a changelog confirm then (a drain that timed out, a confirm answered after the
revocation callback) sent its retry or dead letter while the group may already have given the partition to another
worker. Ownership now answers "not owned" from the end of the revocation callback until the next assignment
(``ReboundConsumer.between_assignments``); during the revocation's own drain the partitions are still this worker's,
and what the drain finishes is sent."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from faust.types import TP

from agents.ownership import owned_partitions, owns
from agents.release import adopt_owned_partitions, release_due
from agents.runtime import Runtime
from rebound.errors import PermanentError
from tests.agents.conftest import FakeClock, eventually
from tests.agents.support import (
    VALUE,
    Agents,
    at_each_confirm,
    dead_letters,
    first,
    park_one_due,
    per_call,
    record_acks,
    request_its_release,
    run_first_try,
    scripted,
    tier_headers,
)


def revocation(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch, app_revocation: Any = None
) -> Callable[[], Awaitable[None]]:
    """The consumer's own revocation of partition 0 (``ReboundConsumer.on_partitions_revoked``, as aiokafka's
    ``_on_join_prepare`` calls it), without a group to commit to; ``app_revocation`` stands for Faust's app revocation
    (the dispatcher's drain, the streams' wait). The assignor is left as it was: only an assignment changes it."""
    consumer: Any = runtime.app.consumer

    async def nothing(*args: Any) -> None:
        return None

    monkeypatch.setattr(consumer, "_app_revocation", app_revocation or nothing)
    monkeypatch.setattr(consumer, "maybe_wait_for_commit_to_finish", nothing)
    monkeypatch.setattr(consumer, "commit", nothing)
    revoked = {TP(runtime.release_topic.get_topic_name(), 0)}
    return lambda: consumer.on_partitions_revoked(revoked)


def app_signal(runtime: Runtime) -> Callable[[Any], Awaitable[None]]:
    """Faust's app revocation as far as the release schedule hears of it: the ``on_partitions_revoked`` signal, whose
    receiver (``register_release_timer``) suspends the partition's schedule."""

    async def send(revoked: Any) -> None:
        await runtime.app.on_partitions_revoked.send(revoked)

    return send


def revocation_ends_during_confirm(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch, app_revocation: Any = None
) -> None:
    """The revocation callback (drain and commit included) returns while the next confirmed write is on its way."""
    at_each_confirm(runtime, monkeypatch, revocation(runtime, monkeypatch, app_revocation))


async def test_a_worker_owns_nothing_from_the_end_of_a_revocation_to_its_next_assignment(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: Runtime = make_runtime()
    seen: list[bool] = []

    async def app_revocation(revoked: Any) -> None:  # the drain: the partitions are still this worker's
        seen.append(owns(runtime, 0) and owned_partitions(runtime) == frozenset({0}))

    await revocation(runtime, monkeypatch, app_revocation)()
    assert seen == [True], "the revocation's own drain was refused its partitions"
    assert owned_partitions(runtime) == frozenset() and not owns(runtime, 0), "owned after the revocation ended"
    # what the next assignment does (tests/app/test_consumer_assignment_window.py)
    runtime.app.consumer.between_assignments = False  # type: ignore[attr-defined]
    assert owned_partitions(runtime) == frozenset({0}) and owns(runtime, 0)


@pytest.mark.parametrize("ordering", ["none", "key"])
@pytest.mark.parametrize("outcome", ["permanent", "fail"])
async def test_a_first_try_whose_mark_is_confirmed_after_the_revocation_ended_sends_nothing(
    make_runtime: Any,
    monkeypatch: pytest.MonkeyPatch,
    ordering: str,
    outcome: str,
) -> None:
    runtime: Runtime = make_runtime(ordering=ordering)
    revocation_ends_during_confirm(runtime, monkeypatch)
    made, acked = await run_first_try(runtime, monkeypatch, outcome)
    assert made == [(0, 0)], "the handler did not run once"
    assert dead_letters(runtime) == [], "a dead letter was sent after the revocation ended"
    assert runtime.tier_topics["items.retry.1s"].sent == [], "a retry was sent after the revocation ended"
    assert acked == [], "the record was acknowledged"
    assert runtime.counters["main.revoked_before_send"] == 1


@pytest.mark.parametrize("ordering", ["none", "key"])
@pytest.mark.parametrize("outcome", ["permanent", "fail"])
async def test_a_first_try_whose_mark_is_confirmed_during_the_revocations_drain_still_sends(
    make_runtime: Any, clock: Any, monkeypatch: pytest.MonkeyPatch, ordering: str, outcome: str
) -> None:
    """The graceful drain: the revocation waits for the work it has, which ends while the partition is still this
    worker's; its outcome is sent once, and the record acknowledged before the revocation's commit."""
    runtime: Runtime = make_runtime(ordering=ordering)
    runtime.schedule.adopt(0, [])
    made, _ = per_call(runtime, outcome)
    confirming, draining = asyncio.Event(), asyncio.Event()

    async def drain(revoked: Any) -> None:  # Faust's app revocation: the dispatcher's drain waits for the work
        draining.set()
        await runtime.dispatcher.wait_idle()

    revoke = revocation(runtime, monkeypatch, drain)

    async def confirmed_during_the_drain() -> None:
        confirming.set()
        await draining.wait()

    at_each_confirm(runtime, monkeypatch, confirmed_during_the_drain)
    acked = record_acks(monkeypatch)

    async def revoke_once_confirming() -> None:
        await confirming.wait()
        await revoke()

    async with Agents(runtime) as agents_:
        revoking = asyncio.create_task(revoke_once_confirming())
        await first(agents_, VALUE)
        await asyncio.wait_for(revoking, 5)
    assert made == [(0, 0)], "the handler did not run once"
    sent = dead_letters(runtime) if outcome == "permanent" else runtime.tier_topics["items.retry.1s"].sent
    assert len(sent) == 1, "the drained first try's outcome was not sent"
    assert acked == [0], "the drained record was not acknowledged"
    assert runtime.counters["main.revoked_before_send"] == 0
    assert not owns(runtime, 0), "owned after the revocation ended"


async def test_a_release_whose_intent_is_confirmed_after_the_revocation_ended_sends_nothing(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The entry keeps its intent for the next owner, which sends the same dead letter (at-least-once)."""
    runtime: Runtime = make_runtime()
    scripted(runtime, PermanentError("no"))
    await park_one_due(runtime, clock)
    revocation_ends_during_confirm(runtime, monkeypatch)
    await request_its_release(runtime, lambda: "revoked" in caplog.text)
    assert runtime.failed_topics["items"].sent == [], "a dead letter was sent after the revocation ended"
    assert runtime.counters["release.revoked"] == 1
    [entry] = runtime.store.load(b"k", entries=True).pending
    assert entry.intent is not None and entry.intent.dead, "the intent the next owner sends"


async def test_a_release_request_revoked_is_acknowledged_and_the_next_owner_releases_the_entry_from_its_schedule(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Acknowledging the revoked request loses nothing: a release request only wakes the entry's owner up. Played
    here by the same worker getting the partition back (same table, as the changelog gives the next owner), through
    the schedule's own path: the revocation suspends the partition's schedule (its request in flight back in its
    heap), the next assignment's recovery resumes it (nothing was replayed into it), and its own request sends the
    intended dead letter, once. A worker that gets it for the first time reads it from the table instead
    (``adopt_owned_partitions``, tests/agents/test_tier_and_release.py)."""
    runtime: Runtime = make_runtime()
    calls = scripted(runtime, PermanentError("no"))
    await park_one_due(runtime, clock)
    confirm = runtime.store.confirm
    revocation_ends_during_confirm(runtime, monkeypatch, app_signal(runtime))
    acked = record_acks(monkeypatch)
    async with runtime.agents["release"].test_context() as releaser:
        assert await release_due(runtime) == 1
        [request] = runtime.release_topic.sent
        runtime.release_topic.sent.clear()
        await releaser.put(request.value, key=request.key, partition=0)
        await eventually(lambda: "revoked" in caplog.text)
        await runtime.dispatcher.wait_idle()
        assert acked == [0], "the revoked request was not acknowledged"
        assert runtime.failed_topics["items"].sent == []
        assert runtime.schedule.suspended == frozenset({0}), "the revocation did not suspend the partition"
        monkeypatch.setattr(runtime.store, "confirm", confirm)
        # the next assignment gives it partition 0 back
        runtime.app.consumer.between_assignments = False  # type: ignore[attr-defined]
        adopt_owned_partitions(runtime)  # after its recovery: resumed, not read again
        assert runtime.schedule.partitions == frozenset({0}) and not runtime.schedule.suspended
        assert await release_due(runtime) == 1, "the resumed schedule has no release of the parked entry"
        [request] = runtime.release_topic.sent
        await releaser.put(request.value, key=request.key, partition=0)
        await runtime.dispatcher.wait_idle()
    assert calls == [1], "the handler ran again: the intent was not followed"
    assert len(runtime.failed_topics["items"].sent) == 1, "the intended dead letter was not sent once"
    assert not runtime.store.load(b"k", entries=True).pending, "the entry is still parked"


async def test_a_recovery_completed_between_revocation_and_assignment_drops_no_suspended_partition(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faust's recovery is cut short only by the next assignment, not by a revocation: the previous generation's
    recovery can complete (``on_recovery_completed``, then ``adopt_owned_partitions``) after the revocation and
    before the assignment, when the worker owns nothing. It must leave the suspended partitions as they are: dropped,
    each would be read again after the assignment, and its requests in flight sent again."""
    runtime: Runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    async with runtime.agents["items.retry.1s"].test_context() as tier:
        await tier.put(b'{"any": 1}', key=b"k", headers=tier_headers(clock), partition=0)
    await revocation(runtime, monkeypatch, app_signal(runtime))()
    assert runtime.schedule.suspended == frozenset({0})
    adopt_owned_partitions(runtime)  # the previous generation's recovery completes: nothing is owned now
    assert runtime.schedule.suspended == frozenset({0}), "a suspended partition dropped between assignments"
    read: list[frozenset[int]] = []
    monkeypatch.setattr("agents.release.slots_by_partition", lambda rt, parts: read.append(parts) or {})
    runtime.app.consumer.between_assignments = False  # type: ignore[attr-defined]
    adopt_owned_partitions(runtime)  # the next assignment's recovery
    assert read == [], "the partition was read again though nothing was replayed into it"
    assert [slot.origin for _, slot in runtime.schedule.slots()] == ["items/0/7"]
