"""The writer-epoch fence on a real Faust table (memory store): stamping, replay, and when a claim is made.

The changelog topic's ``send_soon`` is recorded instead of producing (what reaches the broker is covered by
``tests/integration/test_fencing.py``); everything else is Faust's own table, store and recovery objects.
"""

from __future__ import annotations

import asyncio
import runpy
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord
from faust.types import TP
from faust.types.tuples import RecordMetadata

from agents.runtime import Runtime
from app.factory import build
from rebound.fencing import encode_epoch, epoch_key, next_claim, record_epoch
from rebound.headers import WRITER_EPOCH
from rebound.settings import load_settings
from tables.fencing import TableFence
from tests.app_under_test import build_runtime


@pytest.fixture
def fence(runtime: Runtime) -> TableFence:
    fence = runtime.fences[0]
    assert fence.table is runtime.table
    return fence  # type: ignore[no-any-return]


@pytest.fixture
def sent(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    return record_sends(runtime, monkeypatch)


def record_sends(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every changelog record sent, acknowledged at once, at the offsets that follow the high watermark of the
    partition's last recovery: nothing else landed in between (:class:`Changelog` models what did)."""
    records: list[dict[str, Any]] = []
    next_offsets: dict[int, int] = {}

    def send_soon(**kwargs: Any) -> asyncio.Future[Any]:
        records.append(kwargs)
        partition = kwargs["partition"]
        tp = changelog_tp(runtime, partition)
        highwater = runtime.app.tables.recovery.active_highwaters.get(tp, -1)
        offset = next_offsets[partition] = max(next_offsets.get(partition, 0), highwater + 1)
        next_offsets[partition] += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(RecordMetadata(tp.topic, partition, tp, offset, 0, 0))
        return future

    monkeypatch.setattr(runtime.table.changelog_topic, "send_soon", send_soon)
    return records


def changelog_tp(runtime: Runtime, partition: int) -> TP:
    return TP(runtime.table.changelog_topic.get_topic_name(), partition)


def event(runtime: Runtime, partition: int, offset: int, key: bytes, value: bytes | None, epoch: int | None) -> Any:
    headers = [(WRITER_EPOCH, encode_epoch(epoch))] if epoch is not None else []
    message = SimpleNamespace(
        tp=changelog_tp(runtime, partition),
        partition=partition,
        offset=offset,
        key=key,
        value=value,
        headers=headers,
    )
    return SimpleNamespace(message=message, key=key, value=value)  # Faust's Event: raw serializers, same bytes


async def test_a_replay_keeps_the_new_owners_value_over_a_late_write(runtime: Runtime, fence: TableFence) -> None:
    table = runtime.table
    table.apply_changelog_batch(
        [
            event(runtime, 1, 0, epoch_key(1), encode_epoch(1), 1),
            event(runtime, 1, 1, b"k", b"first owner", 1),
            event(runtime, 1, 2, epoch_key(1), encode_epoch(2), 2),
            event(runtime, 1, 3, b"k", b"second owner", 2),
            event(runtime, 1, 4, b"k", None, 1),  # the first owner's settle, sent when it ran again
            event(runtime, 1, 5, b"j", b"unstamped", None),
        ]
    )
    assert table.data.data == {epoch_key(1): b"2", b"k": b"second owner", b"j": b"unstamped"}
    assert fence.records_skipped == 1


async def test_the_claim_is_above_the_replay_and_rewrites_what_was_skipped(
    runtime: Runtime, fence: TableFence, sent: list[dict[str, Any]]
) -> None:
    runtime.table.apply_changelog_batch(
        [
            event(runtime, 1, 0, epoch_key(1), encode_epoch(4), 4),
            event(runtime, 1, 1, b"k", b"owner 4", 4),
            event(runtime, 1, 2, b"k", b"late", 3),
        ]
    )
    claimed = next_claim(4, 7)
    records = fence.claim([1], generation=7)
    assert records == [
        (1, epoch_key(1), encode_epoch(claimed)),
        (1, b"k", b"owner 4"),  # so compaction cannot keep only the skipped record
    ]
    await fence._send_acknowledged(records, generation=7)
    assert [(r["key"], r["value"], record_epoch(r["headers"])) for r in sent] == [
        (key, value, claimed) for _partition, key, value in records
    ]
    fence.send_changelog(1, b"k", b"next write")
    assert record_epoch(sent[-1]["headers"]) == claimed


async def test_no_claim_from_a_recovery_a_newer_rebalance_interrupted(
    runtime: Runtime, fence: TableFence, sent: list[dict[str, Any]]
) -> None:
    """Faust calls the tables' completion of an interrupted recovery with partitions it has not read to the end."""
    recovery = runtime.app.tables.recovery
    tp = changelog_tp(runtime, 0)
    recovery._generation_id = runtime.app.consumer_generation_id = 3
    recovery.active_highwaters[tp] = 10
    recovery.active_offsets[tp] = 4
    await runtime.table.on_recovery_completed({tp}, set())
    assert sent == []
    recovery.active_offsets[tp] = 10
    recovery.signal_recovery_start.set()  # a newer rebalance started
    await runtime.table.on_recovery_completed({tp}, set())
    assert sent == []
    recovery.signal_recovery_start.clear()
    runtime.app.consumer_generation_id = 4  # assigned again; Faust signals its recovery a moment later
    await runtime.table.on_recovery_completed({tp}, set())
    assert sent == []
    runtime.app.consumer_generation_id = 3
    await runtime.table.on_recovery_completed({tp}, set())
    assert [(r["key"], record_epoch(r["headers"])) for r in sent] == [(epoch_key(0), next_claim(None, 3))]


async def test_a_replay_resumes_at_its_point_with_the_claim_in_force_there(
    rocksdb_runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not the highest epoch the store ever saw (a later claim's marker sits after the point in the log), and not the
    epoch read before the claim either: what landed after the recovery's high watermark, even before the marker, was
    never in this owner's copy, which its writes then changed (a frozen previous owner's last writes: one table's
    tail applied and the other's not left payloads deleted under states that still named them)."""
    runtime = rocksdb_runtime
    fence: TableFence = runtime.fences[0]
    sent = record_sends(runtime, monkeypatch)
    tp = changelog_tp(runtime, 1)
    assert fence.persisted_offset(tp) == -1  # nothing kept yet: from the start
    first, second = next_claim(None, 1), next_claim(next_claim(None, 1), 2)
    runtime.table.apply_changelog_batch(
        [event(runtime, 1, 0, epoch_key(1), encode_epoch(first), first), event(runtime, 1, 1, b"k", b"v1", first)]
    )
    runtime.table.apply_changelog_batch(
        [event(runtime, 1, 2, epoch_key(1), encode_epoch(second), second), event(runtime, 1, 3, b"k", b"v2", second)]
    )
    assert fence.persisted_offset(tp) == 3
    recovery = runtime.app.tables.recovery
    recovery.active_highwaters[tp] = 3
    recovery.active_offsets[tp] = 3
    recovery._generation_id = runtime.app.consumer_generation_id = 5
    # fetched past the high watermark: not applied, and read again by the next recovery
    runtime.table.apply_changelog_batch([event(runtime, 1, 4, b"j", b"landed before the marker", second)])
    assert runtime.table.data._db_for_partition(1).get(b"j") is None
    assert fence.records_deferred == 1
    await runtime.table.on_recovery_completed({tp}, set())  # claims round 3; the point stays where it read to
    claimed = fence.writer_epoch(1)
    assert fence.persisted_offset(tp) == 3
    read_again(
        runtime,
        tp,
        [
            event(runtime, 1, 4, b"j", b"landed before the marker", second),
            event(runtime, 1, 5, epoch_key(1), encode_epoch(claimed), claimed),
        ],
    )
    assert runtime.table.data._db_for_partition(1).get(b"j") is None
    del sent[:]
    await recover(runtime, tp, read_to=5, generation=6)
    assert [(r["key"], r["value"]) for r in sent][1:] == [(b"j", None)]  # so compaction cannot keep only that record


async def test_after_an_eviction_every_partition_is_emptied_and_read_again_from_the_start(
    rocksdb_runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = rocksdb_runtime
    fence: TableFence = runtime.fences[0]
    member = {"id": "member-1"}
    monkeypatch.setattr(fence, "_member_id", lambda: member["id"])
    tp = changelog_tp(runtime, 1)
    fence.persisted_offset(tp)
    epoch = next_claim(None, 1)
    runtime.table.apply_changelog_batch(
        [event(runtime, 1, 0, epoch_key(1), encode_epoch(epoch), epoch), event(runtime, 1, 1, b"k", b"v", epoch)]
    )
    fence.claim([1], generation=1)
    claimed = fence.writer_epoch(1)
    db = runtime.table.data._db_for_partition(1)
    db.put(b"late-only", b"this worker's own late write")  # in its copy, skipped by everyone else's replay
    assert fence.persisted_offset(tp) == 1
    member["id"] = "member-2"  # the group dropped this worker; it joined again under a new id
    assert fence.persisted_offset(tp) == -1
    assert list(db.keys()) == []  # emptied: read again from the start
    sent = record_sends(runtime, monkeypatch)
    fence.send_changelog(1, b"resent", b"old")  # RetryStore resending a write that failed before the eviction
    assert record_epoch(sent[-1]["headers"]) == claimed  # still the old claim: skipped if anyone claimed since


async def test_a_member_id_reset_before_the_rejoin_does_not_hide_the_eviction(
    rocksdb_runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiokafka clears the member id (to "") when it is dropped, and gets a new one when it joins again."""
    runtime = rocksdb_runtime
    fence: TableFence = runtime.fences[0]
    member: dict[str, str | None] = {"id": "member-1"}
    monkeypatch.setattr(fence, "_member_id", lambda: member["id"])
    tp = changelog_tp(runtime, 0)
    fence.persisted_offset(tp)
    runtime.table.apply_changelog_batch([event(runtime, 0, 0, b"k", b"v", None)])
    assert fence.persisted_offset(tp) == 0
    member["id"] = None
    fence.claim([], generation=1)
    assert fence.persisted_offset(tp) == 0
    member["id"] = "member-2"
    assert fence.persisted_offset(tp) == -1


async def test_a_restarted_worker_does_not_trust_the_copy_it_left(tmp_path: Path) -> None:
    """It may hold the worker's own writes that landed late, which every other replay skips."""
    settings = load_settings(
        handler="tests.scripted_handler:handle", data_dir=str(tmp_path), provision_topics=False, store="rocksdb://"
    )
    before = build(settings, partitions=2)
    tp = changelog_tp(before, 1)
    before.fences[0].persisted_offset(tp)
    before.table.apply_changelog_batch([event(before, 1, 0, b"k", b"v", None)])
    assert before.fences[0].persisted_offset(tp) == 0
    for db in before.table.data._dbs.values():
        db.close()
    after = build(settings, partitions=2)
    try:
        assert after.fences[0].persisted_offset(tp) == -1
        assert list(after.table.data._db_for_partition(1).keys()) == []
    finally:
        for db in after.table.data._dbs.values():
            db.close()


async def test_a_revoked_partition_is_read_again_from_the_start_and_a_kept_one_resumes_at_its_point(
    rocksdb_runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faust's own ``on_rebalance`` of the table (``TableManager`` calls it before recovery asks where to start)."""
    runtime = rocksdb_runtime
    fence: TableFence = runtime.fences[0]
    record_sends(runtime, monkeypatch)
    tp = changelog_tp(runtime, 1)
    fence.persisted_offset(tp)
    first = next_claim(None, 1)
    await recover(
        runtime,
        tp,
        read_to=1,
        generation=5,
        fetched=[
            event(runtime, 1, 0, epoch_key(1), encode_epoch(first), first),
            event(runtime, 1, 1, b"k", b"v", first),
        ],
    )
    source_tp = TP("orders", 1)  # a source partition with the same number: not the changelog's
    await runtime.table.on_rebalance({tp}, {source_tp}, set(), 6)
    assert fence.persisted_offset(tp) == 1
    await runtime.table.on_rebalance(set(), {tp}, set(), 7)
    await runtime.table.on_rebalance({tp}, set(), {tp}, 8)  # back to this worker
    assert fence.persisted_offset(tp) == -1
    assert list(runtime.table.data._db_for_partition(1).keys()) == []


async def test_a_partition_back_from_another_owner_keeps_what_that_owner_accepted(
    two_workers: tuple[Runtime, Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claims the partition, loses it to B, and gets it back (same process, same member id).

    The previous owner's settle of ``k`` landed after A's high watermark and before A's marker, and A's claim did not
    write ``k`` over it (a newer rebalance started while it read that span: ``_read_span`` gives up; here A's sends
    are simply acknowledged as if nothing had landed): B, reading from the start like every other reader, applies it.
    Resumed from its point with its claim's epoch, A would skip it as older and, at its next claim, write its copy
    over it: a settled held message back in the table.
    """
    a, b = two_workers
    sent_a = record_sends(a, monkeypatch)
    record_sends(b, monkeypatch)
    tp_a, tp_b = changelog_tp(a, 1), changelog_tp(b, 1)
    old = next_claim(None, 1)
    log = [event(a, 1, 0, epoch_key(1), encode_epoch(old), old), event(a, 1, 1, b"k", b"held (old owner)", old)]
    assert a.table.persisted_offset(tp_a) == -1
    await recover(a, tp_a, read_to=1, generation=5, fetched=log)
    mark_a = a.fences[0].writer_epoch(1)
    log += [
        event(a, 1, 2, b"k", None, old),  # the previous owner's late settle, landed before A's marker
        event(a, 1, 3, epoch_key(1), encode_epoch(mark_a), mark_a),
    ]
    await a.table.on_rebalance(set(), {tp_a}, set(), 6)  # the partition moves to B
    assert b.table.persisted_offset(tp_b) == -1
    await recover(b, tp_b, read_to=3, generation=6, fetched=log)
    assert b.table.data._db_for_partition(1).get(b"k") is None  # the settle counts: it landed before A's marker
    mark_b = b.fences[0].writer_epoch(1)
    log.append(event(a, 1, 4, epoch_key(1), encode_epoch(mark_b), mark_b))
    await a.table.on_rebalance({tp_a}, set(), {tp_a}, 7)  # and back to A
    start = a.table.persisted_offset(tp_a)
    del sent_a[:]
    await recover(a, tp_a, read_to=4, generation=7, fetched=[e for e in log if e.message.offset > start])
    assert a.table.data._db_for_partition(1).get(b"k") is None
    assert [(r["key"], r["value"]) for r in sent_a] == [(epoch_key(1), encode_epoch(a.fences[0].writer_epoch(1)))]


async def test_records_past_the_recovery_are_written_over_after_the_claim(
    two_workers: tuple[Runtime, Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left out of the copy, a record fetched past the high watermark must not stay in the log for other readers.

    The previous owner's settle of ``k`` landed before A's marker: every reader from the start would apply it while
    A's copy (on which A acts) still holds ``k``. A's claim writes ``k`` again from its copy after its marker, as for a
    skipped record. A marker fetched there (a newer claim) is no key to write over.
    """
    a, b = two_workers
    sent_a = record_sends(a, monkeypatch)
    record_sends(b, monkeypatch)
    old = next_claim(None, 1)
    newer = next_claim(next_claim(old, 5), 9)
    log = [
        event(a, 1, 0, epoch_key(1), encode_epoch(old), old),
        event(a, 1, 1, b"k", b"held", old),
        event(a, 1, 2, b"k", None, old),  # fetched past the high watermark
        event(a, 1, 3, b"j", b"landed late", old),
        event(a, 1, 4, epoch_key(1), encode_epoch(newer), newer),
    ]
    a.table.persisted_offset(changelog_tp(a, 1))
    await recover(a, changelog_tp(a, 1), read_to=1, generation=5, fetched=log)
    assert a.fences[0].records_deferred == 3
    mark_a = a.fences[0].writer_epoch(1)
    claim_a = [(r["key"], r["value"]) for r in sent_a]
    assert claim_a == [(epoch_key(1), encode_epoch(mark_a)), (b"j", None), (b"k", b"held")]
    log = log[:4] + [event(a, 1, offset, key, value, mark_a) for offset, (key, value) in enumerate(claim_a, start=4)]
    b.table.persisted_offset(changelog_tp(b, 1))  # A loses the partition before reading any further; B reads it all
    await recover(b, changelog_tp(b, 1), read_to=log[-1].message.offset, generation=6, fetched=log)
    for key in (b"k", b"j"):
        assert b.table.data._db_for_partition(1).get(key) == a.table.data._db_for_partition(1).get(key)


@pytest.fixture
async def two_workers(tmp_path: Path) -> AsyncIterator[tuple[Runtime, Runtime]]:
    """Two processes' tables, each with its own RocksDB data directory."""
    runtimes = tuple(build_runtime(tmp_path / name, store="rocksdb://") for name in ("a", "b"))
    yield runtimes[0], runtimes[1]
    for runtime in runtimes:
        for db in runtime.table.data._dbs.values():
            db.close()


def read_again(runtime: Runtime, tp: TP, events: list[Any]) -> None:
    """The replay of a recovery whose high watermark is the last of ``events`` (Faust takes it before reading)."""
    runtime.app.tables.recovery.active_highwaters[tp] = events[-1].message.offset
    runtime.table.apply_changelog_batch(events)


async def recover(runtime: Runtime, tp: TP, *, read_to: int, generation: int, fetched: list[Any] | None = None) -> None:
    """Faust's recovery that reads ``tp``'s changelog through ``read_to`` (its high watermark, taken first): the
    replay of what it ``fetched`` (which may run past it), then its completion (the claim follows)."""
    recovery = runtime.app.tables.recovery
    recovery.active_highwaters[tp] = read_to
    if fetched:
        runtime.table.apply_changelog_batch(fetched)
    recovery.active_offsets[tp] = read_to
    recovery._generation_id = runtime.app.consumer_generation_id = generation
    await runtime.table.on_recovery_completed({tp}, set())


async def test_a_record_fetched_before_a_rebalance_does_not_hide_the_records_before_it_from_the_next_recovery(
    rocksdb_runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faust's own recovery loop, interrupted by a rebalance and started again (chaos run b-keyrandom2, issue 22).

    The first read's fetch ran ahead of the replay; the rebalance cleared the changelog queue (offsets 3 and 4) but
    not the record the conductor was still waiting to put there (5: the queue was full, and the put waits for the flow
    to resume). Resumed by the next recovery, it lands before the records fetched again from the replay point; Faust
    takes its offset as read and drops 3 and 4 when they come again: a deletion and a newer owner's marker that the
    copy never gets, while the partition counts as read to the end (its claim below that marker).
    """
    runtime = rocksdb_runtime
    record_sends(runtime, monkeypatch)
    app, table, fence = runtime.app, runtime.table, runtime.fences[0]
    recovery = app.tables.recovery
    queue = app.tables.changelog_queue
    tp = changelog_tp(runtime, 1)
    old = next_claim(None, 6)
    newer = next_claim(next_claim(old, 7), 8)
    log = [
        (epoch_key(1), encode_epoch(old), old),
        (b"k", b"held", old),
        (b"j", b"held", old),
        (epoch_key(1), encode_epoch(newer), newer),
        (b"k", None, newer),
        (b"j", b"next", newer),
    ]

    def fetched(offset: int, generation: int) -> Any:
        record = event(runtime, 1, offset, *log[offset])
        record.message.generation_id = generation  # Faust stamps what it fetches with the generation then
        return record

    async def replayed_to(offset: int) -> None:
        for _ in range(200):
            if queue.empty() and recovery.active_offsets.get(tp) == offset:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"the replay did not reach {offset}: {recovery.active_offsets.get(tp)}")

    slurp = asyncio.create_task(type(recovery)._slurp_changelogs.fun(recovery))  # type: ignore[attr-defined]
    try:
        app.consumer_generation_id = recovery._generation_id = 9
        recovery.add_active(table, tp)  # asks the fence where to start: the beginning
        recovery.active_highwaters[tp] = 5
        recovery._set_recovery_started()
        app.flow_control.resume()
        for offset in range(3):
            await queue.put(fetched(offset, 9))
        await replayed_to(2)
        app.flow_control.suspend()  # the rebalance: Faust suspends the flow, then clears the queues
        # the conductor's put of a record the queue had no room for (Faust's on_message, in a task of its own)
        waiting = asyncio.ensure_future(queue.put(fetched(5, 9)))
        await asyncio.sleep(0)
        app.flow_control.clear()
        recovery.flush_buffers()
        app.consumer_generation_id = recovery._generation_id = 10
        await table.on_rebalance({tp}, set(), set(), 10)
        recovery.add_active(table, tp)
        assert recovery.active_offsets[tp] == 2  # the next read starts where the first one applied to
        app.flow_control.resume()
        await waiting  # before what the new fetch brings
        for offset in range(2, 6):
            await queue.put(fetched(offset, 10))
        await replayed_to(5)
        recovery.flush_buffers()
    finally:
        slurp.cancel()
    assert fence.records_fetched_before == 1
    await table.on_recovery_completed({tp}, set())
    assert table.data._db_for_partition(1).get(b"k") is None
    assert table.data._db_for_partition(1).get(b"j") == b"next"
    assert fence.writer_epoch(1) == next_claim(newer, 10)


class Changelog:
    """One changelog partition as the broker keeps it: every writer's records in the order they landed, the offsets
    their sends are acknowledged with, and a group-less consumer over it (aiokafka's, as the fence uses it)."""

    def __init__(self, runtime: Runtime, partition: int) -> None:
        self.runtime, self.partition = runtime, partition
        self.records: list[Any] = []
        self.landing_before_the_next_send: list[tuple[bytes, bytes | None, int]] = []
        """Records of other writers that land between the recovery's high watermark and this worker's next send."""
        self.readers_made = 0

    def land(self, key: bytes, value: bytes | None, epoch: int | None) -> int:
        offset = len(self.records)
        self.records.append(event(self.runtime, self.partition, offset, key, value, epoch))
        return offset

    def written_by(self, runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
        """``runtime``'s changelog sends land here, each acknowledged with its offset."""
        sent: list[dict[str, Any]] = []

        def send_soon(**kwargs: Any) -> asyncio.Future[Any]:
            assert kwargs["partition"] == self.partition
            sent.append(kwargs)
            for record in self.landing_before_the_next_send:
                self.land(*record)
            self.landing_before_the_next_send.clear()
            offset = self.land(kwargs["key"], kwargs["value"], record_epoch(kwargs["headers"]))
            tp = changelog_tp(runtime, self.partition)
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            future.set_result(RecordMetadata(tp.topic, tp.partition, tp, offset, 0, 0))
            return future

        monkeypatch.setattr(runtime.table.changelog_topic, "send_soon", send_soon)
        return sent

    def reader(self) -> Any:
        self.readers_made += 1
        return SpanReader(self)


class SpanReader:
    """What the fence calls of aiokafka's ``AIOKafkaConsumer`` (group-less: assign, seek, fetch), over a model log."""

    def __init__(self, changelog: Changelog) -> None:
        self.changelog = changelog
        self.at: int | None = None
        self.stopped = False

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.stopped = True

    def assign(self, partitions: list[Any]) -> None:
        assert [tp.partition for tp in partitions] == [self.changelog.partition]

    def seek(self, tp: Any, offset: int) -> None:
        self.at = offset

    async def position(self, tp: Any) -> int:
        assert self.at is not None
        return self.at

    async def getmany(self, *partitions: Any, timeout_ms: int = 0, max_records: int | None = None) -> dict[Any, Any]:
        assert self.at is not None
        tp = partitions[0]
        fetched = [
            ConsumerRecord(
                tp.topic, tp.partition, r.message.offset, 0, 0, r.key, r.value, None, 0, 0, r.message.headers
            )
            for r in self.changelog.records[self.at :]
        ]
        self.at = len(self.changelog.records)
        return {tp: fetched} if fetched else {}


async def test_a_late_write_landing_between_the_high_watermark_and_the_marker_is_written_over(
    two_workers: tuple[Runtime, Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chaos --ordering key --outcome random --seed 2 (92f73b4, 3 lost): the previous owner's write of ``k`` landed
    after the high watermark A's recovery read to, and after its last fetch, but before A's marker. A never read it;
    every later reader from the start applies it (it precedes the marker), so B's copy held what A's did not (a key
    blocked by a message that had ended, its later messages held for good). A's claim now reads the span between the
    high watermark and its marker and writes those keys again from its copy, after the marker.

    ``j`` shows the records A's recovery did fetch past the high watermark, which the claim writes over already: not
    twice."""
    a, b = two_workers
    log = Changelog(a, 1)
    sent_a = log.written_by(a, monkeypatch)
    record_sends(b, monkeypatch)
    monkeypatch.setattr(a.fences[0], "_changelog_reader", log.reader)
    old = next_claim(None, 1)
    log.land(epoch_key(1), encode_epoch(old), old)
    log.land(b"k", b"held", old)
    log.land(b"j", b"held", old)
    log.land(b"j", None, old)  # fetched past the high watermark (2): left out of A's copy
    log.landing_before_the_next_send.append((b"k", None, old))  # after A's last fetch, before its marker
    tp_a = changelog_tp(a, 1)
    assert a.table.persisted_offset(tp_a) == -1
    await recover(a, tp_a, read_to=2, generation=5, fetched=list(log.records))
    tp_b = changelog_tp(b, 1)
    assert b.table.persisted_offset(tp_b) == -1  # the partition moves to B, which reads it all
    await recover(b, tp_b, read_to=len(log.records) - 1, generation=6, fetched=list(log.records))
    for key in (b"k", b"j"):
        assert b.table.data._db_for_partition(1).get(key) == a.table.data._db_for_partition(1).get(key) == b"held"
    mark_a = a.fences[0].writer_epoch(1)
    assert [(r["key"], r["value"]) for r in sent_a] == [
        (epoch_key(1), encode_epoch(mark_a)),
        (b"j", b"held"),  # the claim's own: left out past the high watermark
        (b"k", b"held"),  # read between the high watermark and the marker
    ]
    assert log.readers_made == 1


async def test_a_marker_right_after_the_high_watermark_makes_no_consumer(
    rocksdb_runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The common case costs nothing; an empty changelog (high watermark -1) is a span from offset 0."""
    runtime = rocksdb_runtime
    log = Changelog(runtime, 1)
    log.written_by(runtime, monkeypatch)
    monkeypatch.setattr(runtime.fences[0], "_changelog_reader", log.reader)
    tp = changelog_tp(runtime, 1)
    runtime.table.persisted_offset(tp)
    await recover(runtime, tp, read_to=-1, generation=3)
    assert log.readers_made == 0 and len(log.records) == 1
    old = next_claim(None, 3)
    log.land(b"k", b"written", old)
    log.landing_before_the_next_send.append((b"k", b"late", old))  # the owner of generation 3, superseded below
    runtime.table.persisted_offset(tp)
    await recover(runtime, tp, read_to=1, generation=4, fetched=list(log.records))
    assert log.readers_made == 1 and runtime.fences[0].keys_written_over_the_span == 1
    assert [(r.key, r.value) for r in log.records[2:]] == [
        (b"k", b"late"),
        (epoch_key(1), encode_epoch(runtime.fences[0].writer_epoch(1))),
        (b"k", b"written"),
    ]

    empty = Changelog(runtime, 0)
    empty.written_by(runtime, monkeypatch)
    monkeypatch.setattr(runtime.fences[0], "_changelog_reader", empty.reader)
    empty.landing_before_the_next_send.append((b"j", b"late", None))  # unstamped: every reader applies it
    tp0 = changelog_tp(runtime, 0)
    runtime.table.persisted_offset(tp0)
    await recover(runtime, tp0, read_to=-1, generation=5)
    assert [(r.key, r.value) for r in empty.records] == [
        (b"j", b"late"),
        (epoch_key(0), encode_epoch(runtime.fences[0].writer_epoch(0))),
        (b"j", None),  # this copy has none: a deletion
    ]


@pytest.mark.parametrize("failure", ["retriable", "not retriable", "rebalance"])
async def test_reading_the_span_retries_gives_up_at_a_rebalance_and_crashes_otherwise(
    rocksdb_runtime: Runtime, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

    runtime = rocksdb_runtime
    fence: TableFence = runtime.fences[0]
    recovery = runtime.app.tables.recovery
    log = Changelog(runtime, 1)
    log.written_by(runtime, monkeypatch)
    crashes: list[BaseException] = []

    async def crash(reason: BaseException) -> None:
        crashes.append(reason)

    monkeypatch.setattr(runtime.app, "crash", crash)
    sleep = asyncio.sleep
    monkeypatch.setattr(asyncio, "sleep", lambda _s: sleep(0))  # the backoff
    readers: list[SpanReader] = []

    def reader() -> SpanReader:
        made = log.reader()
        readers.append(made)
        if len(readers) == 1:  # the first consumer fails to start

            async def start() -> None:
                if failure == "rebalance":
                    recovery.signal_recovery_start.set()
                    raise KafkaConnectionError("no broker")
                raise (KafkaConnectionError if failure == "retriable" else TopicAuthorizationFailedError)()

            made.start = start  # type: ignore[method-assign]
        return made

    monkeypatch.setattr(fence, "_changelog_reader", reader)
    old = next_claim(None, 1)
    log.land(b"k", b"written", old)
    log.landing_before_the_next_send.append((b"k", None, old))
    tp = changelog_tp(runtime, 1)
    runtime.table.persisted_offset(tp)
    try:
        if failure == "not retriable":
            with pytest.raises(TopicAuthorizationFailedError):
                await recover(runtime, tp, read_to=0, generation=4, fetched=list(log.records))
        else:
            await recover(runtime, tp, read_to=0, generation=4, fetched=list(log.records))
    finally:
        recovery.signal_recovery_start.clear()
    assert all(made.stopped for made in readers)
    written_over = [(r.key, r.value) for r in log.records[3:]]
    if failure == "retriable":
        assert len(readers) == 2 and written_over == [(b"k", b"written")] and crashes == []
    elif failure == "rebalance":  # the recovery that follows reads the partition again (from this claim's point)
        assert len(readers) == 1 and written_over == [] and crashes == []
        assert fence.persisted_offset(tp) == 0
    else:
        assert len(readers) == 1 and written_over == [] and len(crashes) == 1


async def test_a_key_the_claim_wrote_before_a_resent_marker_is_written_over_again(
    two_workers: tuple[Runtime, Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim's rewrite of ``j`` (left out past the high watermark) covers a stale record of ``j`` only if it lands
    after the marker. The marker's first send failed and was sent again: the rewrite landed first, then the previous
    owner's settle of ``j``, then the marker. Every reader from the start applies that settle (it precedes the
    marker), so ``j`` is written again after the marker, as every key of the span is whose claim record landed
    before it."""
    from aiokafka.errors import KafkaTimeoutError

    a, b = two_workers
    log = Changelog(a, 1)
    sent_a = log.written_by(a, monkeypatch)
    record_sends(b, monkeypatch)
    monkeypatch.setattr(a.fences[0], "_changelog_reader", log.reader)
    sleep = asyncio.sleep
    monkeypatch.setattr(asyncio, "sleep", lambda _s: sleep(0))  # the resend's backoff
    old = next_claim(None, 1)
    log.land(epoch_key(1), encode_epoch(old), old)
    log.land(b"k", b"held", old)
    log.land(b"j", b"held", old)
    log.land(b"j", None, old)  # fetched past the high watermark (2): the claim writes j again
    landed = a.table.changelog_topic.send_soon
    refused: list[bytes] = []

    def send_soon(**kwargs: Any) -> asyncio.Future[Any]:
        if not refused:  # the marker's first send fails without landing
            refused.append(kwargs["key"])
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            future.set_exception(KafkaTimeoutError())
            return future
        future = landed(**kwargs)
        if kwargs["key"] == b"j" and len(log.records) == 5:  # right after the claim's rewrite, before the marker
            log.land(b"j", None, old)
        return future

    monkeypatch.setattr(a.table.changelog_topic, "send_soon", send_soon)
    tp_a = changelog_tp(a, 1)
    assert a.table.persisted_offset(tp_a) == -1
    await recover(a, tp_a, read_to=2, generation=5, fetched=list(log.records))
    mark_a = a.fences[0].writer_epoch(1)
    assert refused == [epoch_key(1)]
    assert [(r.key, r.value) for r in log.records[4:7]] == [
        (b"j", b"held"),
        (b"j", None),
        (epoch_key(1), encode_epoch(mark_a)),
    ]
    tp_b = changelog_tp(b, 1)
    assert b.table.persisted_offset(tp_b) == -1  # the partition moves to B, which reads it all
    await recover(b, tp_b, read_to=len(log.records) - 1, generation=6, fetched=list(log.records))
    assert b.table.data._db_for_partition(1).get(b"j") == a.table.data._db_for_partition(1).get(b"j") == b"held"
    assert [(r["key"], r["value"]) for r in sent_a][-1] == (b"j", b"held")


def rebalance_as_faust_does(runtime: Runtime, generation: int) -> Any:
    """A newer rebalance the way a stray claim sees it: the generation moves, ``signal_recovery_start`` is set and,
    a few loop turns later, cleared by the recovery that starts (Faust cancels its wait for the tables' completions,
    not the completions: the claim runs on by itself)."""
    recovery = runtime.app.tables.recovery
    sleep = asyncio.sleep

    async def rebalance() -> None:
        runtime.app.consumer_generation_id = recovery._generation_id = generation
        recovery.signal_recovery_start.set()
        await sleep(0)
        recovery.signal_recovery_start.clear()

    return rebalance


async def test_a_rebalance_during_the_span_read_voids_the_rewrite_though_its_signal_is_cleared_again(
    rocksdb_runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read waits in a fetch (up to 500 ms each) while a newer rebalance starts and its recovery clears the
    signal again: only the generation still tells. Here the worker was dropped from the group (a new member id) and
    given the partition back, so the next recovery emptied its copy; the void claim went on to write ``k`` as a
    deletion, with its epoch, though the copy it claimed from held ``k``."""
    runtime = rocksdb_runtime
    fence: TableFence = runtime.fences[0]
    member = {"id": "member-1"}
    monkeypatch.setattr(fence, "_member_id", lambda: member["id"])
    log = Changelog(runtime, 1)
    log.written_by(runtime, monkeypatch)
    old = next_claim(None, 1)
    log.land(b"k", b"held", old)
    log.landing_before_the_next_send.append((b"k", None, old))
    tp = changelog_tp(runtime, 1)
    rebalance = rebalance_as_faust_does(runtime, 5)
    fetches: list[int] = []

    def reader() -> SpanReader:
        made = log.reader()
        fetch = made.getmany

        async def getmany(*partitions: Any, timeout_ms: int = 0, max_records: int | None = None) -> dict[Any, Any]:
            fetches.append(len(fetches))
            if len(fetches) == 1:  # nothing yet; meanwhile the group moves on
                await rebalance()
                member["id"] = "member-2"
                assert fence.persisted_offset(tp) == -1  # the next recovery empties the copy
                return {}
            return await fetch(*partitions, timeout_ms=timeout_ms, max_records=max_records)

        made.getmany = getmany  # type: ignore[method-assign]
        return made

    monkeypatch.setattr(fence, "_changelog_reader", reader)
    assert runtime.table.persisted_offset(tp) == -1
    await recover(runtime, tp, read_to=0, generation=4, fetched=list(log.records))
    assert (
        runtime.app.tables.recovery._generation_id == 5
        and not runtime.app.tables.recovery.signal_recovery_start.is_set()
    )
    assert [(r.key, r.value) for r in log.records[:2]] == [(b"k", b"held"), (b"k", None)]
    assert [r.key for r in log.records[2:]] == [epoch_key(1)]  # the marker only: no rewrite from the emptied copy
    assert fetches == [0]


async def test_a_failed_claim_record_is_not_sent_again_in_a_newer_generation(
    rocksdb_runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim's resend waits out a backoff; a newer rebalance then (its signal already cleared again) voids it."""
    runtime = rocksdb_runtime
    sent = record_sends(runtime, monkeypatch)
    acknowledged = runtime.table.changelog_topic.send_soon
    refused: list[bytes] = []

    def send_soon(**kwargs: Any) -> asyncio.Future[Any]:
        if kwargs["key"] == b"j" and not refused:
            refused.append(kwargs["key"])
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            future.set_exception(ConnectionError("broker gone"))
            return future
        return acknowledged(**kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(runtime.table.changelog_topic, "send_soon", send_soon)
    rebalance = rebalance_as_faust_does(runtime, 5)

    async def backoff(_seconds: float) -> None:
        await rebalance()

    monkeypatch.setattr(asyncio, "sleep", backoff)
    old = next_claim(None, 1)
    tp = changelog_tp(runtime, 1)
    assert runtime.table.persisted_offset(tp) == -1
    fetched = [event(runtime, 1, 0, b"j", b"held", old), event(runtime, 1, 1, b"j", None, old)]
    await recover(runtime, tp, read_to=0, generation=4, fetched=fetched)  # j left out past it: the claim writes j
    assert refused == [b"j"] and runtime.app.tables.recovery._generation_id == 5
    assert [r["key"] for r in sent] == [epoch_key(1)]


async def test_a_span_read_that_stalls_is_logged_and_started_again_with_a_new_consumer(
    rocksdb_runtime: Runtime, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The span's partition has no leader: the first consumer's fetches answer nothing, for ever (all of the
    worker's streams wait on the claim). Past the stall deadline (here 0 s) the read is logged and goes on from where
    it was with a new consumer."""
    import tables.fencing

    runtime = rocksdb_runtime
    fence: TableFence = runtime.fences[0]
    monkeypatch.setattr(tables.fencing, "SPAN_STALL_S", 0.0, raising=False)
    sleep = asyncio.sleep
    monkeypatch.setattr(asyncio, "sleep", lambda _s: sleep(0))  # the backoff
    log = Changelog(runtime, 1)
    log.written_by(runtime, monkeypatch)
    old = next_claim(None, 1)
    log.land(b"k", b"held", old)
    log.landing_before_the_next_send.append((b"k", None, old))
    readers: list[SpanReader] = []

    def reader() -> SpanReader:
        made = log.reader()
        readers.append(made)
        if len(readers) == 1:
            empty: list[int] = []

            async def getmany(*_partitions: Any, timeout_ms: int = 0, max_records: int | None = None) -> dict[Any, Any]:
                empty.append(timeout_ms)
                assert len(empty) < 20, "a stalled read never given up"
                return {}

            made.getmany = getmany  # type: ignore[method-assign]
        return made

    monkeypatch.setattr(fence, "_changelog_reader", reader)
    tp = changelog_tp(runtime, 1)
    assert runtime.table.persisted_offset(tp) == -1
    with caplog.at_level("WARNING", logger="tables.fencing"):
        await recover(runtime, tp, read_to=0, generation=4, fetched=list(log.records))
    assert len(readers) == 2 and all(made.stopped for made in readers)
    assert any("made no progress" in record.getMessage() for record in caplog.records)
    assert [(r.key, r.value) for r in log.records[3:]] == [(b"k", b"held")]


async def test_the_slow_claim_injection_holds_a_claim_back_before_its_marker_is_sent(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``tests/slow_claim_injection.py`` (the worker of ``tests/integration/test_late_write_before_the_marker.py``)
    wraps ``TableFence._send_acknowledged`` by its name. Renamed, or a claim no longer sent through it, this fails
    here, in the fast tier; otherwise only that broker test would, as a worker failing to load its handler or as a
    wait of 90 s for a hold that never comes."""
    sent = record_sends(runtime, monkeypatch)
    monkeypatch.setattr(TableFence, "_send_acknowledged", TableFence._send_acknowledged)  # put back after the test
    monkeypatch.setenv("SLOW_CLAIM_S", "1.5")
    held: list[tuple[float, int]] = []
    sleep = asyncio.sleep

    async def hold(seconds: float) -> None:
        held.append((seconds, len(sent)))
        await sleep(0)

    monkeypatch.setattr(asyncio, "sleep", hold)
    runpy.run_module("tests.slow_claim_injection")  # as the worker imports it: the wrapper put on the class
    tp = changelog_tp(runtime, 1)
    assert runtime.table.persisted_offset(tp) == -1
    with caplog.at_level("WARNING", logger="tests.slow_claim_injection"):
        await recover(runtime, tp, read_to=-1, generation=4)
    assert held == [(1.5, 0)], "the claim was not held back before anything was sent"
    assert [r["key"] for r in sent] == [epoch_key(1)]
    assert any("slow claim: holding" in record.getMessage() for record in caplog.records)
