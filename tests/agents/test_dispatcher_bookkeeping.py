"""A work's bookkeeping (its acknowledgement, its slot, its lane) is its task's last step; a task cut before its first
step, which never runs that step, still ends: its offset unacknowledged and read again, its slot and lane free."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tests.agents.test_dispatcher import TP0, FakeEvent, FakeMessage, make


async def test_a_work_cut_before_its_first_step_still_frees_its_slot_and_is_not_acknowledged() -> None:
    dispatcher, app, acks = make(limit=2)
    ran: list[int] = []

    async def run(event: FakeEvent) -> None:
        ran.append(event.message.offset)

    dispatcher.offer(FakeEvent(FakeMessage(TP0, 0), acks), lane="k", run=run)
    dispatcher.cut_short()  # in the same loop pass: the task has not taken its first step
    await asyncio.wait_for(dispatcher.wait_idle(), 1.0)
    await asyncio.sleep(0)
    assert ran == [] and acks == [] and app.consumer.abandoned == [0]
    assert dispatcher.in_flight == 0 and dispatcher.core.tracked(TP0) == 0


async def test_a_finished_work_is_acknowledged_by_the_time_its_task_is_done() -> None:
    dispatcher, _, acks = make(limit=2)

    async def run(event: FakeEvent) -> None:
        await asyncio.sleep(0)

    dispatcher.offer(FakeEvent(FakeMessage(TP0, 0), acks), lane="k", run=run)
    [task] = list(dispatcher._tasks.values())
    seen: list[list[int]] = []
    task.add_done_callback(lambda _: seen.append(list(acks)))
    await dispatcher.wait_idle()
    await asyncio.sleep(0)
    assert seen == [[0]] and acks == [0]


class StaleLease:
    """A session lease gone stale once the work started; its wait is the group's next word, which says the worker is
    still a member unless the work's generation was revoked meanwhile."""

    def __init__(self) -> None:
        self.stale = False

    def fresh(self) -> bool:
        return not self.stale

    async def wait(self, revoked: Callable[[], bool]) -> bool:
        await asyncio.sleep(0)
        return not revoked()


async def test_a_handler_call_checks_the_lease_against_the_generation_of_its_work_set_in_its_task() -> None:
    """The work's generation is set in its task's context (``_run``, with Faust's current event): a work revoked
    while the lease was stale makes no handler call, although the current generation's lease is renewed."""
    dispatcher, app, acks = make(limit=2)
    lease = StaleLease()
    app.consumer.session_lease = lease  # type: ignore[attr-defined]
    gate = asyncio.Event()
    called: list[int] = []

    async def run(event: FakeEvent) -> None:
        await gate.wait()
        await dispatcher.lease_gate()  # as call_handler does before each handler call
        called.append(event.message.offset)

    dispatcher.offer(FakeEvent(FakeMessage(TP0, 0), acks), lane="k", run=run)
    await asyncio.sleep(0)
    lease.stale = True  # the worker was stopped past its session timeout
    dispatcher.revoke()  # and its partitions given away: a new generation
    gate.set()
    await asyncio.wait_for(dispatcher.wait_idle(), 1.0)
    assert called == [] and acks == []
