"""Records are published without giving the event loop away per record (``ReboundApp.maybe_start_producer``).

Every publish asks the app for its producer (``Topic.publish_message``): Faust's producer buffer sends every table's
changelog records in one task, one at a time, and Faust's ``App.maybe_start_producer`` is wrapped in mode's
``stampede``, three ``asyncio.sleep(0)`` per call: the buffer moved one record per three turns of a busy event loop,
and every confirmed table write waited behind it. Real Faust objects (memory store, no broker): the app's real
producer, marked started (mode sets that flag first thing in ``start()``) or started with its connection replaced.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agents.delivery import direct_producer
from agents.runtime import Runtime
from tests.app_under_test import build_runtime, slow_starting_producer, started_producer, turns_taken


@pytest.fixture
async def runtime(tmp_path: Path) -> Runtime:
    return build_runtime(tmp_path)


async def test_both_tables_changelog_topics_take_the_started_producer_without_a_turn(runtime: Runtime) -> None:
    producer = started_producer(runtime.app)
    for table in (runtime.store.states, runtime.store.payloads):
        changelog: Any = table.changelog_topic
        got, turns = await turns_taken(changelog._get_producer())
        assert got is producer
        assert turns == 0


async def test_a_producer_not_started_is_started_through_faust_s_path_and_then_taken_without_a_turn(
    runtime: Runtime,
) -> None:
    starts: list[str] = []
    producer = slow_starting_producer(runtime.app, starts, seconds=0)
    topic: Any = runtime.store.states.changelog_topic
    try:
        got, turns = await turns_taken(topic._get_producer())
        assert got is producer and producer.started and starts == ["connecting", "connected"]
        assert turns >= 3  # Faust's path, stampede included
        # And the override is still the app's afterwards: mode's stampede caches its wrapper in the instance's
        # __dict__ under the method's name, so falling back through super() would have hidden it for good.
        got, turns = await turns_taken(topic._get_producer())
        assert got is producer and turns == 0
        assert starts == ["connecting", "connected"]
    finally:
        await producer.stop()


async def test_a_publish_arriving_while_the_producer_starts_waits_for_the_start_behind_the_first(
    runtime: Runtime,
) -> None:
    """mode marks a service started before its ``on_start`` runs: a second caller must not take the producer then
    (the driver's would raise NotReady), nor overtake the first caller still waiting for the start."""
    starts: list[str] = []
    producer = slow_starting_producer(runtime.app, starts)
    topic: Any = runtime.store.states.changelog_topic
    order: list[tuple[str, list[str]]] = []

    async def publish(name: str) -> None:
        assert await topic._get_producer() is producer
        order.append((name, list(starts)))

    try:
        first = asyncio.ensure_future(publish("first"))
        while not starts:
            await asyncio.sleep(0)
        assert producer.started  # the flag alone says started: the connection is still being made
        second = asyncio.ensure_future(publish("second"))
        await asyncio.gather(first, second)
    finally:
        await producer.stop()
    assert [states for _, states in order] == [["connecting", "connected"]] * 2, order


async def test_a_transaction_s_producer_is_faust_s_to_give(runtime: Runtime) -> None:
    started_producer(runtime.app)
    runtime.app.in_transaction = True  # processing_guarantee="exactly_once" in a worker
    topic: Any = runtime.store.states.changelog_topic
    assert await topic._get_producer() is runtime.app.consumer.transactions


async def test_an_attempt_event_is_not_put_into_the_buffer_of_a_producer_still_connecting(runtime: Runtime) -> None:
    """``direct_producer`` asks the app's ``producer_ready``: mode marks the producer started before its ``on_start``
    has connected it, so while a start made here is under way the record takes Faust's send (which waits for it)."""
    starts: list[str] = []
    producer = slow_starting_producer(runtime.app, starts)
    topic: Any = runtime.store.states.changelog_topic
    app: Any = runtime.app
    try:
        start = asyncio.ensure_future(topic._get_producer())
        while not starts:
            await asyncio.sleep(0)
        assert producer.started and not app.producer_ready
        assert direct_producer(runtime, runtime.attempts_topic) is None
        await start
        assert app.producer_ready
    finally:
        await producer.stop()
