"""The operator's pause against the other reasons a main-topic partition is not fetched.

Rebound's consumer (``app/consumer.py``) holds topics per reason: ``pause`` (an operator, ``agents/control.py``) and
``breaker`` (the circuit breaker, ``agents/breaker.py``); the dispatcher pauses single partitions for back-pressure.
A partition is fetched only when no reason holds it: ending one never ends another.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from faust.types import TP

from agents.control import PAUSE_REASON, control_board, main_paused, pause_view
from agents.runtime import Runtime
from app.consumer import ReboundConsumer
from rebound.breaker import BreakerState
from rebound.pause import PauseState
from rebound.routing import Classification
from tests.app_under_test import build_runtime

ITEMS_0, ITEMS_1, ITEMS_2, OTHER = TP("items", 0), TP("items", 1), TP("items", 2), TP("other", 0)
PAUSED = PauseState(paused=True, by="alice", source="10.0.0.5", at_ms=1_000, action_id="p1")
RESUMED = PauseState(paused=False, by="bob", source="10.0.0.6", at_ms=2_000, action_id="r1")


@pytest.fixture
async def runtime(tmp_path: Path) -> Runtime:
    return build_runtime(
        tmp_path,
        web_enabled=False,
        breaker_enabled=True,
        breaker_window="10s",
        breaker_min_calls=2,
        breaker_failure_ratio=0.5,
        breaker_probe_interval="1s",
    )


@pytest.fixture
async def consumer(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> ReboundConsumer:
    """Assigned two main-topic partitions and another topic's, the flow running after the recovery's seek."""
    consumer = runtime.app.consumer
    assert isinstance(consumer, ReboundConsumer)
    assigned = {ITEMS_0, ITEMS_1, OTHER}
    monkeypatch.setattr(consumer, "assignment", lambda: assigned)
    monkeypatch.setattr(consumer, "positions_checked_at", float("inf"))  # no position check (no consumer thread)
    consumer._get_active_partitions().update(assigned)
    consumer._sought_this_generation = True
    return consumer


def active(consumer: ReboundConsumer) -> set[TP]:
    return set(consumer._get_active_partitions())


def open_breaker(runtime: Runtime) -> None:
    gate = runtime.breaker_gate
    assert gate is not None
    for _ in range(2):
        gate.record(Classification.RETRYABLE, probe=False)
    assert gate.breaker.state is BreakerState.OPEN


def close_breaker(runtime: Runtime) -> None:
    gate = runtime.breaker_gate
    assert gate is not None
    gate.breaker.admit(runtime.clock() + 60_000)  # the probe...
    gate.record(None, probe=True)  # ...succeeds
    assert gate.breaker.state is BreakerState.CLOSED


async def test_resuming_never_undoes_the_breaker_s_hold_nor_the_breaker_closing_the_pause(
    runtime: Runtime, consumer: ReboundConsumer
) -> None:
    board = control_board(runtime)
    board.apply(PAUSED)
    await consumer._before_each_fetch()
    assert active(consumer) == {OTHER}
    assert consumer.effective_holds == {PAUSE_REASON} and board.applied_here()

    open_breaker(runtime)  # the breaker holds too
    board.apply(RESUMED)
    await consumer._before_each_fetch()
    assert active(consumer) == {OTHER}, "resuming ended the breaker's hold"
    assert consumer.holds == {"breaker": frozenset({"items"})}

    board.apply(PAUSED)
    close_breaker(runtime)
    await consumer._before_each_fetch()
    assert active(consumer) == {OTHER}, "the breaker closing ended the operator's pause"
    assert consumer.holds == {PAUSE_REASON: frozenset({"items"})}

    board.apply(RESUMED)
    assert active(consumer) == {ITEMS_0, ITEMS_1, OTHER}
    assert not main_paused(runtime)


async def test_back_pressure_keeps_its_partition_paused_through_a_resume_and_a_pause_keeps_it_through_its_drain(
    runtime: Runtime, consumer: ReboundConsumer
) -> None:
    consumer.pause_between_batches([ITEMS_1])  # the dispatcher: ITEMS_1 has too much unfinished work
    await consumer._before_each_fetch()
    runtime.dispatcher.core._paused.add(ITEMS_1)
    board = control_board(runtime)
    board.apply(PAUSED)
    await consumer._before_each_fetch()
    consumer.resume_after_pause([ITEMS_1])  # drained meanwhile: the pause still holds it
    assert active(consumer) == {OTHER}

    consumer.pause_between_batches([ITEMS_0])  # ITEMS_0 now has too much unfinished work, ITEMS_1 drained
    await consumer._before_each_fetch()
    runtime.dispatcher.core._paused.clear()
    runtime.dispatcher.core._paused.add(ITEMS_0)
    board.apply(RESUMED)
    assert active(consumer) == {ITEMS_1, OTHER}


async def test_a_partition_assigned_while_paused_stays_paused(runtime: Runtime, consumer: ReboundConsumer) -> None:
    board = control_board(runtime)
    board.apply(PAUSED)
    await consumer._before_each_fetch()
    # A rebalance, as Faust runs it: the flow stops and everything assigned is paused, then the recovery resumes every
    # stream partition (a new one among them), seeks, and resumes the flow.
    consumer.stop_flow()
    assigned = {ITEMS_0, ITEMS_2, OTHER}
    consumer.assignment = lambda: assigned  # type: ignore[method-assign]
    consumer._set_active_tps(assigned)
    consumer.pause_partitions(assigned)
    consumer.resume_partitions(assigned)
    consumer._sought_this_generation = True
    consumer.resume_flow()
    assert active(consumer) == {OTHER}
    await consumer._before_each_fetch()
    assert active(consumer) == {OTHER}
    consumer.on_buffer_drop(ITEMS_2)  # a stream queue that drained does not fetch it either
    assert active(consumer) == {OTHER}

    board.apply(RESUMED)
    assert active(consumer) == assigned


async def test_a_resume_during_a_rebalance_takes_effect_with_the_flow(
    runtime: Runtime, consumer: ReboundConsumer
) -> None:
    board = control_board(runtime)
    board.apply(PAUSED)
    await consumer._before_each_fetch()
    consumer.stop_flow()
    board.apply(RESUMED)  # the flow is stopped: nothing to resume yet
    assert active(consumer) == {OTHER}
    consumer._sought_this_generation = True  # the recovery's seek to the committed offsets
    consumer.resume_flow()
    assert active(consumer) == {ITEMS_0, ITEMS_1, OTHER}


async def test_a_worker_holds_its_main_topics_from_the_start_until_it_has_read_the_pause_state(
    runtime: Runtime,
) -> None:
    app: Any = runtime.app
    assert app.holds_at_start == {PAUSE_REASON: frozenset({"items"})}
    await app.on_start()  # what the worker does before its consumer starts
    assert app.consumer.held_topics == frozenset({"items"})
    board = control_board(runtime)
    assert pause_view(runtime)["known"] is False
    assert not main_paused(runtime)
    board.apply(RESUMED)  # read to the end: not paused
    assert app.consumer.held_topics == frozenset()
    view = pause_view(runtime)
    assert view["known"] is True and view["paused"] is False and view["by"] == "bob"
    board.apply(PAUSED)
    assert main_paused(runtime)
    assert pause_view(runtime) | {"applied_here": None} == {
        "paused": True,
        "by": "alice",
        "source": "10.0.0.5",
        "at": 1_000,
        "topics": ["items"],
        "known": True,
        "applied_here": None,
        "reader_failures": 0,
    }


async def test_ending_a_hold_restarts_the_stream_clocks_of_the_partitions_it_gives_back(
    runtime: Runtime, consumer: ReboundConsumer
) -> None:
    """Faust's livelock detector reports a lagging partition whose stream took no event for
    ``stream_processing_timeout``, timed from ``app.monitor.stream_inbound_time``; a held topic is left out of the check,
    but a resumed partition's stream takes its first record a moment after the hold ends. The time held is not time
    the stream stood still: ending a hold restarts the clocks of the partitions it gives back (``agents/livelock.py``),
    and only those."""
    inbound = runtime.app.monitor.stream_inbound_time
    long_ago = time.monotonic() - 3600.0

    def idle_since_long_ago() -> None:
        inbound.update({ITEMS_0: long_ago, ITEMS_1: long_ago, OTHER: long_ago})

    board = control_board(runtime)
    board.apply(PAUSED)
    idle_since_long_ago()  # the streams took their last events before a long pause
    started = time.monotonic()
    board.apply(RESUMED)
    assert inbound[ITEMS_0] >= started and inbound[ITEMS_1] >= started
    assert inbound[OTHER] == long_ago  # not held: its clock runs on

    idle_since_long_ago()
    board.apply(RESUMED)  # the same resume read again: nothing was held, a stuck stream stays reported
    assert inbound[ITEMS_0] == long_ago

    board.apply(PAUSED)
    open_breaker(runtime)
    idle_since_long_ago()
    board.apply(RESUMED)  # the breaker still holds the main topics: nothing given back yet
    assert inbound[ITEMS_0] == long_ago
    started = time.monotonic()
    close_breaker(runtime)
    assert inbound[ITEMS_0] >= started and inbound[ITEMS_1] >= started
    assert inbound[OTHER] == long_ago
