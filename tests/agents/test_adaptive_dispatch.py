"""Adaptive concurrency on the dispatcher: the limit follows the limiter while work runs (raised, queued work starts at
once; lowered, nothing is cut short and nothing starts until below it), and ``call_handler`` tells it how each call
went. The limiter's own rule is tested in tests/rebound/test_limiter.py; a real worker in
tests/integration/test_adaptive_concurrency.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from faust.types import TP

from agents.attempt import call_handler
from agents.dispatcher import Dispatcher, HandlerCall
from rebound.errors import HandlerTimeout, OverloadError, RetryableError
from rebound.event import RetryEvent
from rebound.http_errors import HttpTimeout
from rebound.limiter import PROBE_CALLS, AdaptiveLimit, CallOutcome, LimitRange

TP0 = TP("items", 0)


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Message:
    tp: TP
    offset: int


@dataclass
class Event:
    message: Message
    acks: list[int]

    def ack(self) -> bool:
        self.acks.append(self.message.offset)
        return True


@dataclass
class Consumer:
    abandoned: list[int] = field(default_factory=list)

    def abandon(self, message: Message, *, finished: bool = False) -> None:
        self.abandoned.append(message.offset)

    def pause_between_batches(self, tps: list[TP]) -> None:
        pass

    def resume_after_pause(self, tps: list[TP]) -> None:
        pass


class Calls:
    """Work whose handler call the test ends: each run reports its start and end to the dispatcher as
    ``call_handler`` does, with the latency the test sets on the clock."""

    def __init__(self, dispatcher: Dispatcher, clock: Clock) -> None:
        self.dispatcher = dispatcher
        self.clock = clock
        self.running: dict[int, asyncio.Future[CallOutcome]] = {}
        self.cancelled: list[int] = []
        self.acks: list[int] = []

    async def run(self, event: Event) -> None:
        call = self.dispatcher.call_started()
        ending: asyncio.Future[CallOutcome] = asyncio.get_running_loop().create_future()
        self.running[event.message.offset] = ending
        try:
            outcome = await ending
        except asyncio.CancelledError:
            self.cancelled.append(event.message.offset)
            self.dispatcher.call_ended(call, CallOutcome.IGNORED)
            raise
        del self.running[event.message.offset]
        self.dispatcher.call_ended(call, outcome)

    def offer(self, count: int) -> None:
        start = len(self.acks) + len(self.running) + self.dispatcher.core.queued
        for offset in range(start, start + count):
            self.dispatcher.offer(Event(Message(TP0, offset), self.acks), f"key-{offset}", self.run)

    async def end(self, count: int, outcome: CallOutcome = CallOutcome.SUCCEEDED) -> None:
        for offset in sorted(self.running)[:count]:
            self.running[offset].set_result(outcome)
        await settle()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def make(low: int = 2, high: int = 64, initial: int = 8) -> tuple[Dispatcher, Calls, Clock]:
    clock = Clock()
    limiter = AdaptiveLimit(LimitRange(low, high, initial), clock=clock, jitter=lambda: 0.0)
    dispatcher = Dispatcher(SimpleNamespace(consumer=Consumer()), limit=1, partition_buffer=10_000, limiter=limiter)
    return dispatcher, Calls(dispatcher, clock), clock


async def probe(calls: Calls, clock: Clock, latency: float = 0.01) -> None:
    """The first probe: calls at the minimum concurrency until it has its samples."""
    limiter = calls.dispatcher.limiter
    assert limiter is not None
    while limiter.probing:
        clock.now += latency
        await calls.end(1)


async def test_the_dispatcher_starts_at_the_limiters_limit_and_raising_it_starts_queued_work_at_once() -> None:
    dispatcher, calls, clock = make(low=2, initial=8)
    calls.offer(40)
    await settle()
    assert dispatcher.core.limit == 2 and len(calls.running) == 2  # probing at the minimum
    await probe(calls, clock)
    # The call that ended the probe raised the limit to 8: six more started in that same step, no poll needed.
    assert dispatcher.core.limit == 8
    assert dispatcher.core.running == 8 and dispatcher.handler_in_flight == 8
    assert len(calls.running) == 8
    assert calls.acks == list(range(PROBE_CALLS))


async def test_lowering_the_limit_cuts_nothing_short_and_starts_nothing_until_below_it() -> None:
    dispatcher, calls, clock = make(low=2, initial=8)
    calls.offer(60)
    await settle()
    await probe(calls, clock)
    assert len(calls.running) == 8
    # Calls at 100 x the baseline: queueing; at the end of the window the limit is halved (the most one window cuts).
    clock.now += 1.0
    while dispatcher.core.limit == 8:
        assert len(calls.running) == 8  # each call that ends is replaced while the limit holds
        await calls.end(1)
    assert dispatcher.core.limit == 4
    assert not calls.cancelled
    assert len(calls.running) == 7  # the call that ended the window left, and nothing started in its place
    for left in (6, 5, 4):
        await calls.end(1)
        assert len(calls.running) == left  # still at or above the limit: nothing starts
    await calls.end(1)
    assert len(calls.running) == 4  # one ended below the limit: one started
    assert not calls.cancelled
    assert calls.acks == sorted(calls.acks) == list(range(len(calls.acks)))


async def test_a_call_records_the_works_holding_a_slot_when_it_started() -> None:
    """The limit bounds dispatched works, not handler calls: the limiter judges whether it was used from them."""
    dispatcher, calls, _ = make(low=2, initial=8)
    calls.offer(3)
    await settle()
    assert dispatcher.core.running == 2
    call = dispatcher.call_started()  # a third call from a work that already holds a slot (a release's)
    assert (call.in_flight, call.running) == (3, 2)
    dispatcher.call_ended(call, CallOutcome.IGNORED)


async def test_handler_in_flight_is_counted_with_a_fixed_limit_too() -> None:
    dispatcher = Dispatcher(SimpleNamespace(consumer=Consumer()), limit=3, partition_buffer=100)
    assert dispatcher.limiter is None
    first, second = dispatcher.call_started(), dispatcher.call_started()
    assert (first.in_flight, second.in_flight, dispatcher.handler_in_flight) == (1, 2, 2)
    dispatcher.call_ended(first, CallOutcome.DROPPED)
    assert dispatcher.handler_in_flight == 1 and dispatcher.core.limit == 3
    snapshot = dispatcher.concurrency()
    assert snapshot["mode"] == "fixed" and snapshot["limit"] == 3 and snapshot["in_flight"] == 1


async def test_the_snapshot_shows_the_adaptive_range_and_baseline() -> None:
    dispatcher, calls, clock = make(low=2, high=64, initial=8)
    calls.offer(PROBE_CALLS + 20)
    await settle()
    await probe(calls, clock, latency=0.01)  # two at once, one ending each 10 ms: each call took 20 ms
    snapshot = dispatcher.concurrency()
    assert snapshot["mode"] == "auto"
    assert (snapshot["limit"], snapshot["minimum"], snapshot["maximum"]) == (8, 2, 64)
    assert snapshot["in_flight"] == len(calls.running) == 8
    assert snapshot["baseline_ms"] == pytest.approx(20.0)
    assert snapshot["probing"] is False


# -- call_handler's samples ------------------------------------------------------------------------------------------


class RecordingDispatcher(Dispatcher):
    def __init__(self) -> None:
        super().__init__(SimpleNamespace(consumer=Consumer()), limit=1, partition_buffer=10)
        self.outcomes: list[CallOutcome] = []

    def call_ended(self, call: HandlerCall, outcome: CallOutcome) -> None:
        self.outcomes.append(outcome)
        super().call_ended(call, outcome)


def runtime_with(handler: Any, timeout_s: float = 5.0) -> Any:
    metrics = SimpleNamespace(handler_called=lambda *args: None)
    settings = SimpleNamespace(handler_timeout_s=timeout_s, handler_timeout=f"{timeout_s}s")
    return SimpleNamespace(handler=handler, settings=settings, metrics=metrics, dispatcher=RecordingDispatcher())


def event() -> RetryEvent:
    return RetryEvent(
        key=b"k", value=b"v", headers={}, topic="items", partition=0, offset=1, attempt=0, timestamp_ms=0,
        first_received_at_ms=0, tier=None,
    )  # fmt: skip


async def succeed(_: RetryEvent) -> None:
    await asyncio.sleep(0)


async def overloaded(_: RetryEvent) -> None:
    raise OverloadError("503 from the service")


async def failing(_: RetryEvent) -> None:
    raise RetryableError("row not there yet")


async def slow(_: RetryEvent) -> None:
    await asyncio.sleep(10)


async def http_timed_out(_: RetryEvent) -> None:
    raise HttpTimeout("no answer within the request timeout")  # the push handler's own timeout, shorter than ours


async def own_timeout(_: RetryEvent) -> None:
    raise TimeoutError("the handler's own call to its database timed out")


@pytest.mark.parametrize(
    ("handler", "raised", "outcome"),
    [
        (succeed, None, CallOutcome.SUCCEEDED),
        (overloaded, OverloadError, CallOutcome.DROPPED),
        (failing, RetryableError, CallOutcome.IGNORED),
        (slow, HandlerTimeout, CallOutcome.DROPPED),
        (http_timed_out, HttpTimeout, CallOutcome.DROPPED),
        (own_timeout, TimeoutError, CallOutcome.DROPPED),
    ],
)
async def test_call_handler_reports_each_call_as_a_sample_a_drop_or_nothing(handler, raised, outcome) -> None:
    runtime = runtime_with(handler, timeout_s=0.05)
    if raised is None:
        await call_handler(runtime, event())
    else:
        with pytest.raises(raised):
            await call_handler(runtime, event())
    assert runtime.dispatcher.outcomes == [outcome]
    assert runtime.dispatcher.handler_in_flight == 0


async def test_a_cancelled_call_is_no_sample_and_leaves_the_count() -> None:
    runtime = runtime_with(slow)
    task = asyncio.ensure_future(call_handler(runtime, event()))
    await settle()
    assert runtime.dispatcher.handler_in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert runtime.dispatcher.outcomes == [CallOutcome.IGNORED]
    assert runtime.dispatcher.handler_in_flight == 0


# -- the worker's build and its metrics ------------------------------------------------------------------------------


def built(tmp_path: Any, **values: Any) -> Any:
    from app.factory import build
    from rebound.settings import load_settings

    settings = load_settings(
        handler="tests.scripted_handler:handle",
        data_dir=str(tmp_path),
        provision_topics=False,
        store="memory://",
        **values,
    )
    return build(settings, partitions=1)


def scrape(runtime: Any) -> dict[str, float]:
    text = runtime.metrics.exposition()[0].decode()
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith(("rebound_concurrency", "rebound_handler_in_flight"))
    }


def test_auto_builds_a_dispatcher_that_follows_a_limiter_and_exports_it(tmp_path) -> None:
    runtime = built(tmp_path, concurrency="auto", concurrency_min=3, concurrency_max=100, concurrency_initial=20)
    dispatcher = runtime.dispatcher
    assert dispatcher.limiter is not None
    assert dispatcher.limiter.bounds == LimitRange(3, 100, 20)
    assert dispatcher.core.limit == 3  # the first probe runs at the minimum
    assert runtime.schedule.max_in_flight == 16 * 100
    call = dispatcher.call_started()
    metrics = scrape(runtime)
    assert metrics["rebound_concurrency_limit"] == 3
    assert metrics["rebound_handler_in_flight"] == 1
    assert metrics["rebound_concurrency_min"] == 3 and metrics["rebound_concurrency_max"] == 100
    assert "rebound_concurrency_baseline_seconds" not in metrics  # not measured yet
    dispatcher.call_ended(call, CallOutcome.SUCCEEDED)
    assert scrape(runtime)["rebound_handler_in_flight"] == 0


def test_a_number_builds_a_fixed_limit_and_exports_it(tmp_path) -> None:
    runtime = built(tmp_path, concurrency=12)
    assert runtime.dispatcher.limiter is None and runtime.dispatcher.core.limit == 12
    assert runtime.schedule.max_in_flight == 16 * 12
    metrics = scrape(runtime)
    assert metrics["rebound_concurrency_limit"] == 12 and metrics["rebound_handler_in_flight"] == 0
    assert "rebound_concurrency_min" not in metrics


def test_the_backlog_views_carry_the_limit_and_the_calls_in_flight(tmp_path) -> None:
    from agents.status import build_summary
    from app.views import backlog
    from rebound.summary import WorkerSummary, aggregate

    runtime = built(tmp_path, concurrency="auto")
    call = runtime.dispatcher.call_started()
    local = backlog(runtime)["concurrency"]
    assert (local["mode"], local["limit"], local["in_flight"], local["minimum"], local["maximum"]) == (
        "auto", 2, 1, 2, 256
    )  # fmt: skip
    summary = WorkerSummary.from_dict(build_summary(runtime).to_dict())  # as published on the status topic
    assert summary.concurrency == local
    cluster = aggregate([summary], now_ms=summary.at_ms, stale_after_ms=10_000)
    assert cluster["concurrency"] == {summary.worker: local}
    runtime.dispatcher.call_ended(call, CallOutcome.IGNORED)
    older = WorkerSummary.from_dict({**summary.to_dict(), "concurrency": None})  # a worker from before
    assert aggregate([older], now_ms=older.at_ms, stale_after_ms=10_000)["concurrency"] == {}
