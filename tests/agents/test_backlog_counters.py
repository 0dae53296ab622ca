"""The backlog's per-tier numbers are counted as messages park and settle, never scanned: checked against a scan.

``local_partition_tiers`` (the store's counters plus the schedule's per-tier heaps) must equal what a scan of the
table's entries says (``tiers_from_entries``), after parks, duplicates, releases that succeed or fail again, an
operator's dead-letter and retry-now, and a re-adoption of the partition.
"""

from __future__ import annotations

import json
from typing import Any

from agents.release import adopt_owned_partitions, release_due
from agents.status import local_partition_tiers, survey_first_received
from rebound import headers as h
from rebound.summary import tiers_from_entries

FIGURES = ("waiting", "overdue", "oldest_due", "next_release")


def retry_record(clock: Any, offset: int, *, attempt: int, due_in_ms: int) -> list[tuple[str, bytes]]:
    provenance = h.Provenance("items", 0, offset, clock.now_ms - 10, clock.now_ms - 5)
    return h.retry_headers(
        [],
        provenance=provenance,
        group="agent-test",
        attempt=attempt,
        due_at_ms=clock.now_ms + due_in_ms,
        error_class="rebound.errors.RetryableError",
        error_message="not yet",
    )


def assert_counts_match_a_scan(runtime: Any, now_ms: int) -> dict[str, dict[str, Any]]:
    counted = local_partition_tiers(runtime)
    scanned = tiers_from_entries(
        (entry for _key, entry in runtime.store.parked()), now_ms=now_ms, partitions=runtime.schedule.partitions
    )
    figures = {tier: {name: stats[name] for name in FIGURES} for tier, stats in counted[0].items() if stats["waiting"]}
    assert figures == {tier: {name: stats[name] for name in FIGURES} for tier, stats in scanned[0].items()}
    return figures


