"""The writes that record a send already made, and a retry's fallback dead letter, ask the session lease and
ownership after the send's await (``agents.ownership.still_owns``; issue 22's rule, the last places that asked
nothing): a first try's *forwarded* or *ended* mark (``remember_outcome``), key order's settle and
``internal-error`` unblock (``KeyOrder.settle``, ``ended_in_error``), and the dead letter a retry sent again from an
intent falls back to when the broker refuses it as too large (``send_again``).

In each, the worker is stopped past its session timeout while the send was on its way (the lease stale, the
revocation coming before the heartbeat's word), or the rebalance takes its partition then (ownership), or the check
itself fails (taken as refused). Nothing is written or sent and the record is left unacknowledged:
the new owner (the same runtime here, with what the changelog holds and a fresh lease) reads it again and finds what
the confirmed write before the send left, a *sending* mark or block, or an intent, and carries the message to one end.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

import agents.main as main_agent
from agents import lifecycle
from agents.runtime import Runtime
from rebound import headers as h
from rebound.errors import RetryableError
from tests.agents.conftest import FakeClock, RecordingTopic, eventually
from tests.agents.support import (
    REQUEST,
    VALUE,
    Agents,
    StaleLease,
    dead_letters,
    first,
    park_one_due,
    per_call,
    record_acks,
    redeliver,
    revoke,
    scripted,
    stale_lease,
    state_of,
    stop_during_each_send,
)
from tests.agents.test_release_intent import crash_before_the_first_settle

TIER = "items.retry.1s"
ORIGIN = "items/0/0"


@dataclass
class FirstTry:
    """A main record (:data:`VALUE`, key ``k``, offset 0) on partition 0 (adopted), its handler calls ending as
    :func:`per_call` says, the offsets acknowledged recorded: where each first try here starts."""

    runtime: Runtime
    made: list[tuple[int, int]]
    hooks: list[Callable[[], Awaitable[None]]]
    acked: list[int]

    async def run(self, agents: Agents) -> None:
        """The record's first try, to its end here."""
        await first(agents, VALUE)
        await self.runtime.dispatcher.wait_idle()

    async def read_again(self, agents: Agents) -> None:
        """The record read again (the new owner's read), to its end here."""
        await redeliver(agents, VALUE, 0)
        await self.runtime.dispatcher.wait_idle()

    def assert_one_end(self) -> None:
        """The message ended once: its *ended* mark, nothing parked, its key not blocked."""
        state = state_of(self.runtime, b"k")
        assert [(m.origin, m.ended) for m in state.marks] == [(ORIGIN, True)]
        assert state.pending == () and state.blocked_by is None


def first_try(make_runtime: Any, monkeypatch: pytest.MonkeyPatch, *outcomes: str, ordering: str = "none") -> FirstTry:
    runtime: Runtime = make_runtime(ordering=ordering)
    runtime.schedule.adopt(0, [])
    made, hooks = per_call(runtime, *outcomes)
    return FirstTry(runtime, made, hooks, record_acks(monkeypatch))


