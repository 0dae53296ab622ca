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

from agents.dispatcher import Dispatcher, LeaseLapsed
from rebound.settings import HANDLER_CANCEL_GRACE_S


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


def make(
    limit: int = 4, buffer: int = 100, drain_s: float = 0.0, hold_back_s: float | None = None
) -> tuple[Dispatcher, FakeApp, list[int]]:
    app = FakeApp()
    dispatcher = Dispatcher(
        app, limit=limit, partition_buffer=buffer, revoke_drain_s=drain_s, drain_hold_back_s=hold_back_s
    )
    return dispatcher, app, []


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


# -- the revocation's drain starts nothing above a record of its partition it would leave undone -------------------


def gated(ran: list[int]) -> tuple[dict[int, asyncio.Event], Any]:
    """A run whose every offset waits for its own gate: the test decides when each one ends."""
    gates: dict[int, asyncio.Event] = {}

    async def run(event: FakeEvent) -> None:
        offset = event.message.offset
        ran.append(offset)
        await gates.setdefault(offset, asyncio.Event()).wait()

    return gates, run


def gate(gates: dict[int, asyncio.Event], offset: int) -> None:
    gates.setdefault(offset, asyncio.Event()).set()


def offer_k_other_k_j(dispatcher: Dispatcher, acks: list[int]) -> tuple[list[int], dict[int, asyncio.Event]]:
    """K@0, other@1, K@2 and J@3 offered, each run waiting for its gate: with two slots, K@0 and other@1 start, K@2
    waits behind K@0 on K's lane and J@3 for a slot. Returns the offsets run (in start order) and the gates."""
    ran: list[int] = []
    gates, run = gated(ran)
    for offset, lane in ((0, "K"), (1, "other"), (2, "K"), (3, "J")):
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane=lane, run=run)
    return ran, gates


async def test_a_drain_starts_no_record_above_a_lower_one_of_its_partition_still_queued_behind_its_key() -> None:
    """K@0 runs, K@2 waits behind it on K's lane, J@3 waits for a slot. A slot frees during the drain: J@3 must not
    start, since the commit cannot pass K@2 unless K@2 starts too; the drain's time runs out with K@0 still running,
    K@2 is dropped, and J@3 would have run for nothing (read again from K@2 by the next owner, and run again)."""
    dispatcher, app, acks = make(limit=2, drain_s=60.0)  # the drain's end is called below, not waited for
    ran, gates = offer_k_other_k_j(dispatcher, acks)
    await asyncio.sleep(0)
    assert ran == [0, 1]
    dispatcher.revoke()
    gate(gates, 1)  # a slot frees during the drain
    for _ in range(5):
        await asyncio.sleep(0)
    assert ran == [0, 1], "the drain started J@3 above K@2, which was still queued behind K@0"
    dispatcher._drain_time_up()  # the drain's time is up with K@0 still running
    assert app.consumer.abandoned == [2, 3]
    gate(gates, 0)
    await dispatcher.wait_idle()
    assert ran == [0, 1] and acks == [0, 1]


async def test_a_drain_starts_records_across_keys_as_slots_free_until_its_last_seconds() -> None:
    """The same as above, in a drain of 60 s whose records may take 30 s: with time left for K@0 to end and K@2 to
    start, J@3 starts in the free slot at once (holding it back would add the waits of separate keys up), as the
    drain does until its last 30 s."""
    dispatcher, app, acks = make(limit=2, drain_s=60.0, hold_back_s=30.0)
    ran, gates = offer_k_other_k_j(dispatcher, acks)
    await asyncio.sleep(0)
    dispatcher.revoke()
    gate(gates, 1)
    for _ in range(5):
        await asyncio.sleep(0)
    assert ran == [0, 1, 3]
    for offset in (3, 0, 2):
        gate(gates, offset)
    await dispatcher.wait_idle()
    assert ran == [0, 1, 3, 2] and acks == [0, 1, 2, 3] and app.consumer.abandoned == []
    assert dispatcher._drain_timer is not None
    dispatcher._drain_timer.cancel()


def on_clock(dispatcher: Dispatcher) -> list[float]:
    """The dispatcher's (and its core's) clock, set by the test: the drain's deadline and hold-back are read from it."""
    now = [0.0]
    dispatcher._clock = dispatcher.core._clock = lambda: now[0]
    return now


async def test_a_second_stop_during_a_drain_keeps_the_first_drain_s_hold_back_time() -> None:
    """A drain of 60 s that holds back in its last 30 s: a second stop 40 s in (a shutdown during the rebalance) does
    not move the hold-back to 70 s. A slot frees then: J@3 stays held back above K@2, queued behind K@0."""
    dispatcher, app, acks = make(limit=2, drain_s=60.0, hold_back_s=30.0)
    now = on_clock(dispatcher)
    ran, gates = offer_k_other_k_j(dispatcher, acks)
    await asyncio.sleep(0)
    dispatcher.revoke()
    timer = dispatcher._drain_timer
    now[0] = 40.0
    dispatcher.revoke()
    assert dispatcher._drain_timer is timer
    gate(gates, 1)
    for _ in range(5):
        await asyncio.sleep(0)
    assert ran == [0, 1], "the second stop moved the hold-back: J@3 started above K@2"
    gate(gates, 0)  # K@2 starts, then J@3
    for _ in range(5):
        await asyncio.sleep(0)
    assert ran == [0, 1, 2, 3]
    gate(gates, 2)
    gate(gates, 3)
    await dispatcher.wait_idle()
    assert acks == [0, 1, 2, 3] and app.consumer.abandoned == []
    assert timer is not None
    timer.cancel()


