"""A commit waits for the changelog records buffered before it began, not for an empty producer buffer.

Faust's commit (``Consumer._commit_offsets``) flushes the producer first, and Faust's flush, its buffer's
(``ProducerBuffer.flush_atmost(None)``), returns only once the buffer is empty: under a steady flow of table writes it
seldom is, and chaos runs logged commits 10 to 30 s long ("Timer commit is overlapping"). The app's producer
(``app/producer.py``) bounds its flush. These tests run Faust's real commit path and the app's own producer and
producer buffer (a mode service with its own sending task), of an app built by the factory but not started; only the
aiokafka producer under them is :class:`BusyBroker`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

import pytest
from aiokafka.structs import TopicPartition
from faust.types import TP
from faust.types.tuples import RecordMetadata

from agents.runtime import Runtime
from app.consumer import ReboundConsumer
from tests.app_under_test import ITEMS_1, started_producer

CHANGELOG_PARTITION = 1
"""Not 0: Faust's ``eager_partitioning`` asks the producer to hash the key when the partition is falsy."""


class BusyBroker:
    """aiokafka's ``AIOKafkaProducer`` as Faust's producer buffer meets it when each partition's batch is full (the
    harness's one record per batch, or a broker slower than the writes): ``send`` returns only once the record before
    it was acknowledged, so the buffer hands records over one at a time while they keep arriving; a record's future
    resolves when the test acknowledges it (:meth:`ack`); ``flush`` waits for the records it holds when called, as
    aiokafka's ``MessageAccumulator.flush`` does (the batches present then, sent or not)."""

    def __init__(self) -> None:
        self.unacked: collections.deque[tuple[asyncio.Future[RecordMetadata], str, int | None, Any]] = (
            collections.deque()
        )
        self.acked: list[Any] = []
        self.room = asyncio.Event()
        self.room.set()
        self.auto_ack = False

    async def send(
        self,
        topic: str,
        value: Any,
        key: Any = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
        headers: Any = None,
    ) -> asyncio.Future[RecordMetadata]:
        while self.unacked:
            self.room.clear()
            await self.room.wait()
        future: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
        self.unacked.append((future, topic, partition, key))
        if self.auto_ack:
            self.ack()
        return future

    def ack(self) -> None:
        if not self.unacked:
            return
        future, topic, partition, key = self.unacked.popleft()
        offset = len(self.acked)
        self.acked.append(key)
        future.set_result(RecordMetadata(topic, partition or 0, TP(topic, partition or 0), offset))
        self.room.set()

    async def flush(self) -> None:
        waiters = [future for future, *_ in self.unacked]
        if waiters:
            await asyncio.wait(waiters)


class Group:
    """The aiokafka consumer under Faust's consumer thread, as far as its ``_commit`` uses it: what it stored, and which
    changelog records the broker had acknowledged when it was asked."""

    def __init__(self, broker: BusyBroker) -> None:
        self.broker = broker
        self.stored: dict[TopicPartition, int] = {}
        self.acked_when_committed: list[Any] | None = None

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition("items", 1)}

    async def commit(self, offsets: dict[TopicPartition, Any]) -> None:
        self.acked_when_committed = list(self.broker.acked)
        self.stored.update({tp: meta.offset for tp, meta in offsets.items()})


@pytest.fixture
async def broker(runtime: Runtime) -> Any:
    """The app's own producer and its buffer, started, on a :class:`BusyBroker`; stopped after the test."""
    busy = BusyBroker()
    producer = started_producer(runtime.app)
    producer._producer = busy
    await producer.buffer.start()
    yield busy
    busy.auto_ack = True
    busy.ack()
    while producer.buffer.size and producer.buffer.state == "running":
        await asyncio.sleep(0)
    await producer.buffer.stop()


