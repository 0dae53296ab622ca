"""The writer-epoch fence on a real Faust table (memory store): stamping, replay, and when a claim is made.

The changelog topic's ``send_soon`` is recorded instead of producing (what reaches the broker is covered by
``tests/integration/test_fencing.py``); everything else is Faust's own table, store and recovery objects.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from faust.types import TP

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
    """Every changelog record sent, acknowledged at once."""
    records: list[dict[str, Any]] = []

    def send_soon(**kwargs: Any) -> asyncio.Future[Any]:
        records.append(kwargs)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(None)
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
    await fence._send_acknowledged(records)
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

    The previous owner's settle of ``k`` landed after A's high watermark and before A's marker: B, reading from the
    start like every other reader, applies it. Resumed from its point with its claim's epoch, A would skip it as older
    and, at its next claim, write its copy over it: a settled held message back in the table.
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
