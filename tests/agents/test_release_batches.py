"""Release requests several to a record (``REBOUND_RELEASE_BATCH``): the timer groups a tick's due requests of one
partition, each with its own send number; the release agent runs each release of a batch in its own key's lane,
tells the schedule of each, skips an unreadable element without losing the others, and acknowledges the record once,
after every release it carries is durable."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import MessageSizeTooLargeError

from agents import release as release_module
from agents.release import release_due
from agents.runtime import Runtime
from rebound.commands import ReleaseBatch, ReleaseRequest, read_release_record
from rebound.records import estimated_record_bytes
from rebound.schedule import Slot
from tests.agents.conftest import FakeClock, eventually, nothing_waits
from tests.agents.support import hold_changelogs_and_record_acks, record_acks, sent_releases, tier_headers

KEYS = (b"a", b"b", b"c")
ORIGIN = "items/0/7"  # (tier_headers' message: the same origin under three table keys)


async def park(runtime: Runtime, clock: FakeClock, keys: tuple[bytes, ...] = KEYS) -> None:
    runtime.schedule.adopt(0, [])
    async with runtime.agents["items.retry.1s"].test_context() as tier:
        for key in keys:
            await tier.put(b'{"succeed_on": 1}', key=key, headers=tier_headers(clock), partition=0)
    clock.advance(1000)


async def test_a_tick_sends_a_partitions_due_requests_up_to_the_setting_to_a_record(
    make_runtime: Any, clock: FakeClock
) -> None:
    runtime: Runtime = make_runtime(release_batch=2)
    runtime.schedule.adopt(0, [Slot(clock.now_ms, key, f"items/0/{i}", 1, "1s") for i, key in enumerate(KEYS)])
    assert await release_due(runtime) == 3
    first, second = runtime.release_topic.sent
    assert (first.key, first.partition, second.key, second.partition) == (b"a", 0, b"c", 0)
    numbers = [runtime.schedule.send_number(0, (key, f"items/0/{i}", 1)) for i, key in enumerate(KEYS)]
    assert read_release_record(first.value) == ReleaseBatch(
        ((b"a", ReleaseRequest("items/0/0", 1, numbers[0])), (b"b", ReleaseRequest("items/0/1", 1, numbers[1])))
    )
    assert second.value == ReleaseRequest("items/0/2", 1, numbers[2]).to_json()  # alone: a single request


async def test_a_setting_of_one_sends_todays_records(make_runtime: Any, clock: FakeClock) -> None:
    runtime: Runtime = make_runtime(release_batch=1)
    runtime.schedule.adopt(0, [Slot(clock.now_ms, key, f"items/0/{i}", 1, "1s") for i, key in enumerate(KEYS)])
    assert await release_due(runtime) == 3
    assert [(record.key, json.loads(record.value)["origin"]) for record in runtime.release_topic.sent] == [
        (b"a", "items/0/0"),
        (b"b", "items/0/1"),
        (b"c", "items/0/2"),
    ]


async def test_each_release_of_a_batch_runs_and_the_record_is_acknowledged_once_all_are_durable(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: Runtime = make_runtime()
    await park(runtime, clock)
    timeline, changelog = hold_changelogs_and_record_acks(runtime, monkeypatch)
    assert await release_due(runtime) == 3
    [record] = runtime.release_topic.sent
    async with runtime.agents["release"].test_context() as releaser:
        channel = releaser.stream().channel  # (put straight in: the context's put waits for the acknowledgement)
        await channel.put(await channel.decode(releaser.to_message(record.key, record.value, partition=0, offset=0)))
        await eventually(lambda: all(nothing_waits(runtime, key) for key in KEYS) and bool(changelog.pending))
        await asyncio.sleep(0.05)
        assert ("acked", 0) not in timeline, "acknowledged before its releases' settles were durable"
        while ("acked", 0) not in timeline:
            changelog.acknowledge_all()
            await asyncio.sleep(0.01)
        await runtime.dispatcher.wait_idle()
    assert runtime.counters["released"] == 3
    assert [entry for entry in timeline if entry[0] == "acked"] == [("acked", 0)]
    durable = [index for index, (kind, _item) in enumerate(timeline) if kind == "durable"]
    assert timeline.index(("acked", 0)) > max(durable)
    assert runtime.schedule.waiting() == 0  # each confirmed
    assert all(runtime.schedule.send_number(0, (key, ORIGIN, 1)) is None for key in KEYS)  # each taken


async def test_a_batchs_releases_wait_in_their_own_keys_lanes(make_runtime: Any, clock: FakeClock) -> None:
    """A release of a batch whose key's lane is busy waits there; the others of the batch run meanwhile."""
    runtime: Runtime = make_runtime()
    await park(runtime, clock)
    lanes: list[Any] = []
    offer_batch = runtime.dispatcher.offer_batch

    def recording(event: Any, parts: list[Any]) -> None:
        lanes.extend(lane for lane, _run in parts)
        offer_batch(event, parts)

    runtime.dispatcher.offer_batch = recording  # type: ignore[method-assign]
    assert await release_due(runtime) == 3
    [record] = runtime.release_topic.sent
    async with runtime.agents["release"].test_context() as releaser:
        await releaser.put(record.value, key=record.key, partition=0)
        await eventually(lambda: all(nothing_waits(runtime, key) for key in KEYS))
        await runtime.dispatcher.wait_idle()
    assert lanes == [(0, key) for key in KEYS]
    assert runtime.counters["released"] == 3


