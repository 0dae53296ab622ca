"""Key-ordered mode on the release path: what a failing release writes before its next retry is sent, and held
messages, parks and revoked releases left while a partition was suspended by a rebalance that gave it straight
back."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agents import release as release_module
from agents.runtime import Runtime
from rebound.errors import PermanentError, RetryableError
from rebound.ordering import block
from rebound.records import estimated_record_bytes
from rebound.state import KeyState, payload_key
from tests.agents.conftest import eventually, nothing_waits
from tests.agents.support import (
    REQUEST,
    TIER,
    VALUE,
    Agents,
    calls,
    handler_calls,
    per_call,
    revoke,
    scripted,
    state_of,
    tier_headers,
)

__all__ = ["calls"]  # the fixture, used here

BLOCKER = "items/0/0"
ORIGIN = "items/0/7"
"""The message :data:`tests.agents.support.REQUEST` releases (:func:`tests.agents.support.tier_headers`)."""


async def nothing() -> None:
    """A handler call's hook (:func:`tests.agents.support.per_call`) that does nothing."""


def record_the_release_path(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch, origin: str = BLOCKER
) -> list[tuple[str, Any]]:
    """One timeline of the key index records sent to the state table's changelog (``("index", KeyState)``), the
    store's confirms (``("confirm", None)``) and the retries sent to a tier (``("retry", the retrying message's
    entry as it stands at the send)``)."""
    timeline: list[tuple[str, Any]] = []

    def send_soon(*, key: Any, value: Any, partition: Any, **_: Any) -> Any:
        timeline.append(("index", KeyState.from_json(value) if value is not None else None))
        done: Any = asyncio.get_running_loop().create_future()
        done.message = SimpleNamespace(partition=0 if partition is None else partition)
        done.set_result(None)
        return done

    monkeypatch.setattr(runtime.store.states.changelog_topic, "send_soon", send_soon)
    confirm = runtime.store.confirm

    async def recorded_confirm() -> None:
        timeline.append(("confirm", None))
        await confirm()

    monkeypatch.setattr(runtime.store, "confirm", recorded_confirm)
    sent_to = [("retry", topic) for topic in runtime.tier_topics.values()]
    for what, topic in [*sent_to, ("dead letter", runtime.failed_topics["items"])]:
        send = topic.send

        async def recorded_send(*, _send: Any = send, _what: str = what, **record: Any) -> Any:
            timeline.append((_what, runtime.store.entry(b"k", origin)))
            return await _send(**record)

        monkeypatch.setattr(topic, "send", recorded_send)
    return timeline


def before_the_retry(timeline: list[tuple[str, Any]], sent: str = "retry") -> tuple[list[tuple[str, Any]], Any]:
    """What came before the one retry (or dead letter) sent, and the retrying message's entry at its send."""
    [at] = [index for index, (what, _) in enumerate(timeline) if what == sent]
    return timeline[:at], timeline[at][1]


async def test_a_failing_release_in_key_order_confirms_one_write_before_its_next_retry(
    make_runtime: Any, clock: Any, monkeypatch: pytest.MonkeyPatch, calls: Path
) -> None:
    """The key is blocked behind the retrying message already (its block was confirmed before the retry now released
    was sent): the release's intent, confirmed before the next retry is sent, writes the key's index again, block
    included, so the block is not written and confirmed a second time on its own (one changelog round trip less per
    failing release in key order)."""
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 2}')  # fails twice: its first retry's release fails too
        await agents.park_tier_records()
        assert state_of(runtime, b"k").blocked_by == BLOCKER
        timeline = record_the_release_path(runtime, monkeypatch)
        clock.advance(1000)
        await agents.release_due()
        assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1)]
        written, entry = before_the_retry(timeline)
        assert [what for what, _ in written] == ["index", "confirm"]
        # What a worker recovering from the changelog reads of the key once that confirm returned: the block, and
        # the retry's intent on its entry (whatever the changelog held before: a block written before a crash may
        # never have been acknowledged).
        [(_, index)] = [item for item in written if item[0] == "index"]
        assert (index.blocked_by, index.blocked_dead) == (BLOCKER, False)
        assert entry is not None and entry.intent is not None and entry.intent.next_attempt == 2


async def park_blocking(runtime: Runtime, clock: Any, *, too_large: bool) -> None:
    """:data:`ORIGIN` parked and due, its key blocked behind it (its first try's block, written here as the worker's
    local store holds it). ``too_large``: its entry record 100 bytes under the changelog's limit, so that its
    release's intent does not fit."""
    runtime.schedule.adopt(0, [])
    value = VALUE
    async with runtime.agents[TIER].test_context() as tier:
        if too_large:
            limit = runtime.store.max_record_bytes
            await tier.put(b'"x"', key=b"small", headers=tier_headers(clock), partition=0)
            raw = runtime.store.payloads[payload_key(b"small", ORIGIN)]
            overhead = estimated_record_bytes(payload_key(b"small", ORIGIN), raw, ()) - len(b'"x"')
            value = b'"' + b"x" * (limit - overhead - 100 - 2) + b'"'
        await tier.put(value, key=b"k", headers=tier_headers(clock), partition=0)
    runtime.store.states.data[b"k"] = block(runtime.store.load(b"k"), ORIGIN).to_json()
    clock.advance(1000)


