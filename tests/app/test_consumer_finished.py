"""Records this worker finished are not run again when it reads them again: after it got its partition back from a
revocation, or after a seek back in the same generation (app/consumer.py ``_skip_if_finished``).

Chaos runs (key-ordered): a slow record held a partition's commits while hundreds of later records of other keys were
finished; the revocation dropped what was queued, the assignor gave the partition back to the same worker, and it ran
them all again from the committed offset (the run and its figures: docs/guarantees.md, "Records a worker finished")."""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.consumer.group_coordinator import GroupCoordinator
from faust.types import TP
from faust.types.tuples import ConsumerMessage

from agents.runtime import Runtime
from app.consumer import ReboundConsumer
from tests.app.consumer_steps import stub_revocation
from tests.app_under_test import ITEMS_1, FetchedMessage

ITEMS_0 = TP("items", 0)
MEMBER = "rebound-1-0f3c"


@pytest.fixture(autouse=True)
async def coordinator(consumer: ReboundConsumer) -> SimpleNamespace:
    """aiokafka's coordinator of a worker that joined the group as ``MEMBER`` in generation 7 (the state it keeps of
    its membership; ``reset_generation`` is aiokafka's own), the generation Faust's listener gave the app."""
    state = SimpleNamespace(
        generation=7, member_id=MEMBER, _rejoin_needed_fut=asyncio.get_running_loop().create_future()
    )
    state.request_rejoin = partial(GroupCoordinator.request_rejoin, state)
    consumer._thread._consumer = SimpleNamespace(_coordinator=state)  # type: ignore[assignment]
    consumer.joined = True
    consumer.app.consumer_generation_id = 7
    return state


class ReadMessage(FetchedMessage):
    acked = False
    generation_id = 7
    """Faust's message carries the generation it was read in (the app's ``consumer_generation_id``: the
    ``coordinator`` fixture's)."""


def committed_at(consumer: ReboundConsumer, committed: int, acked: list[int]) -> None:
    consumer._committed_offset[ITEMS_1] = committed
    consumer._acked[ITEMS_1].extend(acked)
    consumer._acked_index[ITEMS_1].update(acked)


async def _nothing(*args: Any) -> None:
    return None


async def revoke(consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch, *tps: TP) -> None:
    """A revocation (of ``tps``, by default ``items``-1) whose app part (stop the flow, wait for the streams, commit)
    commits nothing more."""
    stub_revocation(consumer, monkeypatch, _nothing)
    await consumer.on_partitions_revoked(set(tps) or {ITEMS_1})


async def assign(
    consumer: ReboundConsumer,
    monkeypatch: pytest.MonkeyPatch,
    *tps: TP,
    committed: int | None,
    generations: int = 1,
    member: str | None = None,
) -> None:
    """The group's assignment ``generations`` after the last one (to ``member``, by default the same member id), then
    the recovery's seek to the committed offset (Faust's app part stubbed); None: no seek."""
    coordinator = consumer._thread._consumer._coordinator  # type: ignore[union-attr]
    coordinator.generation = consumer.app.consumer_generation_id + generations
    coordinator.member_id = member or coordinator.member_id or MEMBER
    consumer.app.consumer_generation_id = coordinator.generation  # as Faust's listener sets it
    consumer.assignment_handed_over(set(tps), coordinator.generation)  # ReboundConsumerThread's first step
    monkeypatch.setattr(consumer, "_on_partitions_assigned", _nothing)
    await consumer.on_partitions_assigned(set(tps), coordinator.generation)
    if committed is None:
        return

    async def seek_to_committed() -> dict[TP, int]:
        return dict.fromkeys(tps, committed)

    monkeypatch.setattr(consumer, "seek_to_committed", seek_to_committed)
    await consumer.perform_seek()


async def read(consumer: ReboundConsumer, offsets: range, batch: int = 1) -> None:
    for offset in offsets:
        await consumer._drain_one(ITEMS_1, ReadMessage(offset), batch=batch)  # type: ignore[arg-type]


