"""Issue 22's three suspicions about Faust, mode and aiokafka, each confirmed or ruled out on the real classes.

(a) Faust records a commit's offsets as committed even when the commit failed. Confirmed; harmless to Rebound: the
    floor it then believes covers only acknowledged offsets, and the rebalance that made the commit fail replaces it
    with the broker's. The broker is never asked to commit past a record no agent finished.
(b) mode's MethodQueue runs two consumer-thread calls at once. Confirmed; harmless: Rebound needs its seeks to run in
    the consumer thread's loop (which they do), not in order with Faust's seek_to_committed; whichever lands last,
    the read cursors see the offsets that follow and read again or drop what does not match.
(c) The Cython stream iterator acks inline, without Consumer.ack. Confirmed, and it is the iterator in use; harmless:
    the one thing ReboundConsumer.ack adds (refusing the ack of a message no stream tracked) cannot arise there,
    because that iterator tracks every event of an acknowledged topic before it yields it and acks no skipped one;
    the main and release agents acknowledge through the dispatcher (``stream.noack()``), which goes through
    Consumer.ack.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import faust
import faust.streams
import pytest
from aiokafka.errors import CommitFailedError
from aiokafka.structs import TopicPartition
from faust.transport.drivers import aiokafka as faust_driver
from faust.types import TP
from faust.types.tuples import ConsumerMessage
from mode.threads import MethodQueue

from agents.runtime import Runtime
from app.consumer import ReboundConsumer
from tests.app_under_test import ITEMS_1, FetchedMessage

ROOT = Path(__file__).resolve().parents[2]
REBALANCED = (
    "Commit cannot be completed since the group has already rebalanced and may have assigned the partitions to "
    "another member"
)  # aiokafka's own text (group_coordinator.py), which Faust's driver matches on "already rebalanced"


# -- (a) a failed commit


class GroupMember:
    """The aiokafka consumer inside Faust's consumer thread, as far as its ``_commit`` uses it: a commit fails the
    way aiokafka's does after the group rebalanced, until ``rebalanced`` is cleared."""

    def __init__(self) -> None:
        self.rebalanced = True
        self.stored: dict[TopicPartition, int] = {}

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition("items", 1)}

    async def commit(self, offsets: dict[TopicPartition, Any]) -> None:
        if self.rebalanced:
            raise CommitFailedError(REBALANCED)
        self.stored.update({tp: meta.offset for tp, meta in offsets.items()})


@pytest.fixture
def group_member(consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch) -> GroupMember:
    """Faust's real commit path down to its driver's ``_commit``; only the aiokafka consumer under it is replaced, and
    the consumer thread's queue (not started here) is stepped over by calling ``_commit`` in this loop."""
    member = GroupMember()
    thread = consumer._thread
    monkeypatch.setattr(thread, "_consumer", member)

    async def commit_in_this_loop(offsets: Any) -> bool:
        return await faust_driver.AIOKafkaConsumerThread._commit(thread, offsets)

    async def nothing_to_flush() -> None:
        return None

    monkeypatch.setattr(thread, "commit", commit_in_this_loop)
    monkeypatch.setattr(consumer.app.producer, "flush", nothing_to_flush)
    return member


def _acknowledge(consumer: ReboundConsumer, offsets: range) -> None:
    acked = consumer._acked[ITEMS_1]
    acked.extend(offsets)
    consumer._acked_index[ITEMS_1].update(offsets)


async def test_behaviour_commit_records_the_floor_even_when_it_fails(
    consumer: ReboundConsumer, group_member: GroupMember
) -> None:
    """Suspicion (a), confirmed: the broker refused the commit, Faust believes offset 10 committed anyway."""
    consumer.read_cursors.positioned(ITEMS_1, 0)
    _acknowledge(consumer, range(10))
    assert await consumer.commit() is False
    assert group_member.stored == {}
    assert consumer._committed_offset[ITEMS_1] == 10, (
        "Faust no longer records a failed commit's offsets as committed: suspicion (a) of issue 22 is gone; "
        "update tests/contract/test_suspicions.py and docs/upgrading.md"
    )


