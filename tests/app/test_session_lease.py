"""The session lease: a worker starts no queued record while its group membership is not known fresh (issue 22).

A worker stopped past its session timeout and woken started queued records before its heartbeat learnt of the
eviction and the revocation dropped its queue; the partitions' new owners ran them too. The dispatcher here is the
real one with a fake consumer carrying a real :class:`SessionLease` on a fake clock; the heartbeat hook is tried on
the real consumer with a coordinator that answers as aiokafka's does. tests/integration/test_evicted_worker_wakes.py
shows it end to end.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.consumer.group_coordinator import CoordinatorGroupRebalance, GroupCoordinator
from aiokafka.protocol.group import JoinGroupRequest, SyncGroupRequest

from agents.attempt import call_handler, run_attempt
from agents.dispatcher import RETRY_BACKOFF_S, Dispatcher
from agents.runtime import Runtime
from app.consumer import ReboundConsumer, SessionLease
from rebound.breaker import BreakerState
from rebound.event import RetryEvent
from rebound.headers import Provenance
from rebound.routing import Classification
from tests.agents.test_dispatcher import TP0, FakeApp, FakeEvent, FakeMessage
from tests.app_under_test import build_runtime

SESSION_S = 6.0


class Clock:
    """Monotonic time the test moves: a SIGSTOP is a jump."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.read_s = 0.0
        """Wall time each read takes: the worker's process descheduled there, as under load (0 unless a test sets it)."""

    def __call__(self) -> float:
        if self.read_s:
            time.sleep(self.read_s)
        return self.now


class Stopping:
    def __init__(self) -> None:
        self.stopping = False

    def __call__(self) -> bool:
        return self.stopping


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def stopping() -> Stopping:
    return Stopping()


@pytest.fixture
def lease(clock: Clock, stopping: Stopping) -> SessionLease:
    lease = SessionLease(SESSION_S, clock=clock, stopping=stopping, poll_s=0.001)
    lease.renewed(clock.now)  # joined
    return lease


def dispatcher_with(lease: SessionLease, limit: int = 2) -> tuple[Dispatcher, FakeApp, list[int], list[int]]:
    app = FakeApp()
    app.consumer.session_lease = lease  # type: ignore[attr-defined]
    return Dispatcher(app, limit=limit, partition_buffer=100), app, [], []


def offer(dispatcher: Dispatcher, offsets: range, acks: list[int], ran: list[int]) -> None:
    async def run(event: FakeEvent) -> None:
        ran.append(event.message.offset)

    for offset in offsets:
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane=f"k{offset}", run=run)


async def turns(count: int = 20) -> None:
    for _ in range(count):
        await asyncio.sleep(0.001)


async def test_a_fresh_lease_starts_records_at_once(lease: SessionLease, clock: Clock) -> None:
    dispatcher, _, acks, ran = dispatcher_with(lease)
    clock.now += SESSION_S - 0.1  # the last heartbeat was sent 5.9 s ago: the group still counts this worker in
    offer(dispatcher, range(3), acks, ran)
    await dispatcher.wait_idle()
    assert ran == [0, 1, 2]
    assert acks == [0, 1, 2]


@pytest.mark.parametrize("read_s", [0.0, 0.002], ids=["idle", "loaded"])
async def test_a_worker_woken_past_its_session_timeout_starts_nothing_until_a_heartbeat_renews_the_lease(
    lease: SessionLease, clock: Clock, caplog: pytest.LogCaptureFixture, read_s: float
) -> None:
    """Not dropped: a renewed lease means the group did not evict it, and the records must run, acknowledged in offset
    order. Not run in offset order: each is on a key of its own, the two waiting ones resume each on its own poll, and
    record 2 takes the first slot freed; under load (``loaded``: the loop descheduled at each lease read) 0's poll
    comes round alone and 2 runs before 1."""
    caplog.set_level(logging.INFO, logger="app.consumer")
    clock.read_s = read_s
    dispatcher, _, acks, ran = dispatcher_with(lease)
    clock.now += SESSION_S + 30  # stopped for 36 s
    offer(dispatcher, range(3), acks, ran)
    await turns()
    assert ran == []
    assert dispatcher.in_flight == 2  # waiting in their slots: nothing else starts either
    lease.renewed(clock.now - 0.002)  # the heartbeat sent after the wake was answered: still a member
    await dispatcher.wait_idle()
    assert sorted(ran) == [0, 1, 2]  # each once, in any order (keys of their own)
    assert acks == [0, 1, 2]
    stalls = [record for record in caplog.records if "not known fresh" in record.getMessage()]
    ends = [record for record in caplog.records if "fresh group membership ended" in record.getMessage()]
    assert len(stalls) == 1, "one stall, logged once however many records wait"
    assert len(ends) == 1 and "2 started" in ends[0].getMessage()


