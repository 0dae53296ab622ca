"""The tier agent parks what is ready in one group: one changelog confirmation for many records, acknowledged after it.

Records are fed through the real tier agent (``agent.test_context()``) straight into its channel, so several wait
in the agent's lane while an earlier group is still confirming, as under load. The store is the real one; only the
changelog topic's ``send_soon`` is replaced where a test needs acknowledgements (test_context has no producer), and
it fails the way Faust's does: the returned future fails with aiokafka's error (Faust's ``_on_published``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import faust.events
import pytest
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError

from agents.runtime import Runtime
from rebound import headers as h
from tests.agents.conftest import FakeClock, eventually
from tests.agents.support import record_acks

TIER = "items.retry.1s"
GROUP = 20


def headers_for(clock: FakeClock, offset: int, partition: int = 0, due_in_ms: int = 1000) -> list[h.Header]:
    provenance = h.Provenance("items", partition, offset, clock.now_ms - 10, clock.now_ms - 5)
    return h.retry_headers(
        [],
        provenance=provenance,
        group="agent-test",
        attempt=1,
        due_at_ms=clock.now_ms + due_in_ms,
        error_class="rebound.errors.RetryableError",
        error_message="not yet",
    )


async def feed(
    agent: Any, clock: FakeClock, offsets: range, partition: int = 0, far_future: frozenset[int] = frozenset()
) -> None:
    """Put records into the agent's channel without waiting for them to be parked (what a fetch hands over).

    The offsets in ``far_future`` are due ten days ahead: refused by the tier's validation (our own retry)."""
    channel = agent.stream().channel
    for offset in offsets:
        key, value = f"k{partition}-{offset}".encode(), f"value {offset}".encode()
        headers = headers_for(clock, offset, partition, 10 * 86_400_000 if offset in far_future else 1000)
        message = agent.to_message(key, value, partition=partition, offset=offset, headers=headers)
        await channel.put(await channel.decode(message))


async def parked_all(runtime: Runtime, agent: Any, count: int) -> None:
    """Until ``count`` records are parked (the lanes' own idleness where the agent has lanes)."""
    await eventually(lambda: runtime.counters["parked"] >= count, timeout=10)
    lanes = getattr(agent.fun, "rebound_lanes", None)
    if lanes is not None:
        await asyncio.wait_for(lanes.wait_idle(), 10)


def gate_first_confirm(runtime: Runtime) -> tuple[asyncio.Event, list[int]]:
    """Spy on the real store's confirm: count its calls, and hold the first until the gate opens."""
    gate = asyncio.Event()
    calls: list[int] = []
    confirm = runtime.store.confirm

    async def counted() -> None:
        calls.append(runtime.counters["parked"])
        if len(calls) == 1:
            await gate.wait()
        await confirm()

    runtime.store.confirm = counted
    return gate, calls


async def test_records_ready_together_cost_one_confirm(make_runtime: Callable[..., Runtime], clock: FakeClock) -> None:
    runtime = make_runtime()
    gate, calls = gate_first_confirm(runtime)
    async with runtime.agents[TIER].test_context() as agent:
        await feed(agent, clock, range(1))
        await eventually(lambda: len(calls) == 1)  # the first record's group is confirming
        await feed(agent, clock, range(1, 1 + GROUP))  # these arrive meanwhile
        await asyncio.sleep(0.05)
        gate.set()
        await parked_all(runtime, agent, 1 + GROUP)
    assert runtime.counters["parked"] == 1 + GROUP
    assert len(calls) == 2, f"{len(calls)} confirmations for {1 + GROUP} records"