@pytest.fixture
def group(consumer: ReboundConsumer, broker: BusyBroker, monkeypatch: pytest.MonkeyPatch) -> Group:
    """Faust's real commit path down to its driver's ``_commit``, run in this loop (the consumer thread is not
    started), on :class:`Group`."""
    member = Group(broker)
    thread = consumer._thread
    monkeypatch.setattr(thread, "_consumer", member)

    async def commit_in_this_loop(offsets: Any) -> bool:
        return await type(thread)._commit(thread, offsets)

    monkeypatch.setattr(thread, "commit", commit_in_this_loop)
    monkeypatch.setattr(consumer, "assignment", lambda: {ITEMS_1})
    consumer.read_cursors.positioned(ITEMS_1, 0)
    consumer._committed_offset[ITEMS_1] = 0
    consumer._acked[ITEMS_1].extend(range(10))
    consumer._acked_index[ITEMS_1].update(range(10))
    return member


def _write(runtime: Runtime, key: bytes) -> Any:
    """One table write's changelog record, as Faust's table queues it (``send_changelog``: the producer buffer)."""
    return runtime.store.states.send_changelog(CHANGELOG_PARTITION, key, b"{}")


async def _turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def test_a_commit_ends_once_what_was_buffered_before_it_is_acknowledged(
    runtime: Runtime, consumer: ReboundConsumer, broker: BusyBroker, group: Group
) -> None:
    """20 table writes are buffered when the commit starts; then one more arrives for every one the broker
    acknowledges, so the buffer is never empty. Faust's flush waited for an empty buffer: the commit ran until the
    writes stopped (here, 500 writes later). Now it ends once the 20 are acknowledged, and commits the offsets taken
    before it flushed (10), not those acknowledged meanwhile."""
    before = [_write(runtime, f"before-{n}".encode()) for n in range(20)]
    await _turns(5)  # the buffer hands the first over; it waits for its acknowledgement
    commit = asyncio.ensure_future(consumer.commit())
    written_after = 0
    while not commit.done() and written_after < 500:
        _write(runtime, f"after-{written_after}".encode())
        await _turns(5)
        consumer._acked[ITEMS_1].append(10 + written_after)  # work finishing during the flush
        consumer._acked_index[ITEMS_1].add(10 + written_after)
        written_after += 1
        broker.ack()
    assert commit.done(), f"the commit still flushing after {written_after} writes that came after it"
    assert await commit is True
    assert group.stored == {TopicPartition("items", 1): 10}
    acked = group.acked_when_committed
    assert acked is not None
    assert all(record.done() and not record.exception() for record in before)
    assert {f"before-{n}".encode() for n in range(20)} <= set(acked)
    assert written_after < 100, f"{written_after} writes came after the commit began before it ended"


async def test_a_record_taken_from_the_buffer_and_not_yet_acknowledged_is_waited_for(
    runtime: Runtime, consumer: ReboundConsumer, broker: BusyBroker, group: Group
) -> None:
    """The buffer is empty when the commit starts, but its task holds the last record, waiting for aiokafka to take
    it: Faust's flush saw an empty buffer and committed without it. The commit now waits for it too."""
    first, held = _write(runtime, b"first"), _write(runtime, b"held")
    await _turns(5)
    assert runtime.app.producer.buffer.size == 0 and not held.done()  # taken from the buffer, not in aiokafka yet
    commit = asyncio.ensure_future(consumer.commit())
    for _ in range(10):
        await _turns(50)  # each acknowledgement given time to reach the commit before the next
        if commit.done():
            break
        broker.ack()
    assert await commit is True
    assert group.acked_when_committed is not None and {b"first", b"held"} <= set(group.acked_when_committed)
    assert first.done() and held.done()