async def test_per_tier_numbers_are_kept_as_messages_park_and_settle(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime(release_batch=1)  # (a record per request: the agent takes some of a tick's requests)
    adopt_owned_partitions(runtime)
    async with (
        runtime.agents["items.retry.1s"].test_context() as first_tier,
        runtime.agents["items.retry.2s"].test_context() as second_tier,
        runtime.agents["release"].test_context() as releaser,
        runtime.agents["admin"].test_context() as admin,
    ):
        for offset in range(1, 13):
            key = f"k{offset % 4}".encode()
            headers = retry_record(clock, offset, attempt=1, due_in_ms=100 * offset)
            await first_tier.put(json.dumps({"succeed_on": offset % 3}).encode(), key=key, headers=headers, partition=0)
        for offset in range(20, 24):
            headers = retry_record(clock, offset, attempt=3, due_in_ms=2000 + offset)
            await second_tier.put(b'{"succeed_on": 0}', key=b"k9", headers=headers, partition=0)
        await first_tier.put(b"{}", key=b"k1", headers=retry_record(clock, 1, attempt=1, due_in_ms=100), partition=0)
        figures = assert_counts_match_a_scan(runtime, clock.now_ms)
        assert (figures["items.retry.1s"]["waiting"], figures["items.retry.2s"]["waiting"]) == (12, 4)
        await survey_first_received(runtime)  # the one figure not counted: read by the periodic survey
        scanned = tiers_from_entries((e for _k, e in runtime.store.parked()), now_ms=clock.now_ms, partitions=[0])
        assert {tier: stats["oldest_first_received"] for tier, stats in local_partition_tiers(runtime)[0].items()} == {
            tier: stats["oldest_first_received"] for tier, stats in scanned[0].items()
        }

        clock.advance(700)  # offsets 1-7 are due; the ones of them whose handler fails again are retried, not parked
        assert_counts_match_a_scan(runtime, clock.now_ms)
        assert await release_due(runtime) == 7  # the timer's tick: 7 requests in flight, still parked
        assert_counts_match_a_scan(runtime, clock.now_ms)
        for request in runtime.release_topic.sent[:4]:  # the release agent has taken 4 of them
            await releaser.put(request.value, key=request.key, partition=request.partition)
        figures = assert_counts_match_a_scan(runtime, clock.now_ms)
        assert figures["items.retry.1s"] == {
            "waiting": 8,
            "overdue": 3,
            "oldest_due": clock.now_ms - 200,
            "next_release": clock.now_ms + 100,
        }

        await admin.put(admin_command("dead-letter", b"k9"), key=b"k9", partition=0)
        await admin.put(admin_command("retry-now", b"k2"), key=b"k2", partition=0)
        figures = assert_counts_match_a_scan(runtime, clock.now_ms)
        assert "items.retry.2s" not in figures

    before = local_partition_tiers(runtime)
    adopt_owned_partitions(runtime)  # the partition read afresh (a rebalance): the same numbers
    assert local_partition_tiers(runtime) == before


def admin_command(action: str, key: bytes) -> bytes:
    from rebound.commands import AdminCommand

    return AdminCommand(action=action, key=key, command_id=f"{action}-1", requested_by="test").to_json()


async def test_a_slow_survey_chunk_is_followed_by_a_longer_pause(make_runtime: Any, monkeypatch: Any) -> None:
    """A busy worker's chunks take longer than the nominal 2 ms: the survey then pauses three times as long as the
    chunk took, so it never holds more than a quarter of the event loop while releases are due."""
    import asyncio
    import time

    from agents import status

    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    chunks = iter([([("items.retry.1s", 5)], b"next"), ([("items.retry.1s", 3)], None)])

    def slow_chunk(partition: int, after: bytes | None, limit: int) -> tuple[list[tuple[str, int]], bytes | None]:
        time.sleep(0.02)  # a chunk that took 20 ms of the event loop
        return next(chunks)

    pauses: list[float] = []
    real_sleep = asyncio.sleep

    async def recorded_sleep(seconds: float) -> None:
        pauses.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(runtime.store, "first_received_chunk", slow_chunk)
    monkeypatch.setattr(runtime.store, "parked_chunk", lambda *args, **kwargs: ([], None))
    monkeypatch.setattr(status.asyncio, "sleep", recorded_sleep)
    await survey_first_received(runtime)

    assert len(pauses) == 3  # two chunks of records of their own, one (empty) of version 2 lists
    assert pauses[0] >= 0.06 and pauses[1] >= 0.06  # three times the 20 ms each chunk took
    assert status.status_board(runtime).first_received == {0: {"items.retry.1s": 3}}


async def park_one(runtime: Any, clock: Any, tier: str, offset: int) -> int:
    """Park one message in ``tier`` on partition 0; returns its first receipt."""
    async with runtime.agents[tier].test_context() as agent:
        headers = retry_record(clock, offset, attempt=1, due_in_ms=600_000)
        await agent.put(b"{}", key=f"k{offset}".encode(), headers=headers, partition=0)
    return int(clock.now_ms - 5)  # (retry_record's first receipt)


def oldest(runtime: Any) -> dict[str, Any]:
    return {tier: stats["oldest_first_received"] for tier, stats in local_partition_tiers(runtime)[0].items()}


async def test_a_first_park_gets_its_oldest_figure_at_the_next_look(make_runtime: Any, clock: Any) -> None:
    """OLDEST showed `-` for a minute while 481 messages waited: the figure came only from the minute's walk. A tier
    with parked messages and no figure now asks for a walk at the survey's next look (every ``SURVEY_CHECK_S``)."""
    from agents.status import SURVEY_CHECK_S, survey_step

    runtime = make_runtime()
    adopt_owned_partitions(runtime)
    now = 100.0
    assert await survey_step(runtime, lambda: now) == "partitions [0] not read yet"  # just taken over: read at once
    now += SURVEY_CHECK_S
    assert await survey_step(runtime, lambda: now) is None  # nothing new to say

    first = await park_one(runtime, clock, "items.retry.1s", 1)
    assert oldest(runtime) == {"items.retry.1s": None}
    now += SURVEY_CHECK_S
    assert (
        await survey_step(runtime, lambda: now)
        == "items.retry.1s has parked messages of partition 0 and no first receipt"
    )
    assert oldest(runtime) == {"items.retry.1s": first}

    clock.advance(1_000)
    await park_one(runtime, clock, "items.retry.1s", 2)  # a later one in a tier with a figure: nothing new
    now += SURVEY_CHECK_S
    assert await survey_step(runtime, lambda: now) is None
    assert oldest(runtime) == {"items.retry.1s": first}


async def test_otherwise_a_walk_comes_every_minute(make_runtime: Any, clock: Any, monkeypatch: Any) -> None:
    """With every partition read and every tier with a figure, the survey walks once a minute, as before; a tier whose
    messages the walk did not find (its count was there when the walk began) does not ask again at every look."""
    from agents import status

    runtime = make_runtime()
    adopt_owned_partitions(runtime)
    first = await park_one(runtime, clock, "items.retry.1s", 1)
    runtime.store.parked_per_tier[0]["items.retry.2s"] = 2  # counted, but no entry for a walk to find
    walks: list[float] = []
    walk = status.survey_first_received

    async def counted_walk(runtime: Any, now: Any, partitions: Any) -> bool:
        walks.append(now())
        return await walk(runtime, now, partitions)

    monkeypatch.setattr(status, "survey_first_received", counted_walk)
    assert await status.survey_step(runtime, lambda: 0.0) is not None
    assert oldest(runtime) == {"items.retry.1s": first, "items.retry.2s": None}
    for second in range(2, 60, 2):
        assert await status.survey_step(runtime, lambda at=float(second): at) is None
    assert await status.survey_step(runtime, lambda: 60.0) == "the minute's walk"
    assert walks == [0.0, 60.0]

    runtime.store.parked_per_tier[0].pop("items.retry.2s")  # emptied, then filled again: new, worth a walk
    assert await status.survey_step(runtime, lambda: 62.0) is None
    runtime.store.parked_per_tier[0]["items.retry.2s"] = 1
    assert await status.survey_step(runtime, lambda: 64.0) is not None
    assert walks == [0.0, 60.0, 64.0]


async def test_no_second_walk_while_one_runs(make_runtime: Any, monkeypatch: Any) -> None:
    """A walk pauses between chunks; a look or a call meanwhile starts no second walk over the same entries."""
    import asyncio

    from agents import status

    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    chunks: list[int] = []

    def chunk(partition: int, after: bytes | None, limit: int) -> tuple[list[tuple[str, int]], bytes | None]:
        chunks.append(partition)
        return [("items.retry.1s", 7)], None

    monkeypatch.setattr(runtime.store, "first_received_chunk", chunk)
    monkeypatch.setattr(runtime.store, "parked_chunk", lambda *args, **kwargs: ([], None))
    paused, go = hold_the_first_pause(monkeypatch)
    running = asyncio.ensure_future(survey_first_received(runtime))
    await paused.wait()

    assert status.survey_due(runtime, 10 * status.FIRST_RECEIPT_SURVEY_S) is None
    assert await status.survey_step(runtime, lambda: 10 * status.FIRST_RECEIPT_SURVEY_S) is None
    assert await survey_first_received(runtime) is False
    assert chunks == [0]
    go.set()
    assert await running is True
    assert chunks == [0] and status.status_board(runtime).first_received == {0: {"items.retry.1s": 7}}


async def test_a_walk_gives_no_figure_of_a_partition_revoked_meanwhile(
    make_runtime: Any, clock: Any, monkeypatch: Any
) -> None:
    """A partition revoked while the walk pauses (its read may stop short: a revoked partition's database is closed)
    gets no figure from that walk; given back, the next look reads it."""
    import asyncio

    from agents import status

    runtime = make_runtime()
    adopt_owned_partitions(runtime)
    first = await park_one(runtime, clock, "items.retry.1s", 1)
    owned = runtime.app.assignor.assigned_actives()
    paused, go = hold_the_first_pause(monkeypatch)
    running = asyncio.ensure_future(survey_first_received(runtime, lambda: 0.0))
    await paused.wait()
    runtime.app.assignor.assigned_actives = set  # revoked (on_revoked suspends its schedule)
    runtime.schedule.suspend(0)
    go.set()
    assert await running is True
    assert status.status_board(runtime).first_received == {}

    runtime.app.assignor.assigned_actives = lambda: owned  # given back as it was
    assert runtime.schedule.resume(0)
    assert await status.survey_step(runtime, lambda: 10.0) == "partitions [0] not read yet"
    assert oldest(runtime) == {"items.retry.1s": first}

    runtime.schedule.drop(0)  # then moved to another worker: its figure goes with it
    assert await status.survey_step(runtime, lambda: 20.0) is None
    assert status.status_board(runtime).first_received == {}


async def test_a_failed_walk_is_tried_again_at_the_minute_not_at_every_look(
    make_runtime: Any, clock: Any, monkeypatch: Any, caplog: Any
) -> None:
    """A walk that fails is logged; its partition and tiers count as read, so the looks every few seconds do not start
    (and log) one failed walk after another: the next try is the minute's walk."""
    from agents import status

    runtime = make_runtime()
    adopt_owned_partitions(runtime)
    await park_one(runtime, clock, "items.retry.1s", 1)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("unreadable")

    monkeypatch.setattr(runtime.store, "first_received_chunk", broken)
    assert await status.survey_step(runtime, lambda: 0.0) is not None
    assert [r.message for r in caplog.records if r.name == "agents.status"] == ["first-receipt survey failed"]
    for second in range(2, 60, 2):
        assert await status.survey_step(runtime, lambda at=float(second): at) is None
    assert await status.survey_step(runtime, lambda: 60.0) == "the minute's walk"


async def test_a_takeover_reads_only_the_partitions_taken_over(make_runtime: Any, monkeypatch: Any) -> None:
    """After a rebalance only the partitions taken over are walked early; the others keep their figures."""
    from faust.types import TP

    from agents import status

    runtime = make_runtime()
    read: list[int] = []

    def chunk(partition: int, after: bytes | None, limit: int) -> tuple[list[tuple[str, int]], bytes | None]:
        read.append(partition)
        return [("items.retry.1s", 100 + partition)], None

    def own(*partitions: int) -> None:
        owned = {TP(runtime.release_topic.get_topic_name(), p) for p in partitions}
        runtime.app.assignor.assigned_actives = lambda: owned
        for partition in partitions:
            if partition not in runtime.schedule.partitions:
                runtime.schedule.adopt(partition, [])
                runtime.store.parked_per_tier[partition] = {"items.retry.1s": 1}

    monkeypatch.setattr(runtime.store, "first_received_chunk", chunk)
    monkeypatch.setattr(runtime.store, "parked_chunk", lambda *args, **kwargs: ([], None))
    own(0, 1)
    assert await status.survey_step(runtime, lambda: 0.0) == "partitions [0, 1] not read yet"
    runtime.schedule.drop(1)
    own(0, 2)
    assert await status.survey_step(runtime, lambda: 2.0) == "partitions [2] not read yet"
    assert read == [0, 1, 2]
    assert status.status_board(runtime).first_received == {0: {"items.retry.1s": 100}, 2: {"items.retry.1s": 102}}


async def test_a_tier_emptied_and_filled_at_every_look_asks_for_one_early_walk_a_minute(
    make_runtime: Any, clock: Any, monkeypatch: Any
) -> None:
    """A fast tier keeps emptying and filling again; each early walk reads the whole partition (a slower tier's large
    backlog too). Such a tier asked for a walk at every other look: it now asks once between two walks of every
    partition, then waits for the minute's."""
    from agents import status

    runtime = make_runtime()
    adopt_owned_partitions(runtime)
    await park_one(runtime, clock, "items.retry.2s", 1)  # (the slow tier's backlog every walk of partition 0 reads)
    walks: list[float] = []
    walk = status.survey_first_received

    async def counted_walk(runtime: Any, now: Any, partitions: Any) -> bool:
        walks.append(now())
        return await walk(runtime, now, partitions)

    monkeypatch.setattr(status, "survey_first_received", counted_walk)
    counts = runtime.store.parked_per_tier[0]
    for look in range(61):  # a look every 2 s for two minutes; the 1 s tier is full at every other one
        if look % 2:
            counts["items.retry.1s"] = 1  # (counted, and emptied before a walk finds it)
        else:
            counts.pop("items.retry.1s", None)
        await status.survey_step(runtime, lambda at=2.0 * look: at)
    assert walks == [0.0, 2.0, 60.0, 62.0, 120.0]  # taken over; one early walk in each minute; the minute's


def own_partitions(runtime: Any, *partitions: int) -> None:
    """``partitions`` assigned to this worker and scheduled here (those not yet: adopted, one message parked)."""
    from faust.types import TP

    owned = {TP(runtime.release_topic.get_topic_name(), p) for p in partitions}
    runtime.app.assignor.assigned_actives = lambda: owned
    for partition in partitions:
        if partition not in runtime.schedule.partitions:
            runtime.schedule.adopt(partition, [])
            runtime.store.parked_per_tier[partition] = {"items.retry.1s": 1}


async def test_a_partition_adopted_again_unseen_by_the_looks_is_read_again(make_runtime: Any, monkeypatch: Any) -> None:
    """A partition adopted again (a replay into it, another takeover) between two looks, or while a walk reads other
    partitions, was never seen gone: its old figure stayed and no early walk read it. Neither does a walk that was
    reading it when it was adopted again give it a figure."""
    import asyncio

    from agents import status

    runtime = make_runtime()
    read: list[int] = []

    def chunk(partition: int, after: bytes | None, limit: int) -> tuple[list[tuple[str, int]], bytes | None]:
        read.append(partition)
        return [("items.retry.1s", 100 + partition)], None

    monkeypatch.setattr(runtime.store, "first_received_chunk", chunk)
    monkeypatch.setattr(runtime.store, "parked_chunk", lambda *args, **kwargs: ([], None))
    own_partitions(runtime, 0, 1)
    assert await status.survey_step(runtime, lambda: 0.0) == "partitions [0, 1] not read yet"

    runtime.schedule.adopt(0, [])  # between two looks
    assert await status.survey_step(runtime, lambda: 2.0) == "partitions [0] not read yet"
    assert read == [0, 1, 0]

    paused, go = hold_the_first_pause(monkeypatch)
    running = asyncio.ensure_future(status.survey_first_received(runtime, lambda: 4.0, frozenset({1})))
    await paused.wait()
    runtime.schedule.adopt(0, [])  # during a walk of another partition
    runtime.schedule.adopt(1, [])  # and of the one it reads: no figure from that read
    status.status_board(runtime).first_received.pop(1)
    go.set()
    assert await running is True
    assert status.status_board(runtime).first_received == {0: {"items.retry.1s": 100}}
    assert await status.survey_step(runtime, lambda: 6.0) == "partitions [0, 1] not read yet"
    assert status.status_board(runtime).first_received == {0: {"items.retry.1s": 100}, 1: {"items.retry.1s": 101}}


def hold_the_first_pause(monkeypatch: Any) -> tuple[Any, Any]:
    """The survey's first pause between chunks held until ``go`` is set (``paused`` says it got there); later pauses
    only yield."""
    import asyncio

    from agents import status

    paused, go = asyncio.Event(), asyncio.Event()
    real_sleep = asyncio.sleep

    async def first_pause_held(seconds: float) -> None:
        if not paused.is_set():
            paused.set()
            await go.wait()
        await real_sleep(0)

    monkeypatch.setattr(status.asyncio, "sleep", first_pause_held)
    return paused, go