async def test_an_unreadable_element_is_logged_and_the_others_released(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runtime: Runtime = make_runtime()
    await park(runtime, clock, keys=(b"a", b"b"))
    acked = record_acks(monkeypatch)
    value = json.dumps(
        {
            "releases": [
                {"key": base64.b64encode(b"a").decode(), "origin": ORIGIN, "attempt": 1},
                {"key": base64.b64encode(b"b").decode(), "origin": ORIGIN},  # no attempt
            ]
        }
    ).encode()
    with caplog.at_level(logging.ERROR, logger="agents.release"):
        async with runtime.agents["release"].test_context() as releaser:
            await releaser.put(value, key=b"a", partition=0)
            await eventually(lambda: nothing_waits(runtime, b"a"))
            await runtime.dispatcher.wait_idle()
            await eventually(lambda: acked == [0])
    assert runtime.counters["released"] == 1
    assert not nothing_waits(runtime, b"b")  # still parked: the schedule sends its request again
    assert "ignoring 1 malformed release requests of the batch at 0@0" in caplog.text


async def test_a_batch_with_nothing_readable_is_acknowledged_in_its_turn(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: Runtime = make_runtime()
    acked = record_acks(monkeypatch)
    async with runtime.agents["release"].test_context() as releaser:
        await releaser.put(b'{"releases": [{"origin": "o"}]}', key=b"a", partition=0)
        await releaser.put(b'{"releases": "none"}', key=b"a", partition=0)
        await eventually(lambda: acked == [0, 1])
    assert runtime.counters["released"] == 0


async def test_no_record_is_larger_than_the_producer_takes(make_runtime: Any, clock: FakeClock) -> None:
    """With REBOUND_PRODUCER_MAX_REQUEST_BYTES at its least, a batch counts its key and its elements' keys: long keys
    go alone (a single request's record, as before batches), short ones still together, and the producer refuses
    none (a record it refused would never be sent: its requests are grouped again the same way)."""
    runtime: Runtime = make_runtime(producer_max_request_bytes=1024)
    runtime.release_topic.max_request_bytes = 1024  # type: ignore[attr-defined]
    keys = [b"a", b"b", b"k" * 300, b"c", b"d", b"l" * 300, b"m" * 300, b"e"]
    runtime.schedule.adopt(0, [Slot(clock.now_ms, key, f"items/0/{i}", 1, "1s") for i, key in enumerate(keys)])
    assert await release_due(runtime) == len(keys)
    sent = runtime.release_topic.sent
    assert runtime.release_topic.refused == 0  # type: ignore[attr-defined]
    assert sorted(key for key, _ in sent_releases(sent)) == sorted(keys)  # each once
    assert all(estimated_record_bytes(record.key, record.value, []) <= 512 for record in sent)
    assert any(isinstance(read_release_record(record.value), ReleaseBatch) for record in sent)
    assert runtime.counters["release.requests"] == len(keys)
    assert runtime.counters["release.request_records"] == len(sent)


async def test_a_record_whose_send_fails_leaves_the_ticks_others_sent(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One record's send raising (aiokafka refuses a record too large at once) no longer stops the tick: the others
    go, the failure is logged and counted, and its requests stay in flight, to be sent again as lost ones are."""
    runtime: Runtime = make_runtime(release_batch=2)
    keys = (b"a", b"b", b"c", b"d")
    runtime.schedule.adopt(0, [Slot(clock.now_ms, key, f"items/0/{i}", 1, "1s") for i, key in enumerate(keys)])
    topic = runtime.release_topic
    fail_sends(monkeypatch, topic, lambda call, partition: MessageSizeTooLargeError("refused") if call == 1 else None)
    with caplog.at_level(logging.WARNING, logger="agents.release"):
        assert await release_due(runtime) == 4
    assert [key for key, _ in sent_releases(topic.sent)] == [b"c", b"d"]
    assert runtime.counters["release.send_failed"] == 1
    assert "was not sent (MessageSizeTooLargeError" in caplog.text
    idents = [(key, f"items/0/{i}", 1) for i, key in enumerate(keys)]
    assert all(runtime.schedule.send_number(0, ident) is not None for ident in idents[:2])  # in flight, untaken
    registry = runtime.metrics.registry
    assert registry.get_sample_value("rebound_release_request_send_failed_total") == 1
    assert registry.get_sample_value("rebound_release_requests_sent_total") == 4
    assert registry.get_sample_value("rebound_release_request_records_total") == 2


async def test_a_partition_whose_send_fails_otherwise_is_not_tried_again_in_the_tick(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure not about the record's size (a full buffer whose broker is down raises after the request timeout)
    leaves the partition's later records of the tick unsent, in flight for the resend, instead of each waiting out
    the same timeout; the other partitions' records still go."""
    runtime: Runtime = make_runtime(release_batch=1)
    monkeypatch.setattr("agents.release.owned_partitions", lambda runtime: frozenset({0, 1}))
    runtime.schedule.adopt(
        0, [Slot(clock.now_ms, key, f"items/0/{i}", 1, "1s") for i, key in enumerate((b"a", b"b", b"c"))]
    )
    runtime.schedule.adopt(1, [Slot(clock.now_ms, b"z", "items/1/0", 1, "1s")])
    topic = runtime.release_topic
    tried = fail_sends(
        monkeypatch, topic, lambda call, partition: RuntimeError("timed out") if partition == 0 else None
    )
    assert await release_due(runtime) == 4
    assert tried == [0, 1]  # partition 0 once, then partition 1
    assert [key for key, _ in sent_releases(topic.sent)] == [b"z"]
    assert runtime.counters["release.send_failed"] == 3
    assert all(
        runtime.schedule.send_number(0, (bytes([k]), f"items/0/{i}", 1)) is not None for i, k in enumerate(b"abc")
    )


def fail_sends(monkeypatch: pytest.MonkeyPatch, topic: Any, error_for: Any) -> list[int]:
    """Make ``topic.send`` raise ``error_for(call number, partition)`` when that is not None; returns the partitions
    tried, in order."""
    send = topic.send
    tried: list[int] = []

    async def failing(**kwargs: Any) -> Any:
        tried.append(kwargs["partition"])
        error = error_for(len(tried), kwargs["partition"])
        if error is not None:
            raise error
        return await send(**kwargs)

    monkeypatch.setattr(topic, "send", failing)
    return tried


DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    "value",
    [b'{"origin": "o", "attempt": 1e999}', DEEP, b'{"releases": ' + DEEP + b"}", b"\xff"],
    ids=["overflow", "deep", "deep-batch", "not-utf-8"],
)
async def test_a_record_no_reader_can_read_is_logged_and_acknowledged_in_its_turn(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: bytes
) -> None:
    """``1e999`` makes ``int()`` raise OverflowError, deep nesting makes ``json.loads`` raise RecursionError: neither
    is a ValueError, and both stopped the release agent. Each is a malformed record, as any other unreadable one."""
    runtime: Runtime = make_runtime()
    acked = record_acks(monkeypatch)
    with caplog.at_level(logging.ERROR, logger="agents.release"):
        async with runtime.agents["release"].test_context() as releaser:
            await releaser.put(value, key=b"a", partition=0)
            await releaser.put(value, key=b"a", partition=0)
            await eventually(lambda: acked == [0, 1])
    assert "ignoring malformed release request at 0@0" in caplog.text
    message = SimpleNamespace(partition=0, offset=2, key=b"a", value=value)
    release_module.taken(runtime, message)  # (read again there: the same skip)
    assert await release_module.handle_release_request(runtime, SimpleNamespace(message=message)) is None


async def test_taken_tells_the_schedule_of_every_release_of_a_batch(make_runtime: Any, clock: FakeClock) -> None:
    """Each request of a batch record counts as taken, with its own send number: none is then thought lost."""
    runtime: Runtime = make_runtime()
    idents = [(key, f"items/0/{i}", 1) for i, key in enumerate(KEYS)]
    runtime.schedule.adopt(0, [Slot(clock.now_ms, key, origin, 1, "1s") for key, origin, _ in idents])
    assert await release_due(runtime) == 3
    [record] = runtime.release_topic.sent
    assert all(runtime.schedule.send_number(0, ident) is not None for ident in idents)  # sent, not taken
    release_module.taken(runtime, SimpleNamespace(partition=0, key=record.key, value=record.value))
    assert [runtime.schedule.send_number(0, ident) for ident in idents] == [None, None, None]
