"""The main agent through Faust's ``test_context``: first tries and where failures go."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rebound import headers as h
from rebound.attempts import AttemptEvent
from tests.agents.conftest import eventually


def attempts(runtime: Any) -> list[AttemptEvent]:
    return [AttemptEvent.from_json(sent.value) for sent in runtime.attempts_topic.sent]


async def test_success_first_time_emits_succeeded_and_forwards_nothing(make_runtime: Any) -> None:
    runtime = make_runtime()
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(b'{"succeed_on": 0}', key=b"k1")
    assert [event.outcome for event in attempts(runtime)] == ["succeeded"]
    assert all(not topic.sent for topic in runtime.tier_topics.values())
    assert not runtime.failed_topics["items"].sent


async def test_first_try_successes_can_go_without_an_attempt_event(make_runtime: Any) -> None:
    """REBOUND_SUCCEEDED_EVENTS=retries: a healthy message produces nothing; its failures still do."""
    runtime = make_runtime(succeeded_events="retries")
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(b'{"succeed_on": 0}', key=b"healthy")
        await agent.put(b'{"succeed_on": 1}', key=b"failing")
    assert [(event.key, event.outcome) for event in attempts(runtime)] == [("failing", "scheduled")]
    assert runtime.counters["outcome.succeeded"] == 1


async def test_retryable_failure_goes_to_first_tier_with_headers(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime()
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(b'{"succeed_on": 1}', key=b"k1", headers=[("trace-id", b"abc")])
    [sent] = runtime.tier_topics["items.retry.1s"].sent
    assert sent.key == b"k1"
    assert sent.value == b'{"succeed_on": 1}'
    assert sent.headers[h.ATTEMPT] == b"1"
    assert sent.headers[h.DUE_AT] == str(clock.now_ms + 1000).encode()
    assert sent.headers[h.ORIGINAL_TOPIC] == b"items"
    assert sent.headers[h.ERROR_CLASS] == b"rebound.errors.RetryableError"
    assert sent.headers["trace-id"] == b"abc"
    [event] = attempts(runtime)
    assert (event.outcome, event.attempt, event.next_tier, event.due_at) == ("scheduled", 0, "1s", clock.now_ms + 1000)


async def test_permanent_and_undecodable_go_straight_to_failed_byte_exact(make_runtime: Any) -> None:
    runtime = make_runtime()
    garbage = b"\xff\xfe{not json"
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(b'{"permanent": true}', key=b"p")
        await agent.put(garbage, key=b"u")
    failed = runtime.failed_topics["items"].sent
    assert [(sent.key, sent.headers[h.REASON]) for sent in failed] == [(b"p", b"permanent"), (b"u", b"undecodable")]
    assert failed[1].value == garbage
    assert all(not topic.sent for topic in runtime.tier_topics.values())


async def test_forged_retry_headers_on_main_topic_are_not_trusted(make_runtime: Any) -> None:
    runtime = make_runtime()
    forged = [(h.ATTEMPT, b"3"), (h.ORIGINAL_TOPIC, b"elsewhere"), (h.FIRST_RECEIVED_AT, b"1")]
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(b'{"succeed_on": 1}', key=b"k", headers=forged)
    [sent] = runtime.tier_topics["items.retry.1s"].sent
    assert sent.headers[h.ATTEMPT] == b"1"  # counted from 0, not from the forged 3
    assert sent.headers[h.ORIGINAL_TOPIC] == b"items"
    assert sent.headers[h.FIRST_RECEIVED_AT] != b"1"


async def test_unclassified_exception_is_retryable_by_default_and_configurable(make_runtime: Any) -> None:
    runtime = make_runtime(permanent_errors="KeyError")
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(json.dumps({"raise": "KeyError"}).encode(), key=b"k")
    [sent] = runtime.failed_topics["items"].sent
    assert sent.headers[h.REASON] == b"permanent"
    assert sent.headers[h.ERROR_CLASS] == b"KeyError"


async def test_a_handler_whose_awaitable_is_cancelled_is_retried_not_skipped(make_runtime: Any) -> None:
    import asyncio

    async def cancelled_inside(event: Any) -> None:
        inner = asyncio.get_running_loop().create_future()
        inner.cancel()
        await inner

    runtime = make_runtime()
    runtime.handler = cancelled_inside
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(b"{}", key=b"k")
    [sent] = runtime.tier_topics["items.retry.1s"].sent
    assert sent.key == b"k"
    assert sent.headers[h.ERROR_CLASS] == b"agents.attempt.HandlerCancelledError"


async def test_a_record_too_large_for_its_tier_is_dead_lettered_not_retried_forever(make_runtime: Any) -> None:
    runtime = make_runtime()
    runtime.tier_topics["items.retry.1s"].broker_max_value_bytes = 10
    big = json.dumps({"succeed_on": 1, "padding": "x" * 100}).encode()
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(big, key=b"big")
    [failed] = runtime.failed_topics["items"].sent
    assert (failed.value, failed.headers[h.REASON]) == (big, b"too-large")


async def test_a_record_too_large_even_for_the_failed_topic_keeps_its_provenance(make_runtime: Any) -> None:
    runtime = make_runtime()
    runtime.failed_topics["items"].broker_max_value_bytes = 10
    big = json.dumps({"permanent": True, "padding": "x" * 100}).encode()
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(big, key=b"big")
    [failed] = runtime.failed_topics["items"].sent
    assert failed.value is None
    assert failed.headers[h.REASON] == b"too-large"
    assert failed.headers[h.ORIGINAL_TOPIC] == b"items"
    assert f"{len(big)} bytes".encode() in failed.headers[h.ERROR_MESSAGE]


async def test_a_handler_that_ignores_cancellation_still_times_out(
    make_runtime: Any, monkeypatch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio

    import agents.attempt

    monkeypatch.setattr(agents.attempt, "CANCEL_GRACE_S", 0.05)
    release = asyncio.Event()

    async def stubborn(event: Any) -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue  # swallows every cancellation

    runtime = make_runtime(handler_timeout="100ms")
    runtime.handler = stubborn
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(b"{}", key=b"k")
        await eventually(lambda: bool(runtime.tier_topics["items.retry.1s"].sent))
    release.set()
    [sent] = runtime.tier_topics["items.retry.1s"].sent
    assert sent.headers[h.ERROR_CLASS] == b"rebound.errors.HandlerTimeout"
    # Which message, found by a new user missing in the line: its key and where it came from.
    [line] = [r.getMessage() for r in caplog.records if "ignored its cancellation" in r.getMessage()]
    assert "key 'k' (items partition 0 offset" in line and "attempt 0" in line
