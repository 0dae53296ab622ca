"""The session lease, then ownership (``agents.ownership.still_owns``), before the sends and writes that still asked
ownership alone, or nothing, after an await (issue 22 follow-up): the tier agent's refusals and its refused park's
take-back, key-ordered mode's refused hold, and an operator's dead-letter command. In each, the worker is stopped
past its session timeout while the await was on its way (the lease stale, the revocation coming before the
heartbeat's word): nothing is sent or written, and the record is left unacknowledged for the partition's next
reader, which ends the message itself (one dead letter, not two; never one here and a success there)."""

from __future__ import annotations

from typing import Any

import pytest

from agents.runtime import Runtime
from rebound import headers as h
from rebound.errors import RecordTooLargeError
from rebound.ordering import HELD_PAYLOAD_PREFIX
from rebound.state import payload_key
from tests.agents.conftest import FakeClock
from tests.agents.support import (
    REQUEST,
    VALUE,
    Agents,
    StaleLease,
    at_each_confirm,
    first,
    operators_dead_letter,
    park_one_due,
    park_two_due,
    per_call,
    put_on_tier,
    record_acks,
    revoke,
    stale_lease,
    state_of,
    stop_during_each_send,
    tier_headers,
    unparkable,
)


def refuse_the_first_confirm(runtime: Runtime, monkeypatch: pytest.MonkeyPatch, lease: StaleLease) -> list[bool]:
    """The first confirmed write from now on is refused as too large, and the worker was stopped past its session
    timeout while the changelog answered; the later ones are confirmed."""
    confirm = runtime.store.confirm
    refused: list[bool] = []

    async def refused_while_stopped() -> None:
        if not refused:
            refused.append(True)
            lease.stale = True
            raise RecordTooLargeError("the changelog record is too large")
        await confirm()

    monkeypatch.setattr(runtime.store, "confirm", refused_while_stopped)
    return refused


def stop_during_each_dead_letter(runtime: Runtime, monkeypatch: pytest.MonkeyPatch, lease: StaleLease) -> None:
    """Each dead letter to ``items``'s failed topic is acknowledged while the worker is stopped past its timeout."""
    stop_during_each_send(runtime.failed_topics["items"], monkeypatch, lease)


async def operators_dead_letter_stopped_during_each_send(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, Any], StaleLease]:
    """An operator's dead-letter of key ``k`` (:func:`operators_dead_letter`), the worker stopped past its session
    timeout during each of its sends (:func:`stop_during_each_dead_letter`); its result and the lease."""
    lease = stale_lease(runtime)
    stop_during_each_dead_letter(runtime, monkeypatch, lease)
    return await operators_dead_letter(runtime), lease


async def test_a_park_refused_while_stopped_past_the_session_timeout_sends_no_dead_letter(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``take_back`` runs after the refused confirm (an await) and before ``not_parked``'s send: it waits for the
    lease; the revocation first, the park is neither taken back nor dead-lettered here, and the tier record is not
    acknowledged (the new owner reads it again and ends it: one dead letter, not two)."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    lease = stale_lease(runtime)
    refused = refuse_the_first_confirm(runtime, monkeypatch, lease)
    acked = record_acks(monkeypatch)
    await put_on_tier(runtime, tier_headers(clock))
    assert refused == [True]
    assert runtime.failed_topics["items"].sent == [], "a dead letter sent by a worker the group may have evicted"
    assert acked == [], "acknowledged, though neither parked for good nor ended"
    assert lease.waits >= 1
    assert runtime.counters["tier.revoked_before_send"] == 1


def invalid_headers(runtime: Runtime, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bytes]]:
    return [(name, b"not a number" if name == h.ATTEMPT else value) for name, value in tier_headers(clock)]


def park_failing(runtime: Runtime, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bytes]]:
    unparkable(monkeypatch)  # not_parked, internal-error
    return tier_headers(clock)


