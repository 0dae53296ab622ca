"""A task factory that wraps each coroutine and suspends once after it (a tracer flushing a span) makes the handler's
task end a turn after the call's last step: the call still succeeded, it did not time out."""

from __future__ import annotations

import asyncio
from typing import Any

from rebound.event import RetryEvent


async def test_a_handler_whose_task_a_factory_wraps_still_succeeds(make_runtime: Any) -> None:
    runtime = make_runtime()
    loop = asyncio.get_running_loop()

    def wrapping_factory(loop: asyncio.AbstractEventLoop, coro: Any, **options: Any) -> asyncio.Future[Any]:
        async def wrapped() -> Any:
            try:
                return await coro
            finally:
                await asyncio.sleep(0)  # the span's asynchronous exit

        return asyncio.Task(wrapped(), loop=loop, **options)

    async def handler(event: RetryEvent) -> None:
        return None

    runtime.handler = handler
    loop.set_task_factory(wrapping_factory)
    try:
        async with runtime.agents["main"].test_context() as agent:
            await agent.put(b"{}", key=b"k")
    finally:
        loop.set_task_factory(None)
    assert runtime.tier_topics["items.retry.1s"].sent == []
    assert runtime.counters["outcome.succeeded"] == 1
