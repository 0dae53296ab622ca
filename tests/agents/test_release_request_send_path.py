"""Release requests go straight into the aiokafka producer's buffer once the app's producer is started, as attempt
events do (Faust's ``Topic.send`` layers cost a request more than aiokafka's own send): the same record, its table key
as key, its JSON as value, on its partition, no headers. Before that, and for a topic that is not a Faust topic,
Faust's path takes them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agents.release import release_due
from agents.topics import raw_topic
from rebound.commands import ReleaseRequest
from rebound.schedule import Slot
from tests.agents.test_attempt_send_path import FaustProducer


def with_faust_release_topic(runtime: Any, producer: FaustProducer) -> list[dict[str, Any]]:
    """The runtime's release topic as the worker has it (a Faust topic, raw bytes), on an app whose producer is
    ``producer``; what goes through Faust's ``Topic.send`` is listed."""
    topic = raw_topic(runtime.app, runtime.release_topic.get_topic_name(), partitions=1)
    via_faust: list[dict[str, Any]] = []

    async def faust_send(**record: Any) -> Any:
        via_faust.append(record)
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    topic.send = faust_send
    runtime.release_topic = topic
    runtime.app.producer = producer
    return via_faust


def due_slot(runtime: Any, clock: Any) -> None:
    runtime.schedule.adopt(0, [Slot(clock.now_ms, b"k", "items/0/7", 1, "1s")])


@pytest.mark.parametrize("started", [True, False], ids=["started", "not-started"])
async def test_a_started_producer_takes_the_request_straight_into_its_buffer_else_faust_sends_the_same(
    make_runtime: Any, clock: Any, started: bool
) -> None:
    runtime = make_runtime()
    producer = FaustProducer(started=started)
    via_faust = with_faust_release_topic(runtime, producer)
    due_slot(runtime, clock)
    assert await release_due(runtime) == 1
    if started:
        assert via_faust == []
        [(topic, value, key, partition)] = producer.aio.sent
        assert (topic, key, partition) == ("agent-test.release", b"k", 0)
    else:
        assert producer.aio.sent == []
        [record] = via_faust
        value = record["value"]
        assert (record["key"], record["partition"]) == (b"k", 0)
    request = ReleaseRequest.from_json(value)
    assert (request.origin, request.attempt) == ("items/0/7", 1)
    if started:
        assert value == ReleaseRequest(request.origin, request.attempt, request.number).to_json()