async def test_records_waiting_when_the_eviction_revokes_them_never_start(lease: SessionLease, clock: Clock) -> None:
    """The heartbeat after the wake is answered UnknownMemberId: no renewal, and the revocation drops the queue."""
    dispatcher, app, acks, ran = dispatcher_with(lease)
    clock.now += SESSION_S + 30
    offer(dispatcher, range(3), acks, ran)
    await turns()
    app.consumer.evicted = True
    dispatcher.revoke()
    await asyncio.wait_for(dispatcher.wait_idle(), 1)  # Faust's revocation waits for the waiting works: they end
    assert ran == []
    assert acks == []
    assert sorted(app.consumer.abandoned) == [0, 1, 2]


async def test_a_revocation_that_drains_ends_the_waits_at_once(lease: SessionLease, clock: Clock) -> None:
    """A rebalance (not an eviction) drains the queue for up to ``REBOUND_REVOKE_DRAIN``: a record whose lease is
    stale must not hold that drain (nor the group, which waits for it) until the next heartbeat."""
    app = FakeApp()
    app.consumer.session_lease = lease  # type: ignore[attr-defined]
    dispatcher = Dispatcher(app, limit=2, partition_buffer=100, revoke_drain_s=30.0)
    acks: list[int] = []
    ran: list[int] = []
    clock.now += SESSION_S + 1
    offer(dispatcher, range(4), acks, ran)
    await turns()
    dispatcher.revoke()
    await asyncio.wait_for(dispatcher.wait_idle(), 1)
    assert ran == []
    assert acks == []


async def test_a_loop_stall_while_the_heartbeats_kept_the_membership_runs_on(lease: SessionLease, clock: Clock) -> None:
    """The prototype's flaw: the worker's loop stood still past the session timeout while the consumer thread kept
    heartbeating; the group never evicted it, so nothing may wait (until the next rebalance or at all)."""
    dispatcher, _, acks, ran = dispatcher_with(lease)
    clock.now += SESSION_S + 30
    lease.renewed(clock.now - 1.0)  # the consumer thread's heartbeat, a second ago
    offer(dispatcher, range(2), acks, ran)
    await dispatcher.wait_idle()
    assert ran == [0, 1]


async def test_a_stopping_consumer_ends_the_wait_without_running(
    lease: SessionLease, clock: Clock, stopping: Stopping
) -> None:
    """No heartbeat comes once the consumer stops: the wait must not hold the shutdown (nor acknowledge anything)."""
    dispatcher, _, acks, ran = dispatcher_with(lease)
    clock.now += SESSION_S + 1
    offer(dispatcher, range(2), acks, ran)
    await turns()
    stopping.stopping = True
    await asyncio.wait_for(dispatcher.wait_idle(), 1)
    assert ran == []
    assert acks == []


