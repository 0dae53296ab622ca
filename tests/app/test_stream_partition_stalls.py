"""A stream partition that Faust's buffer-full pause took out of fetching comes back once its stream's queue has room.

Reproduced with the real stack: Faust's conductor handlers (one per partition, as a worker builds them), the stream's
mode ``ThrowableQueue`` managed by the app's flow control, and Rebound's consumer. The stall fits what a chaos run
showed: ``retry.1s`` partition 0 not read for 27 s after a rebalance while partition 2 of the same tier kept its agent
busy (``out/chaos-a1/logs/j1.0.log`` 10:48:52 to 10:49:19).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from faust.types import TP, Message
from mode.utils.queues import ThrowableQueue

from agents.runtime import Runtime
from app.consumer import ReboundConsumer

P0, P1 = TP("items", 0), TP("items", 1)
WAITING = "an event the stream has not taken yet"


class Tier:
    """One agent's stream over two partitions of a topic: one queue shared by both, fed by the conductor's handler
    of each partition."""

    def __init__(self, runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
        consumer = runtime.app.consumer
        assert isinstance(consumer, ReboundConsumer)
        app = consumer.app
        topic = app.topic("items", key_type=bytes, value_type=bytes, value_serializer="raw")
        self.channel = topic.clone(is_iterator=True)  # what an agent iterating the topic subscribes
        app.topics.add(self.channel)
        self.queue: ThrowableQueue[Any] = self.channel.queue
        assert type(self.queue) is ThrowableQueue and self.queue._clear_on_resume
        self.handlers: dict[TP, Callable[[Message], Any]] = {
            tp: app.topics._build_handler(tp, {self.channel}) for tp in (P0, P1)
        }
        self.offsets = {P0: 0, P1: 0}
        self.consumer = consumer
        assigned = {P0, P1}
        monkeypatch.setattr(consumer, "assignment", lambda: assigned)
        monkeypatch.setattr(consumer, "positions_checked_at", float("inf"))  # no consumer thread: no position check
        consumer._get_active_partitions().update(assigned)
        consumer._sought_this_generation = True  # after the recovery's seek
        consumer.flow_active = True
        app.flow_control.resume()

    async def hand_over(self, tp: TP) -> None:
        """What the fetch loop does with one record of ``tp`` (``_deliver`` -> the conductor's handler)."""
        offset = self.offsets[tp]
        self.offsets[tp] += 1
        await self.handlers[tp](Message(tp.topic, tp.partition, offset, 0.0, 0, {}, b"k", b"v", None, tp=tp))

    async def fill_to_pressure_by(self, tp: TP) -> None:
        """The stream falls behind: its queue reaches Faust's high-pressure mark with a record of ``tp``."""
        while self.queue.qsize() < self.queue.pressure_high_size:
            self.queue.put_nowait(WAITING)
        await self.hand_over(tp)


def consumer_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The consumer's monotonic clock, at 1000.0 until the test moves it (``clock[0] += seconds``)."""
    clock = [1000.0]
    monkeypatch.setattr("app.consumer.monotonic", lambda: clock[0])
    return clock


async def test_a_partition_paused_for_a_full_stream_queue_is_fetched_again_once_the_queue_has_room(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faust's ``on_buffer_full`` takes the partition out of fetching at 80 % of the queue, and mode puts it back only
    when the agent takes a record from the queue at 40 % or less. The queue is shared with the sibling partition:
    while the sibling kept it between the two marks, the partition was never fetched again."""
    tier = Tier(runtime, monkeypatch)
    consumer = tier.consumer
    clock = consumer_clock(monkeypatch)
    await tier.fill_to_pressure_by(P0)
    assert P0 not in consumer._get_active_partitions()  # Faust's buffer-full pause
    while tier.queue.qsize() > 300:
        await tier.queue.get()  # the agent catches up a little (mode's get, as the stream iterator takes records)
    most = 0
    for _ in range(30):  # then takes 10 records between fetches, 0.5 s apart; the sibling brings 10 a fetch
        clock[0] += 0.5
        await consumer._before_each_fetch()
        for tp in sorted(consumer._get_active_partitions()):
            for _ in range(10):
                await tier.hand_over(tp)
        most = max(most, tier.queue.qsize())
        for _ in range(10):
            await tier.queue.get()
    assert tier.offsets[P0] > 1, "never fetched again (1: the record that filled the queue)"
    assert most < tier.queue.maxsize  # and no hand-over found the queue full


async def test_a_partition_fetched_again_is_paused_again_when_its_stream_queue_fills_again(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Put back in the active set while mode still holds its pressure-drop callback, a partition would never be
    reported full again (``in_pressure_high_state`` skips a pending callback): the queue's pressure is ended with it."""
    tier = Tier(runtime, monkeypatch)
    consumer = tier.consumer
    await tier.fill_to_pressure_by(P0)
    while tier.queue.qsize() > tier.queue.pressure_drop_size:  # the agent catches up, but not to empty
        tier.queue.get_nowait()
    tier.queue.clear()
    await tier.hand_over(P1)
    await consumer._before_each_fetch()
    assert P0 in consumer._get_active_partitions()
    await tier.fill_to_pressure_by(P0)
    assert P0 not in consumer._get_active_partitions()  # the buffer-full pause works again


async def test_a_stream_partition_left_out_of_fetching_resumes_between_batches_unless_something_holds_it(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Level-triggered: whatever took it out (a pause whose resume was lost), an assigned stream partition goes back
    to fetching before the next fetch, except while a hold or back-pressure keeps it out."""
    consumer = Tier(runtime, monkeypatch).consumer
    consumer.pause_partitions([P0, P1])  # left over, e.g. a pause whose resume was lost
    consumer.pause_between_batches([P1])  # the dispatcher holds too much of P1
    caplog.set_level(logging.INFO, logger="app.consumer")
    await consumer._before_each_fetch()
    assert consumer._get_active_partitions() == {P0}
    assert "partition=0) was left out of fetching with nothing holding it" in caplog.text
    consumer.hold_topics(frozenset({"items"}), reason="pause")
    await consumer._before_each_fetch()
    assert consumer._get_active_partitions() == set()


async def test_the_recovery_s_own_pause_is_left_alone_until_its_seek(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faust pauses every stream partition while the tables recover (the flow runs then, to read changelogs): the
    stream partitions wait for the recovery's seek to the committed offsets."""
    consumer = Tier(runtime, monkeypatch).consumer
    consumer._sought_this_generation = False
    consumer.pause_partitions([P0, P1])
    await consumer._before_each_fetch()
    assert consumer._get_active_partitions() == set()


async def test_a_stream_partition_left_out_for_long_is_logged_with_the_reason(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = Tier(runtime, monkeypatch)
    consumer = tier.consumer
    clock = consumer_clock(monkeypatch)
    await tier.fill_to_pressure_by(P0)  # P0: its stream's queue is full
    consumer.pause_between_batches([P1])  # P1: back-pressure
    caplog.set_level(logging.INFO, logger="app.consumer")
    await consumer._before_each_fetch()
    clock[0] += 1.0
    await consumer._before_each_fetch()
    assert "left out of fetching" not in caplog.text  # not yet: a short pause is normal
    clock[0] += 10.0
    await consumer._before_each_fetch()
    await consumer._before_each_fetch()
    lines = [r.getMessage() for r in caplog.records if "left out of fetching" in r.getMessage()]
    assert len(lines) == 2, lines  # once each, not once per fetch
    assert any("partition=0" in line and "stream queue full" in line for line in lines)
    assert any("partition=1" in line and "back-pressure" in line for line in lines)


async def test_the_siblings_of_a_partition_kept_out_by_its_stream_queue_pause_until_a_batch_fits(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partition out of fetching for its full stream queue longer than ``queue_starvation_s`` has its siblings paused
    too (else they can keep the queue from draining); all come back once the queue is down to its room mark."""
    tier = Tier(runtime, monkeypatch)
    consumer = tier.consumer
    clock = consumer_clock(monkeypatch)
    await tier.fill_to_pressure_by(P0)
    await consumer._before_each_fetch()
    assert consumer._get_active_partitions() == {P1}  # Faust's pause, for a while
    clock[0] += consumer.queue_starvation_s
    await consumer._before_each_fetch()
    assert consumer._get_active_partitions() == set()
    room_mark = consumer._room_mark(tier.queue)
    while tier.queue.qsize() > room_mark + 1:
        tier.queue._queue.popleft()  # the agent takes records (without mode's own call-backs)
    await consumer._before_each_fetch()
    assert consumer._get_active_partitions() == set()  # one record above the room mark
    tier.queue._queue.popleft()
    await consumer._before_each_fetch()
    assert consumer._get_active_partitions() == {P0, P1}
    assert not tier.queue._pending_pressure_drop_callbacks