@pytest.mark.parametrize("refusal", [invalid_headers, park_failing])
async def test_a_tier_refusal_after_a_confirm_while_stopped_sends_no_dead_letter(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, refusal: Any
) -> None:
    """A refusal's send follows the confirm of the parks before it (``before_reject``, always awaited) and the
    lane's own waits: it asks the lease, and refused, leaves its record unacknowledged."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    lease = stale_lease(runtime)
    headers = refusal(runtime, clock, monkeypatch)
    at_each_confirm(runtime, monkeypatch, lambda: setattr(lease, "stale", True))
    acked = record_acks(monkeypatch)
    await put_on_tier(runtime, headers)
    assert runtime.failed_topics["items"].sent == []
    assert acked == []
    assert lease.waits >= 1


async def test_the_ended_mark_after_a_tier_refusals_send_waits_for_the_lease(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mark that remembers the refused retry as ended is written after its dead letter's send (an await): a
    worker stopped during the send writes nothing more and leaves the record to the next owner, which sends the
    same dead letter again and remembers it (at-least-once, the same end)."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    lease = stale_lease(runtime)
    headers = park_failing(runtime, clock, monkeypatch)
    stop_during_each_dead_letter(runtime, monkeypatch, lease)
    acked = record_acks(monkeypatch)
    await put_on_tier(runtime, headers)
    assert len(runtime.failed_topics["items"].sent) == 1
    assert state_of(runtime, b"k").marks == (), "written by a worker maybe evicted"
    assert acked == []
    assert lease.waits >= 1


async def test_a_hold_refused_while_stopped_past_the_session_timeout_sends_no_dead_letter(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Key-ordered mode: a hold the changelog refused is taken back and dead-lettered after that confirm (an await).
    Stopped past the session timeout meanwhile, the worker neither takes it back nor sends, and leaves the record
    unacknowledged: the new owner may find the key free and run it (a dead letter here would fork it)."""
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    per_call(runtime, "fail")
    acked = record_acks(monkeypatch)
    async with Agents(runtime) as agents:
        await first(agents, VALUE)  # 0: fails once, blocks the key
        lease = stale_lease(runtime)
        refused = refuse_the_first_confirm(runtime, monkeypatch, lease)
        await first(agents, VALUE)  # 1: its hold refused
        await runtime.dispatcher.wait_idle()
    assert refused == [True]
    assert runtime.failed_topics["items"].sent == []
    assert acked == [0]
    assert runtime.counters["main.revoked_before_send"] == 1
    assert lease.waits >= 1


