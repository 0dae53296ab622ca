"""A work that returns an awaitable for its writes becoming durable: its slot and its key's lane go to other work at
once, its offset is acknowledged only once the awaitable completes (in offset order), and a revocation or a shutdown
waits for it or leaves the offset unacknowledged, never acknowledged early."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.agents.test_dispatcher import TP0, FakeEvent, FakeMessage, make


async def test_the_slot_and_the_lane_are_free_while_the_writes_become_durable_and_the_ack_waits_for_them() -> None:
    dispatcher, _, acks = make(limit=1)
    durable = asyncio.get_running_loop().create_future()
    ran: list[int] = []

    async def run(event: FakeEvent) -> Any:
        ran.append(event.message.offset)
        return durable if event.message.offset == 0 else None

    for offset in range(3):  # two of one key, one of another: a limit of one
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane="k" if offset < 2 else "j", run=run)
    await asyncio.sleep(0.01)
    assert sorted(ran) == [0, 1, 2], "the key's next record and the other key waited for a write to become durable"
    assert acks == [], "acknowledged before its writes were durable"
    assert dispatcher.in_flight == 0
    durable.set_result(None)
    await dispatcher.wait_idle()
    assert acks == [0, 1, 2]


async def test_a_durable_wait_that_fails_leaves_the_offset_unacknowledged() -> None:
    dispatcher, app, acks = make(limit=2)

    async def fails() -> None:
        raise RuntimeError("changelog refused")

    async def run(event: FakeEvent) -> Any:
        return fails() if event.message.offset == 0 else None

    for offset in range(2):
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane=f"k{offset}", run=run)
    await dispatcher.wait_idle()
    assert acks == []
    assert sorted(app.consumer.abandoned) == [0, 1]


async def test_a_revocation_waits_for_a_pending_durable_ack_and_acknowledges_it_once_durable() -> None:
    dispatcher, app, acks = make(limit=1)
    durable = asyncio.get_running_loop().create_future()

    async def run(event: FakeEvent) -> Any:
        return durable if event.message.offset == 0 else None

    gate = asyncio.Event()

    async def blocked(event: FakeEvent) -> None:
        await gate.wait()

    dispatcher.offer(FakeEvent(FakeMessage(TP0, 0), acks), lane="k", run=run)
    await asyncio.sleep(0.01)
    dispatcher.offer(FakeEvent(FakeMessage(TP0, 1), acks), lane="j", run=blocked)
    dispatcher.offer(FakeEvent(FakeMessage(TP0, 2), acks), lane="i", run=run)
    await asyncio.sleep(0.01)
    dispatcher.revoke()  # 2 was queued: dropped; 0 waits for durability, 1 runs
    assert app.consumer.abandoned == [2]
    idle = asyncio.ensure_future(dispatcher.wait_idle())
    gate.set()
    await asyncio.sleep(0.01)
    assert not idle.done() and acks == [], "the revocation went on before the pending write was durable"
    durable.set_result(None)
    await idle
    assert acks == [0, 1]


async def test_a_shutdown_cut_leaves_a_pending_durable_ack_unacknowledged() -> None:
    dispatcher, app, acks = make(limit=2)
    durable = asyncio.get_running_loop().create_future()
    dispatcher.shutdown_work_s = 0.01

    async def run(event: FakeEvent) -> Any:
        return durable

    dispatcher.offer(FakeEvent(FakeMessage(TP0, 0), acks), lane="k", run=run)
    await asyncio.sleep(0.01)
    dispatcher.cut_short()
    await dispatcher.wait_idle()
    assert acks == [] and app.consumer.abandoned == [0]


async def test_past_limit_works_waiting_for_durability_a_work_keeps_its_slot_while_it_confirms() -> None:
    dispatcher, _, acks = make(limit=1)
    loop = asyncio.get_running_loop()
    durable = {offset: loop.create_future() for offset in range(3)}
    ran: list[int] = []

    async def run(event: FakeEvent) -> Any:
        ran.append(event.message.offset)
        return durable[event.message.offset]

    for offset in range(3):  # three keys, a limit of one
        dispatcher.offer(FakeEvent(FakeMessage(TP0, offset), acks), lane=f"k{offset}", run=run)
    await asyncio.sleep(0.01)
    assert ran == [0, 1], "0 let go of its slot; 1 could not (one already confirms without a slot)"
    assert dispatcher.in_flight == 1 and dispatcher.core.confirming == 1
    durable[1].set_result(None)
    await asyncio.sleep(0.01)
    assert ran == [0, 1, 2] and acks == [], "1 ended and gave its slot to 2; 1's ack waits for 0"
    assert dispatcher.in_flight == 1 and dispatcher.core.confirming == 1, "2 keeps its slot: 0 still confirms"
    for offset in (0, 2):
        if not durable[offset].done():
            durable[offset].set_result(None)
    await asyncio.sleep(0.01)
    await dispatcher.wait_idle()
    assert ran == [0, 1, 2] and acks == [0, 1, 2] and dispatcher.core.confirming == 0