class FakeChangelog:
    """Stands in for a changelog topic's ``send_soon``: acknowledges each record, except the first write of
    ``fail_key``, whose future fails with aiokafka's timeout (as Faust's ``_on_published`` sets it)."""

    def __init__(self, fail_key: bytes | None, refuse: bytes | None = None) -> None:
        self.fail_key = fail_key
        self.refuse = refuse  # a record (not a tombstone) whose key contains this is refused as too large by the broker
        self.sent: list[tuple[bytes, bool, int]] = []
        self.failed_at: float | None = None
        self.rewritten_at: float | None = None

    def send_soon(self, *, key: Any, value: Any, partition: Any, **_: Any) -> Any:
        future: Any = asyncio.get_running_loop().create_future()
        future.message = SimpleNamespace(partition=0 if partition is None else partition)
        now = asyncio.get_running_loop().time()
        if self.refuse is not None and self.refuse in key and value is not None:
            future.set_exception(MessageSizeTooLargeError("refused by the broker"))
            self.sent.append((key, False, future.message.partition))
        elif key == self.fail_key and self.failed_at is None:
            self.failed_at = now
            future.set_exception(KafkaTimeoutError())
            self.sent.append((key, False, future.message.partition))
        else:
            if key == self.fail_key:
                self.rewritten_at = now
            future.set_result(None)
            self.sent.append((key, True, future.message.partition))
        return future


