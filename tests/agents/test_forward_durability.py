"""Failed first tries forwarded together: marks durable before the retry is sent, and before the offset is acked.

Several failing records of different keys are handed to the real main agent (``agent.test_context()``) at once, as a
fetch hands them over; the changelog topics' ``send_soon`` is replaced by one whose acknowledgements the test gives
(test_context has no producer), and the tier topic and Faust's ``Event.ack`` record when they are reached. What must
hold, for every record, whatever the others do: its *sending* mark is acknowledged before its retry is sent, and
its offset is acknowledged only after its retry and its *forwarded* mark are; the keys do not wait for each other
(every key's mark is in flight before any is acknowledged, so one produce request can carry them all).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agents.runtime import Runtime
from rebound.state import KeyState
from tests.agents.conftest import FakeClock, eventually
from tests.agents.support import hold_changelogs_and_record_acks

FAILS_ONCE = b'{"succeed_on": 1}'
TIER = "items.retry.1s"
KEYS = 5


def marks_written(timeline: list[tuple[str, Any]], *, sending: bool) -> set[bytes]:
    """The keys whose state record written so far carries a retry mark (``sending`` or forwarded)."""
    keys = set()
    for kind, item in timeline:
        if kind == "written" and item[1] is not None:
            state = KeyState.from_json(item[1])
            if any(not mark.ended and mark.sending == sending for mark in state.marks):
                keys.add(item[0])
    return keys


async def test_failed_first_tries_of_different_keys_are_forwarded_together_and_acked_only_once_durable(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: Runtime = make_runtime()
    timeline, changelog = hold_changelogs_and_record_acks(runtime, monkeypatch)
    tier = runtime.tier_topics[TIER]
    send = tier.send

    async def recording_send(**record: Any) -> Any:
        timeline.append(("forwarded", record["key"]))
        return await send(**record)

    monkeypatch.setattr(tier, "send", recording_send)
    keys = [f"k{index}".encode() for index in range(KEYS)]
    async with runtime.agents["main"].test_context() as agent:
        channel = agent.stream().channel
        for offset, key in enumerate(keys):
            message = agent.to_message(key, FAILS_ONCE, partition=0, offset=offset)
            await channel.put(await channel.decode(message))

        # Every key's sending mark is written before any is durable: none waits for another key's.
        await eventually(lambda: marks_written(timeline, sending=True) >= set(keys))
        await asyncio.sleep(0.05)
        assert not [item for kind, item in timeline if kind in ("forwarded", "acked")], (
            "sent before its mark was durable"
        )

        changelog.acknowledge_all()
        await eventually(lambda: len([kind for kind, _ in timeline if kind == "forwarded"]) == KEYS)
        await eventually(lambda: marks_written(timeline, sending=False) >= set(keys))
        await asyncio.sleep(0.05)
        assert not [item for kind, item in timeline if kind == "acked"], "acknowledged before its forwarded mark"

        changelog.acknowledge_all()
        await eventually(lambda: len([kind for kind, _ in timeline if kind == "acked"]) == KEYS)
        await runtime.dispatcher.wait_idle()

    assert [item for kind, item in timeline if kind == "acked"] == list(range(KEYS)), "acks not in offset order"
    for key in keys:
        order = [kind for kind, item in timeline if item == key or (kind == "written" and item[0] == key)]
        assert order.index("durable") < order.index("forwarded"), f"{key!r} forwarded before its mark was durable"
    assert len(runtime.tier_topics[TIER].sent) == KEYS


async def test_the_topics_the_agents_send_to_take_the_started_producer_without_a_turn(tmp_path: Any) -> None:
    """A forward, a dead letter, an attempt event and a release request each waited three turns of the event loop in
    Faust's ``App.maybe_start_producer`` before reaching the producer (``ReboundApp.maybe_start_producer``)."""
    from app.factory import build
    from rebound.settings import load_settings
    from tests.app_under_test import started_producer, turns_taken

    settings = load_settings(
        handler="tests.scripted_handler:handle", data_dir=str(tmp_path), provision_topics=False, store="memory://"
    )
    runtime = build(settings, partitions=1)
    producer = started_producer(runtime.app)
    topics = [
        *runtime.tier_topics.values(),
        *runtime.failed_topics.values(),
        runtime.attempts_topic,
        runtime.release_topic,
    ]
    for topic in topics:
        got, turns = await turns_taken(topic._get_producer())
        assert got is producer
        assert turns == 0, f"{topic.get_topic_name()} gave the loop away {turns} times"


async def test_a_failed_first_try_frees_its_slot_while_its_forwarded_mark_becomes_durable(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One handler slot, two failing records: the second runs (its *sending* mark is written) while the first's
    *forwarded* mark waits for its acknowledgement, and the first offset is acknowledged only once that mark is."""
    runtime: Runtime = make_runtime(concurrency=1)
    timeline, changelog = hold_changelogs_and_record_acks(runtime, monkeypatch)
    first_key, second_key = b"k0", b"k1"
    async with runtime.agents["main"].test_context() as agent:
        channel = agent.stream().channel
        for offset, key in enumerate((first_key, second_key)):
            await channel.put(await channel.decode(agent.to_message(key, FAILS_ONCE, partition=0, offset=offset)))
        await eventually(lambda: first_key in marks_written(timeline, sending=True))
        changelog.acknowledge_all()  # the first's sending mark: its retry is sent, its forwarded mark written
        await eventually(lambda: first_key in marks_written(timeline, sending=False))
        await eventually(lambda: second_key in marks_written(timeline, sending=True))
        assert not [item for kind, item in timeline if kind == "acked"], "acknowledged before its mark was durable"
        while len([kind for kind, _ in timeline if kind == "acked"]) < 2:
            changelog.acknowledge_all()
            await asyncio.sleep(0.01)
        await runtime.dispatcher.wait_idle()

    assert [item for kind, item in timeline if kind == "acked"] == [0, 1]
    forwarded_durable = max(
        index for index, (kind, item) in enumerate(timeline) if kind == "durable" and item == first_key
    )
    assert timeline.index(("acked", 0)) > forwarded_durable, "offset 0 acknowledged before its forwarded mark"
