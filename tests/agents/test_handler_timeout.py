"""Rebound's handler timeout and a handler's own ``TimeoutError`` are told apart (issue 22, defect 5).

Before, the worker raised the builtin ``TimeoutError`` at ``REBOUND_HANDLER_TIMEOUT`` and treated every
``TimeoutError`` as its own: a handler's own timeout was reported as "handler ran longer than ...", the breaker
counted it as a failure whatever the lists said, and listing ``TimeoutError`` as permanent made Rebound's timeout
permanent too. These tests name no new class, so they run (and fail) against that code as well.
"""

from __future__ import annotations

from typing import Any

from rebound import headers as h
from rebound.breaker import BreakerState
from tests.agents.conftest import eventually

OWN_TIMEOUT = b'{"raise": "TimeoutError"}'
HANGS = b'{"sleep": 5}'
BREAKER = {
    "breaker_enabled": True,
    "breaker_window": "10s",
    "breaker_min_calls": 2,
    "breaker_failure_ratio": 0.5,
    "breaker_probe_interval": "1s",
    "breaker_probe_max_interval": "4s",
}


async def test_a_handlers_own_timeout_listed_as_permanent_is_dead_lettered_with_its_own_message(
    make_runtime: Any,
) -> None:
    runtime = make_runtime(permanent_errors="TimeoutError")
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(OWN_TIMEOUT, key=b"k")
    [failed] = runtime.failed_topics["items"].sent
    assert failed.headers[h.REASON] == b"permanent"
    assert failed.headers[h.ERROR_CLASS] == b"TimeoutError"
    assert failed.headers[h.ERROR_MESSAGE] == b"the handler's own call timed out"
    assert not runtime.tier_topics["items.retry.1s"].sent


async def test_a_handlers_own_timeout_is_retried_by_default_with_its_own_message(make_runtime: Any) -> None:
    runtime = make_runtime()
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(OWN_TIMEOUT, key=b"k")
    [sent] = runtime.tier_topics["items.retry.1s"].sent
    assert sent.headers[h.ERROR_CLASS] == b"TimeoutError"
    assert sent.headers[h.ERROR_MESSAGE] == b"the handler's own call timed out"


async def test_rebounds_timeout_stays_retryable_when_timeout_error_is_listed_as_permanent(make_runtime: Any) -> None:
    runtime = make_runtime(permanent_errors="TimeoutError,Exception", handler_timeout="100ms")
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(HANGS, key=b"slow")
        await eventually(lambda: bool(runtime.tier_topics["items.retry.1s"].sent))
    [sent] = runtime.tier_topics["items.retry.1s"].sent
    assert sent.headers[h.ERROR_CLASS] == b"rebound.errors.HandlerTimeout"
    assert sent.headers[h.ERROR_MESSAGE] == b"handler ran longer than 100ms"
    assert not runtime.failed_topics["items"].sent


async def test_rebounds_timeout_is_permanent_only_when_listed_by_its_own_name(make_runtime: Any) -> None:
    runtime = make_runtime(permanent_errors="HandlerTimeout", handler_timeout="100ms")
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(HANGS, key=b"slow")
        await eventually(lambda: bool(runtime.failed_topics["items"].sent))
    [failed] = runtime.failed_topics["items"].sent
    assert failed.headers[h.REASON] == b"permanent"
    assert failed.headers[h.ERROR_CLASS] == b"rebound.errors.HandlerTimeout"


async def test_the_breaker_ignores_a_handlers_own_timeout_listed_as_permanent(make_runtime: Any) -> None:
    runtime = make_runtime(permanent_errors="TimeoutError", **BREAKER)
    async with runtime.agents["main"].test_context() as agent:
        for n in range(2):  # the breaker's minimum: both counted as failures would open it
            await agent.put(OWN_TIMEOUT, key=f"k{n}".encode())
    assert len(runtime.failed_topics["items"].sent) == 2
    assert runtime.breaker_gate.breaker.state is BreakerState.CLOSED
    assert runtime.breaker_gate.breaker.window_counts(runtime.clock()) == (0, 0)


async def test_the_breaker_counts_rebounds_timeout_as_a_failure(make_runtime: Any) -> None:
    runtime = make_runtime(permanent_errors="TimeoutError", handler_timeout="50ms", **BREAKER)
    async with runtime.agents["main"].test_context() as agent:
        for n in range(2):
            await agent.put(HANGS, key=f"slow{n}".encode())
        await eventually(lambda: len(runtime.tier_topics["items.retry.1s"].sent) == 2)
    assert runtime.breaker_gate.breaker.state is BreakerState.OPEN
