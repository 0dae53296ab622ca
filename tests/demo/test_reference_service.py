"""The reference service (demo/reference_service.py) against real clients on a loopback port.

The benchmarks and the HTTP handler's tests read their figures from it, so what it counts must be what happened:
each test drives the running server through aiohttp and checks the answers against its ``/stats``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from demo.reference_service import ReferenceService, ServiceSettings, VirtualSlots, parse_args, serve_in_thread


@pytest.fixture
async def start() -> AsyncIterator[Any]:
    services: list[ReferenceService] = []

    async def factory(**settings: Any) -> ReferenceService:
        service = ReferenceService(ServiceSettings(**settings))
        await service.start("127.0.0.1", 0)
        services.append(service)
        return service

    yield factory
    for service in services:
        await service.stop()


async def post(session: aiohttp.ClientSession, url: str, key: str | None = None, **kwargs: Any) -> tuple[int, float]:
    headers = {"Idempotency-Key": key} if key is not None else {}
    started = time.monotonic()
    async with session.post(url + "/events", data=b"payload", headers=headers, **kwargs) as response:
        await response.read()
        return response.status, time.monotonic() - started


async def stats(session: aiohttp.ClientSession, url: str, query: str = "") -> dict[str, Any]:
    async with session.get(url + "/stats" + query) as response:
        assert response.status == 200
        body: dict[str, Any] = await response.json()
        return body


async def test_serves_at_most_capacity_at_once_and_queues_the_rest(start: Any) -> None:
    service = await start(capacity=4, service_time_ms=100, queue_bound=100)
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        results = await asyncio.gather(*(post(session, service.url, f"k{i}") for i in range(12)))
        elapsed = time.monotonic() - started
        seen = await stats(session, service.url)
    assert [status for status, _ in results] == [200] * 12
    assert seen["served"] == 12
    assert seen["max_concurrent_seen"] == 4
    # 12 calls through 4 slots of 100 ms: three waves, so the last ones waited two service times in the queue.
    assert elapsed >= 0.3
    assert max(latency for _, latency in results) >= 0.28
    assert seen["latency_ms"]["max"] >= 280
    assert seen["queue_wait_ms"]["max"] >= 180
    assert seen["max_queued_seen"] == 8


async def test_past_the_queue_bound_it_answers_503_with_retry_after_when_set(start: Any) -> None:
    service = await start(capacity=2, service_time_ms=200, queue_bound=3, retry_after_s=7)
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(post(session, service.url, f"k{i}")) for i in range(5)]
        await asyncio.sleep(0.1)  # two in service, three queued: the queue is full
        async with session.post(service.url + "/events", data=b"x", headers={"Idempotency-Key": "over"}) as response:
            assert response.status == 503
            assert response.headers["Retry-After"] == "7"
        results = await asyncio.gather(*tasks)
        seen = await stats(session, service.url)
    assert [status for status, _ in results] == [200] * 5
    assert seen["served"] == 5
    assert seen["rejected"] == 1
    assert seen["calls"] == 6
    assert sum(count for _, count in seen["rejected_per_second"]) == 1
    assert sum(count for _, count in seen["served_per_second"]) == 5


async def test_hold_mode_keeps_an_overflowing_request_until_the_client_gives_up(start: Any) -> None:
    service = await start(capacity=1, service_time_ms=300, queue_bound=0, overflow="hold")
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, service.url, "a"))
        await asyncio.sleep(0.05)
        with pytest.raises(asyncio.TimeoutError):
            await post(session, service.url, "b", timeout=aiohttp.ClientTimeout(total=0.2))
        assert (await first)[0] == 200
        await asyncio.sleep(0.1)  # the server notices the closed connection
        seen = await stats(session, service.url)
    assert seen["held"] == 1
    assert seen["rejected"] == 0
    assert seen["abandoned"] == {"queued": 0, "in_service": 0, "held": 1}
    assert seen["served"] == 1


async def test_a_client_that_times_out_in_the_queue_frees_its_place(start: Any) -> None:
    service = await start(capacity=1, service_time_ms=300, queue_bound=5)
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, service.url, "a"))
        await asyncio.sleep(0.05)
        with pytest.raises(asyncio.TimeoutError):
            await post(session, service.url, "b", timeout=aiohttp.ClientTimeout(total=0.1))
        assert (await first)[0] == 200
        status, latency = await post(session, service.url, "c")
        seen = await stats(session, service.url)
    assert status == 200
    assert latency < 0.5  # not behind the abandoned call
    assert seen["abandoned"]["queued"] == 1
    assert seen["served"] == 2
    assert seen["busy"] == 0
    assert seen["queued"] == 0


async def test_capacity_changes_while_it_runs(start: Any) -> None:
    service = await start(capacity=1, service_time_ms=100, queue_bound=100)
    async with aiohttp.ClientSession() as session:
        async with session.post(service.url + "/admin/capacity", json={"capacity": 6}) as response:
            assert response.status == 200
            assert await response.json() == {"capacity": 6, "previous": 1}
        results = await asyncio.gather(*(post(session, service.url, f"k{i}") for i in range(6)))
        assert (await stats(session, service.url))["max_concurrent_seen"] == 6  # one wave of six, not six of one

        async with session.post(service.url + "/admin/capacity", json={"capacity": 2}) as response:
            assert response.status == 200
        async with session.post(service.url + "/admin/reset") as response:
            assert response.status == 200
        await asyncio.gather(*(post(session, service.url, f"j{i}") for i in range(6)))
        seen = await stats(session, service.url)
        async with session.post(service.url + "/admin/capacity", json={"capacity": 0}) as response:
            assert response.status == 400
    assert [status for status, _ in results] == [200] * 6
    assert seen["settings"]["capacity"] == 2
    assert seen["max_concurrent_seen"] == 2
    assert seen["served"] == 6


async def test_a_lowered_capacity_lets_calls_in_service_finish_and_admits_no_new_one_until_under_it(
    start: Any,
) -> None:
    service = await start(capacity=4, service_time_ms=300, queue_bound=100)
    async with aiohttp.ClientSession() as session:
        first = [asyncio.create_task(post(session, service.url, f"a{i}")) for i in range(4)]
        await asyncio.sleep(0.05)
        service.set_capacity(1)
        later = [asyncio.create_task(post(session, service.url, f"b{i}")) for i in range(2)]
        await asyncio.sleep(0.05)
        during = await stats(session, service.url)
        done = await asyncio.gather(*first, *later)
    assert during["busy"] == 4
    assert during["queued"] == 2
    assert [status for status, _ in done] == [200] * 6
    # The two later calls ran one at a time after the first four: the second ended two service times after them.
    assert done[5][1] >= 0.55


async def test_a_call_in_service_across_a_reset_counts_in_the_new_period(start: Any) -> None:
    service = await start(capacity=2, service_time_ms=200)
    async with aiohttp.ClientSession() as session:
        call = asyncio.create_task(post(session, service.url, "across"))
        await asyncio.sleep(0.05)
        async with session.post(service.url + "/admin/reset") as response:
            assert response.status == 200
        assert (await call)[0] == 200
        seen = await stats(session, service.url)
    assert seen["served"] == 1
    assert sum(count for _, count in seen["served_per_second"]) == 1
    assert seen["latency_ms"]["count"] == 1


async def test_idempotency_keys_are_counted_and_bounded(start: Any) -> None:
    service = await start(capacity=8, service_time_ms=1, queue_bound=100, keys_kept=3)
    async with aiohttp.ClientSession() as session:
        for key in ("a", "b", "a", "c", "d", "d"):
            assert (await post(session, service.url, key))[0] == 200
        assert (await post(session, service.url, None))[0] == 200
        seen = await stats(session, service.url)
        without = await stats(session, service.url, "?keys=0")
    # "a" was pushed out by "d" (the oldest first); its repeat had been counted while it was kept.
    assert seen["idempotency_keys"] == {"b": 1, "c": 1, "d": 2}
    assert seen["repeat_calls"] == 2
    assert seen["calls_without_key"] == 1
    assert seen["keys_dropped"] == 1
    assert "idempotency_keys" not in without
    assert without["repeat_calls"] == 2


async def test_latency_percentiles_include_the_service_time(start: Any) -> None:
    service = await start(capacity=10, service_time_ms=50, queue_bound=0)
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(post(session, service.url, f"k{i}") for i in range(10)))
        seen = await stats(session, service.url)
    latency = seen["latency_ms"]
    assert latency["count"] == 10
    assert 50 <= latency["p50"] <= latency["p99"] <= latency["max"] < 1000


async def test_admin_and_stats_paths_are_not_counted_as_calls(start: Any) -> None:
    service = await start(capacity=1, service_time_ms=1)
    async with aiohttp.ClientSession() as session:
        await stats(session, service.url)
        async with session.get(service.url + "/events") as response:
            assert response.status == 405
        seen = await stats(session, service.url)
    assert seen["calls"] == 0


def test_runs_in_a_thread_for_synchronous_callers() -> None:
    async def one(url: str) -> int:
        async with aiohttp.ClientSession() as session:
            return (await post(session, url, "t"))[0]

    with serve_in_thread(ServiceSettings(capacity=2, service_time_ms=1)) as service:
        assert asyncio.run(one(service.url)) == 200
        assert service.snapshot()["served"] == 1


def test_command_line_settings() -> None:
    host, port, settings = parse_args(
        ["--port", "0", "--capacity", "32", "--service-time-ms", "10", "--queue-bound", "64", "--overflow", "hold"]
    )
    assert (host, port) == ("127.0.0.1", 0)
    assert settings == ServiceSettings(capacity=32, service_time_ms=10.0, queue_bound=64, overflow="hold")
    with pytest.raises(SystemExit):
        parse_args(["--capacity", "0"])


# The slots in virtual time (``VirtualSlots``): each call's start and end are fixed when it arrives, from the times the
# slots free, not from when the event loop got round to freeing them.


def test_a_call_starts_when_the_earliest_slot_frees_in_virtual_time() -> None:
    slots = VirtualSlots(capacity=2, queue_bound=10, service_time_s=0.1)
    calls = [slots.admit(now=0.0) for _ in range(5)]
    assert [t for c in calls if c is not None for t in (c.start, c.end)] == pytest.approx(
        [0.0, 0.1, 0.0, 0.1, 0.1, 0.2, 0.1, 0.2, 0.2, 0.3]
    )
    # The loop answers late (no call has left yet at 0.25): the slots still freed at their virtual times.
    late = slots.admit(now=0.25)
    assert late is not None
    assert (late.start, late.end) == pytest.approx((0.25, 0.35))
    assert slots.in_service(0.25) == 2  # the fifth (0.2-0.3) and the late one
    assert slots.waiting(0.25) == 0


def test_the_queue_bound_counts_the_calls_not_started_in_virtual_time() -> None:
    slots = VirtualSlots(capacity=2, queue_bound=3, service_time_s=0.2)
    admitted = [slots.admit(now=0.0) for _ in range(5)]
    assert all(call is not None for call in admitted)
    assert (slots.in_service(0.05), slots.waiting(0.05)) == (2, 3)
    assert slots.admit(now=0.05) is None  # a sixth would wait behind three: 503
    # At 0.2 the first two ended and two waiting ones started: one place in the queue again.
    assert slots.waiting(0.2) == 1
    assert slots.admit(now=0.2) is not None


def test_a_call_that_leaves_early_gives_its_time_to_those_behind_it() -> None:
    slots = VirtualSlots(capacity=1, queue_bound=5, service_time_s=0.3)
    first, second, third = (slots.admit(now=0.0) for _ in range(3))
    assert first is not None and second is not None and third is not None
    assert slots.leave(second, now=0.1) == [third]  # queued, its client gave up: the third moves up
    assert (third.start, third.end) == pytest.approx((0.3, 0.6))
    assert slots.leave(first, now=0.2) == [third]  # in service, gone: its slot frees now
    assert (third.start, third.end) == pytest.approx((0.2, 0.5))
    assert slots.leave(third, now=0.5) == []
    assert (slots.in_service(0.5), slots.waiting(0.5)) == (0, 0)


def test_a_capacity_drop_keeps_scheduled_times_and_a_restore_moves_the_waiting_calls_up() -> None:
    slots = VirtualSlots(capacity=4, queue_bound=100, service_time_s=0.1)
    before = [slots.admit(now=0.0) for _ in range(4)]
    assert slots.resize(1, now=0.05) == []
    assert [c.end for c in before if c is not None] == pytest.approx([0.1] * 4)  # kept
    after = [slots.admit(now=0.05) for _ in range(3)]
    # One slot now: the new calls wait for all four to end, then go one at a time.
    assert [t for c in after if c is not None for t in (c.start, c.end)] == pytest.approx(
        [0.1, 0.2, 0.2, 0.3, 0.3, 0.4]
    )
    moved = slots.resize(4, now=0.15)
    # Four slots again: the two still waiting start now, beside the one in service.
    assert moved == after[1:]
    assert [t for c in after if c is not None for t in (c.start, c.end)] == pytest.approx(
        [0.1, 0.2, 0.15, 0.25, 0.15, 0.25]
    )
    late = slots.admit(now=0.15)
    assert late is not None and late.start == pytest.approx(0.15)
    assert slots.in_service(0.15) == 4


async def test_160_calls_through_four_slots_take_forty_service_times_not_more(start: Any) -> None:
    service = await start(capacity=160, service_time_ms=5, queue_bound=200)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(post(session, service.url) for _ in range(160)))  # open connections, reused below
        service.set_capacity(4)
        service.reset()
        started = time.monotonic()
        results = await asyncio.gather(*(post(session, service.url) for _ in range(160)))
        elapsed = time.monotonic() - started
        seen = await stats(session, service.url)
    assert [status for status, _ in results] == [200] * 160
    assert seen["max_concurrent_seen"] == 4
    # Forty waves of 5 ms: the last call starts 195 ms after the first arrived, so no call waits longer. The loop's
    # lateness in waking a call (a timer's millisecond rounding, a turn of the loop) delays that answer but must not
    # add up from wave to wave (when slots were freed as their calls woke, a wave took 5.4 to 5.8 ms here, the longest wait
    # 210 to 225 ms). The planned start is what must not move, so the wait is asserted, not the latency: one late wake
    # on a loaded machine (25 ms was seen) delays one answer without adding up. The client's own elapsed time is
    # noisier (its 160 requests and answers share the loop): only a floor.
    assert elapsed >= 0.2
    assert seen["queue_wait_ms"]["max"] <= 196
