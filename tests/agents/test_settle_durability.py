"""A release's settle becomes durable with the handler slot free: the release request's offset is acknowledged
only once the settle's changelog records are, and the slot serves other work meanwhile."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiokafka.errors import MessageSizeTooLargeError

from agents.runtime import Runtime
from tests.agents.conftest import FakeClock, eventually, nothing_waits
from tests.agents.support import HeldChangelog, hold_changelogs_and_record_acks, record_acks, tier_headers


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
