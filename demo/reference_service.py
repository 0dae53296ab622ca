"""A service with a known capacity, for the HTTP handler's tests and benchmarks.

``python -m demo.reference_service --port P --capacity C --service-time-ms T --queue-bound Q [--overflow hold]``,
or in-process (``ReferenceService``, or ``serve_in_thread`` from synchronous code).

It behaves like a server with C workers: C calls are served at once, each for T ms; the calls beyond them wait in a
FIFO queue, so their latency grows with the queue; past Q waiting calls it answers 503 (with ``Retry-After`` when
set), or, with ``--overflow hold``, holds the request without an answer until the client gives up, as an overloaded
server whose accept queue is full does. A client that gives up (its timeout closes the connection) leaves the queue
and frees its slot, so ``served`` counts only answers a client could read. Its limit is known exactly, C x 1000 / T
calls per second, which is what the adaptive-concurrency benchmark compares Rebound's goodput with; ``POST
/admin/capacity`` changes C while it runs, to see how fast a client follows.

Every POST to any other path is a call. It reads the record's headers as a service would (``Rebound-Header-List``,
docs/push-handlers.md; decoded here on its own, not with Rebound's code) and answers 400 to a call whose list is
there but does not decode. ``GET /stats`` reports what happened since the start or the last ``POST /admin/reset``: counts, the most calls
in service and waiting at once, latency and queue-wait percentiles, calls served and rejected per second, and the
``Idempotency-Key`` values seen with their counts (the most recent ``keys_kept``; ``?keys=0`` leaves the list out), so
a test can check that a retry carried its original's key, and with them the record headers of each key's latest call
that had any, re-encoded from the decoded bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import dataclasses
import json
import signal
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

IDEMPOTENCY_KEY = "Idempotency-Key"
HEADER_LIST = "Rebound-Header-List"
Overflow = Literal["reject", "hold"]
SERIES_SECONDS = 3600  # per-second counts kept: an hour is longer than any benchmark round


@dataclass(frozen=True)
class ServiceSettings:
    capacity: int = 32
    service_time_ms: float = 10.0
    queue_bound: int = 64
    overflow: Overflow = "reject"
    retry_after_s: int | None = None  # the Retry-After of a 503, whole seconds (RFC 9110); None sends none
    hold_max_s: float = 300.0  # a held request is answered 503 after this, if its client is still there
    keys_kept: int = 100_000
    latencies_kept: int = 200_000

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {self.capacity}")
        if self.queue_bound < 0 or self.service_time_ms < 0 or self.keys_kept < 0:
            raise ValueError("queue_bound, service_time_ms and keys_kept cannot be negative")
        if self.overflow not in ("reject", "hold"):
            raise ValueError(f"overflow is 'reject' or 'hold', not {self.overflow!r}")


class Slots:
    """C slots and a FIFO queue in front of them, whose C can change while calls hold and wait for slots.

    ``asyncio.Semaphore`` cannot shrink, and its waiters are not strictly first come, first served. Lowering C lets
    the calls in service finish and admits nobody until fewer than C are left.
    """

    def __init__(self, capacity: int, queue_bound: int) -> None:
        self.capacity = capacity
        self.queue_bound = queue_bound
        self.busy = 0
        self.waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> bool:
        """True once a slot is held (``release`` it); False, holding nothing, when the queue is full."""
        if self.busy < self.capacity and not self.waiters:
            self.busy += 1
            return True
        if len(self.waiters) >= self.queue_bound:
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # granted as its client went away: the slot goes to the next one
            else:
                with contextlib.suppress(ValueError):
                    self.waiters.remove(waiter)
            raise
        return True

    def release(self) -> None:
        self.busy -= 1
        self._grant()

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self._grant()

    def _grant(self) -> None:
        while self.waiters and self.busy < self.capacity:
            waiter = self.waiters.popleft()
            if not waiter.done():
                self.busy += 1
                waiter.set_result(None)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank, as the benchmarks compute theirs: every figure is one that was observed."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return round(ordered[rank - 1], 2)


def summary(values: deque[float]) -> dict[str, Any]:
    data = list(values)
    return {
        "count": len(data),
        "p50": percentile(data, 50),
        "p90": percentile(data, 90),
        "p99": percentile(data, 99),
        "max": round(max(data), 2) if data else None,
    }


@dataclass
class Stats:
    """What happened since the start or the last reset."""

    keys_kept: int
    latencies_kept: int
    since: float = field(default_factory=time.time)
    calls: int = 0
    served: int = 0
    rejected: int = 0
    held: int = 0
    abandoned: dict[str, int] = field(default_factory=lambda: {"queued": 0, "in_service": 0, "held": 0})
    max_concurrent_seen: int = 0
    max_queued_seen: int = 0
    calls_without_key: int = 0
    repeat_calls: int = 0
    keys_dropped: int = 0
    malformed: int = 0
    keys: OrderedDict[str, int] = field(default_factory=OrderedDict)
    record_headers: OrderedDict[str, list[tuple[str, bytes | None]]] = field(default_factory=OrderedDict)
    served_per_second: OrderedDict[int, int] = field(default_factory=OrderedDict)
    rejected_per_second: OrderedDict[int, int] = field(default_factory=OrderedDict)
    latency_ms: deque[float] = field(default_factory=deque)
    queue_wait_ms: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.latency_ms = deque(maxlen=self.latencies_kept)
        self.queue_wait_ms = deque(maxlen=self.latencies_kept)

    def arrived(self, key: str | None) -> None:
        self.calls += 1
        if key is None:
            self.calls_without_key += 1
            return
        if key in self.keys:
            self.keys[key] += 1
            self.repeat_calls += 1
            return
        if self.keys_kept == 0:
            return
        self.keys[key] = 1
        if len(self.keys) > self.keys_kept:
            self.keys.popitem(last=False)
            self.keys_dropped += 1

    def headers_of(self, key: str | None, pairs: list[tuple[str, bytes | None]]) -> None:
        """Keep the record headers of ``key``'s latest call, for as many keys as ``keys_kept``."""
        if key is None or not pairs or self.keys_kept == 0:
            return
        self.record_headers.pop(key, None)
        self.record_headers[key] = pairs
        if len(self.record_headers) > self.keys_kept:
            self.record_headers.popitem(last=False)

    def count_in(self, series: OrderedDict[int, int]) -> None:
        second = int(time.time())
        series[second] = series.get(second, 0) + 1
        while len(series) > SERIES_SECONDS:
            series.popitem(last=False)

    def report(self, *, with_keys: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "since": self.since,
            "calls": self.calls,
            "served": self.served,
            "rejected": self.rejected,
            "held": self.held,
            "abandoned": dict(self.abandoned),
            "max_concurrent_seen": self.max_concurrent_seen,
            "max_queued_seen": self.max_queued_seen,
            "latency_ms": summary(self.latency_ms),
            "queue_wait_ms": summary(self.queue_wait_ms),
            "served_per_second": [[second, count] for second, count in self.served_per_second.items()],
            "rejected_per_second": [[second, count] for second, count in self.rejected_per_second.items()],
            "distinct_keys_kept": len(self.keys),
            "keys_dropped": self.keys_dropped,
            "repeat_calls": self.repeat_calls,
            "calls_without_key": self.calls_without_key,
            "malformed": self.malformed,
        }
        if with_keys:
            out["idempotency_keys"] = dict(self.keys)
            out["record_headers"] = {
                key: [[name, None if value is None else base64.b64encode(value).decode()] for name, value in pairs]
                for key, pairs in self.record_headers.items()
            }
        return out


