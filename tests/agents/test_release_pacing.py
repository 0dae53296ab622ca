"""Paced releases on the worker: the release timer honours ``REBOUND_RELEASE_RATE`` and the ramp after the breaker
closes, never sends early, and what pacing delays shows in the lateness histogram and its own counter."""

from __future__ import annotations

from typing import Any

import agents.release as release_module
from rebound.breaker import BreakerState
from rebound.routing import Classification
from rebound.schedule import Slot
from tests.agents.conftest import eventually, nothing_waits
from tests.agents.support import sent_releases, tier_headers


def due_now(runtime: Any, count: int, due_at_ms: int) -> list[Slot]:
    slots = [Slot(due_at_ms, b"k%d" % i, f"items/0/{i}", 1, "1s") for i in range(count)]
    runtime.schedule.adopt(0, list(slots))
    return slots


async def run_timer(runtime: Any, clock: Any, *, until_sent: int, limit_ms: int = 60_000) -> list[tuple[int, int]]:
    """The release timer's loop with the fake clock: tick, let the release agent confirm what was sent, sleep what
    the timer would sleep (at least the linger). Returns ``(time, requests sent)`` per tick that sent any."""
    start, sends, sent = clock.now_ms, [], 0
    linger = runtime.settings.release_linger_ms
    while sent < until_sent and clock.now_ms - start < limit_ms:
        before = len(runtime.release_topic.sent)
        await release_module.release_due(runtime)
        released = sent_releases(runtime.release_topic.sent[before:])  # (a tick's may share records)
        for key, request in released:
            runtime.schedule.confirm(0, key, request.origin, request.attempt)
        if released:
            sends.append((clock.now_ms, len(released)))
            sent += len(released)
        clock.advance(max(linger, round(release_module.seconds_until_next_tick(runtime) * 1000)))
    return sends


def most_in_any_window(sends: list[tuple[int, int]], window_ms: int) -> int:
    return max(sum(n for t, n in sends if start <= t < start + window_ms) for start, _ in sends)


