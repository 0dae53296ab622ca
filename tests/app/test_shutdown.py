"""A stop bounded by ``REBOUND_SHUTDOWN_TIMEOUT``: the dispatcher cuts handler work short when its share is up, and
the watchdog ends a worker still stopping at the bound. The end-to-end check through a real worker is
``tests/integration/test_shutdown_bound.py``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import faust
import pytest

from agents.dispatcher import Dispatcher
from app.shutdown import (
    REPORT_TIMEOUT_S,
    SHUTDOWN_OVERRUN_EXIT_CODE,
    ReboundWorker,
    ShutdownWatchdog,
    bound_shutdown,
)
from rebound.settings import SHUTDOWN_FINISH_S, load_settings
from tests.agents.test_dispatcher import TP0, FakeConsumer, FakeEvent, FakeMessage


@dataclass
class StoppingApp:
    consumer: FakeConsumer = field(default_factory=FakeConsumer)
    should_stop: bool = True
    """mode marks the app stopped before its ``on_stop`` stops the flow: a shutdown, not a rebalance."""


def offer_all(dispatcher: Dispatcher, acks: list[int], count: int, run: object) -> list[FakeEvent]:
    events = [FakeEvent(FakeMessage(TP0, offset), acks) for offset in range(count)]
    for event in events:
        dispatcher.offer(event, lane=f"k{event.message.offset}", run=run)  # type: ignore[arg-type]
    return events


async def test_a_shutdown_cuts_running_calls_short_and_drops_the_queue_when_its_work_time_is_up() -> None:
    app = StoppingApp()
    dispatcher = Dispatcher(app, limit=2, partition_buffer=100, revoke_drain_s=10.0, shutdown_work_s=0.2)
    acks: list[int] = []
    started: list[int] = []

    async def hangs(event: FakeEvent) -> None:
        started.append(event.message.offset)
        await asyncio.sleep(3600)

    offer_all(dispatcher, acks, 5, hangs)
    await asyncio.sleep(0)
    began = time.monotonic()
    dispatcher.revoke()  # the shutdown's stop_flow: the drain alone would go on for 10 s
    await asyncio.wait_for(dispatcher.wait_idle(), 5)
    took = time.monotonic() - began
    assert 0.15 < took < 1.0
    assert started == [0, 1]
    assert acks == [], "a call cut short is not acknowledged: it runs again on the next owner"
    assert sorted(app.consumer.abandoned) == [0, 1, 2, 3, 4], "Faust's wait for the streams must not wait for them"
    assert dispatcher.core.queued == 0 and dispatcher.in_flight == 0


async def test_work_finished_before_the_cut_is_acknowledged_and_the_drain_ends_with_the_cut() -> None:
    app = StoppingApp()
    dispatcher = Dispatcher(app, limit=1, partition_buffer=100, revoke_drain_s=10.0, shutdown_work_s=0.3)
    acks: list[int] = []

    async def quick_then_hangs(event: FakeEvent) -> None:
        await asyncio.sleep(0.05 if event.message.offset < 2 else 3600)

    offer_all(dispatcher, acks, 4, quick_then_hangs)
    dispatcher.revoke()
    await asyncio.wait_for(dispatcher.wait_idle(), 5)
    assert acks == [0, 1]
    assert sorted(app.consumer.abandoned) == [2, 3]


async def test_a_rebalance_is_not_cut_short() -> None:
    app = StoppingApp(should_stop=False)
    dispatcher = Dispatcher(app, limit=1, partition_buffer=100, revoke_drain_s=0.0, shutdown_work_s=0.05)
    acks: list[int] = []

    async def slow(event: FakeEvent) -> None:
        await asyncio.sleep(0.3)

    offer_all(dispatcher, acks, 1, slow)
    dispatcher.revoke()
    await asyncio.wait_for(dispatcher.wait_idle(), 5)
    assert acks == [0] and app.consumer.abandoned == []


def test_handler_work_gets_the_shutdown_timeout_less_the_time_to_finish() -> None:
    assert load_settings().shutdown_timeout == 25.0
    assert load_settings().shutdown_work_s == 25.0 - SHUTDOWN_FINISH_S
    assert load_settings(shutdown_timeout=2).shutdown_work_s == 0.0


@pytest.fixture
def watchdogs() -> Iterator[Callable[..., ShutdownWatchdog]]:
    made: list[ShutdownWatchdog] = []

    def make(bound_s: float, **kwargs: Any) -> ShutdownWatchdog:
        made.append(ShutdownWatchdog(bound_s, **kwargs))
        return made[-1]

    yield make
    for watchdog in made:
        watchdog.close()


def test_the_watchdog_ends_a_stop_that_outlasts_its_bound(watchdogs: Callable[..., ShutdownWatchdog]) -> None:
    exits: list[int] = []
    watchdog = watchdogs(0.05, exit_process=exits.append)
    watchdog.arm()
    deadline = watchdog.deadline
    watchdog.arm()  # a second signal does not re-arm it
    assert watchdog.deadline == deadline
    time.sleep(0.3)
    assert exits == [SHUTDOWN_OVERRUN_EXIT_CODE]


def test_a_disarmed_watchdog_does_nothing(watchdogs: Callable[..., ShutdownWatchdog]) -> None:
    exits: list[int] = []
    watchdog = watchdogs(0.05, exit_process=exits.append)
    watchdog.arm()
    watchdog.disarm()
    time.sleep(0.2)
    assert exits == [] and not watchdog.armed


def test_the_watchdog_exits_even_when_its_log_line_cannot_be_written(
    watchdogs: Callable[..., ShutdownWatchdog],
) -> None:
    """A main thread stuck writing to a full stderr pipe holds the stream handler's lock: the overrun's log line
    waits for it for ever, and the exit must not wait behind it."""
    release = threading.Event()

    class StuckHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            release.wait()

    stuck = StuckHandler()
    logging.getLogger("app.shutdown").addHandler(stuck)
    exits: list[int] = []
    try:
        watchdog = watchdogs(0.05, exit_process=exits.append)
        watchdog.arm()
        time.sleep(0.05 + REPORT_TIMEOUT_S + 0.5)
        assert exits == [SHUTDOWN_OVERRUN_EXIT_CODE]
    finally:
        release.set()
        logging.getLogger("app.shutdown").removeHandler(stuck)


@pytest.fixture
def worker() -> Iterator[ReboundWorker]:
    """Rebound's worker class around a bare app, never started: its signal and shutdown hooks are what is tested."""
    app = faust.App("rebound-shutdown-test", broker="kafka://127.0.0.1:1")
    bound_shutdown(app, 60.0)
    loop = asyncio.new_event_loop()
    made = ReboundWorker(app, loop=loop, quiet=True)
    yield made
    if made._rebound_watchdog is not None:
        made._rebound_watchdog.close()
    loop.close()