async def test_a_stop_after_a_drain_has_emptied_drains_afresh_before_the_first_drain_s_time_is_up() -> None:
    """A rebalance's drain of 60 s that holds back in its last 30 s empties at once; a second rebalance 40 s later is
    a drain of its own: its deadline 60 s on (a new timer, the first one cancelled) and its hold-back 30 s on, so a
    slot that frees at once lets J@13 start above K@12 (queued behind K@10), as a fresh drain does."""
    dispatcher, app, acks = make(limit=2, drain_s=60.0, hold_back_s=30.0)
    now = on_clock(dispatcher)
    ran: list[int] = []
    gates, run = gated(ran)
    for offset in (0, 1):
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane="K", run=run)
    await asyncio.sleep(0)
    dispatcher.revoke()
    gate(gates, 0)
    gate(gates, 1)
    await dispatcher.wait_idle()
    assert not dispatcher.core.draining and acks == [0, 1]
    first_timer = dispatcher._drain_timer
    now[0] = 40.0
    for offset, lane in ((10, "K"), (11, "other"), (12, "K"), (13, "J")):
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane=lane, run=run)
    await asyncio.sleep(0)
    dispatcher.revoke()
    assert first_timer is None or first_timer.cancelled()
    assert dispatcher._drain_timer is not None and dispatcher._drain_timer is not first_timer
    gate(gates, 11)
    for _ in range(5):
        await asyncio.sleep(0)
    assert ran[2:] == [10, 11, 13], "the second drain held back from the first one's time"
    for offset in (13, 10, 12):
        gate(gates, offset)
    await dispatcher.wait_idle()
    assert acks == [0, 1, 10, 11, 12, 13] and app.consumer.abandoned == []
    dispatcher._drain_timer.cancel()


async def test_a_held_back_record_starts_as_soon_as_every_lower_one_of_its_partition_has() -> None:
    """The same, but K@0 ends within the drain: K@2 starts on K's lane and J@3, no longer above a queued record,
    starts in the same step; all four are committed with the revocation."""
    dispatcher, app, acks = make(limit=3, drain_s=60.0)
    ran: list[int] = []
    gates, run = gated(ran)
    for offset, lane in ((0, "K"), (1, "other"), (4, "L"), (2, "K"), (3, "J")):
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane=lane, run=run)
    await asyncio.sleep(0)
    assert sorted(ran) == [0, 1, 4]
    dispatcher.revoke()
    gate(gates, 1)
    gate(gates, 4)
    for _ in range(5):
        await asyncio.sleep(0)
    assert sorted(ran) == [0, 1, 4], "J@3 started above K@2"
    gate(gates, 0)  # K@0 ends: K@2 starts, then J@3
    for _ in range(5):
        await asyncio.sleep(0)
    assert ran[3:] == [2, 3]
    gate(gates, 2)
    gate(gates, 3)
    await dispatcher.wait_idle()
    assert acks == [0, 1, 2, 3, 4] and app.consumer.abandoned == []
    assert not dispatcher.core.draining


