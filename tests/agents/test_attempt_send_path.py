"""Attempt events go straight into the aiokafka producer's buffer once the app's producer is started (Faust's
``Topic.send`` layers around it cost a healthy message as much as aiokafka's own send); before that, and for a topic
that is not a Faust topic, Faust's path takes them."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any, cast

import faust

from agents.delivery import emit_attempt
from agents.runtime import Runtime
from rebound.attempts import AttemptEvent, Outcome
from rebound.headers import Provenance


class AioProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, Any, Any]] = []

    async def send(self, topic: str, value: bytes, *, key: Any = None, partition: Any = None) -> asyncio.Future[Any]:
        self.sent.append((topic, value, key, partition))
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


class FaustProducer:
    def __init__(self, started: bool) -> None:
        self.started = started
        self.aio = AioProducer()

    def _ensure_producer(self) -> AioProducer:
        return self.aio


def runtime_with(producer: FaustProducer) -> tuple[Runtime, list[dict[str, Any]]]:
    app = faust.App("attempt-send-path", broker="kafka://127.0.0.1:1", autodiscover=False, store="memory://")
    app.producer = producer  # type: ignore[assignment]
    topic = app.topic("g.attempts", key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    via_faust: list[dict[str, Any]] = []

    async def faust_send(**record: Any) -> None:
        via_faust.append(record)

    topic.send = faust_send  # type: ignore[method-assign]
    metrics = SimpleNamespace(attempt=lambda *labels: None)
    runtime = SimpleNamespace(
        app=app,
        counters=Counter(),
        metrics=metrics,
        settings=SimpleNamespace(succeeded_events="all"),
        group="g",
        clock=lambda: 1234,
        attempts_topic=topic,
    )
    return cast(Runtime, runtime), via_faust


PROVENANCE = Provenance(topic="items", partition=2, offset=7, timestamp_ms=1, first_received_at_ms=1000)


def emit(runtime: Runtime) -> None:
    async def run() -> None:
        await emit_attempt(runtime, key=b"k", provenance=PROVENANCE, attempt=0, tier=None, outcome=Outcome.SUCCEEDED)

    asyncio.run(run())


def test_a_started_producer_takes_the_event_straight_into_its_buffer() -> None:
    producer = FaustProducer(started=True)
    runtime, via_faust = runtime_with(producer)
    emit(runtime)
    assert via_faust == []
    [(topic, value, key, partition)] = producer.aio.sent
    assert (topic, key, partition) == ("g.attempts", b"k", 2)
    event = AttemptEvent.from_json(value)
    assert (event.outcome, event.original_offset, event.event_time) == ("succeeded", 7, 1234)


def test_a_producer_not_started_leaves_the_event_to_faust() -> None:
    producer = FaustProducer(started=False)
    runtime, via_faust = runtime_with(producer)
    emit(runtime)
    assert producer.aio.sent == []
    [record] = via_faust
    assert (record["key"], record["partition"]) == (b"k", 2)
    assert AttemptEvent.from_json(record["value"]).original_offset == 7