async def test_a_stop_signal_arms_the_watchdog_while_the_loop_is_blocked_and_the_loop_still_gets_it(
    worker: ReboundWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler blocking the event loop with synchronous code delays the loop's signal callback (here by 1 s): the
    watchdog's count starts at the signal all the same, and the worker's own stop still begins."""
    stops: list[float] = []

    async def stop_on_signal(signal: signal.Signals) -> None:
        stops.append(time.monotonic())

    monkeypatch.setattr(worker, "_stop_on_signal", stop_on_signal)
    loop = asyncio.get_running_loop()
    worker.loop = loop
    worker.install_signal_handlers()
    try:
        sent = time.monotonic()
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        time.sleep(1.0)  # the loop is blocked
        watchdog = worker._rebound_watchdog
        assert watchdog is not None and watchdog.armed, "armed at the signal, not when the loop got to it"
        assert watchdog.deadline is not None and watchdog.deadline - 60.0 - sent < 0.5
        assert stops == []
        await asyncio.sleep(0.3)
        assert len(stops) == 1 and stops[0] - sent >= 1.0, "the loop's own handler still ran, after the block"
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
            loop.remove_signal_handler(signum)


def test_a_stop_without_a_signal_arms_the_watchdog_and_a_completed_stop_disarms_it(
    worker: ReboundWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash ends mode's ``execute_from_commandline`` through ``on_worker_shutdown`` and ``stop_and_shutdown``,
    never through the signal callback; the stop completed, what follows is the interpreter's, not an overrun."""
    during: list[bool] = []

    def stop_and_shutdown(self: faust.Worker) -> None:
        assert worker._rebound_watchdog is not None
        during.append(worker._rebound_watchdog.armed)
        raise RuntimeError("the crash mode re-raises once the loop is closed")

    monkeypatch.setattr(faust.Worker, "stop_and_shutdown", stop_and_shutdown)
    worker.on_worker_shutdown()
    with pytest.raises(RuntimeError):
        worker.stop_and_shutdown()
    assert during == [True]
    assert worker._rebound_watchdog is not None and not worker._rebound_watchdog.armed


@pytest.mark.parametrize("passes_later", [0, 1, 2, 3])
async def test_a_cut_landing_as_the_next_queued_work_is_handed_its_slot_still_ends_the_shutdown(
    passes_later: int,
) -> None:
    """One work ends and the next queued one gets its slot, in a new task; the cut may come in any loop pass around
    that hand-off, including before the new task's first step (a task cancelled then never runs its body). Whichever:
    the shutdown's wait for the work ends, and every record is acknowledged or let go, none left "running"."""
    app = StoppingApp()
    dispatcher = Dispatcher(app, limit=1, partition_buffer=100, revoke_drain_s=10.0, shutdown_work_s=60.0)
    acks: list[int] = []
    loop = asyncio.get_running_loop()

    def cut_in(passes: int) -> None:
        if passes == 0:
            dispatcher.cut_short()
        else:
            loop.call_soon(cut_in, passes - 1)

    async def first_ends_then_hang(event: FakeEvent) -> None:
        if event.message.offset == 0:
            await asyncio.sleep(0.01)
            loop.call_soon(cut_in, passes_later)
            return
        await asyncio.sleep(3600)

    offer_all(dispatcher, acks, 3, first_ends_then_hang)
    dispatcher.revoke()  # the shutdown: queued work keeps starting (drain), the cut ends it
    await asyncio.wait_for(dispatcher.wait_idle(), 2)
    assert acks == [0]
    assert sorted(app.consumer.abandoned) == [1, 2], "what was cut or dropped is let go, so Faust's wait ends"
    assert dispatcher.in_flight == 0 and list(dispatcher.core.works()) == []
