"""Review of 59508e8: a lease wait begun by a task outside the dispatcher's works (a tier lane, the admin agent) after
a revocation's flow stop ends on that revocation too, as a dispatched work's does (its work's generation)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from app.consumer import SessionLease
from tests.agents.conftest import FakeClock
from tests.agents.support import (
    operators_dead_letter,
    park_one_due,
    put_on_tier,
    record_acks,
    tier_headers,
    unparkable,
)


def stale_session_lease(runtime: Any, max_wait_s: float) -> SessionLease:
    lease = SessionLease(30.0, poll_s=0.01, max_wait_s=max_wait_s)
    lease.renewed(time.monotonic() - 100.0)  # no heartbeat answered for more than a session timeout
    runtime.dispatcher.__dict__["session_lease"] = lease  # (a cached_property)
    return lease


def known_evicted(runtime: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer says the group evicted this worker (the heartbeat's UnknownMemberId came)."""
    monkeypatch.setattr(type(runtime.app.consumer), "evicted", property(lambda self: True), raising=False)


async def tier_refusal_revoked_at_its_confirm(
    runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, *, evicted: bool
) -> tuple[list[int], float]:
    """A tier record refused (:func:`unparkable`) with a stale lease (``max_wait_s`` 3 s), the flow stopped by a
    revocation (the dispatcher's revoke, a new generation; the worker known ``evicted`` or not) once the confirm
    before the refusal has returned; the offsets acknowledged and the seconds the lane took."""
    runtime.schedule.adopt(0, [])
    stale_session_lease(runtime, max_wait_s=3.0)
    unparkable(monkeypatch)  # not_parked, internal-error: before_reject, then reject
    confirm = runtime.store.confirm

    async def confirmed_then_revoked() -> None:
        await confirm()
        if evicted:
            known_evicted(runtime, monkeypatch)
        runtime.dispatcher.revoke()  # Faust's stop_flow at the revocation: the generation moves on

    monkeypatch.setattr(runtime.store, "confirm", confirmed_then_revoked)
    acked = record_acks(monkeypatch)
    began = time.monotonic()
    await put_on_tier(runtime, tier_headers(clock))
    return acked, time.monotonic() - began


async def timed_operators_dead_letter(runtime: Any) -> tuple[dict[str, Any], float]:
    """:func:`operators_dead_letter`'s result, and the seconds it took."""
    began = time.monotonic()
    result = await operators_dead_letter(runtime)
    return result, time.monotonic() - began


async def test_a_tier_refusal_after_the_revocation_began_does_not_wait_out_the_lease(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An evicted worker's rebalance: the flow stops (the dispatcher's revoke, a new generation) while a tier lane's
    confirm before a refusal is on its way; Faust's revocation then waits for the lane's record (``wait_empty``).
    The lane's ``still_ours`` waits for the lease with the *current* generation (the lane has no work generation),
    so the revocation that already happened never ends the wait: it lasts ``max_wait_s`` (a session timeout in
    production), holding the revocation, the rebalance, and the key's lock for ``take_back``."""
    runtime = make_runtime()
    acked, took = await tier_refusal_revoked_at_its_confirm(runtime, clock, monkeypatch, evicted=True)
    assert runtime.failed_topics["items"].sent == []
    assert acked == []
    assert took < 1.0, f"the lane waited {took:.1f}s for a lease the revocation had already ended"


async def test_an_operator_command_after_the_revocation_began_does_not_wait_out_the_lease(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The admin agent is no dispatched work either: a command whose key's lock came after the flow stopped (an
    evicted worker's revocation, which waits for the command's event) waits out ``max_wait_s`` holding the lock."""
    runtime = make_runtime()
    await park_one_due(runtime, clock)
    stale_session_lease(runtime, max_wait_s=3.0)
    hold = runtime.key_locks.hold

    def revoked_while_waiting_for_the_lock(key: Any) -> Any:
        known_evicted(runtime, monkeypatch)
        runtime.dispatcher.revoke()
        return hold(key)

    monkeypatch.setattr(runtime.key_locks, "hold", revoked_while_waiting_for_the_lock)
    result, took = await timed_operators_dead_letter(runtime)
    assert runtime.failed_topics["items"].sent == []
    assert "warning" in result, result
    assert took < 1.0, f"the command waited {took:.1f}s (holding its key's lock) for a lease the revocation ended"


async def test_a_tier_refusal_during_a_revocation_with_a_stale_lease_does_not_hold_the_rebalance(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same without an eviction (a rebalance while heartbeats go unanswered): a dispatched work's wait ends at
    its generation's revocation; the lane's, begun after it, lasts ``max_wait_s`` while the group waits for this
    member's revocation. (Asking ownership before the lease would not help here: the partition is still owned
    until the revocation's callback returns.)"""
    runtime = make_runtime()
    acked, took = await tier_refusal_revoked_at_its_confirm(runtime, clock, monkeypatch, evicted=False)
    assert runtime.failed_topics["items"].sent == []  # left to the partition's next reader, as a work's record
    assert acked == []
    assert took < 1.0, f"the lane waited {took:.1f}s for a lease whose generation was revoked before the wait"


async def test_a_tier_refusal_in_a_later_generation_still_waits_for_the_lease(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lane's generation is the one its group was taken in, not the first it saw: a record taken after an
    earlier revocation (the partition assigned again) waits for the heartbeat's word as before, and runs on it."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    runtime.dispatcher.revoke()  # an earlier rebalance; the partition is assigned again
    stale_session_lease(runtime, max_wait_s=0.2)
    unparkable(monkeypatch)
    await put_on_tier(runtime, tier_headers(clock))
    assert len(runtime.failed_topics["items"].sent) == 1, "the lane's wait ended on the earlier revocation"


async def test_an_operator_command_on_a_worker_known_evicted_does_not_wait_for_the_lease(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heartbeat's answer (UnknownMemberId) came before the revocation: the partition is not owned, which no
    wait can change, so the command is refused at once rather than after ``max_wait_s`` holding its key's lock."""
    runtime = make_runtime()
    await park_one_due(runtime, clock)
    stale_session_lease(runtime, max_wait_s=3.0)
    known_evicted(runtime, monkeypatch)
    result, took = await timed_operators_dead_letter(runtime)
    assert runtime.failed_topics["items"].sent == []
    assert "nothing done" in result["warning"], result
    assert took < 1.0, f"the command waited {took:.1f}s for a partition it knew it no longer owned"