async def test_after_a_failed_commit_the_broker_is_never_asked_past_an_unfinished_record(
    consumer: ReboundConsumer, group_member: GroupMember
) -> None:
    """Suspicion (a), the part that matters: the floor Faust believes covers acknowledged offsets only, so committing
    from it later stores nothing that was not done. Offset 12 is still running; 13 and 14 are done."""
    consumer.read_cursors.positioned(ITEMS_1, 0)
    _acknowledge(consumer, range(10))
    await consumer.commit()
    _acknowledge(consumer, range(10, 12))
    _acknowledge(consumer, range(13, 15))
    group_member.rebalanced = False
    assert await consumer.commit() is True
    assert group_member.stored == {TopicPartition("items", 1): 12}
    _acknowledge(consumer, range(12, 13))
    assert await consumer.commit() is True
    assert group_member.stored == {TopicPartition("items", 1): 15}


async def test_a_floor_the_broker_never_stored_is_forgotten_with_the_revocation_and_read_again_from_the_broker(
    consumer: ReboundConsumer, group_member: GroupMember, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Suspicion (a): "already rebalanced" means a revocation follows; after it, the next recovery's seek takes the
    broker's committed offset (4 here), and the records between it and the believed floor run again."""
    _acknowledge(consumer, range(4, 10))
    consumer._committed_offset[ITEMS_1] = 4
    await consumer.commit()
    assert consumer._committed_offset[ITEMS_1] == 10  # believed, not stored
    monkeypatch.setattr(consumer, "_app_revocation", _nothing_revoked)
    await consumer.on_partitions_revoked({ITEMS_1})
    assert consumer._committed_offset.get(ITEMS_1) is None

    async def broker_committed() -> dict[TP, int]:
        return {ITEMS_1: 4}

    async def no_seek(tp: TP, offset: int) -> None:
        return None

    monkeypatch.setattr(consumer, "seek_to_committed", broker_committed)
    monkeypatch.setattr(consumer, "_seek", no_seek)
    await consumer.perform_seek()
    assert consumer._committed_offset[ITEMS_1] == 4
    assert consumer.read_cursors.next_offset(ITEMS_1) == 4


async def _nothing_revoked(revoked: set[TP]) -> None:
    return None


# -- (b) the consumer thread's method queue


async def test_behaviour_method_queue_runs_two_calls_at_once() -> None:
    """Suspicion (b), confirmed: a second call completes while the first, enqueued before it, still awaits."""
    queue = MethodQueue()
    assert queue.num_workers == 2
    await queue.start()
    try:
        release = asyncio.Event()
        finished: list[str] = []

        async def slow() -> None:  # seek_to_committed: awaits the broker's committed offsets
            await release.wait()
            finished.append("slow")

        def seek() -> Any:  # aiokafka's seek: synchronous (MethodQueue awaits what it returns only if awaitable)
            finished.append("seek")

        loop = asyncio.get_running_loop()
        first = await queue.call(loop.create_future(), slow)
        second = await queue.call(loop.create_future(), seek)
        await asyncio.wait_for(second, 1)
        assert finished == ["seek"], "mode's MethodQueue ran its calls one at a time: suspicion (b) is gone"
        release.set()
        await asyncio.wait_for(first, 1)
        assert finished == ["seek", "slow"]
    finally:
        await queue.stop()


@pytest.mark.parametrize("fetcher_at", [14, 6])
async def test_a_seek_that_lands_out_of_order_with_the_seek_to_committed_is_put_right_by_the_read_cursors(
    consumer: ReboundConsumer, handed_over: dict[str, list[int]], fetcher_at: int
) -> None:
    """Suspicion (b), ruled out as a defect: the recovery's seek put the read cursor at 10, a seek of Rebound's that
    overtook it (or was overtaken) left the fetcher at 14 or at 6. Ahead: read again from 10; behind: the records
    before 10 are dropped. Either way offset 10 is the first handed over and nothing is skipped."""
    consumer.read_cursors.positioned(ITEMS_1, 10)
    for offset in range(fetcher_at, fetcher_at + 3):
        await consumer._drain_one(ITEMS_1, FetchedMessage(offset), batch=1)  # type: ignore[arg-type]
    if fetcher_at > 10:
        assert handed_over == {"delivered": [], "seeks": [10]}
    for offset in range(10, 15):
        await consumer._drain_one(ITEMS_1, FetchedMessage(offset), batch=2)  # type: ignore[arg-type]
    assert handed_over["delivered"] == list(range(10, 15))


# -- (c) the Cython stream iterator


def _event(runtime: Runtime, offset: int) -> Any:
    message = ConsumerMessage(
        "items", 1, offset, 0.0, 0, [], b"k", b"v", None, tp=ITEMS_1, generation_id=runtime.app.consumer_generation_id
    )
    return faust.Event(runtime.app, b"k", b"v", {}, message)


async def test_behaviour_cython_stream_iterator_acks_inline(
    runtime: Runtime, consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Suspicion (c), confirmed: the installed Faust iterates streams with its Cython extension, whose ``after()``
    acknowledges without calling the consumer's ``ack`` (ReboundConsumer's override is not called)."""
    iterator_class: Any = vars(faust.streams)["_CStreamIterator"]
    assert iterator_class is not None, "Faust's Cython stream iterator is not in use here: suspicion (c) does not apply"
    calls: list[Any] = []
    monkeypatch.setattr(consumer, "ack", calls.append)
    runtime.app.flow_control.resume()  # as a recovery leaves it (a worker not started has its flow suspended)
    stream = runtime.app.stream(runtime.app.channel())
    iterator = iterator_class(stream)
    event = _event(runtime, 7)
    cast(Any, stream.channel).queue.put_nowait(event)
    _, state = await iterator.next()
    iterator.after(stream.current_event, True, state)
    assert calls == [], "the Cython iterator now acks through Consumer.ack: suspicion (c) is gone"
    assert event.message.acked


async def test_the_cython_iterator_acks_only_tracked_messages_so_rebound_s_refusal_is_not_needed_there(
    runtime: Runtime, consumer: ReboundConsumer
) -> None:
    """Suspicion (c), ruled out as a defect: on an acknowledged topic the iterator tracks a message before it yields
    it (so ReboundConsumer.ack would pass it to Faust's, same bookkeeping) and does not ack one it skips (flow
    stopped), where Faust's pure-Python iterator would: that is the case ReboundConsumer.ack refuses."""
    iterator_class: Any = vars(faust.streams)["_CStreamIterator"]
    assert iterator_class is not None
    runtime.app.flow_control.resume()
    stream = runtime.app.stream(runtime.main_topics["items"])
    queue = cast(Any, stream.channel).queue
    iterator = iterator_class(stream)
    taken = _event(runtime, 7)
    queue.put_nowait(taken)
    _, state = await iterator.next()
    assert taken.message.tracked
    iterator.after(stream.current_event, True, state)
    stream.current_event = None  # as Faust's _c_aiter does after every event
    assert list(consumer._acked[ITEMS_1]) == [7]

    runtime.app.flow_control.suspend()
    skipped = _event(runtime, 8)
    queue.put_nowait(skipped)
    value, state = await iterator.next()
    assert value is cast(Any, stream)._skipped_value
    iterator.after(stream.current_event, True, state)
    assert not skipped.message.tracked and not skipped.message.acked
    assert list(consumer._acked[ITEMS_1]) == [7]


def test_the_agents_that_rely_on_rebound_s_ack_acknowledge_through_the_dispatcher() -> None:
    """ReboundConsumer.ack guards the main and release agents' acks: they iterate with noack() and the dispatcher
    acks each event (Message.ack -> Consumer.ack), so no stream iterator acks for them."""
    for agent in ("agents/main.py", "agents/release.py"):
        assert "stream.noack().events()" in (ROOT / agent).read_text(), agent
