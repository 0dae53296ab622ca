"""Records this worker finished are not run again when it reads them again: after it got its partition back from a
revocation, or after a seek back in the same generation (app/consumer.py ``_skip_if_finished``).

Chaos runs (key-ordered): a slow record held a partition's commits while hundreds of later records of other keys were
finished; the revocation dropped what was queued, the assignor gave the partition back to the same worker, and it ran
them all again from the committed offset (99.7 % of its repeated handler calls under faults)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from faust.types import TP

from app.consumer import ReboundConsumer
from tests.app.consumer_steps import stub_revocation
from tests.app_under_test import ITEMS_1, FetchedMessage

ITEMS_0 = TP("items", 0)


class ReadMessage(FetchedMessage):
    acked = False


def committed_at(consumer: ReboundConsumer, committed: int, acked: list[int]) -> None:
    consumer._committed_offset[ITEMS_1] = committed
    consumer._acked[ITEMS_1].extend(acked)
    consumer._acked_index[ITEMS_1].update(acked)


async def _nothing(*args: Any) -> None:
    return None


async def revoke(consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A revocation whose app part (stop the flow, wait for the streams, commit) commits nothing more."""
    stub_revocation(consumer, monkeypatch, _nothing)
    await consumer.on_partitions_revoked({ITEMS_1})


async def assign(consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch, *tps: TP, committed: int) -> None:
    """The group's next assignment, then the recovery's seek to the committed offset (Faust's app part stubbed)."""
    monkeypatch.setattr(consumer, "_on_partitions_assigned", _nothing)
    await consumer.on_partitions_assigned(set(tps))

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


async def test_a_partition_with_nothing_committed_forgets_them_all(
    consumer: ReboundConsumer, handed_over: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its topic deleted and created again: the same offsets are other records now."""
    committed_at(consumer, 20, [22, 23])
    await revoke(consumer, monkeypatch)

    async def log_starts(tps: list[TP]) -> dict[TP, int]:
        return dict.fromkeys(tps, 0)

    monkeypatch.setattr(consumer, "_log_starts", log_starts)
    await assign(consumer, monkeypatch, ITEMS_1, committed=0)
    assert consumer._finished == {}


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


async def test_a_commit_forgets_the_finished_offsets_it_passes(consumer: ReboundConsumer) -> None:
    consumer._finished[ITEMS_1] = {5, 9}
    consumer._finished[ITEMS_0] = {5}
    consumer._forget_finished_below(ITEMS_1, 6)
    consumer._forget_finished_below(ITEMS_0, 6)
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
