"""The dispatcher's asyncio side: tasks per work with Faust's current event set, acknowledgements to the events in
offset order, back-pressure through the consumer, and what a revocation does to queued, running and failing work.

The consumer here records calls only; the integration tests (tests/integration/test_concurrency.py) run the real one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from faust.streams import current_event
from faust.types import TP

from agents.dispatcher import Dispatcher


@dataclass
class FakeMessage:
    tp: TP
    offset: int


@dataclass
class FakeEvent:
    message: FakeMessage
    acks: list[int]
    taken: bool = True
    """What Faust's ``Event.ack`` answers: False when its consumer did not take the acknowledgement."""

    def ack(self) -> bool:
        self.acks.append(self.message.offset)
        return self.taken


@dataclass
class FakeConsumer:
    flow_active: bool = True
    abandoned: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    """Abandoned offsets whose work was done all the same (``ReboundConsumer.abandon(..., finished=True)``)."""
    pauses: list[list[TP]] = field(default_factory=list)
    resumes: list[list[TP]] = field(default_factory=list)
    evicted: bool = False
    """What ``ReboundConsumer.evicted`` answers: aiokafka blanked the member id (the group gave the partitions away)."""

    def abandon(self, message: FakeMessage, *, finished: bool = False) -> None:
        self.abandoned.append(message.offset)
        if finished:
            self.finished.append(message.offset)

    def pause_between_batches(self, tps: list[TP]) -> None:
        self.pauses.append(list(tps))

    def resume_after_pause(self, tps: list[TP]) -> None:
        self.resumes.append(list(tps))


@dataclass
class FakeApp:
    consumer: FakeConsumer = field(default_factory=FakeConsumer)


TP0 = TP("items", 0)


def make(limit: int = 4, buffer: int = 100, drain_s: float = 0.0) -> tuple[Dispatcher, FakeApp, list[int]]:
    app = FakeApp()
    return Dispatcher(app, limit=limit, partition_buffer=buffer, revoke_drain_s=drain_s), app, []


async def test_work_runs_with_its_own_event_as_faust_s_current_event_and_is_acknowledged_in_order() -> None:
    dispatcher, _, acks = make()
    gates = {offset: asyncio.Event() for offset in range(3)}
    seen: dict[int, Any] = {}

    async def run(event: FakeEvent) -> None:
        await gates[event.message.offset].wait()
        seen[event.message.offset] = current_event()

    events = [FakeEvent(FakeMessage(TP0, offset), acks) for offset in range(3)]
    for event in events:
        dispatcher.offer(event, lane=f"k{event.message.offset}", run=run)
    await asyncio.sleep(0)
    assert dispatcher.in_flight == 3
    gates[2].set()
    gates[1].set()
    await asyncio.sleep(0.01)
    assert acks == []  # 0 is still running
    gates[0].set()
    await dispatcher.wait_idle()
    assert acks == [0, 1, 2]
    assert all(seen[offset] is events[offset] for offset in range(3))


async def test_a_full_partition_is_paused_between_batches_and_resumed_once_half_has_drained() -> None:
    dispatcher, app, acks = make(limit=1, buffer=4)
    gate = asyncio.Event()

    async def run(event: FakeEvent) -> None:
        await gate.wait()

    for offset in range(4):
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane="hot", run=run)
    assert app.consumer.pauses == [[TP0]]
    gate.set()
    await dispatcher.wait_idle()
    assert app.consumer.resumes == [[TP0]]
    assert acks == [0, 1, 2, 3]


async def test_revocation_drops_queued_work_and_waits_for_running_work() -> None:
    dispatcher, app, acks = make(limit=1)
    gate = asyncio.Event()
    ran: list[int] = []

    async def run(event: FakeEvent) -> None:
        ran.append(event.message.offset)
        await gate.wait()

    for offset in range(3):
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane=f"k{offset}", run=run)
    await asyncio.sleep(0)
    dispatcher.revoke()
    assert app.consumer.abandoned == [1, 2]
    gate.set()
    await dispatcher.wait_idle()
    assert ran == [0]
    assert acks == [0]


