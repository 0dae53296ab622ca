"""Tier agents park, the release path runs due messages and never early."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rebound import headers as h
from rebound.attempts import AttemptEvent
from rebound.state import KeyState, PendingMessage, record_digest
from tests.agents.conftest import eventually, nothing_waits
from tests.agents.support import tier_headers


def stored_payload_key(table_key: bytes, origin: str) -> bytes:
    return len(table_key).to_bytes(4, "big") + table_key + origin.encode()


async def park_and_release(
    runtime: Any, clock: Any, until: Callable[[], bool], value: bytes = b'{"succeed_on": 1}'
) -> None:
    """``value`` parked on the 1s tier (``items/0/7``, key ``k``, partition 0), then due, and its release requested;
    returns once ``until`` holds."""
    async with (
        runtime.agents["items.retry.1s"].test_context() as tier,
        runtime.agents["release"].test_context() as releaser,
    ):
        await tier.put(value, key=b"k", headers=tier_headers(clock), partition=0)
        clock.advance(1000)
        await releaser.put(json.dumps({"origin": "items/0/7", "attempt": 1}).encode(), key=b"k", partition=0)
        await eventually(until)


async def test_tier_record_is_parked_once_even_if_redelivered(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    async with runtime.agents["items.retry.1s"].test_context() as agent:
        for _ in range(2):
            await agent.put(b'{"succeed_on": 1}', key=b"k", headers=tier_headers(clock), partition=0)
        state = runtime.store.load(b"k", entries=True, with_payloads=True)
    [entry] = state.pending
    assert (entry.origin, entry.attempt, entry.tier, entry.due_at_ms) == ("items/0/7", 1, "1s", clock.now_ms + 1000)
    assert entry.headers == (("trace-id", b"abc"),)
    assert entry.value == b'{"succeed_on": 1}'
    assert runtime.store.payloads.get(stored_payload_key(b"k", "items/0/7")) is not None
    assert runtime.counters["tier.duplicates"] == 1
    assert runtime.schedule.pop_due(clock.now_ms) == []
    [(partition, slot)] = runtime.schedule.pop_due(clock.now_ms + 1000)
    assert (partition, slot.table_key, slot.origin) == (0, b"k", "items/0/7")


async def test_invalid_retry_headers_are_dead_lettered(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime()
    cases = {
        b"not-configured": tier_headers(clock, **{h.ORIGINAL_TOPIC: b"payments"}),
        b"not-decimal": tier_headers(clock, **{h.ATTEMPT: b"one"}),
        b"far-future": tier_headers(clock, due_in_ms=10 * 86_400_000),
        b"missing": [("trace-id", b"abc")],
    }
    async with runtime.agents["items.retry.1s"].test_context() as agent:
        for key, headers in cases.items():
            await agent.put(b"payload", key=key, headers=headers, partition=0)
    failed = runtime.failed_topics["items"].sent
    assert [sent.key for sent in failed] == list(cases)
    assert {sent.headers[h.REASON] for sent in failed} == {b"invalid-retry-headers"}
    assert all(sent.value == b"payload" for sent in failed)
    assert nothing_waits(runtime, b"not-configured")


async def test_release_never_runs_before_due_then_runs_and_settles(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    request = json.dumps({"origin": "items/0/7", "attempt": 1}).encode()
    async with (
        runtime.agents["items.retry.1s"].test_context() as tier,
        runtime.agents["release"].test_context() as releaser,
    ):
        await tier.put(b'{"succeed_on": 1}', key=b"k", headers=tier_headers(clock), partition=0)
        await releaser.put(request, key=b"k", partition=0)  # early request: ignored, slot back in the schedule
        assert runtime.store.load(b"k", entries=True).pending
        assert runtime.counters["release.early"] == 1
        clock.advance(1000)
        await releaser.put(request, key=b"k", partition=0)
        await eventually(lambda: nothing_waits(runtime, b"k"))
        assert (
            runtime.store.payloads.get(stored_payload_key(b"k", "items/0/7")) is None
        )  # settled: its bytes are gone too
        await releaser.put(request, key=b"k", partition=0)  # duplicate request: nothing left to run
        await eventually(lambda: runtime.counters["release.stale"] == 1)
    outcomes = [AttemptEvent.from_json(sent.value) for sent in runtime.attempts_topic.sent]
    assert [(event.outcome, event.attempt, event.tier) for event in outcomes] == [("succeeded", 1, "1s")]


async def test_a_success_on_a_retry_keeps_its_event_when_first_try_successes_have_none(
    make_runtime: Any, clock: Any
) -> None:
    runtime = make_runtime(succeeded_events="retries")
    runtime.schedule.adopt(0, [])
    await park_and_release(runtime, clock, lambda: nothing_waits(runtime, b"k"))
    outcomes = [AttemptEvent.from_json(sent.value) for sent in runtime.attempts_topic.sent]
    assert [(event.outcome, event.attempt) for event in outcomes] == [("succeeded", 1)]


async def test_failed_retry_moves_to_next_tier_and_last_one_exhausts(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    async with (
        runtime.agents["items.retry.2s"].test_context() as tier,
        runtime.agents["release"].test_context() as releaser,
    ):
        await tier.put(
            b'{"fail": "always"}', key=b"k", headers=tier_headers(clock, attempt=3, due_in_ms=2000), partition=0
        )
        clock.advance(2000)
        await releaser.put(json.dumps({"origin": "items/0/7", "attempt": 3}).encode(), key=b"k", partition=0)
        await eventually(lambda: nothing_waits(runtime, b"k"))
    [failed] = runtime.failed_topics["items"].sent
    assert failed.headers[h.REASON] == b"exhausted"
    assert failed.headers[h.ATTEMPT] == b"3"
    assert failed.headers[h.ORIGINAL_OFFSET] == b"7"
    assert nothing_waits(runtime, b"k")


async def test_republish_mode_signs_the_record_and_the_main_agent_keeps_its_attempt(
    make_runtime: Any, clock: Any
) -> None:
    runtime = make_runtime(release_mode="republish", header_secret="s3cret")
    runtime.schedule.adopt(0, [])
    await park_and_release(runtime, clock, lambda: nothing_waits(runtime, b"k"), value=b'{"succeed_on": 5}')
    [republished] = runtime.main_topics["items"].sent
    assert republished.headers[h.ATTEMPT] == b"1"
    assert "rebound.signature" in republished.headers
    async with runtime.agents["main"].test_context() as main:
        await main.put(republished.value, key=b"k", headers=list(republished.headers.items()), partition=0)
        tampered = {**republished.headers, h.ATTEMPT: b"0"}
        await main.put(republished.value, key=b"k2", headers=list(tampered.items()), partition=0)
    first, second = runtime.tier_topics["items.retry.1s"].sent
    assert first.headers[h.ATTEMPT] == b"2"  # genuine: attempt 1 failed, so retry 2
    assert first.headers[h.ORIGINAL_OFFSET] == b"7"
    assert second.headers[h.ATTEMPT] == b"1"  # tampered: treated as a first delivery


async def test_a_key_with_too_many_parked_messages_dead_letters_the_excess(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime(max_pending_per_key="2")
    async with runtime.agents["items.retry.1s"].test_context() as tier:
        for offset in (1, 2, 3):
            headers = dict(tier_headers(clock))
            headers[h.ORIGINAL_OFFSET] = str(offset).encode()
            await tier.put(f"message {offset}".encode(), key=b"hot", headers=list(headers.items()), partition=0)
    assert [entry.origin for entry in runtime.store.load(b"hot", entries=True, with_payloads=True).pending] == [
        "items/0/1",
        "items/0/2",
    ]
    [failed] = runtime.failed_topics["items"].sent
    assert (failed.value, failed.headers[h.REASON]) == (b"message 3", b"key-backlog-full")
    assert failed.headers[h.ORIGINAL_OFFSET] == b"3"


async def test_a_forged_record_cannot_touch_another_keys_parked_bytes(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime()
    async with runtime.agents["items.retry.1s"].test_context() as tier:
        await tier.put(b"genuine", key=b"k1", headers=tier_headers(clock), partition=0)
        await tier.put(b"FORGED", key=b"k2", headers=tier_headers(clock, attempt=2), partition=0)  # same origin
    assert runtime.store.load(b"k1", entries=True, with_payloads=True).pending[0].value == b"genuine"
    assert runtime.store.load(b"k2", entries=True, with_payloads=True).pending[0].value == b"FORGED"


async def test_a_tier_record_on_the_wrong_partition_is_rejected(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime()
    runtime.partitions = 2  # so that original partition 1 belongs on tier partition 1, not 0
    headers = dict(tier_headers(clock))
    headers[h.ORIGINAL_PARTITION] = b"1"
    async with runtime.agents["items.retry.1s"].test_context() as tier:
        await tier.put(b"payload", key=b"k", headers=list(headers.items()), partition=0)
    [failed] = runtime.failed_topics["items"].sent
    assert failed.headers[h.REASON] == b"invalid-retry-headers"
    assert nothing_waits(runtime, b"k")


async def test_a_release_that_keeps_failing_ends_on_the_failed_topic(
    make_runtime: Any, clock: Any, monkeypatch: Any
) -> None:
    from rebound.state import PendingMessage

    runtime = make_runtime()
    request = json.dumps({"origin": "items/0/7", "attempt": 1}).encode()
    async with (
        runtime.agents["items.retry.1s"].test_context() as tier,
        runtime.agents["release"].test_context() as releaser,
    ):
        await tier.put(b'{"succeed_on": 1}', key=b"k", headers=tier_headers(clock), partition=0)
        clock.advance(1000)

        def corrupt(self: Any, raw: bytes) -> Any:
            raise ValueError("not a Rebound payload record")

        monkeypatch.setattr(PendingMessage, "with_payload", corrupt)
        for _ in range(3):
            await releaser.put(request, key=b"k", partition=0)
        await eventually(lambda: nothing_waits(runtime, b"k"))
    [failed] = runtime.failed_topics["items"].sent
    assert failed.headers[h.REASON] == b"internal-error"
    assert (failed.key, failed.value) == (b"k", None)
    assert failed.headers[h.ORIGINAL_OFFSET] == b"7"


async def test_a_later_recovery_rebuilds_a_partition_adopted_from_a_half_read_table(
    make_runtime: Any, clock: Any, monkeypatch: Any
) -> None:
    """Faust reported an interrupted recovery complete before the one that read the changelog (chaos run, mock
    cluster): the schedule adopted from that half-read table never learnt of the entries restored afterwards."""
    from agents import release

    runtime = make_runtime()
    monkeypatch.setattr(release, "owned_partitions", lambda _runtime: frozenset({0}))
    async with runtime.agents["items.retry.1s"].test_context() as agent:
        # restored by the changelog read (the schedule does not have partition 0 yet, so parking adds no slot)
        await agent.put(b'{"succeed_on": 1}', key=b"k", headers=tier_headers(clock), partition=0)
    runtime.schedule.adopt(0, [])  # what the first, early adoption found
    runtime.store.replayed.clear()
    release.adopt_owned_partitions(runtime)  # nothing replayed since: the partition is kept as scheduled
    assert runtime.schedule.pop_due(clock.now_ms + 1000) == []
    runtime.store.replayed.add(0)  # the changelog read replays records of partition 0 (RetryStore notes it) ...
    release.adopt_owned_partitions(runtime)  # ... and the recovery that read it completes
    [(partition, slot)] = runtime.schedule.pop_due(clock.now_ms + 1000)
    assert (partition, slot.table_key, slot.origin) == (0, b"k", "items/0/7")


async def test_a_partition_revoked_and_assigned_back_with_nothing_replayed_is_not_read_again(
    make_runtime: Any, clock: Any, monkeypatch: Any
) -> None:
    """Faust revokes every partition at each rebalance: one that comes straight back resumes its slots; only one
    moved here, or one whose changelog was replayed into meanwhile, is read."""
    from agents import release

    runtime = make_runtime()
    monkeypatch.setattr(release, "owned_partitions", lambda _runtime: frozenset({0}))
    release.adopt_owned_partitions(runtime)
    async with runtime.agents["items.retry.1s"].test_context() as agent:
        await agent.put(b'{"succeed_on": 1}', key=b"k", headers=tier_headers(clock), partition=0)
    reads: list[frozenset[int]] = []
    real_parked = runtime.store.parked
    monkeypatch.setattr(
        runtime.store, "parked", lambda partitions=None: reads.append(partitions) or real_parked(partitions)
    )
    runtime.schedule.suspend(0)  # the rebalance revoked it ...
    runtime.store.replayed.clear()
    release.adopt_owned_partitions(runtime)  # ... and assigned it back
    assert reads == []
    [(partition, slot)] = runtime.schedule.pop_due(clock.now_ms + 1000)
    assert (partition, slot.origin) == (0, "items/0/7")
    assert runtime.store.parked_per_tier[0] == {"items.retry.1s": 1}  # its counts kept too


async def test_a_release_reads_its_bytes_once_and_its_end_is_named_by_their_digest(
    make_runtime: Any, clock: Any, monkeypatch: Any
) -> None:
    """The settle names the ended message by the digest of the bytes the release ran (the same attempt's bytes are
    never replaced), rather than reading and decoding its record a second time."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    reads: list[str] = []
    read = runtime.store.with_payload

    def counted(table_key: bytes, entry: Any, **options: Any) -> Any:
        reads.append(entry.origin)
        return read(table_key, entry, **options)

    monkeypatch.setattr(runtime.store, "with_payload", counted)
    value = b'{"succeed_on": 1}'
    await park_and_release(runtime, clock, lambda: nothing_waits(runtime, b"k"), value=value)
    assert reads == ["items/0/7"]
    [mark] = runtime.store.load(b"k").marks
    assert (mark.origin, mark.attempt, mark.ended) == ("items/0/7", 1, True)
    assert mark.digest == record_digest(b"k", value)