async def test_the_revocation_logs_each_partition_s_committed_and_lowest_unacknowledged_offsets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What an analysis of repeated calls needs at each revocation: per partition the dispatcher holds work of, the
    committed offset as Rebound's consumer knows it, the lowest offset taken and not acknowledged, and how many of its
    records are queued, running, and done behind a lower one."""
    caplog.set_level("INFO", logger="agents.dispatcher")
    dispatcher, app, acks = make(limit=2, drain_s=60.0)
    tp1 = TP("items", 1)
    app.consumer._committed_offset = {TP0: 40, tp1: 7}  # type: ignore[attr-defined]
    ran: list[int] = []
    gates, run = gated(ran)
    for offset, lane in ((42, "K"), (43, "J"), (44, "K")):
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane=lane, run=run)
    gate(gates, 43)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    dispatcher.offer(FakeEvent(FakeMessage(tp1, 8), acks), lane="X", run=run)  # in 43's slot
    dispatcher.offer(FakeEvent(FakeMessage(tp1, 9), acks), lane="M", run=run)  # waits for a slot
    await asyncio.sleep(0)
    assert sorted(ran) == [8, 42, 43]
    dispatcher.revoke()
    assert (
        "dispatcher: revocation: TP(topic='items', partition=0): committed 40, lowest unacknowledged 42, "
        "1 queued, 1 running, 1 done behind a lower one (a release batch counted by its releases)" in caplog.text
    )
    assert (
        "dispatcher: revocation: TP(topic='items', partition=1): committed 7, lowest unacknowledged 8, "
        "1 queued, 1 running, 0 done behind a lower one (a release batch counted by its releases)" in caplog.text
    )
    dispatcher._drain_time_up()
    gate(gates, 42)
    gate(gates, 8)
    await dispatcher.wait_idle()


async def test_a_drain_whose_shared_lanes_allow_no_sound_order_still_goes_on() -> None:
    """A key's main records and its release requests share a lane. Records read again late can leave two lanes in an
    order no start order can keep: L holds release@50 before main@10, M holds main@12 before release@40. Held back,
    release@50 would wait for release@40 (behind main@12 on M), which waits for main@10 (behind release@50 on L): the
    drain would stall until its time is up. The head that would wait for itself starts instead, and the rest follow
    in an order the rule allows."""
    dispatcher, app, acks = make(limit=1, drain_s=60.0)
    main, release = TP("items", 0), TP("items-release", 0)
    ran: list[tuple[str, int]] = []
    held = asyncio.Event()

    async def run(event: FakeEvent) -> None:
        ran.append((event.message.tp.topic, event.message.offset))
        if event.message.tp.topic == "other":
            await held.wait()

    dispatcher.offer(FakeEvent(FakeMessage(TP("other", 0), 0), acks), lane="Z", run=run)  # takes the one slot
    for tp, offset, lane in ((release, 50, "L"), (main, 12, "M"), (main, 10, "L"), (release, 40, "M")):
        dispatcher.offer(FakeEvent(FakeMessage(tp, offset), acks), lane=lane, run=run)  # 10 and 40: read again late
    await asyncio.sleep(0)
    dispatcher.revoke()
    held.set()
    await dispatcher.wait_idle()
    assert ran == [("other", 0), ("items-release", 50), ("items", 10), ("items", 12), ("items-release", 40)]
    assert acks == [0, 10, 12, 40, 50] and app.consumer.abandoned == []
    assert not dispatcher.core.draining


async def test_a_lane_held_back_in_a_drain_goes_on_when_what_holds_it_changes() -> None:
    """A held-back head is looked at again when its lane changes under it: a record of the new generation read in
    ahead of it (it is no drained record: it starts), or the head dropped with its partition (a work below it ended
    without being done) and a record of another partition next on its lane."""
    dispatcher, app, acks = make(limit=2, drain_s=60.0)
    other = TP("items-release", 0)
    ran: list[int] = []
    gates: dict[int, asyncio.Event] = {}

    async def run(event: FakeEvent) -> None:
        offset = event.message.offset
        ran.append(offset)
        if offset == 0:
            raise LeaseLapsed("the lease lapsed: K@0 is not run, and left to the partition's next reader")
        await gates.setdefault(offset, asyncio.Event()).wait()

    ready = asyncio.Event()

    async def k0(event: FakeEvent) -> None:
        await ready.wait()
        await run(event)

    dispatcher.offer(FakeEvent(FakeMessage(TP0, 0), acks), lane="K", run=k0)
    dispatcher.offer(FakeEvent(FakeMessage(TP0, 1), acks), lane="O", run=run)
    for tp, offset, lane in ((TP0, 2, "K"), (TP0, 4, "J"), (other, 7, "J"), (TP0, 5, "N")):
        dispatcher.offer(FakeEvent(FakeMessage(tp, offset), acks), lane=lane, run=run)
    await asyncio.sleep(0)
    dispatcher.revoke()
    gate(gates, 1)  # a slot frees: J@4 and N@5 are held back (K@2 is queued behind K@0)
    for _ in range(5):
        await asyncio.sleep(0)
    assert ran == [1]
    dispatcher.offer(FakeEvent(FakeMessage(TP0, 3), acks), lane="N", run=run)  # the new generation's, ahead of N@5
    await asyncio.sleep(0)
    assert ran == [1, 3]
    gate(gates, 3)
    ready.set()  # K@0 ends not done: K@2, J@4 and N@5 are dropped; release@7 is next on J
    for _ in range(5):
        await asyncio.sleep(0)
    assert ran == [1, 3, 0, 7]
    gate(gates, 7)
    await dispatcher.wait_idle()
    assert sorted(app.consumer.abandoned) == [0, 1, 2, 4, 5]  # 1 was done, above 0: read again
    assert acks == [3, 7]


def test_a_worker_s_drain_holds_back_for_as_long_as_a_record_started_may_take(make_runtime: Any) -> None:
    """The last seconds of the drain in which it holds back: the handler timeout and its cancellation grace; a 15 s
    drain with a 5 s handler timeout starts records as slots free for its first 9 s."""
    runtime = make_runtime(handler_timeout="5s")
    assert runtime.dispatcher.revoke_drain_s == 15.0
    assert runtime.dispatcher.drain_hold_back_s == 5.0 + HANDLER_CANCEL_GRACE_S