async def test_offsets_acknowledged_past_the_commit_are_not_run_again_when_the_partition_comes_back(
    consumer: ReboundConsumer,
    handed_over: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """293 unfinished, 300 to 305 acknowledged: commits stay at 293 through the revocation. Given back, the partition
    is read from 293: 300 to 305 are acknowledged as they come, not handed to a stream; the rest is; and commits run
    over them in offset order once 293 to 299 are done."""
    committed_at(consumer, 293, list(range(300, 306)))
    await revoke(consumer, monkeypatch)
    assert ITEMS_1 not in consumer._acked  # Faust's bookkeeping forgets the partition, as before
    await assign(consumer, monkeypatch, ITEMS_1, committed=293)
    with caplog.at_level(logging.INFO, logger="app.consumer"):
        await read(consumer, range(293, 308))
    assert handed_over["delivered"] == [*range(293, 300), 306, 307]
    assert consumer.redeliveries_skipped == {"items": 6}
    said = [record.getMessage() for record in caplog.records if "not run again" in record.getMessage()]
    assert len(said) == 1 and "offset 300 and 5 more" in said[0], said
    assert consumer._new_offset(ITEMS_1) is None  # 293 to 299 are running again
    consumer._acked[ITEMS_1].extend(range(293, 300))
    consumer._acked_index[ITEMS_1].update(range(293, 300))
    assert consumer._new_offset(ITEMS_1) == 306
    assert consumer.read_cursors.next_offset(ITEMS_1) == 308


async def test_finished_work_the_dispatcher_let_go_of_is_not_run_again_and_other_let_go_work_is(
    consumer: ReboundConsumer, handed_over: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dispatcher acknowledges in offset order: work finished behind a slow head is let go of unacknowledged when
    the revocation drops what is queued in between (agents/dispatcher.py). Finished, it is not run again here;
    dropped before it ran, it is."""
    consumer._committed_offset[ITEMS_1] = 10
    for offset in (11, 12, 14):
        consumer.abandon(ReadMessage(offset), finished=True)  # type: ignore[arg-type]
    consumer.abandon(ReadMessage(13))  # type: ignore[arg-type]  # dropped, never ran
    await revoke(consumer, monkeypatch)
    await assign(consumer, monkeypatch, ITEMS_1, committed=10)
    await read(consumer, range(10, 16))
    assert handed_over["delivered"] == [10, 13, 15]
    consumer._acked[ITEMS_1].extend([10, 13])
    consumer._acked_index[ITEMS_1].update([10, 13])
    assert consumer._new_offset(ITEMS_1) == 15


async def test_finished_work_let_go_of_after_the_next_assignment_is_not_remembered(
    consumer: ReboundConsumer, handed_over: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A work that ends after the generation it was read in has moved on (a shutdown's straggler) is not remembered:
    what it did was not waited for by that generation's revocation."""
    consumer._committed_offset[ITEMS_1] = 10
    straggler = ReadMessage(12)
    straggler.generation_id = consumer.app.consumer_generation_id - 1
    consumer.abandon(ReadMessage(11), finished=True)  # type: ignore[arg-type]
    consumer.abandon(straggler, finished=True)  # type: ignore[arg-type]
    assert consumer._finished == {ITEMS_1: {11}}


async def test_a_partition_the_group_gave_elsewhere_is_run_in_full_when_it_comes_back(
    consumer: ReboundConsumer, handed_over: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another member read it from the committed offset meanwhile: what this worker finished is forgotten."""
    committed_at(consumer, 20, [22, 23])
    await revoke(consumer, monkeypatch)
    await assign(consumer, monkeypatch, ITEMS_0, committed=7)
    assert consumer._finished == {}
    await revoke(consumer, monkeypatch)
    await assign(consumer, monkeypatch, ITEMS_1, committed=20)
    await read(consumer, range(20, 25))
    assert handed_over["delivered"] == list(range(20, 25))


async def test_what_another_member_committed_past_is_forgotten(
    consumer: ReboundConsumer, handed_over: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    committed_at(consumer, 20, [22, 23, 25])
    await revoke(consumer, monkeypatch)
    await assign(consumer, monkeypatch, ITEMS_1, committed=24)  # the group's committed offset moved on meanwhile
    assert consumer._finished == {ITEMS_1: {25}}
    await read(consumer, range(24, 27))
    assert handed_over["delivered"] == [24, 26]
    assert consumer._finished == {}


async def _log_starts_at_0(tps: list[TP]) -> dict[TP, int]:
    return dict.fromkeys(tps, 0)


async def test_a_partition_with_nothing_committed_forgets_them_all(
    consumer: ReboundConsumer, handed_over: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its topic deleted and created again: the same offsets are other records now, all handed over."""
    committed_at(consumer, 20, [22, 23])
    await revoke(consumer, monkeypatch)
    monkeypatch.setattr(consumer, "_log_starts", _log_starts_at_0)
    await assign(consumer, monkeypatch, ITEMS_1, committed=0)
    await read(consumer, range(25))
    assert handed_over["delivered"] == list(range(25))


async def test_a_partition_read_before_its_seek_forgets_them_all_when_nothing_is_committed(
    consumer: ReboundConsumer, handed_over: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faust resumes the partitions before its seek to the committed offsets: the first record asks the group's
    committed offset itself (``_position_from_committed``). Nothing committed (the topic created again): the
    records at the offsets finished before are other records, handed over."""
    committed_at(consumer, 20, [22, 23])
    await revoke(consumer, monkeypatch)
    monkeypatch.setattr(consumer, "_log_starts", _log_starts_at_0)

    async def nothing_committed(*args: Any) -> None:
        return None

    monkeypatch.setattr(consumer._thread, "call_thread", nothing_committed)
    await assign(consumer, monkeypatch, ITEMS_1, committed=None)  # no seek yet
    await read(consumer, range(25))
    assert handed_over["delivered"] == list(range(25))


async def test_an_evicted_worker_runs_again_what_it_finished(
    consumer: ReboundConsumer,
    coordinator: SimpleNamespace,
    handed_over: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped past its session timeout while a slow head held the partition's commits: the group gave the partition
    to another member, whose writer epoch fenced the write of a record finished here behind the head (acknowledged
    once its write was confirmed, the write then refused), and the commit of the revocation is refused (aiokafka
    blanks the member id). Given the partition back before the other member committed past them, this worker runs
    them all again: their only copy was fenced. Read once the app's commit is done, not at the revocation's start."""
    committed_at(consumer, 293, list(range(300, 306)))

    async def commit_refused(revoked: set[TP]) -> None:  # the app's revocation: its commit refused
        GroupCoordinator.reset_generation(coordinator)  # type: ignore[arg-type]

    stub_revocation(consumer, monkeypatch, commit_refused)
    await consumer.on_partitions_revoked({ITEMS_1})
    assert consumer._finished == {}
    await assign(consumer, monkeypatch, ITEMS_1, committed=293, generations=2, member="rebound-1-9a7e")
    await read(consumer, range(293, 308))
    assert handed_over["delivered"] == list(range(293, 308))
    assert consumer.redeliveries_skipped == {}


@pytest.mark.parametrize(
    ("generations", "member"),
    [(2, MEMBER), (1, "rebound-1-9a7e")],
    ids=["a generation skipped", "a new member id"],
)
async def test_an_assignment_not_right_after_the_revocation_as_the_same_member_runs_them_again(
    consumer: ReboundConsumer,
    handed_over: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
    generations: int,
    member: str,
) -> None:
    """A generation skipped (this worker's SyncGroup refused as the group rebalanced again: another member may have
    been given the partition and fenced writes of records finished here), or a new member id (the group dropped
    this worker, as after a revocation that outlasted the rebalance timeout, which aiokafka learns only at its next
    JoinGroup): the records finished here run again."""
    committed_at(consumer, 293, list(range(300, 306)))
    await revoke(consumer, monkeypatch)
    await assign(consumer, monkeypatch, ITEMS_1, committed=293, generations=generations, member=member)
    await read(consumer, range(293, 308))
    assert handed_over["delivered"] == list(range(293, 308))


def taken_by_a_stream(consumer: ReboundConsumer, offset: int) -> ConsumerMessage:
    """Faust's own message of items-1 as its fetcher makes it (stamped with the app's generation then), taken by a
    stream: tracked and among the consumer's unacknowledged messages, as Faust's stream iterator leaves it."""
    generation = consumer.app.consumer_generation_id
    message = ConsumerMessage("items", 1, offset, 0.0, 0, None, b"k", b"v", None, tp=ITEMS_1, generation_id=generation)
    message.tracked = True
    consumer._unacked_messages.add(message)
    return message


@pytest.mark.parametrize("acked", ["before the next assignment", "after the next assignment"])
async def test_a_late_ack_of_a_revoked_partition_is_not_taken_for_finished_when_the_partition_comes_back(
    consumer: ReboundConsumer, handed_over: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch, acked: str
) -> None:
    """Offset 12's work (generation 7) still runs when the revocation's clean-up is done: Faust's app part did not wait
    for it (the app stopping, or ``consumer.assignment()`` read empty after a resubscription: Faust then skips its
    stop and ``wait_empty``). It acknowledges late, while the partition is another member's, whose writer epoch may
    have fenced its writes. The group gives the partition back two generations on, nothing committed past 10: 12 is
    handed over again, not acknowledged unread as finished, and no commit passes it before it is done again."""
    consumer._committed_offset[ITEMS_1] = 10
    straggler = taken_by_a_stream(consumer, 12)
    await revoke(consumer, monkeypatch)
    if acked == "after the next assignment":
        await assign(consumer, monkeypatch, ITEMS_0, committed=7)
    assert straggler.ack(consumer) is False  # Faust's Message.ack: its last reference gone, the consumer's ack
    assert ITEMS_1 not in consumer._acked_index and ITEMS_1 not in consumer._acked
    assert straggler not in consumer._unacked_messages  # a later revocation's wait_empty does not wait for it
    if acked == "before the next assignment":
        await assign(consumer, monkeypatch, ITEMS_0, committed=7)
    await revoke(consumer, monkeypatch, ITEMS_0)
    await assign(consumer, monkeypatch, ITEMS_1, committed=10)
    await read(consumer, range(10, 14))
    assert handed_over["delivered"] == [10, 11, 12, 13]
    assert consumer.redeliveries_skipped == {}
    for offset in (10, 11, 13):
        assert taken_by_a_stream(consumer, offset).ack(consumer)
    assert consumer._new_offset(ITEMS_1) == 12


@pytest.mark.parametrize(
    "acked",
    [
        "before the next assignment",
        "as Faust's listener sets the next generation",
        "as the next assignment is handed over",
        "after the next assignment",
    ],
)
async def test_a_late_ack_of_a_partition_the_same_member_keeps_in_the_very_next_generation_is_taken(
    consumer: ReboundConsumer,
    handed_over: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
    coordinator: SimpleNamespace,
    acked: str,
) -> None:
    """The same revocation that does not wait for the streams (a resubscription), but the assignor gives items-1
    back to the same member in the very next generation, as it usually does: nobody else held it meanwhile, so the
    work taken in generation 7 and finished late counts, as :attr:`_finished` counts work finished before the
    revocation. Refused, 10 to 12 ran twice (and with the dispatcher, which still tracks them, stalled: below).
    Handed over: the consumer thread has set the new generation, the worker's loop has not run its part yet. Faust's
    listener sets the app's generation before that (the window is still open): remembered as finished in generation
    7 all the same (compared with the app's generation, 8 by then, they were let go of and ran twice)."""
    consumer._committed_offset[ITEMS_1] = 10
    late = [taken_by_a_stream(consumer, offset) for offset in (10, 11, 12)]
    await revoke(consumer, monkeypatch)
    if acked == "before the next assignment":
        assert [message.ack(consumer) for message in late] == [False, False, False]  # not Faust's: remembered
        await assign(consumer, monkeypatch, ITEMS_1, committed=10)
    elif acked == "as Faust's listener sets the next generation":
        coordinator.generation = consumer.app.consumer_generation_id = 8  # the consumer thread, before its first step
        assert [message.ack(consumer) for message in late] == [False, False, False]  # not Faust's: remembered
        consumer.assignment_handed_over({ITEMS_1}, 8)
        await assign(consumer, monkeypatch, ITEMS_1, committed=10, generations=0)
    elif acked == "as the next assignment is handed over":
        coordinator.generation = consumer.app.consumer_generation_id = 8  # as Faust's listener sets it
        consumer.assignment_handed_over({ITEMS_1}, 8)
        assert [message.ack(consumer) for message in late] == [True, True, True]
        await assign(consumer, monkeypatch, ITEMS_1, committed=10, generations=0)  # the worker loop's part
    else:
        await assign(consumer, monkeypatch, ITEMS_1, committed=10)
        assert [message.ack(consumer) for message in late] == [True, True, True]
    await read(consumer, range(10, 14))
    assert handed_over["delivered"] == [13]
    assert not any(message in consumer._unacked_messages for message in late)
    assert consumer._new_offset(ITEMS_1) == 13


@pytest.mark.parametrize("given_back", ["a generation later", "to a new member id"])
async def test_a_late_ack_is_refused_where_another_member_may_have_held_the_partition_meanwhile(
    consumer: ReboundConsumer, handed_over: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch, given_back: str
) -> None:
    """items-1 comes back, but not in the very next generation to the same member id: another member may have held
    it and fenced (or run again) offset 12's work, so its late acknowledgement is refused and 12 runs again."""
    consumer._committed_offset[ITEMS_1] = 10
    late = taken_by_a_stream(consumer, 12)
    await revoke(consumer, monkeypatch)
    if given_back == "a generation later":
        await assign(consumer, monkeypatch, ITEMS_1, committed=10, generations=2)
    else:
        await assign(consumer, monkeypatch, ITEMS_1, committed=10, member="rebound-1-77aa")
    assert late.ack(consumer) is False
    assert late not in consumer._unacked_messages
    await read(consumer, range(10, 14))
    assert handed_over["delivered"] == [10, 11, 12, 13]


class StreamEvent:
    """What the dispatcher needs of Faust's event: its message, and its ``ack`` (Faust's ``Message.ack``, down to
    the consumer's); weakly referable, as the dispatcher sets it as its work's current event."""

    def __init__(self, consumer: ReboundConsumer, message: ConsumerMessage) -> None:
        self.consumer, self.message = consumer, message

    def ack(self) -> bool:
        return bool(self.message.ack(self.consumer))


@pytest.mark.parametrize("finished", ["before the next assignment", "after the next assignment"])
async def test_work_a_revocation_did_not_wait_for_ends_acknowledged_once_on_a_partition_given_back_at_once(
    runtime: Runtime,
    consumer: ReboundConsumer,
    handed_over: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
    finished: str,
) -> None:
    """The real dispatcher: Faust's revocation skipped its stop of the flow, so the dispatcher still tracks offset
    10's work (generation 7) when the same member gets items-1 back in generation 8 and reads 10 again. Finished
    before that assignment, it is remembered and 10 is not run again; finished after it, the copy read again is a
    second delivery (abandoned) and the late acknowledgement is taken. Refused, 10 ran twice, or was neither
    acknowledged nor read again (the dispatcher forgets an acknowledgement the consumer refuses): commits stalled."""
    dispatcher = runtime.dispatcher
    consumer._committed_offset[ITEMS_1] = 10
    gate = asyncio.Event()
    runs: list[int] = []

    async def run(event: Any) -> None:
        runs.append(event.message.offset)
        await gate.wait()

    dispatcher.offer(StreamEvent(consumer, taken_by_a_stream(consumer, 10)), "k", run)
    await asyncio.sleep(0)
    await revoke(consumer, monkeypatch)  # (Faust's app part, with the dispatcher's revoke, skipped)
    if finished == "before the next assignment":
        gate.set()
        await dispatcher.wait_idle()
    await assign(consumer, monkeypatch, ITEMS_1, committed=10)
    await read(consumer, range(10, 11))
    if handed_over["delivered"]:  # read again by a stream: offered again
        dispatcher.offer(StreamEvent(consumer, taken_by_a_stream(consumer, 10)), "k", run)
    gate.set()
    await dispatcher.wait_idle()
    assert runs == [10]
    assert consumer._new_offset(ITEMS_1) == 11


@pytest.mark.parametrize(
    ("generations", "member"),
    [(2, MEMBER), (1, "rebound-1-9a7e")],
    ids=["a generation skipped", "a new member id"],
)
async def test_a_refused_late_ack_of_work_the_dispatcher_still_tracked_has_its_offset_read_again(
    runtime: Runtime,
    consumer: ReboundConsumer,
    handed_over: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
    generations: int,
    member: str,
) -> None:
    """As above, but items-1 comes back where another member may have held it meanwhile: the copy of 10 read again is
    a second delivery (the dispatcher still tracks the original), and the original's late acknowledgement is refused.
    Nothing read 10 again before the next rebalance (commits stuck at None; only the check of commits held behind
    acknowledged offsets could heal it, and it needs later acknowledgements): the partition is read again from 10
    before the next fetch, and 10 runs again (at-least-once)."""
    dispatcher = runtime.dispatcher
    consumer._committed_offset[ITEMS_1] = 10
    gate = asyncio.Event()
    runs: list[int] = []

    async def run(event: Any) -> None:
        runs.append(event.message.offset)
        await gate.wait()

    dispatcher.offer(StreamEvent(consumer, taken_by_a_stream(consumer, 10)), "k", run)
    await asyncio.sleep(0)
    await revoke(consumer, monkeypatch)  # (Faust's app part, with the dispatcher's revoke, skipped)
    await assign(consumer, monkeypatch, ITEMS_1, committed=10, generations=generations, member=member)
    await read(consumer, range(10, 11))
    dispatcher.offer(StreamEvent(consumer, taken_by_a_stream(consumer, 10)), "k", run)  # a second delivery
    gate.set()
    await dispatcher.wait_idle()
    assert runs == [10]
    assert consumer._new_offset(ITEMS_1) is None
    assert consumer._reposition == {ITEMS_1: 10}
    monkeypatch.setattr(consumer, "assignment", lambda: {ITEMS_1})
    monkeypatch.setattr(consumer, "positions_check_interval", float("inf"))
    await consumer._before_each_fetch()
    assert handed_over["seeks"] == [10]
    await read(consumer, range(10, 11))
    dispatcher.offer(StreamEvent(consumer, taken_by_a_stream(consumer, 10)), "k", run)
    await dispatcher.wait_idle()
    assert runs == [10, 10]
    assert consumer._new_offset(ITEMS_1) == 11


async def test_records_not_run_again_count_towards_the_periodic_commit(
    consumer: ReboundConsumer, handed_over: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Acknowledged as a stream's ``ack`` would, they count in ``_n_acked``: a partition read again that is all
    finished records is committed every ``_commit_every`` acknowledgements, as Faust's loop does."""
    committed_at(consumer, 10, list(range(10, 16)))
    await revoke(consumer, monkeypatch)
    await assign(consumer, monkeypatch, ITEMS_1, committed=10)
    commits: list[int] = []

    async def commit() -> bool:
        commits.append(consumer._n_acked)
        return True

    monkeypatch.setattr(consumer, "commit", commit)
    consumer._commit_every, consumer._n_acked = 3, 0
    await read(consumer, range(10, 17))
    assert handed_over["delivered"] == [16]
    assert len(commits) == 2  # before 13 and before 16


async def test_a_seek_back_in_the_same_generation_does_not_run_acknowledged_records_again(
    consumer: ReboundConsumer, handed_over: dict[str, list[int]]
) -> None:
    """Records dropped on their way to a stream are read again from the committed offset; those acknowledged since
    are acknowledged already and only wait for their commit."""
    committed_at(consumer, 40, [42, 43])
    consumer.read_cursors.positioned(ITEMS_1, 40)
    await read(consumer, range(40, 45))
    assert handed_over["delivered"] == [40, 41, 44]
    assert consumer._acked[ITEMS_1] == [42, 43]  # not acknowledged twice
    assert consumer.redeliveries_skipped == {"items": 2}


async def test_a_commit_forgets_the_finished_offsets_it_passes(
    consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finished records deleted before they were read again (retention, compaction) are never read again: the commit
    that passes over them (a confirmed gap) forgets them."""

    async def committed(*args: Any, **kwargs: Any) -> bool:
        return True

    monkeypatch.setattr(type(consumer).__mro__[1], "_commit_offsets", committed)
    consumer._finished[ITEMS_1] = {5, 9}
    consumer._finished[ITEMS_0] = {5}
    assert await consumer._commit_offsets({ITEMS_1: 6, ITEMS_0: 6})
    assert consumer._finished == {ITEMS_1: {9}}


async def test_offsets_of_unacknowledged_topics_are_never_remembered(
    consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    changelog = TP("rebound-retry_state-changelog", 1)
    monkeypatch.setattr(consumer, "_must_see_every_offset", lambda tp: tp != changelog)
    message = ReadMessage(3)
    message.tp = changelog
    consumer.abandon(message, finished=True)  # type: ignore[arg-type]
    assert consumer._finished == {}