async def test_a_release_whose_partition_was_revoked_meanwhile_leaves_the_state_to_the_new_owner(
    make_runtime: Any, clock: Any, caplog: Any
) -> None:
    """The settle asks the assignor whether the partition is still actively owned here; revoked while the handler ran,
    the entry stays as it is (the new owner has it and runs it again: at-least-once)."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    assignor = runtime.app.assignor
    calls: list[Any] = []
    run = runtime.handler

    async def revoking(event: Any) -> Any:
        calls.append(event.offset)
        assignor.assigned_actives = set
        assignor.is_active = lambda tp: False
        return await run(event)

    runtime.handler = revoking
    await park_and_release(runtime, clock, lambda: "revoked while items/0/7 was released" in caplog.text)
    assert calls == [7]
    [entry] = runtime.store.load(b"k", entries=True).pending
    assert (entry.origin, entry.attempt) == ("items/0/7", 1)
    assert runtime.store.payloads.get(stored_payload_key(b"k", "items/0/7")) is not None


async def test_a_message_of_the_key_parked_while_its_retry_ran_stays_parked_after_the_settle(
    make_runtime: Any, clock: Any
) -> None:
    """The settle reads the key again after the handler's await (the tier agent writes without the key's lock): a
    message of the same key parked meanwhile is counted and kept, never written over by the release's first read.
    (The park is made here as the tier agent makes it, from the handler's task.)"""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    run = runtime.handler

    async def parking_a_sibling(event: Any) -> Any:
        seven = runtime.store.load(b"k", origin="items/0/7", with_payloads=True).find("items/0/7")
        source = replace(seven.provenance, offset=8)
        eight = replace(seven, origin=PendingMessage.origin_of(source), provenance=source)
        before = runtime.store.load(b"k", origin=eight.origin)
        runtime.store.save(b"k", before, before.park(eight)[0])
        return await run(event)

    runtime.handler = parking_a_sibling
    await park_and_release(runtime, clock, lambda: runtime.store.entry(b"k", "items/0/7") is None)
    state = runtime.store.load(b"k", entries=True)
    assert [entry.origin for entry in state.pending] == ["items/0/8"]
    assert runtime.store.load(b"k").parked == 1
    assert runtime.store.payloads.get(stored_payload_key(b"k", "items/0/8")) is not None


async def test_a_settle_decodes_nothing_again_when_its_key_was_not_written_while_the_handler_ran(
    make_runtime: Any, clock: Any, monkeypatch: Any
) -> None:
    """The settle's read of the key finds the same records the release read before its handler: their decoded state
    is taken as it is (the same bytes decode to the same state), where it was decoded a second time."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    decoded: list[bytes | None] = []
    from_json = KeyState.from_json.__func__  # type: ignore[attr-defined]

    def counted(cls: Any, raw: Any) -> Any:
        decoded.append(raw)
        return from_json(cls, raw)

    async with (
        runtime.agents["items.retry.1s"].test_context() as tier,
        runtime.agents["release"].test_context() as releaser,
    ):
        await tier.put(b'{"succeed_on": 1}', key=b"k", headers=tier_headers(clock), partition=0)
        clock.advance(1000)
        monkeypatch.setattr(KeyState, "from_json", classmethod(counted))
        await releaser.put(json.dumps({"origin": "items/0/7", "attempt": 1}).encode(), key=b"k", partition=0)
        await eventually(lambda: runtime.store.payloads.get(stored_payload_key(b"k", "items/0/7")) is None)
        monkeypatch.undo()
        assert nothing_waits(runtime, b"k")
    assert len(decoded) == 1, "the release decoded its key's index once, before its handler"