async def test_a_taken_back_hold_whose_write_was_confirmed_while_stopped_sends_no_dead_letter(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same, the worker stopped while the take-back's own write was confirmed: its dead letter is not sent."""
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    per_call(runtime, "fail")
    acked = record_acks(monkeypatch)
    async with Agents(runtime) as agents:
        await first(agents, VALUE)
        lease = stale_lease(runtime)
        refused = refuse_the_first_confirm(runtime, monkeypatch, StaleLease())
        at_each_confirm(runtime, monkeypatch, lambda: setattr(lease, "stale", True))
        await first(agents, VALUE)
        await runtime.dispatcher.wait_idle()
    assert refused == [True]
    assert runtime.failed_topics["items"].sent == []
    assert state_of(runtime, b"k").held == ()
    assert acked == [0]
    assert lease.waits >= 1


async def test_an_operator_dead_letter_write_after_its_sends_waits_for_the_lease(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key's state is written after the dead letters' sends were awaited: a worker stopped during them writes
    nothing (as ``run_held`` does not), and says so to the operator."""
    runtime = make_runtime()
    await park_one_due(runtime, clock)
    result, lease = await operators_dead_letter_stopped_during_each_send(runtime, monkeypatch)
    assert len(runtime.failed_topics["items"].sent) == 1
    assert "warning" in result, result
    assert runtime.counters["admin.dead_lettered"] == 0
    assert len(state_of(runtime, b"k").pending) == 1, "written by a worker maybe evicted"
    assert lease.waits >= 1


async def test_an_operator_dead_letter_after_waiting_for_the_keys_lock_waits_for_the_lease(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command waits for its key's lock (a release of the key may hold it for a whole handler call): stopped
    past the session timeout meanwhile, the worker sends no dead letter, which could end a message the new owner
    has released and run to another end (a fork)."""
    runtime = make_runtime()
    await park_one_due(runtime, clock)
    lease = stale_lease(runtime)
    hold = runtime.key_locks.hold

    def stale_once_locked(key: Any) -> Any:
        lease.stale = True
        return hold(key)

    monkeypatch.setattr(runtime.key_locks, "hold", stale_once_locked)
    result = await operators_dead_letter(runtime)
    assert runtime.failed_topics["items"].sent == []
    assert "warning" in result, result
    assert len(state_of(runtime, b"k").pending) == 1
    assert lease.waits >= 1


async def test_a_held_message_run_after_its_keys_settle_waits_for_the_lease_before_its_dead_letter(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Key-ordered mode: the key's held messages run right after the settle that lifted its block, a confirmed write.
    A held message whose bytes are gone is dead-lettered (``payload-missing``) without running: after that await,
    the lease is asked first; the revocation first, it stays held for the new owner and nothing is sent."""
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    per_call(runtime, "fail")
    async with Agents(runtime) as agents:
        await first(agents, VALUE)  # 0: fails once, blocks the key
        await first(agents, VALUE)  # 1: held
        del runtime.store.payloads.data[payload_key(b"k", HELD_PAYLOAD_PREFIX + "items/0/1")]
        await agents.park_tier_records()
        lease = stale_lease(runtime)
        at_each_confirm(runtime, monkeypatch, lambda: setattr(lease, "stale", True))
        clock.advance(2000)
        await agents.release_due()
        await runtime.dispatcher.wait_idle()
    assert runtime.failed_topics["items"].sent == []
    assert [entry.origin for entry in state_of(runtime, b"k").held] == ["items/0/1"]
    assert lease.waits >= 1


async def test_a_release_whose_payload_is_lost_sends_nothing_on_a_partition_no_longer_owned(
    make_runtime: Any, clock: FakeClock
) -> None:
    """A release without its bytes ends ``payload-missing`` without a handler call, so no send check of the call
    path comes before its dead letter: ownership is asked there (the lease was awaited before the read), as a
    resent intent's is."""
    runtime = make_runtime()
    await park_one_due(runtime, clock)
    entry = runtime.store.entry(b"k", "items/0/7")
    assert entry is not None
    runtime.store.payloads.data[payload_key(b"k", "items/0/7")] = entry.encode_entry()  # (metadata, no bytes)
    revoke(runtime)
    async with runtime.agents["release"].test_context() as releaser:
        await releaser.put(REQUEST, key=b"k", partition=0)
        await runtime.dispatcher.wait_idle()
    assert runtime.failed_topics["items"].sent == []
    assert runtime.counters["release.revoked"] == 1


async def test_an_operator_dead_letter_stopped_partway_says_which_went_out_and_which_were_left(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused after the first of two dead letters: the answer lists the one sent and the one not sent, and says the
    key's state was not written (both still parked, so the sent one may run again on the new owner)."""
    runtime = make_runtime()
    await park_two_due(runtime, clock)
    result, _ = await operators_dead_letter_stopped_during_each_send(runtime, monkeypatch)
    assert len(runtime.failed_topics["items"].sent) == 1
    assert [m["origin"] for m in result["messages"]] == ["items/0/7"]
    assert [m["origin"] for m in result["not_sent"]] == ["items/0/8"]
    assert result["incomplete"] is True
    warning = result["warning"]
    assert "1 of 2" in warning and "sent: items/0/7" in warning and "not sent: items/0/8" in warning, warning
    assert "not written" in warning and "still parked" in warning, warning
    assert len(state_of(runtime, b"k").pending) == 2


async def test_an_operator_dead_letter_asks_again_before_the_ended_marks(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ended marks (and key order's unblock, ``record_outcome``) are written after the confirm of the write that
    removed the entries: stopped past the session timeout during that confirm, they are not written, and the answer
    says the dead letters were sent and the entries removed, but not remembered as ended."""
    import agents.admin as admin_agent

    runtime = make_runtime()
    await park_one_due(runtime, clock)
    lease = stale_lease(runtime)
    recorded: list[str] = []
    record_outcome = admin_agent.record_outcome

    async def recording(runtime_: Any, table_key: bytes, origin: str, *args: Any, **kwargs: Any) -> Any:
        recorded.append(origin)
        return await record_outcome(runtime_, table_key, origin, *args, **kwargs)

    monkeypatch.setattr(admin_agent, "record_outcome", recording)
    at_each_confirm(runtime, monkeypatch, lambda: setattr(lease, "stale", True))
    result = await operators_dead_letter(runtime)
    assert len(runtime.failed_topics["items"].sent) == 1
    assert recorded == [], "an ended mark written by a worker maybe evicted"
    assert state_of(runtime, b"k").pending == ()
    assert result["incomplete"] is True and [m["origin"] for m in result["messages"]] == ["items/0/7"]
    assert "not all are remembered as ended" in result["warning"], result


async def test_a_stale_release_request_writes_no_settle_again_on_a_partition_no_longer_owned(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose entry is gone writes the key's state again (``reassert_settled``: the settle's records may
    not have been acknowledged). That write is this worker's view of the key: on a partition no longer owned (the
    lease was awaited before the read; ownership asked after it, as a stale entry's drop asks) it is not made, and
    whatever the new owner parked is not written over."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    reasserted: list[bytes] = []
    monkeypatch.setattr(runtime.store, "reassert_settled", lambda table_key, origin: reasserted.append(table_key))
    revoke(runtime)
    async with runtime.agents["release"].test_context() as releaser:
        await releaser.put(REQUEST, key=b"k", partition=0)
        await runtime.dispatcher.wait_idle()
    assert reasserted == [], "a settle written again on a partition maybe another worker's"
    assert runtime.counters["release.revoked"] == 1
