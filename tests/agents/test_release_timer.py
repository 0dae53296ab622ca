"""The release timer's pacing: ticks follow due times, but never closer together than the linger."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import agents.release as release_module


async def ticks_within(runtime: Any, monkeypatch: pytest.MonkeyPatch, seconds: float) -> int:
    """Run the timer for ``seconds`` with something due at every moment and a wakeup after every tick (the worst
    case: a confirm per release at 1,000 a second); count its ticks."""
    ticks = 0

    async def tick(runtime: Any) -> int:
        nonlocal ticks
        ticks += 1
        runtime.release_wakeup.set()
        return 1

    monkeypatch.setattr(release_module, "release_due", tick)
    monkeypatch.setattr(release_module, "seconds_until_next_tick", lambda runtime: 0.0)
    timer = asyncio.ensure_future(release_module.release_ticks(runtime))
    await asyncio.sleep(seconds)
    timer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await timer
    return ticks


async def test_ticks_are_at_least_the_linger_apart(make_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = await ticks_within(make_runtime(release_linger_ms=50), monkeypatch, 0.3)
    assert 3 <= ticks <= 7  # 0.3 s / 50 ms, give or take the first and the last


async def test_without_a_linger_every_wakeup_ticks(make_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = await ticks_within(make_runtime(release_linger_ms=0), monkeypatch, 0.1)
    assert ticks > 50  # what the linger is there to stop


async def test_a_failed_tick_does_not_end_the_timer(make_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = make_runtime(release_linger_ms=10)
    calls = 0

    async def failing(runtime: Any) -> int:
        nonlocal calls
        calls += 1
        raise RuntimeError("broker gone")

    monkeypatch.setattr(release_module, "release_due", failing)
    monkeypatch.setattr(release_module, "seconds_until_next_tick", lambda runtime: 0.0)
    timer = asyncio.ensure_future(release_module.release_ticks(runtime))
    await asyncio.sleep(0.1)
    assert not timer.done()
    timer.cancel()
    assert calls >= 3