@pytest.mark.parametrize("ordering", ["none", "key"])
@pytest.mark.parametrize("outcome", ["fail", "permanent"])
async def test_the_mark_after_a_first_trys_send_is_not_written_once_the_lease_lapsed(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch, ordering: str, outcome: str
) -> None:
    """A first try's retry (``fail``) or dead letter (``permanent``) acknowledged while the worker was stopped past
    its session timeout: its *forwarded* or *ended* mark (key order: with the key's block or unblock) is not written
    and the record is not acknowledged. Read again by the new owner: a dead letter's intent sends the same dead letter
    without the handler (one end, twice on the failed topic); a retry's *sending* mark or block runs the record again
    and remembers its end, and the retry already sent is refused as ended when it arrives (one end)."""
    tried = first_try(make_runtime, monkeypatch, outcome, ordering=ordering)  # (a second call succeeds)
    runtime, made, acked = tried.runtime, tried.made, tried.acked
    lease = stale_lease(runtime)
    sent_to = runtime.tier_topics[TIER] if outcome == "fail" else runtime.failed_topics["items"]
    stop_during_each_send(sent_to, monkeypatch, lease)
    async with Agents(runtime) as agents:
        await tried.run(agents)
        assert len(sent_to.sent) == 1
        assert acked == [], "acknowledged by a worker the group may have evicted"
        assert runtime.counters["main.revoked_after_send"] == 1
        left = state_of(runtime, b"k")  # what the confirmed write before the send left, and nothing after it
        if outcome == "fail" and ordering == "key":
            assert left.blocked_by == ORIGIN and left.marks == (), left
        elif outcome == "fail":
            assert [(m.sending, m.ended) for m in left.marks] == [(True, False)], left
        else:
            assert [(m.intent is not None, m.ended) for m in left.marks] == [(True, False)], left

        runtime.dispatcher.__dict__["session_lease"] = StaleLease()  # the new owner: its lease fresh
        await tried.read_again(agents)
        assert acked == [0]
        await agents.park_tier_records()
    tried.assert_one_end()
    if outcome == "fail":
        assert made == [(0, 0), (0, 0)], "the record ran again, as after a crash between the send and the mark"
        assert runtime.failed_topics["items"].sent == []
        assert runtime.counters["tier.duplicates_ended"] == 1, "the retry sent before was not refused as ended"
    else:
        assert made == [(0, 0)], "the handler ran again: a second lifecycle"
        [one, again] = dead_letters(runtime)
        assert one[:2] == again[:2] == (b"permanent", b"0")


@pytest.mark.parametrize("ordering", ["none", "key"])
async def test_a_check_after_the_send_that_fails_is_taken_as_refused(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, ordering: str
) -> None:
    """The check after a first try's retry was sent raises (the assignor, the consumer or the lease failing): taken
    as refused, as a revocation. It reached the main agent's catch-all before, which dead-lettered the message
    ``internal-error`` while its retry was on the tier: two lifecycles (a review's finding). Now nothing is written,
    the record is left unacknowledged, and read again it runs once more and its retry is refused as ended: one end."""
    tried = first_try(make_runtime, monkeypatch, "fail", ordering=ordering)  # (a second call succeeds)
    runtime, made, acked = tried.runtime, tried.made, tried.acked
    tier_topic: RecordingTopic = runtime.tier_topics[TIER]
    send = tier_topic.send
    failing: list[bool] = []

    async def sent_then_the_check_fails(*args: Any, **kwargs: Any) -> Any:
        result = await send(*args, **kwargs)
        failing.append(True)
        return result

    real = lifecycle.still_owns

    async def fails_once_after_the_send(runtime: Runtime, partition: int) -> bool:
        if failing:
            failing.clear()
            raise RuntimeError("assignor hiccup")
        return await real(runtime, partition)

    monkeypatch.setattr(tier_topic, "send", sent_then_the_check_fails)
    monkeypatch.setattr(lifecycle, "still_owns", fails_once_after_the_send)
    async with Agents(runtime) as agents:
        await tried.run(agents)
        assert len(tier_topic.sent) == 1
        assert dead_letters(runtime) == [], "dead-lettered internal-error while its retry is on the tier"
        assert acked == []
        assert runtime.counters["main.revoked_after_send"] == 1
        assert "assignor hiccup" in caplog.text and "internal error" not in caplog.text

        await tried.read_again(agents)
        assert acked == [0]
        await agents.park_tier_records()
    tried.assert_one_end()
    assert made == [(0, 0), (0, 0)], "the record ran again, as after a crash between the send and the mark"
    assert dead_letters(runtime) == []
    assert runtime.counters["tier.duplicates_ended"] == 1, "the retry sent before was not refused as ended"


