"""The circuit breaker on a worker (``agents/breaker.py``): the gate, the held topics, the held releases, the probe."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from agents import release as release_module
from rebound.breaker import BreakerState
from rebound.routing import Classification
from rebound.schedule import Slot

BREAKER = {
    "breaker_enabled": True,
    "breaker_window": "10s",
    "breaker_min_calls": 2,
    "breaker_failure_ratio": 0.5,
    "breaker_probe_interval": "1s",
    "breaker_probe_max_interval": "4s",
}


@pytest.fixture
def runtime(make_runtime: Any) -> Any:
    return make_runtime(**BREAKER)


def open_breaker(runtime: Any) -> None:
    gate = runtime.breaker_gate
    for _ in range(2):
        gate.record(Classification.RETRYABLE, probe=False)
    assert gate.breaker.state is BreakerState.OPEN


async def started(coro: Any) -> asyncio.Task[Any]:
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0.01)
    return task


async def test_opening_holds_the_main_topics_and_closing_fetches_them_again(runtime: Any) -> None:
    consumer = runtime.app.consumer
    open_breaker(runtime)
    assert consumer.held_topics == frozenset({"items"})
    assert runtime.counters["breaker.open"] == 1
    runtime.breaker_gate.breaker.admit(runtime.clock() + 1000)  # the probe...
    runtime.breaker_gate.record(None, probe=True)  # ...succeeds
    assert runtime.breaker_gate.breaker.state is BreakerState.CLOSED
    assert consumer.held_topics == frozenset()


async def test_every_transition_is_logged_open_to_half_open_too(
    runtime: Any, clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """design.md says each transition is logged: closed -> open, half-open -> open and half-open -> closed were,
    open -> half-open (each probe) never was."""
    caplog.set_level(logging.INFO, logger="agents.breaker")
    gate = runtime.breaker_gate
    open_breaker(runtime)
    for outcome in (Classification.RETRYABLE, None):  # the first probe fails, the second closes it
        clock.advance(4000)
        probe = await started(gate.enter())
        assert probe.result() is True
        gate.record(outcome, probe=True)
    moves = [
        (record.levelname, record.getMessage())
        for record in caplog.records
        if record.name == "agents.breaker" and " -> " in record.getMessage()
    ]
    assert [(level, message.split(":")[0]) for level, message in moves] == [
        ("WARNING", "circuit breaker closed -> open"),
        ("INFO", "circuit breaker open -> half-open"),
        ("WARNING", "circuit breaker half-open -> open"),
        ("INFO", "circuit breaker open -> half-open"),
        ("WARNING", "circuit breaker half-open -> closed"),
    ]
    assert moves[1][1] == "circuit breaker open -> half-open: probe due after 1s open; probe call let through"
    assert moves[3][1] == "circuit breaker open -> half-open: probe due after 2s open; probe call let through"


async def test_permanent_failures_say_nothing_about_the_dependency(runtime: Any) -> None:
    gate = runtime.breaker_gate
    for _ in range(5):
        gate.record(Classification.PERMANENT, probe=False)
        gate.record(Classification.UNDECODABLE, probe=False)
    assert gate.breaker.state is BreakerState.CLOSED


async def test_calls_wait_at_the_gate_one_probes_and_a_success_lets_all_through(runtime: Any, clock: Any) -> None:
    gate = runtime.breaker_gate
    open_breaker(runtime)
    first = await started(gate.enter())
    second = await started(gate.enter())
    assert not first.done() and not second.done()
    assert gate.waiting == 2
    clock.advance(1000)
    gate.tick()  # the release timer's tick at the probe time wakes them: one becomes the probe
    await asyncio.sleep(0.01)
    assert [task.done() for task in (first, second)].count(True) == 1
    probe = first if first.done() else second
    other = second if probe is first else first
    assert probe.result() is True
    gate.record(None, probe=True)
    await asyncio.sleep(0.01)
    assert other.done() and other.result() is False
    assert gate.waiting == 0


async def test_a_failed_probe_keeps_it_open_and_the_next_probe_comes_later(runtime: Any, clock: Any) -> None:
    gate = runtime.breaker_gate
    open_breaker(runtime)
    clock.advance(1000)
    assert await gate.enter() is True
    gate.record(Classification.RETRYABLE, probe=True)
    assert gate.breaker.state is BreakerState.OPEN
    waiter = await started(gate.enter())
    clock.advance(1000)
    gate.tick()
    await asyncio.sleep(0.01)
    assert not waiter.done()  # the interval doubled: 2 s now
    clock.advance(1000)
    gate.tick()
    await asyncio.sleep(0.01)
    assert waiter.done() and waiter.result() is True
    gate.abandoned()  # cancelled by a rebalance: the next call probes at once
    assert await gate.enter() is True


async def test_calls_waiting_at_the_gate_run_one_per_probe_time_and_never_otherwise(runtime: Any, clock: Any) -> None:
    """Records fetched while it is open (a fetch under way at the opening, a batch fetched for a probe) wait at the
    gate: each probe time lets exactly one of them through, so several can run before it closes, one per probe."""
    gate = runtime.breaker_gate
    open_breaker(runtime)
    waiters = [await started(gate.enter()) for _ in range(3)]
    ran: list[asyncio.Task[Any]] = []
    for interval in (1000, 2000, 4000):  # the probe interval doubles after each failed probe, up to 4 s
        clock.advance(interval - 1)
        gate.tick()
        await asyncio.sleep(0.01)
        assert {task for task in waiters if task.done()} == set(ran)  # nothing before the probe time
        clock.advance(1)
        gate.tick()
        await asyncio.sleep(0.01)
        probes = [task for task in waiters if task.done() and task not in ran]
        assert len(probes) == 1 and probes[0].result() is True
        ran += probes
        gate.record(Classification.RETRYABLE, probe=True)  # the dependency is still down
        await asyncio.sleep(0.01)
        assert {task for task in waiters if task.done()} == set(ran)
    assert gate.waiting == 0 and gate.breaker.state is BreakerState.OPEN


async def test_a_call_on_its_last_attempt_never_probes(runtime: Any, clock: Any) -> None:
    gate = runtime.breaker_gate
    open_breaker(runtime)
    last = await started(gate.enter(can_probe=False))
    clock.advance(1000)
    gate.tick()
    await asyncio.sleep(0.01)
    assert not last.done()
    assert gate.could_probe == 0
    # Nothing to be the probe, nothing due among the releases: the main topics are fetched for one.
    assert runtime.app.consumer.held_topics == frozenset()
    assert gate.main_fetched_for_probe
    assert await gate.enter() is True  # a main-topic record arrives: it is the probe, the topics are held again
    assert runtime.app.consumer.held_topics == frozenset({"items"})
    gate.record(None, probe=True)
    await asyncio.sleep(0.01)
    assert last.done() and last.result() is False


async def test_releases_wait_while_open_and_one_that_can_afford_it_is_sent_as_the_probe(
    runtime: Any, clock: Any
) -> None:
    now = clock.now_ms
    last_attempt = runtime.policy.max_retries
    runtime.schedule.adopt(
        0,
        [
            Slot(now - 500, b"a", "items/0/1", last_attempt, "2s"),  # earliest due, but its failure would end it
            Slot(now - 100, b"b", "items/0/2", 1, "1s"),
            Slot(now + 60_000, b"c", "items/0/3", 1, "1s"),
        ],
    )
    open_breaker(runtime)
    assert await release_module.release_due(runtime) == 0  # open, no probe yet: nothing is sent
    clock.advance(1000)
    assert await release_module.release_due(runtime) == 1
    [request] = runtime.release_topic.sent
    assert request.key == b"b"
    assert await release_module.release_due(runtime) == 0  # one probe at a time
    runtime.breaker_gate.breaker.admit(clock.now_ms)
    runtime.breaker_gate.record(None, probe=True)  # closed: what is due goes, and the held wait moved due times
    sent = await release_module.release_due(runtime)
    assert sent == 1 and runtime.release_topic.sent[-1].key == b"a"
    later = {slot.table_key: slot.due_at_ms for _, slot in runtime.schedule.slots() if slot.table_key == b"c"}
    assert later == {b"c": now + 60_000 + 1000}  # its wait stopped for the second the breaker was open


def test_postponing_moves_due_times_by_the_time_held_and_never_earlier() -> None:
    from rebound.schedule import ReleaseSchedule

    schedule = ReleaseSchedule()
    schedule.adopt(
        0,
        [
            Slot(500, b"before", "t/0/1", 1),  # due before it opened: overdue already, stays
            Slot(1_500, b"during", "t/0/2", 1),  # due while open: moves by the 500 ms it waited while open
            Slot(5_000, b"after", "t/0/3", 1),  # due after: moves by the whole 2 s
            Slot(1_500, b"held", "t/0/4", -1),  # a held-message request: not a due time, stays
        ],
    )
    assert schedule.postpone_held(opened_at_ms=1_000, closed_at_ms=3_000) == 2
    due = {slot.table_key: slot.due_at_ms for _, slot in schedule.slots()}
    assert due == {b"before": 500, b"during": 2_000, b"after": 7_000, b"held": 1_500}


def test_breaker_settings_are_validated_at_start_up() -> None:
    from rebound.errors import ConfigurationError
    from rebound.settings import load_settings

    with pytest.raises(ConfigurationError, match="BREAKER_PROBE_MAX_INTERVAL"):
        load_settings(breaker_enabled=True, breaker_probe_interval="10s", breaker_probe_max_interval="5s")
    with pytest.raises(ConfigurationError, match="BREAKER_FAILURE_RATIO"):
        load_settings(breaker_enabled=True, breaker_failure_ratio=1.5)
    load_settings(breaker_probe_interval="10s", breaker_probe_max_interval="5s")  # off: not checked


async def test_a_call_waiting_at_the_gate_leaves_when_the_flow_stops(runtime: Any) -> None:
    """A revocation waits for every record taken: calls waiting for an outage to end must not hold it up."""
    from agents.breaker import LeftTheGate

    open_breaker(runtime)
    waiter = await started(runtime.breaker_gate.enter())
    consumer = runtime.app.consumer
    consumer.flow_active = False
    runtime.breaker_gate.flow_stopped()
    await asyncio.sleep(0.01)
    assert waiter.done()
    with pytest.raises(LeftTheGate):
        waiter.result()
    with pytest.raises(LeftTheGate):  # and one that arrives while the flow is stopped does not wait at all
        await runtime.breaker_gate.enter()
    assert isinstance(LeftTheGate(), asyncio.CancelledError)  # cut short like a cancelled call: not acknowledged


async def test_an_ignored_probe_lets_the_next_call_probe_at_once(runtime: Any, clock: Any) -> None:
    gate = runtime.breaker_gate
    open_breaker(runtime)
    clock.advance(1000)
    assert await gate.enter() is True
    waiter = await started(gate.enter())
    gate.record(Classification.PERMANENT, probe=True)  # bad data: says nothing about the dependency
    await asyncio.sleep(0.01)
    assert waiter.done() and waiter.result() is True


async def test_a_release_on_its_last_attempt_stays_parked_while_the_breaker_is_open(
    make_runtime: Any, clock: Any
) -> None:
    """It must not wait at the gate: calls that can never be the probe could fill every slot, and then nothing
    would ever probe."""
    import json

    runtime = make_runtime(**BREAKER)
    runtime.schedule.adopt(0, [])
    last = runtime.policy.max_retries
    from tests.agents.support import tier_headers

    async with (
        runtime.agents["items.retry.2s"].test_context() as tier,
        runtime.agents["release"].test_context() as releaser,
    ):
        await tier.put(b'{"succeed_on": 9}', key=b"k", headers=tier_headers(clock, attempt=last), partition=0)
        clock.advance(2000)
        assert len(runtime.schedule.pop_due(clock.now_ms)) == 1  # the timer sent its request before it opened
        open_breaker(runtime)
        request = json.dumps({"origin": "items/0/7", "attempt": last}).encode()
        await releaser.put(request, key=b"k", partition=0)
    assert runtime.counters["breaker.deferred"] == 1
    assert runtime.store.load(b"k", entries=True, with_payloads=True).pending  # still parked
    assert [slot.attempt for _, slot in runtime.schedule.slots()] == [last]
    assert not runtime.failed_topics["items"].sent


async def test_the_release_timer_ticks_at_its_interval_while_open_however_much_is_due(runtime: Any, clock: Any) -> None:
    runtime.schedule.adopt(0, [Slot(clock.now_ms - 1000, b"a", "items/0/1", 1, "1s")])
    assert release_module.seconds_until_next_tick(runtime) == 0  # closed: due now
    open_breaker(runtime)
    assert release_module.seconds_until_next_tick(runtime) == runtime.settings.timer_interval


async def test_a_release_whose_total_duration_is_spent_is_never_chosen_as_the_probe(
    make_runtime: Any, clock: Any
) -> None:
    """It would be deferred (its failure would expire it) and chosen again at every probe time: nothing would probe."""
    runtime = make_runtime(**BREAKER, max_retry_duration="10s")
    from tests.agents.support import tier_headers

    runtime.schedule.adopt(0, [])
    async with runtime.agents["items.retry.1s"].test_context() as tier:
        await tier.put(b"{}", key=b"k", headers=tier_headers(clock, attempt=1), partition=0)
    clock.advance(20_000)  # its first receipt is 20 s old, all before the breaker opened: a failure would expire it
    open_breaker(runtime)
    clock.advance(1000)  # the probe time
    assert await release_module.release_due(runtime) == 0
    assert runtime.breaker_gate.main_fetched_for_probe  # the main topics are fetched for a probe instead