async def test_unpaced_everything_due_goes_in_one_tick(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime()
    due_now(runtime, 200, clock.now_ms)
    assert await release_module.release_due(runtime) == 200


async def test_the_timer_sends_at_the_rate_and_never_early(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime(release_rate="50")  # burst by default a tenth of a second's worth: 5
    start = clock.now_ms
    due_now(runtime, 200, start)
    sends = await run_timer(runtime, clock, until_sent=200)
    assert sum(n for _, n in sends) == 200
    assert sends[0] == (start, 5)  # the bucket's burst at once, then one every 20 ms
    last = sends[-1][0]
    assert 3_850 <= last - start <= 4_000  # (200 - 5) / 50 s
    for window_ms in (100, 500, 1000, 2000):
        assert most_in_any_window(sends, window_ms) <= 50 * window_ms / 1000 + 5
    assert runtime.counters["release.paced"] == 195  # all but the burst went later than due


async def test_the_timer_sleeps_until_the_pacer_allows_the_next(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime(release_rate="10", release_burst=1)
    due_now(runtime, 3, clock.now_ms)
    assert await release_module.release_due(runtime) == 1
    assert release_module.seconds_until_next_tick(runtime) == 0.1  # not 0: something is due, but not allowed yet
    clock.advance(99)
    assert await release_module.release_due(runtime) == 0
    clock.advance(1)
    assert await release_module.release_due(runtime) == 1


async def test_a_slot_not_yet_due_is_not_sent_however_much_is_allowed(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime(release_rate="1000", release_burst=100)
    runtime.schedule.adopt(0, [Slot(clock.now_ms + 500, b"k", "items/0/1", 1, "1s")])
    assert await release_module.release_due(runtime) == 0
    assert release_module.seconds_until_next_tick(runtime) == 0.2  # the timer interval: it is due in 500 ms
    clock.advance(500)
    assert await release_module.release_due(runtime) == 1


async def test_lateness_under_pacing_is_reported(make_runtime: Any, clock: Any) -> None:
    """Two retries due at once at one release a second: the second runs a second late, and the lateness histogram
    and the paced counter say so."""
    runtime = make_runtime(release_rate="1", release_burst=1)
    runtime.schedule.adopt(0, [])
    async with (
        runtime.agents["items.retry.1s"].test_context() as tier,
        runtime.agents["release"].test_context() as releaser,
    ):
        for key in (b"a", b"b"):
            await tier.put(b'{"succeed_on": 1}', key=key, headers=tier_headers(clock), partition=0)
        clock.advance(1000)
        for _ in range(2):
            before = len(runtime.release_topic.sent)
            while len(runtime.release_topic.sent) == before:
                await release_module.release_due(runtime)
                if len(runtime.release_topic.sent) == before:
                    clock.advance(round(release_module.seconds_until_next_tick(runtime) * 1000))
            request = runtime.release_topic.sent[-1]
            await releaser.put(request.value, key=request.key, partition=0)
        await eventually(lambda: nothing_waits(runtime, b"a") and nothing_waits(runtime, b"b"))
    assert runtime.counters["released"] == 2
    assert runtime.counters["release.lag_ms_total"] == 1000  # 0 for the first, 1 s for the second
    assert runtime.counters["release.paced"] == 1
    text = runtime.metrics.exposition()[0].decode()
    assert 'rebound_release_lateness_seconds_bucket{le="0.005",tier="1s",topic="items"} 1.0' in text
    assert 'rebound_release_lateness_seconds_bucket{le="1.0",tier="1s",topic="items"} 2.0' in text
    assert "rebound_release_paced_total 1.0" in text
    assert "rebound_release_rate_allowed 1.0" in text


async def test_after_the_breaker_closes_releases_ramp_up_to_the_rate(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime(
        breaker_enabled=True,
        breaker_min_calls=2,
        breaker_window="10s",
        breaker_probe_interval="1s",
        release_rate="100",
        release_ramp="10s",
    )
    gate = runtime.breaker_gate
    for _ in range(2):
        gate.record(Classification.RETRYABLE, probe=False)
    assert gate.breaker.state is BreakerState.OPEN
    clock.advance(1000)
    gate.breaker.admit(clock.now_ms)
    gate.record(None, probe=True)
    assert gate.breaker.snapshot(clock.now_ms)["state"] == BreakerState.CLOSED
    closed_at = clock.now_ms
    due_now(runtime, 2_000, closed_at - 5_000)  # a backlog that came due while it was open
    sends = await run_timer(runtime, clock, until_sent=2_000, limit_ms=30_000)
    sent_by = {second: sum(n for t, n in sends if t < closed_at + second * 1000) for second in (1, 5, 10, 15)}
    # From 10/s to 100/s over 10 s (the area under the line): (10 + 19) / 2 = 14.5 in the first second,
    # 5 * (10 + 55) / 2 = 162.5 in five, 550 in ten, then 100 a second; plus the bucket, 10 x the share of the rate.
    assert 14 <= sent_by[1] <= 17
    assert 160 <= sent_by[5] <= 170
    assert 545 <= sent_by[10] <= 560
    assert 1_040 <= sent_by[15] <= 1_060
    text = runtime.metrics.exposition()[0].decode()
    assert "rebound_release_rate_allowed 100.0" in text


def breaker_runtime(make_runtime: Any, clock: Any, **settings: Any) -> Any:
    """A paced runtime whose breaker opens after two failures (``open_breaker``) and closes after a probe."""
    return make_runtime(
        breaker_enabled=True,
        breaker_min_calls=2,
        breaker_window="10s",
        breaker_probe_interval="1s",
        **settings,
    )


def open_breaker(runtime: Any) -> None:
    for _ in range(2):
        runtime.breaker_gate.record(Classification.RETRYABLE, probe=False)
    assert runtime.breaker_gate.breaker.state is BreakerState.OPEN


def close_breaker(runtime: Any, clock: Any) -> None:
    gate = runtime.breaker_gate
    clock.advance(1000)
    gate.breaker.admit(clock.now_ms)
    gate.record(None, probe=True)
    assert gate.breaker.snapshot(clock.now_ms)["state"] == BreakerState.CLOSED


def allowed_rate(runtime: Any) -> str:
    text = runtime.metrics.exposition()[0].decode()
    return next(line for line in text.splitlines() if line.startswith("rebound_release_rate_allowed "))


async def test_the_allowed_rate_reads_0_while_the_breaker_is_open(make_runtime: Any, clock: Any) -> None:
    """Open, the breaker lets only its probe go, whatever the pacer would allow: the gauge says 0, then the ramp's
    start once it closes."""
    runtime = breaker_runtime(make_runtime, clock, release_rate="100", release_ramp="10s")
    assert allowed_rate(runtime) == "rebound_release_rate_allowed 100.0"
    open_breaker(runtime)
    assert allowed_rate(runtime) == "rebound_release_rate_allowed 0.0"
    close_breaker(runtime, clock)
    assert allowed_rate(runtime) == "rebound_release_rate_allowed 10.0"  # the ramp starts at a tenth


async def test_during_the_ramp_the_timer_wakes_when_the_ramp_allows_the_next(make_runtime: Any, clock: Any) -> None:
    """At 10/s ramping over 10 s from 1/s, the next release after one is allowed once the ramp's integral reaches 1,
    at 748.1 ms: the timer sleeps that long, not the 1 s the rate at the ramp's start would say (up to
    REBOUND_TIMER_INTERVAL, here 60 s)."""
    runtime = breaker_runtime(make_runtime, clock, release_rate="10", release_ramp="10s", timer_interval=60)
    open_breaker(runtime)
    close_breaker(runtime, clock)
    due_now(runtime, 5, clock.now_ms)
    assert await release_module.release_due(runtime) == 1
    # tokens after x ms: 10/s x (0.1 x + 0.9 x^2 / 2 / 10 s) = 1 at x = 748.1 ms
    assert release_module.seconds_until_next_tick(runtime) == 0.749
    clock.advance(748)
    assert await release_module.release_due(runtime) == 0
    clock.advance(1)
    assert await release_module.release_due(runtime) == 1


async def test_lost_requests_are_sent_again_unpaced_and_uncounted(make_runtime: Any, clock: Any) -> None:
    """Requests the release agent never took are sent again once their partition has been silent for the resend
    window: not held back by the pacer (the window bounds resends), taking none of its tokens, and not counted as
    paced a second time."""
    runtime = make_runtime(release_rate="1", release_burst=1)
    due_now(runtime, 3, clock.now_ms)
    for _ in range(3):  # one a second, none ever taken: lost
        assert await release_module.release_due(runtime) == 1
        clock.advance(1000)
    assert runtime.counters["release.paced"] == 2
    clock.advance(runtime.schedule.resend_after_ms)
    runtime.schedule.add(0, Slot(clock.now_ms, b"new", "items/0/new", 1, "1s"))
    assert await release_module.release_due(runtime) == 4  # the 3 again, at 1/s with a burst of 1, and the new one
    origins = [request.origin for _, request in sent_releases(runtime.release_topic.sent[3:])]
    assert sorted(origins) == ["items/0/0", "items/0/1", "items/0/2", "items/0/new"]
    assert runtime.pacer.allowance(clock.now_ms) == 0  # the new one took the token, the resends none
    assert runtime.counters["release.paced"] == 2  # nor were the resends counted again