async def test_work_done_behind_a_dropped_offset_is_abandoned_as_finished() -> None:
    """A slow head holds the acknowledgements of later keys' finished records; the revocation drops what is queued
    behind it: those finished records are let go of as finished (the consumer does not run them again if it reads
    them again), the dropped ones are not."""
    dispatcher, app, acks = make(limit=2)
    slow = asyncio.Event()

    async def run(event: FakeEvent) -> None:
        if event.message.offset == 0:
            await slow.wait()

    dispatcher.offer(FakeEvent(FakeMessage(TP0, 0), acks), lane="slow", run=run)
    dispatcher.offer(FakeEvent(FakeMessage(TP0, 1), acks), lane="slow", run=run)  # queued behind 0
    for offset in (2, 3):
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane=f"k{offset}", run=run)
    await asyncio.sleep(0.01)
    assert acks == [] and app.consumer.abandoned == []  # 2 and 3 done, waiting for 0
    dispatcher.revoke()
    slow.set()
    await dispatcher.wait_idle()
    assert acks == [0]
    assert sorted(app.consumer.abandoned) == [1, 2, 3]
    assert sorted(app.consumer.finished) == [2, 3]


async def test_a_draining_revocation_finishes_queued_work_in_time_and_drops_the_rest() -> None:
    """Work queued when the flow stops runs on for ``revoke_drain_s``: acknowledged, it is committed with the
    revocation (Faust waits for it) instead of being done again by the next owner; later, it is dropped."""
    dispatcher, app, acks = make(limit=1, drain_s=0.2)
    quick = asyncio.Event()
    ran: list[int] = []

    async def run(event: FakeEvent) -> None:
        ran.append(event.message.offset)
        if event.message.offset == 1:
            await asyncio.sleep(1)  # outlasts the drain: 2 never starts
        else:
            await quick.wait()

    for offset in range(3):
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane=f"k{offset}", run=run)
    await asyncio.sleep(0)
    dispatcher.revoke()
    assert app.consumer.abandoned == []
    quick.set()
    await asyncio.sleep(0.1)
    assert ran == [0, 1] and acks == [0]  # 1 started after the revocation
    await asyncio.sleep(0.2)
    assert app.consumer.abandoned == [2]  # the drain time is up: 2 is read again by the next owner
    await dispatcher.wait_idle()
    assert ran == [0, 1] and acks == [0, 1]