async def test_a_commit_cut_short_leaves_no_mark_in_the_buffer(
    runtime: Runtime, consumer: ReboundConsumer, broker: BusyBroker, group: Group
) -> None:
    """A shutdown cancels a commit still waiting: its mark leaves the buffer, which goes on with the records."""
    buffer = runtime.app.producer.buffer
    for n in range(3):
        _write(runtime, f"record-{n}".encode())
    await _turns(5)  # record-0 sent, record-1 held by the buffer's task, record-2 queued
    queued = buffer.size
    commit = asyncio.ensure_future(consumer.commit())
    await _turns(5)
    assert buffer.size == queued + 1 and not commit.done()  # its mark, behind record-2
    commit.cancel()
    with pytest.raises(asyncio.CancelledError):
        await commit
    assert buffer.size == queued
    for _ in range(3):
        broker.ack()
        await _turns(5)
    assert broker.acked == [b"record-0", b"record-1", b"record-2"] and group.stored == {}


async def test_a_buffer_that_stops_before_the_mark_s_turn_gets_faust_s_flush(
    runtime: Runtime, consumer: ReboundConsumer, broker: BusyBroker, group: Group
) -> None:
    """The producer stopping while a commit waits: the commit stops waiting for the mark and runs Faust's flush, which
    refuses a buffer that still holds records as it always did ("Cannot flush: Producer not Running")."""
    buffer = runtime.app.producer.buffer
    for n in range(3):
        _write(runtime, f"record-{n}".encode())
    await _turns(5)
    commit = asyncio.ensure_future(consumer.commit())
    await _turns(5)
    stopping = asyncio.ensure_future(buffer.stop())
    with pytest.raises(RuntimeError, match="Cannot flush"):
        await commit
    assert group.stored == {} and buffer.size == 1  # record-2, and no mark
    await asyncio.gather(stopping, return_exceptions=True)


def _producer_flush(app: Any) -> Any:
    return app.producer.flush()


def _app_stop_flush(app: Any) -> Any:
    """What Faust's app runs at its stop and after a revocation's wait for the streams (``App._producer_flush``)."""
    return app._producer_flush(logging.getLogger(__name__))


@pytest.mark.parametrize("flush", [_producer_flush, _app_stop_flush], ids=["producer-flush", "app-stop-flush"])
async def test_the_app_s_producer_flush_waits_for_what_it_held_when_called(
    runtime: Runtime, broker: BusyBroker, flush: Any
) -> None:
    """The factory's app's own producer, flushed outside a commit (Faust flushes it at its stop and after a
    revocation's wait for the streams): it too ends once the records buffered when it was called are acknowledged,
    while one more arrives for every one acknowledged; Faust's flush ran until the writes stopped."""
    before = [_write(runtime, f"before-{n}".encode()) for n in range(20)]
    await _turns(5)
    flushing = asyncio.ensure_future(flush(runtime.app))
    written_after = 0
    while not flushing.done() and written_after < 500:
        _write(runtime, f"after-{written_after}".encode())
        await _turns(5)
        written_after += 1
        broker.ack()
    assert flushing.done(), f"the flush still waiting after {written_after} writes that came after it"
    await flushing
    assert all(record.done() and not record.exception() for record in before)
    assert {f"before-{n}".encode() for n in range(20)} <= set(broker.acked)
    assert written_after < 100, f"{written_after} writes came after the flush began before it ended"


class FlushedProducer:
    """A transaction's aiokafka producer, as far as Faust's flush uses it."""

    def __init__(self) -> None:
        self.flushes = 0

    async def flush(self) -> None:
        self.flushes += 1


async def test_in_a_transaction_the_producer_flushes_as_faust_does(runtime: Runtime, broker: BusyBroker) -> None:
    """Under Faust's exactly-once guarantee (which Rebound does not set) records go through one aiokafka producer
    per transaction, which only Faust's own flush reaches: the app's producer keeps it there."""
    app = runtime.app
    app.in_transaction = True
    producer = app.producer
    transaction = FlushedProducer()
    producer._transaction_producers = {"rebound-items-1": transaction}
    await producer.flush()
    assert transaction.flushes == 1
