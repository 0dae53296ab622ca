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

The slots are kept in virtual time (``VirtualSlots``), so the service gives that limit whatever its event loop's
lateness: a call's start (the later of its arrival and the earliest time one of the C slots frees) and end (start +
T) are computed when it arrives, and the handler sleeps until that end. A loop that wakes it late delays that one
answer; the slot was free at the end all the same. (Slots held in real time, with a sleep of T and a freed slot
handed to the next call a loop turn later, were held about 12.3 ms at 10 ms under load: 2,600/s of a nominal 3,200.)
"Waiting" is a call whose start is still ahead; "in service", one between its start and end. A capacity change
applies to the calls that arrive after it: lowering C keeps the scheduled calls' times (those in service and waiting
finish as scheduled, so more than C may be in service until they end), raising it gives the new slots to the
waiting calls at once. A call that leaves before its end hands its slot or its place on to the calls behind it.
Latency is measured from a call's arrival to its answer (so it includes the loop's lateness); queue wait is the
modelled one, start minus arrival, for the calls that reached service.

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
import heapq
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


@dataclass(eq=False)
class Call:
    """An admitted call's place in virtual time: in service from ``start`` to ``end``, waiting before ``start``."""

    arrival: float
    start: float
    end: float


class VirtualSlots:
    """C slots and a FIFO queue in front of them, in virtual time; pure arithmetic on the times it is given.

    A call arriving at ``now`` starts at the later of ``now`` and the earliest time one of the C slots frees, and ends
    a service time later; both are fixed when it arrives (a heap of the C slots' free times). The handler then sleeps
    until ``end``: a loop that wakes it late delays that answer, but the slot was free again at ``end`` for the next
    call, so lateness never eats capacity. A call is in service from ``start`` to ``end`` and waiting before
    ``start``; one that would wait when ``queue_bound`` calls already do is refused (``admit`` returns None).

    Times only move earlier after they are fixed: a call that leaves before its end (its client gave up) frees its
    slot, or its place in the queue, at once, and the waiting calls are scheduled again from then, in their order;
    raising C does the same with the new slots. Lowering C keeps every scheduled call's times and takes away the
    slots that free first, so the calls arriving after it see C slots (the calls in service and waiting may exceed
    C until they end, as they would on a server whose workers finish their requests).
    """

    def __init__(self, capacity: int, queue_bound: int, service_time_s: float) -> None:
        self.capacity = capacity
        self.queue_bound = queue_bound
        self.service_time_s = service_time_s
        self.calls: dict[Call, None] = {}  # admitted and not yet left, in the order of arrival
        self._free = [float("-inf")] * capacity  # the slots' free times, a heap

    def admit(self, now: float) -> Call | None:
        start = max(now, self._free[0])
        if start > now and self.waiting(now) >= self.queue_bound:
            return None
        call = Call(now, start, start + self.service_time_s)
        heapq.heapreplace(self._free, call.end)
        self.calls[call] = None
        return call

    def leave(self, call: Call, now: float) -> list[Call]:
        """``call`` answered, or given up at ``now``; returns the calls whose times moved (earlier)."""
        del self.calls[call]
        if now >= call.end:
            return []
        return self._reschedule(now)

    def resize(self, capacity: int, now: float) -> list[Call]:
        """C becomes ``capacity`` at ``now``; returns the calls whose times moved (earlier: only when raised)."""
        raised = capacity > self.capacity
        self.capacity = capacity
        if raised:
            return self._reschedule(now)
        self._free = heapq.nlargest(capacity, self._free)
        heapq.heapify(self._free)
        return []

    def in_service(self, now: float) -> int:
        return sum(1 for call in self.calls if call.start <= now < call.end)

    def waiting(self, now: float) -> int:
        return sum(1 for call in self.calls if call.start > now)

    def _reschedule(self, now: float) -> list[Call]:
        started = [call.end for call in self.calls if call.start <= now]
        free = heapq.nlargest(self.capacity, started) + [now] * max(0, self.capacity - len(started))
        heapq.heapify(free)
        moved: list[Call] = []
        for call in [call for call in self.calls if call.start > now]:
            start = max(now, heapq.heappop(free))
            if start < call.start:
                call.start, call.end = start, start + self.service_time_s
                moved.append(call)
            heapq.heappush(free, max(call.end, start))
        self._free = free
        return moved


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
        self.slots = VirtualSlots(settings.capacity, settings.queue_bound, settings.service_time_ms / 1000)
        self.stats = self._new_stats()
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeups: dict[Call, tuple[asyncio.Future[None], asyncio.TimerHandle]] = {}

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
        self._loop = asyncio.get_running_loop()
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
        self._rearm(self.slots.resize(capacity, self._now()))
        return previous

    def _now(self) -> float:
        return self._loop.time() if self._loop is not None else time.monotonic()

    def reset(self) -> None:
        self.stats = self._new_stats()

    def snapshot(self, *, with_keys: bool = True) -> dict[str, Any]:
        now = self._now()
        return {
            "settings": dataclasses.asdict(self.settings),
            "busy": self.slots.in_service(now),
            "queued": self.slots.waiting(now),
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
        call = self._admit(loop.time())
        if call is None:
            try:
                return await self._overflow()
            except asyncio.CancelledError:
                self.stats.abandoned["held"] += 1
                raise
        try:
            await self._until_end(call)
        except asyncio.CancelledError:
            now = loop.time()
            started = call.start <= now
            self.stats.abandoned["in_service" if started else "queued"] += 1
            if started:
                self.stats.queue_wait_ms.append((call.start - arrived) * 1000)
            self._rearm(self.slots.leave(call, now))
            raise
        self.slots.leave(call, loop.time())
        self.stats.queue_wait_ms.append((call.start - arrived) * 1000)
        self.stats.served += 1
        self.stats.latency_ms.append((loop.time() - arrived) * 1000)
        self.stats.count_in(self.stats.served_per_second)
        return web.Response(text="ok")

    def _admit(self, now: float) -> Call | None:
        """The call's times, or None past the queue bound; counts the most in service and waiting at once."""
        call = self.slots.admit(now)
        if call is None:
            return None
        # In service when it starts: the calls whose slot time covers that instant, itself included.
        in_service = sum(1 for other in self.slots.calls if other.start <= call.start < other.end or other is call)
        self.stats.max_concurrent_seen = max(self.stats.max_concurrent_seen, in_service)
        if call.start > now:
            self.stats.max_queued_seen = max(self.stats.max_queued_seen, self.slots.waiting(now))
        return call

    async def _until_end(self, call: Call) -> None:
        """Sleep until ``call.end`` on the loop's clock, waking earlier if the call's times move (``_rearm``)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._wakeups[call] = (done, loop.call_at(call.end, _resolve, done))
        try:
            await done
        finally:
            self._wakeups.pop(call)[1].cancel()

    def _rearm(self, moved: list[Call]) -> None:
        """The calls whose end moved wake at their new one."""
        if self._loop is None:
            return
        for call in moved:
            wakeup = self._wakeups.get(call)
            if wakeup is not None:
                done, timer = wakeup
                timer.cancel()
                self._wakeups[call] = (done, self._loop.call_at(call.end, _resolve, done))

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


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


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