def revoked_during_each_send(topic: Any, monkeypatch: pytest.MonkeyPatch, runtime: Runtime) -> Callable[[], None]:
    """Each record sent to ``topic`` is acknowledged after the rebalance took this worker's partitions (the assignor
    says so, the session lease still fresh); returns what gives them back (the partition's next assignment)."""
    assignor = runtime.app.assignor
    owned = (assignor.assigned_actives, assignor.is_active)
    send = topic.send

    async def revoked_during_the_send(*args: Any, **kwargs: Any) -> Any:
        result = await send(*args, **kwargs)
        revoke(runtime)
        return result

    def assigned_again() -> None:
        assignor.assigned_actives, assignor.is_active = owned

    monkeypatch.setattr(topic, "send", revoked_during_the_send)
    return assigned_again


@pytest.mark.parametrize("ordering", ["none", "key"])
async def test_the_mark_after_a_retrys_send_is_not_written_once_its_partition_was_revoked(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch, ordering: str
) -> None:
    """Refused through ownership rather than the lease: the rebalance took the partition while the first try's retry
    was sent (the lease fresh). No *forwarded* mark (key order: no settle) and the record is not acknowledged; read
    again once the partition is assigned again, it runs again and the retry sent is refused as ended: one end."""
    tried = first_try(make_runtime, monkeypatch, "fail", ordering=ordering)  # (a second call succeeds)
    runtime, made, acked = tried.runtime, tried.made, tried.acked
    tier_topic: RecordingTopic = runtime.tier_topics[TIER]
    assigned_again = revoked_during_each_send(tier_topic, monkeypatch, runtime)
    async with Agents(runtime) as agents:
        await tried.run(agents)
        assert len(tier_topic.sent) == 1
        assert acked == [], "acknowledged by a worker whose partition was revoked"
        assert runtime.counters["main.revoked_after_send"] == 1
        left = state_of(runtime, b"k")
        assert (left.blocked_by == ORIGIN) if ordering == "key" else [m.sending for m in left.marks] == [True], left

        assigned_again()
        await tried.read_again(agents)
        assert acked == [0]
        await agents.park_tier_records()
    tried.assert_one_end()
    assert made == [(0, 0), (0, 0)]
    assert runtime.counters["tier.duplicates_ended"] == 1