@pytest.mark.parametrize("evicted", [True, False])
async def test_an_evicted_worker_does_not_drain_its_queued_work(
    evicted: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker stopped past its session timeout learns of its eviction when it resumes: the group already gave its
    partitions to new owners, who run what is queued here; draining would make each of those calls twice."""
    dispatcher, app, acks = make(limit=1, drain_s=0.3)
    app.consumer.evicted = evicted
    gate = asyncio.Event()
    ran: list[int] = []

    async def run(event: FakeEvent) -> None:
        ran.append(event.message.offset)
        await gate.wait()

    for offset in range(3):
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane=f"k{offset}", run=run)
    await asyncio.sleep(0)
    with caplog.at_level("INFO", logger="agents.dispatcher"):
        dispatcher.revoke()
    gate.set()
    await asyncio.sleep(0.1)
    await dispatcher.wait_idle()
    if evicted:
        assert app.consumer.abandoned == [1, 2] and ran == [0]  # running work finishes; queued work never starts
        assert "evicted from the group: not draining 2 queued records" in caplog.text
    else:
        assert app.consumer.abandoned == [] and ran == [0, 1, 2]  # the drain runs the queued work
        assert "evicted" not in caplog.text


async def test_failing_work_is_run_again_and_left_to_the_next_reader_after_a_revocation() -> None:
    dispatcher, app, acks = make()
    calls = 0

    async def run(event: FakeEvent) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("the failed topic refused even the smallest stand-in")

    dispatcher.offer(FakeEvent(FakeMessage(TP0, 7), acks), lane="k", run=run)
    while calls < 2:  # run again after a back-off, never acknowledged
        await asyncio.sleep(0.02)
    dispatcher.revoke()
    await asyncio.wait_for(dispatcher.wait_idle(), timeout=5)
    assert acks == []
    assert app.consumer.abandoned == [7]


async def test_a_second_stop_during_a_drain_keeps_the_first_deadline() -> None:
    """A shutdown during a rebalance's drain: the revocation in progress is waiting for that work too."""
    dispatcher, app, acks = make(limit=1, drain_s=0.3)
    gate = asyncio.Event()

    async def run(event: FakeEvent) -> None:
        await gate.wait()

    for offset in range(2):
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane=f"k{offset}", run=run)
    await asyncio.sleep(0)
    dispatcher.revoke()
    await asyncio.sleep(0.2)
    dispatcher.revoke()
    await asyncio.sleep(0.15)
    assert app.consumer.abandoned == [1]  # 0.35 s after the first stop, not 0.3 s after the second
    gate.set()
    await dispatcher.wait_idle()
    assert acks == [0]


async def test_an_acknowledgement_faust_does_not_take_is_logged_and_the_record_runs_again_when_read_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dispatcher, app, acks = make()
    ran: list[int] = []

    async def run(event: FakeEvent) -> None:
        ran.append(event.message.offset)

    dispatcher.offer(FakeEvent(FakeMessage(TP0, 5), acks, taken=False), lane="k", run=run)
    await dispatcher.wait_idle()
    assert "did not take the acknowledgement" in caplog.text
    dispatcher.offer(FakeEvent(FakeMessage(TP0, 5), acks), lane="k", run=run)  # read again
    await dispatcher.wait_idle()
    assert ran == [5, 5] and app.consumer.abandoned == []


async def test_a_message_the_consumer_voided_is_let_go_without_running() -> None:
    """The consumer voids a record whose hand-over it interrupted (and reads again): if Faust's conductor still put
    it into a stream, the dispatcher abandons it instead of running it ahead of the records read again."""
    from types import SimpleNamespace

    from agents.dispatcher import Dispatcher

    abandoned: list[Any] = []
    voided: set[int] = set()
    message = SimpleNamespace(tp=("items", 0), offset=289)

    def take_void(m: Any) -> bool:
        """What ``ReboundConsumer.take_void`` does: True once for a voided message, and it is no longer void."""
        if id(m) not in voided:
            return False
        voided.discard(id(m))
        return True

    consumer = SimpleNamespace(
        take_void=take_void,
        abandon=lambda message, finished=False: abandoned.append(message),
        flow_active=True,
    )
    dispatcher = Dispatcher(SimpleNamespace(consumer=consumer), limit=4, partition_buffer=10)
    ran: list[int] = []

    async def run(event: Any) -> None:
        ran.append(event.message.offset)

    voided.add(id(message))
    dispatcher.offer(SimpleNamespace(message=message), "k", run)
    assert abandoned == [message] and dispatcher.core.running == 0
    await dispatcher.wait_idle()
    assert ran == []


async def test_pauses_and_resumes_are_logged_with_the_most_records_held(caplog: pytest.LogCaptureFixture) -> None:
    """A stream stalled on purpose says so; the most held since the pause is the buffer plus what was handed over
    after the pause was asked for (the rest of a fetched batch)."""
    caplog.set_level("INFO", logger="agents.dispatcher")
    dispatcher, app, acks = make(limit=1, buffer=4)
    gate = asyncio.Event()

    async def run(event: FakeEvent) -> None:
        await gate.wait()

    for offset in range(6):  # two more records of the batch after the pause was asked for
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane="hot", run=run)
    assert "dispatcher: pausing TP(topic='items', partition=0): 4 records taken" in caplog.text
    gate.set()
    await dispatcher.wait_idle()
    assert app.consumer.pauses == [[TP0]] and app.consumer.resumes == [[TP0]]
    assert "held up to 6 since the pause, buffer 4" in caplog.text