def failing_once_a_later_attempt_parked(runtime: Runtime, error: Exception) -> None:
    """The handler fails with ``error`` after a later attempt of the message it runs was parked meanwhile (a copy of
    its retry, say): the release's intent then changes nothing (:func:`rebound.state.with_intent`), and none is
    written."""

    async def handler(event: Any) -> None:
        before = runtime.store.load(b"k", origin=ORIGIN)
        [entry] = before.pending
        runtime.store.save(b"k", before, replace(before, pending=(replace(entry, attempt=entry.attempt + 1),)))
        raise error

    runtime.handler = handler


def without_an_intent(runtime: Runtime, clock: Any, case: str, error: Exception) -> Any:
    """A release of :data:`ORIGIN` (its key blocked behind it) whose intent is not written (``case``: ``too large``
    or ``unchanged``), its handler failing with ``error``; returns its set-up, to await."""
    if case == "unchanged":
        failing_once_a_later_attempt_parked(runtime, error)
    else:
        scripted(runtime, error)
    return park_blocking(runtime, clock, too_large=case == "too large")


async def request_the_release(runtime: Runtime, timeline: list[tuple[str, Any]]) -> None:
    async with runtime.agents["release"].test_context() as releaser:
        await releaser.put(REQUEST, key=b"k", partition=0)
        await eventually(
            lambda: (
                any(what in ("retry", "dead letter") for what, _ in timeline)
                or bool(runtime.release_failures)
                or bool(runtime.counters["release.revoked"])
            )
        )


