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