async def test_a_flow_stop_ends_back_pressure_on_both_sides_so_no_drain_word_is_needed(tmp_path: Path) -> None:
    """The consumer keeps a back-pressured partition paused until the dispatcher says it drained. A flow stop must not
    leave that word owed: the real consumer's ``stop_flow`` forgets its back-pressure and calls the dispatcher's
    revoke (registered by the factory), which forgets its pause, so work finishing during the rebalance reports no
    drain and none is waited for; in the next generation the dispatcher asks for the pause afresh at its buffer.
    (Driven through the real consumer and dispatcher: the fakes above cannot show what ``stop_flow`` does.)"""
    from aiokafka.structs import TopicPartition

    from app.consumer import ReboundConsumer
    from app.factory import build
    from rebound.settings import load_settings

    runtime = build(
        load_settings(
            handler="tests.scripted_handler:handle", data_dir=str(tmp_path), provision_topics=False, store="memory://"
        ),
        partitions=2,
    )
    consumer, dispatcher = runtime.app.consumer, runtime.dispatcher
    assert isinstance(consumer, ReboundConsumer)
    buffer = dispatcher.core.partition_buffer
    gate = asyncio.Event()

    async def run(event: FakeEvent) -> None:
        await gate.wait()

    acks: list[int] = []
    for offset in range(buffer):
        dispatcher.offer(FakeEvent(FakeMessage(TopicPartition("items", 0), offset), acks), lane="hot", run=run)
    assert dispatcher.core.paused == {TP0} and consumer.back_pressured == {TP0}
    consumer.stop_flow()  # a rebalance begins
    assert dispatcher.core.paused == frozenset() and consumer.back_pressured == frozenset()
    gate.set()
    await dispatcher.wait_idle()
    assert consumer.back_pressured == frozenset()  # nothing owed, nothing re-asserted by late work
    consumer.resume_flow()  # the next generation
    gate.clear()
    for offset in range(buffer, 2 * buffer):
        dispatcher.offer(FakeEvent(FakeMessage(TopicPartition("items", 0), offset), acks), lane="hot", run=run)
    assert consumer.back_pressured == {TP0}
    gate.set()
    await dispatcher.wait_idle()


async def test_a_work_is_resumed_by_the_task_it_started_in() -> None:
    """What a work takes of its task before it first suspends must be the task that resumes it: ``asyncio.timeout``
    and ``TaskGroup`` (in Rebound's code or a handler's) cancel the task current when they were entered, and the store
    confirms a writer's changelog writes by its task (``tables/retry_state.py``). A work whose first step ran in the
    offering agent's task and went on in another (an eager start without a real task, as Python 3.11 has no eager
    task factory) fails this: its timeout cancels the agent instead of interrupting the work."""
    dispatcher, _, acks = make()
    seen: dict[str, bool] = {}

    async def run(event: FakeEvent) -> None:
        first = asyncio.current_task()
        try:
            async with asyncio.timeout(0.02):
                await asyncio.sleep(1)
        except TimeoutError:
            seen["timed out"] = True
        seen["same task"] = asyncio.current_task() is first

    async def agent() -> str:
        dispatcher.offer(FakeEvent(FakeMessage(TP0, 0), acks), lane="k", run=run)
        await asyncio.sleep(0.1)  # the agent reads on: it must not be what the work's timeout cancels
        return "read on"

    assert await asyncio.create_task(agent()) == "read on"
    await dispatcher.wait_idle()
    assert seen == {"timed out": True, "same task": True}
    assert acks == [0]