async def test_a_key_blocker_read_again_that_succeeds_is_not_settled_once_its_partition_was_revoked(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Key order: the key's blocker, read again (its retry may have been sent: ``maybe_sent``), succeeds while the
    rebalance takes its partition. Its settle (the end remembered, the block lifted) is not written and the record is
    not acknowledged; the block stays, and read again once the partition is assigned again, it runs once more and
    settles: the retry sent is refused as ended."""
    tried = first_try(make_runtime, monkeypatch, "fail", ordering="key")  # (later calls succeed)
    runtime, made, acked = tried.runtime, tried.made, tried.acked
    lease = stale_lease(runtime)
    tier_topic: RecordingTopic = runtime.tier_topics[TIER]
    stop_during_each_send(tier_topic, monkeypatch, lease)
    assignor = runtime.app.assignor
    owned = (assignor.assigned_actives, assignor.is_active)
    async with Agents(runtime) as agents:
        await tried.run(agents)  # its retry sent, its settle refused (the lease): the key blocked behind it
        assert state_of(runtime, b"k").blocked_by == ORIGIN and acked == []

        runtime.dispatcher.__dict__["session_lease"] = StaleLease()  # a fresh lease

        async def revoked_during_the_call() -> None:
            revoke(runtime)

        tried.hooks.append(revoked_during_the_call)
        await tried.read_again(agents)
        assert made == [(0, 0), (0, 0)]
        assert acked == [], "acknowledged by a worker whose partition was revoked"
        assert runtime.counters["main.revoked_after_send"] == 2
        left = state_of(runtime, b"k")
        assert left.blocked_by == ORIGIN and left.marks == (), "settled by a worker whose partition was revoked"

        assignor.assigned_actives, assignor.is_active = owned
        await tried.read_again(agents)
        assert acked == [0]
        await agents.park_tier_records()
    tried.assert_one_end()
    assert made == [(0, 0), (0, 0), (0, 0)]
    assert runtime.counters["tier.duplicates_ended"] == 1


@pytest.mark.parametrize("ordering", ["none", "key"])
async def test_the_end_after_an_internal_error_dead_letter_is_not_written_once_the_lease_lapsed(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch, ordering: str
) -> None:
    """The main agent's catch-all asked before its ``internal-error`` dead letter; the *ended* mark (key order:
    ``ended_in_error``'s unblock) follows that send's await and asks again: stopped past the session timeout during
    the send, it is not written and the record is not acknowledged (its new owner runs it again, as after a crash
    there: no intent is written for an error of ours)."""
    tried = first_try(make_runtime, monkeypatch, ordering=ordering)
    runtime, acked = tried.runtime, tried.acked
    lease = stale_lease(runtime)
    stop_during_each_send(runtime.failed_topics["items"], monkeypatch, lease)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(main_agent, "check_redelivery", broken)
    async with Agents(runtime) as agents:
        await tried.run(agents)
    [(reason, *_)] = dead_letters(runtime)
    assert reason == b"internal-error"
    assert acked == []
    assert state_of(runtime, b"k").marks == (), "an ended mark written by a worker maybe evicted"
    assert runtime.counters["main.revoked_after_send"] == 1


async def test_a_retry_sent_again_and_refused_as_too_large_falls_back_to_its_dead_letter_only_while_owned(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release request read again finds its entry's retry intent (the settle was lost in a crash) and sends that
    retry again; the broker refuses it as too large while the worker is stopped past its session timeout. Its
    fallback dead letter follows that refused send's await: it is not sent here (the request's release counted
    revoked), and the new owner, reading the same intent, sends it once: one dead letter, not two."""
    runtime: Runtime = make_runtime()
    calls = scripted(runtime, RetryableError("later"))
    crash_before_the_first_settle(monkeypatch)
    lease = stale_lease(runtime)
    tier_topic: RecordingTopic = runtime.tier_topics[TIER]
    send = tier_topic.send

    async def lowered_and_stopped_after_the_first(**record: Any) -> Any:
        if tier_topic.sent:  # the retry sent again: refused, and the worker stopped meanwhile
            tier_topic.broker_max_value_bytes = 1
            lease.stale = True
        return await send(**record)

    monkeypatch.setattr(tier_topic, "send", lowered_and_stopped_after_the_first)
    await park_one_due(runtime, clock)
    async with runtime.agents["release"].test_context() as releaser:
        channel = releaser.stream().channel

        async def request(offset: int, until: Callable[[], bool]) -> None:
            await channel.put(await channel.decode(releaser.to_message(b"k", REQUEST, partition=0, offset=offset)))
            await eventually(until)
            await runtime.dispatcher.wait_idle()

        # Its handler runs and its retry intent is written, then the retry sent; its settle lost in a crash.
        await request(0, lambda: len(tier_topic.sent) == 1)
        await request(1, lambda: tier_topic.refused == 1)  # read again: the same retry sent again, refused
        assert calls == [1]
        assert tier_topic.refused == 1
        assert runtime.failed_topics["items"].sent == [], "a dead letter sent by a worker the group may have evicted"
        assert runtime.counters["release.revoked"] == 1
        [entry] = state_of(runtime, b"k").pending
        assert entry.intent is not None and not entry.intent.dead

        runtime.dispatcher.__dict__["session_lease"] = StaleLease()  # the new owner: its lease fresh
        await request(2, lambda: bool(runtime.failed_topics["items"].sent))
    assert calls == [1]
    [failed] = runtime.failed_topics["items"].sent
    assert (failed.headers[h.REASON], failed.headers[h.ATTEMPT]) == (b"too-large", b"1")
    assert state_of(runtime, b"k").pending == ()
