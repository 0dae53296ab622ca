"""Per-key locks serialise work on one key, let other keys run, and leave nothing behind."""

from __future__ import annotations

import asyncio

from agents.locks import KeyLocks


async def test_one_key_at_a_time_other_keys_in_parallel_and_nothing_left_behind() -> None:
    locks = KeyLocks()
    order: list[str] = []

    async def work(key: bytes, name: str, pause: float) -> None:
        async with locks.hold(key):
            order.append(f"{name} in")
            await asyncio.sleep(pause)
            order.append(f"{name} out")

    await asyncio.gather(work(b"k", "a", 0.05), work(b"k", "b", 0.0), work(b"other", "c", 0.0))
    assert order.index("a out") < order.index("b in")  # the same key waits
    assert order.index("c out") < order.index("a out")  # another key does not
    assert len(locks) == 0


async def test_a_failure_inside_releases_the_lock() -> None:
    locks = KeyLocks()
    try:
        async with locks.hold(b"k"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    async with asyncio.timeout(1):
        async with locks.hold(b"k"):
            pass
    assert len(locks) == 0