@pytest.mark.parametrize("case", ["too large", "unchanged"])
async def test_a_failing_release_that_writes_no_intent_writes_the_keys_block_again_before_its_retry(
    make_runtime: Any, clock: Any, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """A release whose intent is not written (it does not fit its record, or changes nothing): then nothing else
    writes the key's index before the retry is sent, and its block is written again and confirmed on its own."""
    runtime: Runtime = make_runtime(ordering="key")
    await without_an_intent(runtime, clock, case, RetryableError("later"))
    timeline = record_the_release_path(runtime, monkeypatch, origin=ORIGIN)
    await request_the_release(runtime, timeline)
    assert runtime.counters["release.intent_too_large"] == (case == "too large")
    written, entry = before_the_retry(timeline)
    assert [what for what, _ in written][-2:] == ["index", "confirm"]
    assert [what for what, _ in written].count("confirm") == 1
    assert written[-2][1].blocked_by == ORIGIN
    assert entry is not None and entry.intent is None


@pytest.mark.parametrize("case", ["too large", "unchanged"])
async def test_a_release_revoked_while_its_block_is_written_again_sends_no_retry(
    make_runtime: Any, clock: Any, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The partition is revoked during the round trip of the block written again in place of an intent: the new
    owner may have read the changelog before it, and finds the entry with no intent, so it runs the handler again.
    Sending the retry here too would fork the message: nothing is sent, and the release is counted revoked."""
    runtime: Runtime = make_runtime(ordering="key")
    await without_an_intent(runtime, clock, case, RetryableError("later"))
    timeline = record_the_release_path(runtime, monkeypatch, origin=ORIGIN)
    confirm = runtime.store.confirm

    async def revoked_meanwhile() -> None:
        revoke(runtime)
        await confirm()

    monkeypatch.setattr(runtime.store, "confirm", revoked_meanwhile)
    await request_the_release(runtime, timeline)
    assert ("confirm", None) in timeline, "no block written again: the revocation was not during its round trip"
    assert runtime.tier_topics[TIER].sent == [], "a retry sent after the partition was revoked"
    assert runtime.failed_topics["items"].sent == []
    assert runtime.counters["release.revoked"] == 1


@pytest.mark.parametrize("case", ["too large", "unchanged"])
async def test_a_failing_release_dead_lettered_without_an_intent_writes_no_block_before_its_dead_letter(
    make_runtime: Any, clock: Any, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """A dead letter sent without an intent needs no block written again before it (as before intents): the
    message's entry, parked until its settle, keeps its key's later messages waiting on whichever worker reads it."""
    runtime: Runtime = make_runtime(ordering="key")
    await without_an_intent(runtime, clock, case, PermanentError("no"))
    timeline = record_the_release_path(runtime, monkeypatch, origin=ORIGIN)
    await request_the_release(runtime, timeline)
    written, entry = before_the_retry(timeline, "dead letter")
    assert "confirm" not in [what for what, _ in written]
    assert entry is not None and entry.intent is None


async def test_a_first_try_read_again_behind_its_own_block_writes_the_block_again_before_its_retry(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record whose first try blocked its key before its worker stopped (that write maybe never acknowledged), its
    retry not sent, is read again and fails again: the key is blocked behind it already, so the block changes
    nothing, yet it is written again and confirmed before the retry is sent (a first try writes no intent that
    would carry it): a changelog without it would let the key's later messages overtake it on the next owner."""
    runtime: Runtime = make_runtime(ordering="key")
    runtime.store.states.data[b"k"] = block(runtime.store.load(b"k"), BLOCKER).to_json()
    scripted(runtime, RetryableError("again"))
    timeline = record_the_release_path(runtime, monkeypatch)
    async with Agents(runtime) as agents:
        await agents.main(VALUE)
        await eventually(lambda: any(what == "retry" for what, _ in timeline))
    written, _ = before_the_retry(timeline)
    assert [what for what, _ in written] == ["index", "confirm"]
    assert written[0][1].blocked_by == BLOCKER


async def test_held_messages_left_when_the_flow_stopped_run_after_their_partition_comes_straight_back(
    make_runtime: Any, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rebalance stops the flow while a key's held messages run after its block was lifted: the rest are left, so
    as not to lengthen the revocation. The partition comes straight back with nothing replayed into its table, and
    its schedule resumes as it was, unread: the held messages left must be in it, else they (and every later message
    of the key, held behind them) wait until the partition is read again, at some later rebalance."""
    runtime: Runtime = make_runtime(ordering="key")
    monkeypatch.setattr(release_module, "owned_partitions", lambda _runtime: frozenset({0}))
    release_module.adopt_owned_partitions(runtime)
    made, hooks = per_call(runtime, "fail")  # the blocking message fails once; every other call succeeds
    consumer = runtime.app.consumer
    async with Agents(runtime) as agents:
        await agents.main(VALUE)  # 0: fails, blocks the key
        await agents.main(VALUE)  # 1: held
        await agents.main(VALUE)  # 2: held
        await agents.park_tier_records()

        async def rebalance() -> None:  # while held 1 runs: Faust stops the flow, and the revocation suspends 0
            consumer.flow_active = False
            runtime.schedule.suspend(0)

        hooks.extend([nothing, rebalance])
        clock.advance(1000)
        await agents.release_due()
        assert made == [(0, 0), (0, 1), (1, 0)]
        assert [entry.origin for entry in state_of(runtime, b"k").held] == ["items/0/2"]

        consumer.flow_active = True  # assigned straight back, nothing replayed: resumed, not read again
        runtime.store.replayed.clear()
        release_module.adopt_owned_partitions(runtime)
        await agents.release_due()
        assert made[3:] == [(2, 0)]
        assert nothing_waits(runtime, b"k")


async def test_a_retry_parked_while_its_partition_was_suspended_is_released_after_it_comes_straight_back(
    make_runtime: Any, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tier record parked during the revocation (its park was on its way when the partition was suspended): the
    partition resumed unread must release it."""
    runtime: Runtime = make_runtime()
    monkeypatch.setattr(release_module, "owned_partitions", lambda _runtime: frozenset({0}))
    release_module.adopt_owned_partitions(runtime)
    runtime.schedule.suspend(0)
    async with runtime.agents[TIER].test_context() as tier:
        await tier.put(VALUE, key=b"k", headers=tier_headers(clock), partition=0)
    assert runtime.store.entry(b"k", ORIGIN) is not None
    runtime.store.replayed.clear()
    release_module.adopt_owned_partitions(runtime)
    [(partition, slot)] = runtime.schedule.pop_due(clock.now_ms + 1000)
    assert (partition, slot.origin, slot.attempt) == (0, ORIGIN, 1)


async def test_a_release_revoked_by_a_rebalance_that_gives_its_partition_straight_back_is_asked_for_once(
    make_runtime: Any, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release running when the rebalance suspends its partition ends revoked and puts its slot back for later;
    the suspension kept the slot it had in flight too. Given straight back (resumed unread), the partition sends one
    request for the message, not two (the second one stale: a read, and a settle written again, for nothing)."""
    runtime: Runtime = make_runtime()
    monkeypatch.setattr(release_module, "owned_partitions", lambda _runtime: frozenset({0}))
    release_module.adopt_owned_partitions(runtime)
    made, hooks = per_call(runtime, "fail", "fail")
    assignor = runtime.app.assignor
    owned = (assignor.assigned_actives, assignor.is_active)
    async with Agents(runtime) as agents:
        await agents.main(VALUE)
        await agents.park_tier_records()

        async def rebalance() -> None:  # during the release's handler call
            runtime.schedule.suspend(0)
            revoke(runtime)

        hooks.append(rebalance)
        clock.advance(1000)
        await agents.release_due()
        await eventually(lambda: runtime.counters["release.revoked"] == 1)
        assert made == [(0, 0), (0, 1)]
        assignor.assigned_actives, assignor.is_active = owned  # assigned straight back, nothing replayed
        runtime.store.replayed.clear()
        release_module.adopt_owned_partitions(runtime)
        clock.advance(5000)
        await release_module.release_due(runtime)
    assert [json.loads(request.value)["origin"] for request in runtime.release_topic.sent] == ["items/0/0"]
