"""The handler timeout's shared deadline queue (``agents/attempt.py`` ``_Deadlines``): each wait ends at its own
deadline, not at the first one's or a tick's, and waits that ended leave the queue."""

from __future__ import annotations

import asyncio

import pytest

from agents.attempt import _COMPACT_AT, _deadlines_of, _finished_within


async def test_staggered_waits_each_time_out_at_their_own_deadline() -> None:
    loop = asyncio.get_running_loop()
    hang = loop.create_task(asyncio.sleep(10))
    started = loop.time()
    ended: dict[str, float] = {}

    async def wait(name: str, after: float) -> None:
        await asyncio.sleep(after)
        assert not await _finished_within(loop, hang, 0.2)
        ended[name] = loop.time() - started

    await asyncio.gather(wait("first", 0.0), wait("second", 0.1), wait("third", 0.15))
    hang.cancel()
    assert 0.19 <= ended["first"] < 0.28
    assert 0.29 <= ended["second"] < 0.38
    assert 0.34 <= ended["third"] < 0.43


async def test_a_task_that_finishes_first_ends_its_wait_and_leaves_the_queue() -> None:
    loop = asyncio.get_running_loop()
    quick = [loop.create_task(asyncio.sleep(0.01)) for _ in range(50)]
    assert all([await _finished_within(loop, task, 5.0) for task in quick])
    deadlines = _deadlines_of(loop, 5.0)
    hang = loop.create_task(asyncio.sleep(10))
    waiting = loop.create_task(_finished_within(loop, hang, 5.0))
    await asyncio.sleep(0)
    assert len(deadlines.waits) == 1  # the ended waits left from the head as this one joined
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert hang.cancelled() or hang.cancelling()  # a cancellation of the caller cancels the task too
    await asyncio.gather(hang, return_exceptions=True)


async def test_a_wait_behind_one_still_pending_still_ends_at_its_deadline() -> None:
    loop = asyncio.get_running_loop()
    long = loop.create_task(asyncio.sleep(0.5))
    first = loop.create_task(_finished_within(loop, long, 0.3))
    await asyncio.sleep(0.05)
    hang = loop.create_task(asyncio.sleep(10))
    started = loop.time()
    assert not await _finished_within(loop, hang, 0.3)
    assert 0.29 <= loop.time() - started < 0.38
    assert not await first
    hang.cancel()
    await asyncio.gather(long, hang, return_exceptions=True)


@pytest.mark.parametrize("ending", ["finished", "cancelled"])
async def test_waits_that_ended_behind_a_pending_one_do_not_pile_up(ending: str) -> None:
    """A call near its timeout heads the queue for up to the whole timeout; the calls that end behind it meanwhile
    (thousands a second on a healthy worker) must leave the queue before it ends, as a cancelled timer leaves the
    loop's heap, not stay there one entry each."""
    loop = asyncio.get_running_loop()
    hang = loop.create_task(asyncio.sleep(10))
    slow = loop.create_task(_finished_within(loop, hang, 5.0))
    await asyncio.sleep(0)
    deadlines = _deadlines_of(loop, 5.0)
    ended = 2000
    for _ in range(ended):
        if ending == "finished":
            quick = loop.create_task(asyncio.sleep(0))
            assert await _finished_within(loop, quick, 5.0)
        else:
            other = loop.create_task(asyncio.sleep(10))
            waiting = loop.create_task(_finished_within(loop, other, 5.0))
            await asyncio.sleep(0)
            waiting.cancel()
            await asyncio.gather(waiting, other, return_exceptions=True)
    pending = [waiter for _, waiter in deadlines.waits if not waiter.done()]
    assert len(pending) == 1
    assert len(deadlines.waits) <= max(_COMPACT_AT, 2 * len(pending))
    slow.cancel()
    await asyncio.gather(slow, hang, return_exceptions=True)