async def test_a_failed_changelog_write_holds_the_whole_group_until_written_again(
    make_runtime: Callable[..., Runtime], clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = make_runtime()
    runtime.store.confirm_writes = True
    payloads = FakeChangelog(fail_key=None)
    states = FakeChangelog(fail_key=b"k0-5")  # the state record of the 6th record of the group fails once
    monkeypatch.setattr(runtime.store.payloads.changelog_topic, "send_soon", payloads.send_soon)
    monkeypatch.setattr(runtime.store.states.changelog_topic, "send_soon", states.send_soon)
    acked: list[tuple[int, float]] = []
    ack = faust.events.Event.ack

    def recording_ack(self: Any) -> Any:
        acked.append((self.message.offset, asyncio.get_running_loop().time()))
        return ack(self)

    monkeypatch.setattr(faust.events.Event, "ack", recording_ack)
    gate, calls = gate_first_confirm(runtime)
    async with runtime.agents[TIER].test_context() as agent:
        await feed(agent, clock, range(1))
        await eventually(lambda: len(calls) == 1)
        await feed(agent, clock, range(1, 1 + GROUP))
        await asyncio.sleep(0.05)
        gate.set()
        await parked_all(runtime, agent, 1 + GROUP)
        await asyncio.sleep(0.05)
    assert states.failed_at is not None and states.rewritten_at is not None, "the failed write was not written again"
    group_acks = [(offset, at) for offset, at in acked if offset >= 1]
    early = [offset for offset, at in group_acks if at < states.rewritten_at]
    assert not early, f"offsets {early} acknowledged before the group's failed changelog write was written again"
    assert [offset for offset, _ in group_acks] == list(range(1, 1 + GROUP)), "not all acknowledged, in offset order"
    assert len(calls) == 2
    assert runtime.counters["parked"] == 1 + GROUP


async def test_a_partition_waiting_for_its_changelog_does_not_hold_another(
    make_runtime: Callable[..., Runtime], clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """And each record's table writes go to its own partition's changelog (Faust takes it from the current event)."""
    runtime = make_runtime()
    runtime.partitions = 2
    runtime.store.confirm_writes = True
    changelog = FakeChangelog(fail_key=None)
    monkeypatch.setattr(runtime.store.payloads.changelog_topic, "send_soon", changelog.send_soon)
    monkeypatch.setattr(runtime.store.states.changelog_topic, "send_soon", changelog.send_soon)
    gate, calls = gate_first_confirm(runtime)
    async with runtime.agents[TIER].test_context() as agent:
        await feed(agent, clock, range(1), partition=0)
        await eventually(lambda: len(calls) == 1)  # partition 0's group waits for its changelog acknowledgements
        await feed(agent, clock, range(1), partition=1)
        try:
            await eventually(lambda: runtime.counters["parked"] == 2 and len(calls) == 2, timeout=3)
        finally:
            gate.set()
        await parked_all(runtime, agent, 2)
    written = {(b"k1-" in key, partition) for key, _ok, partition in changelog.sent}
    assert written == {(False, 0), (True, 1)}, f"changelog partitions by record partition: {written}"


async def test_a_refused_park_is_still_ended_when_a_later_record_of_its_group_is_rejected(
    make_runtime: Callable[..., Runtime], clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rejected record's end is confirmed at once; the parks before it in its group are confirmed first, so a
    refusal of one of their changelog records still takes that park back and dead-letters it (too-large)."""
    runtime = make_runtime()
    runtime.store.confirm_writes = True
    payloads = FakeChangelog(fail_key=None, refuse=b"k0-3")  # the payload record of offset 3
    states = FakeChangelog(fail_key=None)
    monkeypatch.setattr(runtime.store.payloads.changelog_topic, "send_soon", payloads.send_soon)
    monkeypatch.setattr(runtime.store.states.changelog_topic, "send_soon", states.send_soon)
    gate, calls = gate_first_confirm(runtime)
    async with runtime.agents[TIER].test_context() as agent:
        await feed(agent, clock, range(1))
        await eventually(lambda: len(calls) == 1)
        await feed(agent, clock, range(1, 6), far_future=frozenset({4}))  # offset 4: refused, remembered as ended
        await asyncio.sleep(0.05)
        gate.set()
        await eventually(lambda: len(runtime.failed_topics["items"].sent) >= 2)
        lanes = agent.fun.rebound_lanes
        await asyncio.wait_for(lanes.wait_idle(), 10)
    reasons = {
        int(dict(letter.headers)[h.ORIGINAL_OFFSET]): dict(letter.headers)[h.REASON]
        for letter in runtime.failed_topics["items"].sent
    }
    assert reasons == {3: b"too-large", 4: b"invalid-retry-headers"}


def lanes_of(agent: Any) -> Any:
    return agent.fun.rebound_lanes


def record_abandons(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Spy on the real consumer's ``abandon`` (what Faust's ``wait_empty`` stops waiting for)."""
    abandoned: list[int] = []
    consumer = runtime.app.consumer
    abandon = consumer.abandon  # type: ignore[attr-defined]

    def recording_abandon(message: Any) -> None:
        abandoned.append(message.offset)
        abandon(message)

    monkeypatch.setattr(consumer, "abandon", recording_abandon)
    return abandoned


async def test_records_waiting_in_a_lane_when_the_flow_stops_are_let_go_of_not_parked(
    make_runtime: Callable[..., Runtime], clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a revocation (and a shutdown) Faust waits until every record its streams took is acknowledged: the records
    queued behind the group being parked are abandoned as the flow stops, neither parked nor acknowledged."""
    runtime = make_runtime()
    acked = record_acks(monkeypatch)
    abandoned = record_abandons(runtime, monkeypatch)
    gate, calls = gate_first_confirm(runtime)
    async with runtime.agents[TIER].test_context() as agent:
        await feed(agent, clock, range(1))
        await eventually(lambda: len(calls) == 1)  # offset 0's group is confirming
        await feed(agent, clock, range(1, 6))
        await eventually(lambda: lanes_of(agent)._queues[0].qsize() == 5)
        for callback in runtime.app.flow_stopped_callbacks:  # type: ignore[attr-defined]  # what stop_flow calls
            callback()
        gate.set()
        await asyncio.wait_for(lanes_of(agent).wait_idle(), 10)
        await asyncio.sleep(0.05)
    assert runtime.counters["parked"] == 1, "records queued at the flow stop were parked"
    assert acked == [0]
    assert abandoned == [1, 2, 3, 4, 5]


class FakeConsumer:
    def __init__(self) -> None:
        self.abandoned: list[int] = []

    def abandon(self, message: Any) -> None:
        self.abandoned.append(message.offset)


def bare_lanes(linger_s: float = 0.05) -> tuple[Any, FakeConsumer, list[list[int]]]:
    """Lanes whose parking only records the group (the lanes' own scheduling under test)."""
    from agents.tier import TierLanes

    consumer = FakeConsumer()
    runtime: Any = SimpleNamespace(
        app=SimpleNamespace(consumer=consumer), dispatcher=SimpleNamespace(core=SimpleNamespace(generation=0))
    )
    lanes = TierLanes(runtime, SimpleNamespace(topic="t"), linger_s=linger_s)  # type: ignore[arg-type]
    parked: list[list[int]] = []

    async def fake_park(batch: list[Any]) -> None:
        parked.append([event.message.offset for event in batch])

    lanes._park_until_done = fake_park  # type: ignore[method-assign]
    return lanes, consumer, parked


def bare_event(offset: int) -> Any:
    return SimpleNamespace(message=SimpleNamespace(partition=0, offset=offset, tp="t[0]"))


async def test_close_stops_a_lane_whose_record_arrives_as_it_is_cancelled() -> None:
    """On 3.11 ``asyncio.wait_for`` swallowed a cancellation arriving as its inner get completed: close hung."""
    lanes, consumer, parked = bare_lanes()
    await lanes.offer(bare_event(1))
    for _ in range(3):
        await asyncio.sleep(0)  # the lane took 1 and lingers for more
    await lanes.offer(bare_event(2))
    await asyncio.sleep(0)  # the lane's get completes
    await asyncio.wait_for(lanes.close(), 2)
    assert parked == []
    assert sorted(consumer.abandoned) == [1, 2], "records held by a closed lane must be let go of"


async def test_a_lane_lingering_with_a_record_is_not_idle() -> None:
    lanes, _consumer, parked = bare_lanes()
    await lanes.offer(bare_event(1))
    for _ in range(3):
        await asyncio.sleep(0)  # the lane took 1 and lingers for more
    await asyncio.wait_for(lanes.wait_idle(), 1)
    assert parked == [[1]]
    await lanes.close()


async def test_a_lane_that_dies_is_started_again_with_the_group_it_held() -> None:
    lanes, consumer, parked = bare_lanes(linger_s=0.001)
    failures = [RuntimeError("a bug in the lane")]
    park = lanes._park_until_done

    async def dies_once(batch: list[Any]) -> None:
        if failures:
            raise failures.pop()
        await park(batch)

    lanes._park_until_done = dies_once
    await lanes.offer(bare_event(1))
    await asyncio.wait_for(lanes.wait_idle(), 2)
    await lanes.offer(bare_event(2))
    await asyncio.wait_for(lanes.wait_idle(), 2)
    assert parked == [[1], [2]]
    assert consumer.abandoned == []
    await lanes.close()


async def test_a_confirm_failing_unforeseen_parks_the_group_again_never_dead_letters(
    make_runtime: Callable[..., Runtime], clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some of the group's writes may be durable: a dead letter would give such a park a second end."""
    runtime = make_runtime()
    acked = record_acks(monkeypatch)
    confirm = runtime.store.confirm
    calls: list[int] = []

    async def fails_once() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("unforeseen")
        await confirm()

    runtime.store.confirm = fails_once
    async with runtime.agents[TIER].test_context() as agent:
        await feed(agent, clock, range(3))
        await eventually(lambda: len(acked) == 3, timeout=5)
        await asyncio.wait_for(lanes_of(agent).wait_idle(), 10)
    assert runtime.failed_topics["items"].sent == [], "a group whose parks may be durable was dead-lettered"
    assert acked == [0, 1, 2]
    assert runtime.counters["parked"] == 3
    assert runtime.counters["tier.duplicates"] >= 1, "the group was not parked again"


def test_an_acknowledgement_that_fails_lets_go_of_the_rest_of_the_group() -> None:
    """Acknowledged past a hole, the rest would never be committed, and Faust would wait for the hole at the next
    revocation: they are abandoned (read again) instead."""
    from agents.tier import _acknowledge_in_order

    consumer = FakeConsumer()
    acked: list[int] = []

    def event(offset: int) -> Any:
        def ack() -> None:
            if offset == 2:
                raise RuntimeError("ack failed")
            acked.append(offset)

        return SimpleNamespace(ack=ack, message=SimpleNamespace(partition=0, offset=offset, tp="t[0]"))

    runtime: Any = SimpleNamespace(app=SimpleNamespace(consumer=consumer))
    _acknowledge_in_order(runtime, [event(offset) for offset in range(1, 5)])
    assert acked == [1]
    assert consumer.abandoned == [2, 3, 4]
