"""A revocation whose consumer reads no assignment still stops the flow, revokes the dispatcher's work and waits for
the streams (``ReboundApp._on_partitions_revoked``), and a revocation that reads one does it once, through Faust's own
steps.

Faust's ``App._on_partitions_revoked`` stops the flow and waits for the streams only when ``consumer.assignment()`` is
non-empty; aiokafka's reads its current subscription's, which a resubscription replaces with one that has no
assignment yet, while the revocation it then calls is of the previous assignment. Here the aiokafka consumer is
aiokafka's own (not started: its subscription state is all that is read), resubscribed as Faust's conductor does;
the app, its revocation, the consumer and the dispatcher are the worker's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from agents.runtime import Runtime
from app.consumer import ReboundConsumer
from tests.app.test_consumer_finished import StreamEvent, taken_by_a_stream
from tests.app_under_test import ITEMS_1, started_producer


async def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


async def _no_commit(*args: Any, **kwargs: Any) -> bool:
    """Faust's ``commit``, committing nothing (``wait_empty`` ends with ``commit(start_new_transaction=False)``)."""
    return False


@pytest.fixture
async def kafka_consumer(consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """aiokafka's consumer of the worker, subscribed to ``items`` and assigned items-1, never started (nothing here
    reaches a broker). Faust's commits are real: with nothing assigned they commit nothing."""
    kafka = AIOKafkaConsumer(group_id="rebound", bootstrap_servers="127.0.0.1:1")
    kafka.subscribe(topics=["items"])
    kafka._subscription.assign_from_subscribed({TopicPartition("items", 1)})
    consumer._thread._consumer = kafka
    monkeypatch.setattr(consumer, "maybe_wait_for_commit_to_finish", _nothing)
    yield kafka
    kafka._closed = True  # (never started: nothing to close)
    assert consumer.app.crash_reason is None, "the revocation crashed the app"


def commits_nothing(consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Commits that commit nothing (a commit of an assigned partition would reach aiokafka's coordinator)."""
    monkeypatch.setattr(consumer, "commit", _no_commit)


def resubscribe(kafka: Any) -> None:
    """Faust's conductor subscribing again with one more topic (``Conductor._subscriber``, ``consumer.subscribe``)."""
    kafka.subscribe(topics=["items", "items-added-later"])


class Work:
    """Offset 10 of items-1, taken by a stream and running on the real dispatcher until :meth:`finish`."""

    def __init__(self, runtime: Runtime, consumer: ReboundConsumer, steps: list[str] | None = None) -> None:
        self.gate = asyncio.Event()
        self.ended = False
        self.steps = [] if steps is None else steps
        self.message = taken_by_a_stream(consumer, 10)
        runtime.dispatcher.offer(StreamEvent(consumer, self.message), "k", self.run)

    async def run(self, event: Any) -> None:
        await self.gate.wait()
        self.ended = True
        self.steps.append("work ended")

    def finish(self) -> None:
        self.gate.set()


async def test_a_revocation_that_finds_no_assignment_stops_the_flow_revokes_the_dispatcher_and_waits(
    runtime: Runtime, consumer: ReboundConsumer, kafka_consumer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a resubscription: the revocation of items-1 reads an empty assignment. Faust's revocation alone left the
    flow running, the dispatcher's generation where it was (its work of items-1 not revoked) and returned at once,
    with the work still running. As in Faust's own steps, the stream queues are emptied, and the producer is flushed
    after the wait and before the ``on_partitions_revoked`` signal (the release schedule's suspension)."""
    consumer._committed_offset[ITEMS_1] = 10
    steps: list[str] = []
    producer = started_producer(runtime.app)

    async def flush() -> None:
        steps.append("producer flushed")

    async def revoked_signal(sender: Any, revoked: set[Any], **kwargs: Any) -> None:
        steps.append("on_partitions_revoked sent")

    monkeypatch.setattr(producer, "flush", flush)
    runtime.app.on_partitions_revoked.connect(revoked_signal)
    stream_queue = runtime.app.channel().queue
    stream_queue.put_nowait(object())  # an event a stream has yet to take
    work = Work(runtime, consumer, steps)
    await asyncio.sleep(0)
    generation = runtime.dispatcher.core.generation
    resubscribe(kafka_consumer)
    assert consumer.assignment() == set()

    revocation = asyncio.ensure_future(consumer.on_partitions_revoked({ITEMS_1}))
    await asyncio.sleep(0.05)
    assert consumer.flow_active is False
    assert runtime.app.flow_control.is_active() is False
    assert runtime.dispatcher.core.generation == generation + 1, "the dispatcher's work was not revoked"
    assert not revocation.done(), "the revocation did not wait for the work it took"
    assert stream_queue.empty(), "the stream queues were not cleared"

    work.finish()
    await asyncio.wait_for(revocation, timeout=5)
    assert work.ended and work.message.acked
    assert steps == ["work ended", "producer flushed", "on_partitions_revoked sent"], steps
    # Faust's commits during the wait discard an unassigned partition's offsets: taken from the acknowledged ones
    # (Rebound's _new_offset) for a commit that never came, 10 was no longer remembered as finished and ran again.
    assert consumer._finished == {ITEMS_1: {10}}, "acknowledged in time, remembered as finished (nothing committed)"
    assert consumer.between_assignments is True


async def test_a_revocation_that_finds_its_assignment_stops_the_flow_once(
    runtime: Runtime, consumer: ReboundConsumer, kafka_consumer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The normal path: Faust's revocation stops the flow and waits; Rebound's does not do it again."""
    commits_nothing(consumer, monkeypatch)
    work = Work(runtime, consumer)
    await asyncio.sleep(0)
    generation, stops = runtime.dispatcher.core.generation, consumer._flow_stops

    revocation = asyncio.ensure_future(consumer.on_partitions_revoked({ITEMS_1}))
    await asyncio.sleep(0.05)
    assert not revocation.done()
    work.finish()
    await asyncio.wait_for(revocation, timeout=5)
    assert consumer.flow_active is False and work.message.acked
    assert (consumer._flow_stops, runtime.dispatcher.core.generation) == (stops + 1, generation + 1)


async def test_an_assignment_emptied_between_the_two_checks_still_stops_the_flow_once(
    runtime: Runtime, consumer: ReboundConsumer, kafka_consumer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer thread resubscribes after Rebound read the assignment and before Faust reads it (right after the
    tables' part of the revocation): Faust's revocation stops nothing, so the flow is stopped after it."""
    commits_nothing(consumer, monkeypatch)
    tables_revoked = runtime.app.tables.on_partitions_revoked

    def tables_then_resubscribed(revoked: set[Any]) -> None:
        tables_revoked(revoked)
        resubscribe(kafka_consumer)

    monkeypatch.setattr(runtime.app.tables, "on_partitions_revoked", tables_then_resubscribed)
    generation, stops = runtime.dispatcher.core.generation, consumer._flow_stops
    await consumer.on_partitions_revoked({ITEMS_1})
    assert consumer.flow_active is False
    assert (consumer._flow_stops, runtime.dispatcher.core.generation) == (stops + 1, generation + 1)


async def test_a_stopping_worker_s_revocation_that_finds_no_assignment_stops_the_flow_without_waiting(
    runtime: Runtime, consumer: ReboundConsumer, kafka_consumer: Any
) -> None:
    """Faust's revocation in a stopping app only closes the consumer, and its stop (``_stop_consumer``) stops the flow
    only if the assignment reads non-empty: the dispatcher, revoked here, bounds the work by the shutdown's time."""
    work = Work(runtime, consumer)
    await asyncio.sleep(0)
    generation = runtime.dispatcher.core.generation
    resubscribe(kafka_consumer)
    kafka_consumer._coordinator = SimpleNamespace(close=_nothing, member_id="rebound-1")
    runtime.app._stopped.set()  # mode's mark of a service stopping (``should_stop``)
    try:
        await asyncio.wait_for(consumer.on_partitions_revoked({ITEMS_1}), timeout=5)
        assert consumer.flow_active is False
        assert runtime.dispatcher.core.generation == generation + 1
        assert not work.ended, "a stopping worker's revocation waits for nothing"
    finally:
        work.finish()
        await runtime.dispatcher.wait_idle()
