"""The guard on a handler's own sub-tasks (``agents/attempt.py`` ``_guard_handler_subtasks``) holds whatever task
factory the handler's code sets on the loop: asyncio re-raises ``SystemExit`` out of any task into the loop."""

from __future__ import annotations

import asyncio
from typing import Any

from rebound import headers as h
from rebound.event import RetryEvent


async def test_an_exit_in_a_subtask_is_routed_after_the_handler_set_its_own_task_factory(make_runtime: Any) -> None:
    """A library the handler configures on its first call (a tracer's task-local context, say) may replace the
    loop's task factory without calling the one it found: the guard is put back in front of it."""
    runtime = make_runtime()
    loop = asyncio.get_running_loop()
    made: list[object] = []

    def own_factory(loop: asyncio.AbstractEventLoop, coro: Any, **options: Any) -> asyncio.Future[Any]:
        made.append(coro)
        return asyncio.Task(coro, loop=loop, **options)

    async def subtask() -> None:
        raise SystemExit("from a sub-task")

    async def handler(event: RetryEvent) -> None:
        if event.key == b"sets":
            loop.set_task_factory(own_factory)
        elif event.key == b"spawns":
            await asyncio.gather(subtask())

    runtime.handler = handler
    try:
        async with runtime.agents["main"].test_context() as agent:
            await agent.put(b"{}", key=b"sets")
            await agent.put(b"{}", key=b"spawns")
    finally:
        loop.set_task_factory(None)
    [forwarded] = runtime.tier_topics["items.retry.1s"].sent
    assert forwarded.key == b"spawns"
    assert forwarded.headers[h.ERROR_CLASS] == b"SystemExit"
    assert made  # the handler's own factory still makes the tasks