async def test_the_wait_is_bounded_then_the_record_starts_and_says_why(
    lease: SessionLease, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A coordinator that never answers must not stall the partition for good: after ``max_wait_s`` (a session
    timeout) the record starts, as it would have without the lease."""
    dispatcher, _, acks, ran = dispatcher_with(lease)
    clock.now += SESSION_S + 1
    offer(dispatcher, range(1), acks, ran)
    await turns()
    clock.now += lease.max_wait_s - 0.01
    await turns()
    assert ran == []
    clock.now += 0.02
    await asyncio.wait_for(dispatcher.wait_idle(), 1)
    assert ran == [0]
    assert acks == [0]
    ended = [record for record in caplog.records if "fresh group membership ended" in record.getMessage()]
    assert [record.levelno for record in ended] == [logging.WARNING]
    assert "no heartbeat answered" in ended[0].getMessage()


async def test_after_a_stall_outlasts_the_longest_wait_records_start_at_once_until_a_renewal(
    lease: SessionLease, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A coordinator away for long must not make each record wait its own ``max_wait_s`` (a partition crawling at a
    few records per session timeout); the next stall, after a renewal, waits and is logged again."""
    dispatcher, _, acks, ran = dispatcher_with(lease)
    clock.now += SESSION_S + 1
    offer(dispatcher, range(1), acks, ran)
    await turns()
    clock.now += lease.max_wait_s
    await asyncio.wait_for(dispatcher.wait_idle(), 1)
    offer(dispatcher, range(1, 4), acks, ran)
    await asyncio.wait_for(dispatcher.wait_idle(), 1)  # no wait, no clock moved
    assert ran == [0, 1, 2, 3]
    lease.renewed(clock.now)
    clock.now += SESSION_S + 1
    offer(dispatcher, range(4, 5), acks, ran)
    await turns()
    assert ran == [0, 1, 2, 3]  # a new stall waits again
    lease.renewed(clock.now)
    await asyncio.wait_for(dispatcher.wait_idle(), 1)
    assert ran == [0, 1, 2, 3, 4]
    begun = [record for record in caplog.records if "not known fresh" in record.getMessage()]
    assert len(begun) == 2


# -- every handler call checks the lease, not only a record's start: a work may wait after it started (its write's
# confirmation, its backoff, the open breaker) and the worker be stopped past its session timeout meanwhile


def handler_runtime(dispatcher: Dispatcher, called: list[int]) -> Any:
    """What ``call_handler`` reads of the runtime: a handler that records the offsets it was called for."""

    async def handler(event: RetryEvent) -> None:
        called.append(event.offset)

    metrics = SimpleNamespace(handler_called=lambda *args: None)
    settings = SimpleNamespace(handler_timeout_s=5.0, handler_timeout="5s")
    return SimpleNamespace(handler=handler, settings=settings, metrics=metrics, dispatcher=dispatcher)


def retry_event(offset: int) -> RetryEvent:
    return RetryEvent(
        key=b"k", value=b"v", headers={}, topic="items", partition=0, offset=offset, attempt=0, timestamp_ms=0,
        first_received_at_ms=0, tier=None,
    )  # fmt: skip


async def test_a_work_that_waited_past_the_session_timeout_calls_the_handler_only_once_the_lease_is_renewed(
    lease: SessionLease, clock: Clock
) -> None:
    """The record started on a fresh lease, then waited (a write's confirmation, a lock) while the worker was stopped
    past its session timeout: its handler call waits for the heartbeat's word like a record's start."""
    dispatcher, _, acks, _ = dispatcher_with(lease)
    called: list[int] = []
    runtime = handler_runtime(dispatcher, called)
    confirmed = asyncio.Event()

    async def run(event: FakeEvent) -> None:
        await confirmed.wait()
        await call_handler(runtime, retry_event(event.message.offset))

    dispatcher.offer(FakeEvent(FakeMessage(TP0, 0), acks), lane="k", run=run)
    await turns()
    assert dispatcher.in_flight == 1  # started on a fresh lease
    clock.now += SESSION_S + 30  # stopped while it waited
    confirmed.set()
    await turns()
    assert called == []
    assert dispatcher.handler_in_flight == 0  # waiting for the lease is not a call in flight
    lease.renewed(clock.now - 0.002)  # still a member: the call goes ahead
    await asyncio.wait_for(dispatcher.wait_idle(), 1)
    assert called == [0]
    assert acks == [0]


async def test_a_work_that_waited_past_the_session_timeout_and_was_evicted_never_calls_the_handler(
    lease: SessionLease, clock: Clock
) -> None:
    dispatcher, app, acks, _ = dispatcher_with(lease)
    called: list[int] = []
    runtime = handler_runtime(dispatcher, called)
    confirmed = asyncio.Event()

    async def run(event: FakeEvent) -> None:
        await confirmed.wait()
        await call_handler(runtime, retry_event(event.message.offset))

    dispatcher.offer(FakeEvent(FakeMessage(TP0, 0), acks), lane="k", run=run)
    await turns()
    clock.now += SESSION_S + 30
    confirmed.set()
    await turns()
    app.consumer.evicted = True  # the heartbeat after the wake: UnknownMemberId, and the revocation
    dispatcher.revoke()
    await asyncio.wait_for(dispatcher.wait_idle(), 1)
    assert called == []
    assert acks == []  # left unacknowledged to the partition's new owner


async def test_a_work_run_again_after_its_backoff_checks_the_lease_before_the_handler(
    lease: SessionLease, clock: Clock
) -> None:
    """The dispatcher runs a work whose failure routing failed again after a backoff: stopped during that backoff
    past its session timeout, the worker must not call the handler again before the group's word."""
    dispatcher, app, acks, _ = dispatcher_with(lease)
    called: list[int] = []
    runtime = handler_runtime(dispatcher, called)
    runs = 0

    async def run(event: FakeEvent) -> None:
        nonlocal runs
        runs += 1
        await call_handler(runtime, retry_event(event.message.offset))
        if runs == 1:
            # Stopped during the backoff that follows: moved here, not after some turns of the test's, which a loaded
            # loop can spread over more than the backoff (the run again then called the handler on a fresh lease).
            clock.now += SESSION_S + 30
            raise RuntimeError("the failed topic refused the record")

    dispatcher.offer(FakeEvent(FakeMessage(TP0, 0), acks), lane="k", run=run)
    async with asyncio.timeout(RETRY_BACKOFF_S[0] + 1):
        while runs < 2:  # run again after its backoff
            await asyncio.sleep(0.001)
    await turns()
    assert called == [0]
    app.consumer.evicted = True
    dispatcher.revoke()
    await asyncio.wait_for(dispatcher.wait_idle(), 1)
    assert called == [0]
    assert acks == []


BREAKER = {
    "breaker_enabled": True,
    "breaker_window": "10s",
    "breaker_min_calls": 2,
    "breaker_failure_ratio": 0.5,
    "breaker_probe_interval": "1s",
    "breaker_probe_max_interval": "4s",
}


class Recorder:
    """The attempts topic: records what is sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def get_topic_name(self) -> str:
        return "rebound.attempts"

    async def send(self, *, key: Any = None, value: Any = None, headers: Any = None, partition: Any = None) -> Any:
        self.sent.append(value)
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


async def test_a_call_waiting_at_the_open_breaker_does_not_probe_once_the_lease_lapsed(
    tmp_path: Path, lease: SessionLease, clock: Clock
) -> None:
    """A call waits at the open breaker (``run_attempt``) for its probe time; the worker is stopped past its session
    timeout meanwhile. Let through as the probe, it must wait for the lease, and the eviction's revocation ends it
    without a handler call, the probe abandoned (the next call probes)."""
    runtime = build_runtime(tmp_path, **BREAKER)
    dispatcher, app, acks, _ = dispatcher_with(lease)
    called: list[int] = []
    now_ms = [10_000_000]
    runtime.dispatcher = dispatcher
    runtime.handler = handler_runtime(dispatcher, called).handler
    runtime.clock = lambda: now_ms[0]
    runtime.attempts_topic = Recorder()
    gate = runtime.breaker_gate
    assert gate is not None
    for _ in range(2):
        gate.record(Classification.RETRYABLE, probe=False)
    assert gate.breaker.state is BreakerState.OPEN

    async def run(event: FakeEvent) -> None:
        offset = event.message.offset
        provenance = Provenance("items", 0, offset, now_ms[0], now_ms[0])
        await run_attempt(runtime, key=b"k", value=b"v", headers=[], provenance=provenance, attempt=0, tier=None)

    dispatcher.offer(FakeEvent(FakeMessage(TP0, 0), acks), lane="k", run=run)
    await turns()
    assert gate.waiting == 1 and called == []
    clock.now += SESSION_S + 30  # stopped while it waited at the gate...
    now_ms[0] += 1000  # ...past its probe time
    gate.tick()
    await turns()
    assert gate.waiting == 0  # let through as the probe
    assert called == []
    assert gate.breaker.snapshot(now_ms[0])["probe_in_flight"]
    app.consumer.evicted = True
    dispatcher.revoke()
    await asyncio.wait_for(dispatcher.wait_idle(), 1)
    assert called == []
    assert acks == []
    assert not gate.breaker.snapshot(now_ms[0])["probe_in_flight"]  # abandoned: the next call probes at once


def test_the_dispatcher_looks_the_lease_up_once(lease: SessionLease) -> None:
    dispatcher, app, _, _ = dispatcher_with(lease)
    assert dispatcher.session_lease is lease
    app.consumer.session_lease = None  # type: ignore[attr-defined]
    assert dispatcher.session_lease is lease


def test_the_lease_runs_a_session_timeout_from_the_later_renewal(lease: SessionLease, clock: Clock) -> None:
    start = clock.now
    clock.now += SESSION_S - 0.001
    assert lease.fresh()
    clock.now += 0.001
    assert not lease.fresh()
    lease.renewed(start + 3)
    lease.renewed(start + 1)  # an older stamp read later never shortens it
    assert lease.until == start + 3 + SESSION_S


def test_a_lease_never_renewed_is_off() -> None:
    """A consumer thread that could not watch the heartbeats leaves the worker as it was before the lease."""
    assert SessionLease(SESSION_S).fresh()


# -- the consumer thread's heartbeat hook, on the real consumer


class Coordinator:
    """aiokafka's coordinator as the hook sees it: ``_do_heartbeat`` answers True while still a member; every group
    request (JoinGroup, SyncGroup, ...) goes through ``_send_req``."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.answers: list[bool] = []
        self.round_trip_s = 0.0

    async def _do_heartbeat(self) -> bool:
        self.clock.now += self.round_trip_s  # a stop between sending it and reading the answer: a long round trip
        return self.answers.pop(0)

    async def _send_req(self, request: object) -> object:
        self.clock.now += self.round_trip_s
        return SimpleNamespace(error_code=0)


def watched(runtime: Runtime, clock: Clock) -> tuple[ReboundConsumer, Coordinator]:
    consumer = runtime.app.consumer
    assert isinstance(consumer, ReboundConsumer)
    consumer.session_lease.clock = clock
    coordinator = Coordinator(clock)
    consumer._thread._consumer = SimpleNamespace(_coordinator=coordinator)
    consumer._thread.watch_heartbeats()
    return consumer, coordinator


async def test_the_lease_is_the_app_s_session_timeout_and_off_until_the_heartbeats_are_watched(
    runtime: Runtime,
) -> None:
    consumer = runtime.app.consumer
    assert isinstance(consumer, ReboundConsumer)
    assert consumer.session_lease.session_timeout_s == float(runtime.app.conf.broker_session_timeout)
    assert consumer.session_lease.fresh()


async def test_a_successful_heartbeat_renews_the_lease_from_when_it_was_sent(runtime: Runtime, clock: Clock) -> None:
    consumer, coordinator = watched(runtime, clock)
    lease = consumer.session_lease
    session = lease.session_timeout_s
    coordinator.answers = [True]
    coordinator.round_trip_s = 2.0
    sent_at = clock.now
    do_heartbeat: Any = coordinator._do_heartbeat
    assert await do_heartbeat() is True
    assert lease.until == sent_at + session  # not from the answer: the group counted from the send at the latest


async def test_a_failed_heartbeat_does_not_renew_the_lease(runtime: Runtime, clock: Clock) -> None:
    consumer, coordinator = watched(runtime, clock)
    lease = consumer.session_lease
    until = lease.until
    clock.now += 100.0  # woken after a long stop
    coordinator.answers = [False]  # UnknownMemberId: aiokafka resets the generation and answers False
    do_heartbeat: Any = coordinator._do_heartbeat
    assert await do_heartbeat() is False
    assert lease.until == until
    assert not lease.fresh()


async def test_a_join_renews_the_lease(runtime: Runtime, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also a join with no partitions (aiokafka calls the listener for every generation): the heartbeats stopped
    during the join, and the lease would be stale until the first one after it."""
    consumer, coordinator = watched(runtime, clock)
    thread = consumer._thread
    clock.now += 100.0
    assert not consumer.session_lease.fresh()

    async def faust_s(self: Any, assigned: Any, generation_id: int = 0) -> None:
        return None

    monkeypatch.setattr(type(thread).__mro__[1], "on_partitions_assigned", faust_s)
    sent_at = clock.now
    coordinator.round_trip_s = 0.01
    send_req: Any = coordinator._send_req
    await send_req(SyncGroupRequest("g", 7, "m", None, []))
    await thread.on_partitions_assigned(set(), 7)
    assert consumer.session_lease.until == sent_at + consumer.session_lease.session_timeout_s
    assert consumer.session_lease.fresh()


async def test_a_join_renews_the_lease_from_when_its_sync_group_was_sent(
    runtime: Runtime, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group restarts the member's session when its SyncGroup arrives, no later. A worker stopped while its
    SyncGroup was on its way (a stop during a rebalance) and woken past its session timeout reads an assignment the
    group may have taken back since: it must not start that assignment's records on a lease stamped at the wake."""
    consumer, coordinator = watched(runtime, clock)
    thread = consumer._thread
    lease = consumer.session_lease

    async def faust_s(self: Any, assigned: Any, generation_id: int = 0) -> None:
        return None

    monkeypatch.setattr(type(thread).__mro__[1], "on_partitions_assigned", faust_s)
    send_req: Any = coordinator._send_req
    await send_req(JoinGroupRequest("g", 6000, 4000, "", None, "consumer", []))
    sent_at = clock.now
    coordinator.round_trip_s = lease.session_timeout_s + 30.0  # stopped until well past the session timeout
    await send_req(SyncGroupRequest("g", 7, "m", None, []))
    await thread.on_partitions_assigned(set(), 7)
    assert lease.until == sent_at + lease.session_timeout_s
    assert not lease.fresh()


def test_aiokafka_s_group_rebalance_sends_its_requests_through_the_coordinator_s_send_req() -> None:
    """The hook replaces ``_send_req`` on the coordinator: a join's SyncGroup must be sent through it."""
    source = inspect.getsource(CoordinatorGroupRebalance._send_sync_group_request)
    assert "await self._coordinator._send_req(request)" in source


def test_aiokafka_s_heartbeat_task_looks_the_heartbeat_up_on_the_coordinator_each_beat() -> None:
    """The hook replaces ``_do_heartbeat`` on the coordinator after it exists: the task must read it per beat."""
    assert "await self._do_heartbeat()" in inspect.getsource(GroupCoordinator._heartbeat_routine)


@pytest.mark.parametrize("renewed", [True, False], ids=["renewed", "evicted"])
async def test_a_worker_stopped_between_the_lease_check_and_the_handlers_first_step_does_not_call_it_on_waking(
    lease: SessionLease, clock: Clock, renewed: bool
) -> None:
    """``call_handler`` checks the lease, then makes the handler's task, whose first step comes a loop pass later:
    a worker stopped past its session timeout in that gap (a CI run of test_evicted_worker_wakes saw it: a call 0 ms
    after the wake) must not call the handler when it wakes. The task checks the lease again right before the call,
    and the call waits for the group's word like any other: renewed, it is made once; evicted, never."""
    dispatcher, app, acks, _ = dispatcher_with(lease)
    called: list[int] = []
    runtime = handler_runtime(dispatcher, called)
    call_started = dispatcher.call_started

    def stopped_right_after_the_check() -> Any:
        clock.now += SESSION_S + 30  # the SIGSTOP lands after the check, before the handler's task steps
        return call_started()

    dispatcher.call_started = stopped_right_after_the_check  # type: ignore[method-assign]

    async def run(event: FakeEvent) -> None:
        await call_handler(runtime, retry_event(event.message.offset))

    dispatcher.offer(FakeEvent(FakeMessage(TP0, 0), acks), lane="k", run=run)
    await turns()
    assert called == []
    assert dispatcher.handler_in_flight == 0  # the call not made is not in flight
    dispatcher.call_started = call_started  # type: ignore[method-assign]
    if renewed:
        lease.renewed(clock.now - 0.002)  # the heartbeat after the wake: still a member
        await asyncio.wait_for(dispatcher.wait_idle(), 1)
        assert called == [0] and acks == [0]
    else:
        app.consumer.evicted = True  # UnknownMemberId, and the revocation
        dispatcher.revoke()
        await asyncio.wait_for(dispatcher.wait_idle(), 1)
        assert called == [] and acks == []


async def test_handler_calls_go_ahead_once_a_stall_outlasts_the_longest_wait(lease: SessionLease, clock: Clock) -> None:
    """The gate gave up on a stall (the coordinator away past ``max_wait_s``): the handler's task must not ask the
    stale lease again and send the call back to the gate, over and over; the calls are made, as without the lease."""
    dispatcher, _, acks, _ = dispatcher_with(lease)
    called: list[int] = []
    runtime = handler_runtime(dispatcher, called)

    async def run(event: FakeEvent) -> None:
        await call_handler(runtime, retry_event(event.message.offset))

    clock.now += SESSION_S + 1
    dispatcher.offer(FakeEvent(FakeMessage(TP0, 0), acks), lane="k", run=run)
    await turns()
    assert called == []
    clock.now += lease.max_wait_s
    await asyncio.wait_for(dispatcher.wait_idle(), 1)
    dispatcher.offer(FakeEvent(FakeMessage(TP0, 1), acks), lane="k", run=run)  # the stall given up on: at once
    await asyncio.wait_for(dispatcher.wait_idle(), 1)
    assert called == [0, 1] and acks == [0, 1]
    assert dispatcher.handler_in_flight == 0


async def test_a_call_renewed_at_the_gate_is_checked_again_in_its_task(lease: SessionLease, clock: Clock) -> None:
    """A work that awaited (a backoff) past its session timeout waits at ``call_handler``'s gate; renewed, the
    handler's task is made, and a stop before its first step must still not call the handler on waking."""
    dispatcher, _, acks, _ = dispatcher_with(lease)
    called: list[int] = []
    runtime = handler_runtime(dispatcher, called)
    call_started = dispatcher.call_started
    go = asyncio.get_running_loop().create_future()

    async def run(event: FakeEvent) -> None:
        await go  # a backoff between attempts inside the work
        await call_handler(runtime, retry_event(event.message.offset))

    dispatcher.offer(FakeEvent(FakeMessage(TP0, 0), acks), lane="k", run=run)
    await turns()
    clock.now += SESSION_S + 1  # stale: the call waits at call_handler's gate
    go.set_result(None)
    await turns()

    def stopped_right_after_the_gate() -> Any:
        clock.now += SESSION_S + 30
        return call_started()

    dispatcher.call_started = stopped_right_after_the_gate  # type: ignore[method-assign]
    lease.renewed(clock.now - 0.002)  # renewed: the gate lets the call go; the stop lands before its first step
    await turns()
    dispatcher.call_started = call_started  # type: ignore[method-assign]
    assert called == []
    lease.renewed(clock.now - 0.002)
    await asyncio.wait_for(dispatcher.wait_idle(), 1)
    assert called == [0] and acks == [0]
