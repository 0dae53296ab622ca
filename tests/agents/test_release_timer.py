"""The release timer's pacing: ticks follow due times, but never closer together than the linger. Each tick's own
duration is observed once on ``/metrics``, the wait between ticks left out."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import agents.release as release_module


def tick_samples(runtime: Any) -> dict[str, float]:
    """``rebound_release_tick_seconds`` as a scrape reads it: ``_count``, ``_sum`` and ``le=<bound>`` per bucket."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(runtime.metrics.exposition()[0].decode()):
        if family.name == "rebound_release_tick_seconds":
            for sample in family.samples:
                name = sample.name.removeprefix("rebound_release_tick_seconds_")
                found[f"le={sample.labels['le']}" if name == "bucket" else name] = sample.value
    return found


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
    assert tick_samples(runtime)["count"] == calls  # a failed tick's cost is a tick's cost too


async def test_each_tick_observes_its_own_duration_once_and_not_the_wait(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The perf counter is the loop's clock plus 4 ms for every tick, added inside the tick: each observation is
    those 4 ms (and the few microseconds the tick really took), never the 50 ms linger slept between ticks."""
    runtime = make_runtime(release_linger_ms=50)
    loop = asyncio.get_running_loop()
    spent = 0.0
    calls = 0

    async def tick(runtime: Any) -> int:
        nonlocal spent, calls
        calls += 1
        spent += 0.004
        runtime.release_wakeup.set()
        return 1

    monkeypatch.setattr(release_module, "perf_counter", lambda: loop.time() + spent)
    monkeypatch.setattr(release_module, "release_due", tick)
    monkeypatch.setattr(release_module, "seconds_until_next_tick", lambda runtime: 0.0)
    assert tick_samples(runtime)["count"] == 0  # exposed before the first tick: rate() has a zero to start from
    timer = asyncio.ensure_future(release_module.release_ticks(runtime))
    await asyncio.sleep(0.2)
    timer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await timer
    observed = tick_samples(runtime)
    assert calls >= 2
    assert observed["count"] == calls
    assert observed["le=0.0025"] == 0  # each took at least its 4 ms
    assert observed["le=0.01"] == calls  # and none took the linger's 50 ms
    assert 0.004 * calls <= observed["sum"] < 0.01 * calls
