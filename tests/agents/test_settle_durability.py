"""A release's settle becomes durable with the handler slot free: the release request's offset is acknowledged
only once the settle's changelog records are, and the slot serves other work meanwhile."""

from __future__ import annotations

import asyncio
import json
import logging
import operator
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import MessageSizeTooLargeError

from agents.release import MAX_RELEASE_FAILURES
from agents.runtime import Runtime
from tests.agents.conftest import FakeClock, eventually, nothing_waits
from tests.agents.support import (
    HeldChangelog,
    dead_letters,
    hold_changelogs_and_record_acks,
    record_acks,
    scripted,
    tier_headers,
)


async def test_a_release_acknowledges_its_request_only_once_its_settle_is_durable_and_frees_its_slot_before(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: Runtime = make_runtime(concurrency=1)
    runtime.schedule.adopt(0, [])
    async with runtime.agents["items.retry.1s"].test_context() as tier:
        await tier.put(b'{"succeed_on": 1}', key=b"k", headers=tier_headers(clock), partition=0)
    assert runtime.store.load(b"k", entries=True).pending
    timeline, changelog = hold_changelogs_and_record_acks(runtime, monkeypatch)
    clock.advance(1000)
    request = json.dumps({"origin": "items/0/7", "attempt": 1}).encode()
    async with runtime.agents["release"].test_context() as releaser:
        channel = releaser.stream().channel
        await channel.put(await channel.decode(releaser.to_message(b"k", request, partition=0, offset=0)))
        await eventually(lambda: nothing_waits(runtime, b"k") and bool(changelog.pending))
        await asyncio.sleep(0.05)
        assert runtime.dispatcher.in_flight == 0, "the slot is held while the settle becomes durable"
        assert ("acked", 0) not in timeline, "acknowledged before the settle was durable"
        while ("acked", 0) not in timeline:
            changelog.acknowledge_all()  # the index, then the payload's deletion it deferred
            await asyncio.sleep(0.01)
        await runtime.dispatcher.wait_idle()
    written = [index for index, (kind, _item) in enumerate(timeline) if kind == "written"]
    durable = [index for index, (kind, _item) in enumerate(timeline) if kind == "durable"]
    assert len(durable) == len(written) >= 2
    assert timeline.index(("acked", 0)) > max(durable)


async def test_a_settle_the_changelog_refuses_after_the_request_was_handled_is_a_failed_release_tried_again(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settle's records are refused as too large (twice) while its wait runs apart from the request
    (``settle_refused``): the request is acknowledged, the release counts as failed and is scheduled again, the
    payload's deletion (whose index was refused) is not made, and the next request writes the settle again."""
    runtime: Runtime = make_runtime(concurrency=1)
    runtime.schedule.adopt(0, [])
    async with runtime.agents["items.retry.1s"].test_context() as tier:
        await tier.put(b'{"succeed_on": 1}', key=b"k", headers=tier_headers(clock), partition=0)
    payload_keys = set(runtime.store.payloads.keys())
    assert payload_keys
    runtime.store.confirm_writes = True
    timeline: list[tuple[str, Any]] = []
    changelog = HeldChangelog(timeline)
    monkeypatch.setattr(runtime.store.states.changelog_topic, "send_soon", changelog.send_soon)
    monkeypatch.setattr(runtime.store.payloads.changelog_topic, "send_soon", changelog.send_soon)

    def refuse_all() -> int:
        pending, changelog.pending = changelog.pending, []
        for _key, future in pending:
            future.set_exception(MessageSizeTooLargeError())
        return len(pending)

    acked = record_acks(monkeypatch)
    clock.advance(1000)
    ident = (b"k", "items/0/7", 1)
    request = json.dumps({"origin": ident[1], "attempt": ident[2]}).encode()
    async with runtime.agents["release"].test_context() as releaser:
        channel = releaser.stream().channel
        await channel.put(await channel.decode(releaser.to_message(b"k", request, partition=0, offset=0)))
        await eventually(lambda: bool(changelog.pending))
        assert refuse_all() >= 1
        await eventually(lambda: bool(changelog.pending))  # written once more: a batch can be refused innocently
        assert refuse_all() >= 1
        await eventually(lambda: acked == [0])
        await runtime.dispatcher.wait_idle()
        assert runtime.release_failures == {ident: 1}
        again = [slot for _partition, slot in runtime.schedule.slots() if slot.due_at_ms == runtime.clock() + 1000]
        assert [slot.ident for slot in again] == [ident], "not released again after a backoff"
        assert not changelog.pending and set(runtime.store.payloads.keys()) == payload_keys, (
            "the payload was deleted though the index that stopped counting it was refused"
        )

        # The next request finds it settled here and writes the settle again (now accepted).
        written = len(timeline)
        await channel.put(await channel.decode(releaser.to_message(b"k", request, partition=0, offset=1)))
        while 1 not in acked:
            changelog.acknowledge_all()
            await asyncio.sleep(0.01)
        await runtime.dispatcher.wait_idle()
    rewritten = [item[0] for kind, item in timeline[written:] if kind == "written"]
    assert b"k" in rewritten and payload_keys <= set(rewritten), "the settle was not written again"


class IndexRefusingChangelog:
    """Both tables' changelogs as a broker whose ``max.message.bytes`` is below the key's index record: every record
    of the index ``key`` is refused as too large, at once; every other record is acknowledged."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.refused = 0

    def send_soon(self, *, key: Any, value: Any, partition: Any, **_: Any) -> Any:
        future: Any = asyncio.get_running_loop().create_future()
        future.message = SimpleNamespace(partition=0 if partition is None else partition)
        if key == self.key and value is not None:
            self.refused += 1
            future.set_exception(MessageSizeTooLargeError())
        else:
            future.set_result(None)
        return future


async def test_a_success_whose_settle_the_changelog_keeps_refusing_is_never_dead_lettered(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The release succeeds; the broker refuses its settle's index record as too large, and every write of it after
    (the settle, then the drop of the entry whose end the local index remembers). Each such request is a failed
    release; after ``MAX_RELEASE_FAILURES`` of them ``give_up`` took over and, finding the entry's record still there
    (its deletion waits for the refused index), dead-lettered it ``internal-error``: a message its handler had
    succeeded ended on the failed topic too, and again every cycle. Its end is known (the *ended* mark): nothing is
    sent, the entry stays parked in the changelog, and the handler ran once; ``give_up``'s refused drop is logged
    as such (it said it could not dead-letter it)."""
    runtime: Runtime = make_runtime(concurrency=1)
    runtime.schedule.adopt(0, [])
    async with runtime.agents["items.retry.1s"].test_context() as tier:
        await tier.put(b'{"succeed_on": 1}', key=b"k", headers=tier_headers(clock), partition=0)
    calls = scripted(runtime, None)
    runtime.store.confirm_writes = True
    changelog = IndexRefusingChangelog(b"k")
    monkeypatch.setattr(runtime.store.states.changelog_topic, "send_soon", changelog.send_soon)
    monkeypatch.setattr(runtime.store.payloads.changelog_topic, "send_soon", changelog.send_soon)
    acked = record_acks(monkeypatch)
    clock.advance(1000)
    request = json.dumps({"origin": "items/0/7", "attempt": 1}).encode()
    requests = 2 * MAX_RELEASE_FAILURES + 1
    caplog.set_level(logging.ERROR, logger="agents.release")
    async with runtime.agents["release"].test_context() as releaser:
        channel = releaser.stream().channel
        for offset in range(requests):  # the schedule's requests after each failed release's backoff
            await channel.put(await channel.decode(releaser.to_message(b"k", request, partition=0, offset=offset)))
            await eventually(partial(operator.contains, acked, offset))  # acknowledged: a request is only a trigger
            await runtime.dispatcher.wait_idle()
            clock.advance(31_000)
    assert changelog.refused >= 2 * requests
    assert calls == [1]
    assert dead_letters(runtime) == [], "a message that succeeded was dead-lettered"
    assert runtime.store.entry(b"k", "items/0/7") is not None  # still parked here as in the changelog
    gave_up = [message for message in map(logging.LogRecord.getMessage, caplog.records) if "repeated" in message]
    assert gave_up and all(message.startswith("could not drop (its message ended") for message in gave_up), gave_up
