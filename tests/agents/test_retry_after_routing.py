"""The main agent carries a failure's ``Retry-After`` into its tier record's due time (``agents/attempt.py``), and a
tier agent parks such a record although its due time is later than the tier's delay."""

from __future__ import annotations

from typing import Any

from rebound import headers as h
from rebound.attempts import AttemptEvent
from rebound.errors import OverloadError
from rebound.event import RetryEvent


def overloaded(seconds: float) -> Any:
    async def handle(event: RetryEvent) -> None:
        raise OverloadError("HTTP 503 Service Unavailable", retry_after_s=seconds)

    return handle


async def test_a_retry_after_longer_than_the_tier_delay_sets_the_due_time(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime()
    runtime.handler = overloaded(30)
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(b"v", key=b"k")
    [sent] = runtime.tier_topics["items.retry.1s"].sent  # the tier of its attempt, as always
    assert sent.headers[h.DUE_AT] == str(clock.now_ms + 30_000).encode()
    [event] = [AttemptEvent.from_json(record.value) for record in runtime.attempts_topic.sent]
    assert (event.outcome, event.due_at, event.error_class) == (
        "scheduled",
        clock.now_ms + 30_000,
        "rebound.errors.OverloadError",
    )


async def test_a_retry_after_beyond_the_longest_wait_is_capped_and_retried(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime(retry_after_max="1m")
    runtime.handler = overloaded(7200)  # a maintenance window on the first try: wait the cap, then ask again
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(b"v", key=b"k")
    assert not runtime.failed_topics["items"].sent
    [sent] = runtime.tier_topics["items.retry.1s"].sent
    assert sent.headers[h.DUE_AT] == str(clock.now_ms + 60_000).encode()


async def test_a_tier_parks_a_record_due_after_its_delay_up_to_the_longest_wait(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime(retry_after_max="1h")
    runtime.schedule.adopt(0, [])

    def forwarded(due_in_ms: int, offset: int) -> list[h.Header]:
        return h.retry_headers(
            [],
            provenance=h.Provenance("items", 0, offset, clock.now_ms, clock.now_ms),
            group="agent-test",
            attempt=1,
            due_at_ms=clock.now_ms + due_in_ms,
            error_class="rebound.http_errors.HttpOverloaded",
            error_message="HTTP 429",
        )

    async with runtime.agents["items.retry.1s"].test_context() as agent:
        await agent.put(b"v", key=b"waits", headers=forwarded(1_800_000, 7), partition=0)
        await agent.put(b"v", key=b"forged", headers=forwarded(3 * 3_600_000, 8), partition=0)
        state = runtime.store.load(b"waits", entries=True, with_payloads=False)
    [entry] = state.pending
    assert (entry.tier, entry.due_at_ms) == ("1s", clock.now_ms + 1_800_000)
    assert runtime.schedule.pop_due(clock.now_ms + 1_799_999) == []
    [(_, slot)] = runtime.schedule.pop_due(clock.now_ms + 1_800_000)
    assert slot.table_key == b"waits"
    [refused] = runtime.failed_topics["items"].sent  # beyond REBOUND_RETRY_AFTER_MAX: still refused
    assert (refused.key, refused.headers[h.REASON]) == (b"forged", b"invalid-retry-headers")