def record_headers(text: str | None) -> list[tuple[str, bytes | None]]:
    """``Rebound-Header-List`` as a Python service reads it: ``[name, base64 or null]`` pairs, in order, repeated
    names kept; none when the header is absent. ``ValueError`` for anything else."""
    if text is None:  # a client that is not Rebound (a load generator, curl): no record headers
        return []
    try:
        pairs = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{HEADER_LIST} is not JSON ({exc})") from None
    if not isinstance(pairs, list):
        raise ValueError(f"{HEADER_LIST} is not a JSON array")
    decoded: list[tuple[str, bytes | None]] = []
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ValueError(f"not a [name, value] pair: {pair!r}"[:200])
        name, value = pair
        if value is not None and not isinstance(value, str):
            raise ValueError(f"header {name!r}: not base64 text")
        try:
            decoded.append((name, None if value is None else base64.b64decode(value, validate=True)))
        except binascii.Error as exc:
            raise ValueError(f"header {name!r}: not base64 ({exc})") from None
    return decoded


class ReferenceService:
    """The server: ``await start(host, port)`` (port 0 picks one), ``url``, ``set_capacity``, ``await stop()``."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self.slots = Slots(settings.capacity, settings.queue_bound)
        self.stats = self._new_stats()
        self.url = ""
        self._runner: web.AppRunner | None = None

    def _new_stats(self) -> Stats:
        return Stats(keys_kept=self.settings.keys_kept, latencies_kept=self.settings.latencies_kept)

    def application(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/stats", self._stats)
        app.router.add_post("/admin/capacity", self._capacity)
        app.router.add_post("/admin/reset", self._reset)
        app.router.add_post("/{path:.*}", self._call)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        # handler_cancellation: a client that closes its connection (its timeout) cancels the call's handler, so
        # it leaves the queue or frees its slot instead of being served to nobody.
        self._runner = web.AppRunner(self.application(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=1024)
        await site.start()
        bound = self._runner.addresses[0][1]  # the port chosen when ``port`` is 0
        self.url = f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def set_capacity(self, capacity: int) -> int:
        """Change C now; returns the previous one."""
        previous = self.settings.capacity
        self.settings = dataclasses.replace(self.settings, capacity=capacity)
        self.slots.resize(capacity)
        return previous

    def reset(self) -> None:
        self.stats = self._new_stats()

    def snapshot(self, *, with_keys: bool = True) -> dict[str, Any]:
        return {
            "settings": dataclasses.asdict(self.settings),
            "busy": self.slots.busy,
            "queued": len(self.slots.waiters),
            **self.stats.report(with_keys=with_keys),
        }

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.snapshot(with_keys=request.query.get("keys", "1") != "0"))

    async def _capacity(self, request: web.Request) -> web.Response:
        try:
            capacity = int((await request.json())["capacity"])
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            return web.json_response({"error": 'send {"capacity": <int >= 1>}'}, status=400)
        if capacity < 1:
            return web.json_response({"error": "capacity must be at least 1"}, status=400)
        return web.json_response({"capacity": capacity, "previous": self.set_capacity(capacity)})

    async def _reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"reset": True})

    async def _call(self, request: web.Request) -> web.StreamResponse:
        # Each fact is counted in the period current when it happens (``self.stats`` is read each time, never kept):
        # a call in service across a reset counts as served after it, so the per-second series stay whole.
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        key = request.headers.get(IDEMPOTENCY_KEY)
        self.stats.arrived(key)
        await request.read()
        try:
            self.stats.headers_of(key, record_headers(request.headers.get(HEADER_LIST)))
        except ValueError as exc:
            self.stats.malformed += 1
            return web.Response(status=400, text=f"malformed request: {exc}")
        stage = "queued"
        try:
            if not await self._admit():
                stage = "held"
                return await self._overflow()
            stage = "in_service"
            try:
                self.stats.max_concurrent_seen = max(self.stats.max_concurrent_seen, self.slots.busy)
                self.stats.queue_wait_ms.append((loop.time() - arrived) * 1000)
                await asyncio.sleep(self.settings.service_time_ms / 1000)
            finally:
                self.slots.release()
        except asyncio.CancelledError:
            self.stats.abandoned[stage] += 1
            raise
        self.stats.served += 1
        self.stats.latency_ms.append((loop.time() - arrived) * 1000)
        self.stats.count_in(self.stats.served_per_second)
        return web.Response(text="ok")

    async def _admit(self) -> bool:
        waiting = len(self.slots.waiters)
        if (self.slots.busy >= self.slots.capacity or waiting) and waiting < self.slots.queue_bound:
            self.stats.max_queued_seen = max(self.stats.max_queued_seen, waiting + 1)
        return await self.slots.acquire()

    async def _overflow(self) -> web.Response:
        if self.settings.overflow == "hold":
            self.stats.held += 1
            await asyncio.sleep(self.settings.hold_max_s)
        self.stats.rejected += 1
        self.stats.count_in(self.stats.rejected_per_second)
        headers = {}
        if self.settings.retry_after_s is not None:
            headers["Retry-After"] = str(self.settings.retry_after_s)
        return web.Response(status=503, text="overloaded: the queue is full", headers=headers)


@contextlib.contextmanager
def serve_in_thread(settings: ServiceSettings, host: str = "127.0.0.1", port: int = 0) -> Iterator[ReferenceService]:
    """The service on its own event loop in a thread, for synchronous tests and scripts; stopped on exit."""
    service = ReferenceService(settings)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="reference-service", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(service.start(host, port), loop).result(timeout=10)
        yield service
    finally:
        asyncio.run_coroutine_threadsafe(service.stop(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def parse_args(argv: list[str] | None = None) -> tuple[str, int, ServiceSettings]:
    parser = argparse.ArgumentParser(prog="python -m demo.reference_service", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free one (printed at start)")
    parser.add_argument("--capacity", type=int, default=32, help="calls served at once")
    parser.add_argument("--service-time-ms", type=float, default=10.0)
    parser.add_argument("--queue-bound", type=int, default=64, help="calls waiting beyond capacity")
    parser.add_argument("--overflow", choices=["reject", "hold"], default="reject", help="past the bound: 503 or hold")
    parser.add_argument("--retry-after", type=int, default=None, help="whole seconds, sent with each 503")
    parser.add_argument("--hold-max-s", type=float, default=300.0)
    parser.add_argument("--keys-kept", type=int, default=100_000)
    args = parser.parse_args(argv)
    try:
        settings = ServiceSettings(
            capacity=args.capacity,
            service_time_ms=args.service_time_ms,
            queue_bound=args.queue_bound,
            overflow=args.overflow,
            retry_after_s=args.retry_after,
            hold_max_s=args.hold_max_s,
            keys_kept=args.keys_kept,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return args.host, args.port, settings


async def serve(host: str, port: int, settings: ServiceSettings) -> None:
    service = ReferenceService(settings)
    url = await service.start(host, port)
    print(f"reference service on {url} ({settings})", flush=True)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopped.set)
    try:
        await stopped.wait()
    finally:
        await service.stop()


def main(argv: list[str] | None = None) -> int:
    host, port, settings = parse_args(argv)
    asyncio.run(serve(host, port, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
