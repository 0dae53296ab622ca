"""Ownership asked where it can neither let a stale view be written nor let a send out unchecked (issue 22 review).

- A stale entry's drop (``drop_ended``) saved an index read before it waited for the session lease: the tier agent
  writes a key without its lock (an ended mark, a park), and what it wrote during that wait was overwritten. The lease
  is now awaited before the read, and ownership asked after it without awaiting (as ``give_up`` does).
- A held message given up (``_give_up_held``) and the main agent's catch-all sent their ``internal-error`` dead
  letter without asking: a worker the group evicted or between assignments sent it for a partition maybe another's.
  Refused now as a first try's send is: nothing sent, the record or request left unacknowledged.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import agents.main as main_agent
import agents.ordering as ordering_agents
from agents.lifecycle import memory_of
from agents.runtime import Runtime
from agents.tier import current
from rebound.headers import Provenance
from rebound.ordering import HELD_ATTEMPT
from rebound.state import remember
from tests.agents.conftest import FakeClock
from tests.agents.support import VALUE, Agents, StaleLease, first, record_acks
from tests.agents.test_ended_orphan import ORIGIN, OfPartition0, ended_with_a_stale_copy, request_release
from tests.scripted_handler import CALLS_ENV

OTHER = Provenance("items", 0, 5, 0, 0)
"""Another message of key ``k``, whose retry the tier agent finds ended while the stale entry's drop waits."""


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "calls.jsonl"
    monkeypatch.setenv(CALLS_ENV, str(path))
    return path


class TierWriteDuringTheWait(StaleLease):
    """Stale once the release holds its key's lock; while its wait lasts, the tier agent (no key lock) writes an
    ended mark of another message of the key, as ``_remember_ended`` does; then the heartbeat renews the lease."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(renewed=True)
        self.runtime = runtime

    async def wait(self, revoked: Any) -> bool:
        self.waits += 1
        runtime = self.runtime
        before = runtime.store.load(b"k")
        after = remember(
            before, OTHER, attempt=2, ended=True, partition=0, now_ms=runtime.clock(), memory=memory_of(runtime)
        )
        with current(OfPartition0()):
            runtime.store.save(b"k", before, after)
        self.stale = False
        return True


@pytest.mark.parametrize("ordering", ["none", "key"])
async def test_a_tier_write_during_the_stale_lease_wait_of_a_stale_entrys_drop_survives(
    make_runtime: Any, clock: FakeClock, calls: Path, monkeypatch: pytest.MonkeyPatch, ordering: str
) -> None:
    runtime: Runtime = make_runtime(ordering=ordering)
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await ended_with_a_stale_copy(runtime, agents, clock)
        lease = TierWriteDuringTheWait(runtime)
        runtime.dispatcher.__dict__["session_lease"] = lease  # (a cached_property)
        hold = runtime.key_locks.hold

        def stale_once_locked(key: Any) -> Any:  # stopped past the session timeout while the request waited
            lease.stale = True
            return hold(key)

        monkeypatch.setattr(runtime.key_locks, "hold", stale_once_locked)
        await request_release(agents, runtime)
    assert lease.waits == 1, "the lease was never waited for"
    assert runtime.counters["release.ended"] == 1 and runtime.store.entry(b"k", ORIGIN) is None
    marks = {(mark.origin, mark.attempt, mark.ended) for mark in runtime.store.load(b"k").marks}
    assert ("items/0/5", 2, True) in marks, f"the tier's ended mark written during the wait was overwritten: {marks}"
    assert (ORIGIN, 1, True) in marks


def evict(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The group evicted this worker (aiokafka blanked its member id): it owns nothing."""
    monkeypatch.setattr(type(runtime.app.consumer), "evicted", property(lambda self: True), raising=False)


async def test_a_held_message_given_up_by_an_evicted_worker_is_not_dead_lettered(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, calls: Path
) -> None:
    """Its third failure is the one that gives it up: evicted during that run, nothing is sent and it stays held
    for the partition's next owner (the release request that ran it is left unacknowledged)."""
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 1}')
        await agents.main(b'{"succeed_on": 0}')  # held
        await agents.park_tier_records()
        real_run_attempt = ordering_agents.run_attempt
        runs = []

        async def broken(runtime_: Any, **kwargs: Any) -> Any:
            if kwargs["provenance"].offset == 1:
                runs.append(1)
                if len(runs) == 3:
                    evict(runtime, monkeypatch)
                raise RuntimeError("the failed topic refused the record")
            return await real_run_attempt(runtime_, **kwargs)

        monkeypatch.setattr(ordering_agents, "run_attempt", broken)
        clock.advance(1000)
        await agents.release_due()
        assert [slot.attempt for _, slot in runtime.schedule.slots()] == [HELD_ATTEMPT]
        for _ in range(2):
            clock.advance(5000)
            await agents.release_due()
        await runtime.dispatcher.wait_idle()
    assert len(runs) == 3
    assert runtime.failed_topics["items"].sent == [], "a held message dead-lettered by an evicted worker"
    assert [entry.origin for entry in runtime.store.load(b"k").held] == ["items/0/1"], "taken off the held list"
    assert runtime.counters["main.revoked_before_send"] == 1


@pytest.mark.parametrize("ordering", ["none", "key"])
@pytest.mark.parametrize("lost", ["evicted", "lease"])
async def test_the_main_agents_catch_all_sends_nothing_for_a_partition_it_may_have_lost(
    make_runtime: Any,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    ordering: str,
    lost: str,
) -> None:
    """An error of ours after the worker was evicted (or its lease lapsed: the revocation before the heartbeat's
    word): no ``internal-error`` dead letter, and the record is not acknowledged (not a skipped offset)."""
    runtime: Runtime = make_runtime(ordering=ordering)
    runtime.schedule.adopt(0, [])
    lease = StaleLease(renewed=False)
    runtime.dispatcher.__dict__["session_lease"] = lease

    def broken(*args: Any, **kwargs: Any) -> Any:
        if lost == "evicted":
            evict(runtime, monkeypatch)
        else:
            lease.stale = True
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(main_agent, "check_redelivery", broken)
    acked = record_acks(monkeypatch)
    caplog.set_level(logging.WARNING)
    async with Agents(runtime) as agents_:
        await first(agents_, VALUE)
        await runtime.dispatcher.wait_idle()
    assert runtime.failed_topics["items"].sent == [], "an internal-error dead letter for a partition maybe lost"
    assert acked == [], "the record was acknowledged: its offset skipped"
    assert runtime.counters["main.revoked_before_send"] == 1


async def test_the_main_agents_catch_all_still_dead_letters_on_an_owned_partition(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: Runtime = make_runtime()
    runtime.schedule.adopt(0, [])

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(main_agent, "check_redelivery", broken)
    acked = record_acks(monkeypatch)
    async with Agents(runtime) as agents_:
        await first(agents_, VALUE)
        await runtime.dispatcher.wait_idle()
    [failed] = runtime.failed_topics["items"].sent
    assert failed.headers["rebound.reason"] == b"internal-error"
    assert acked == [0]
