"""Paths that used to lose or wedge a message, through the real agents (``agent.test_context()``).

Each has an end-to-end twin in ``tests/integration/test_fault_paths.py`` that runs a real worker on the broker.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from faust.exceptions import ProducerSendError

from rebound import headers as h
from rebound.attempts import AttemptEvent
from rebound.errors import PermanentError, RetryableError
from rebound.event import RetryEvent
from rebound.records import estimated_record_bytes
from rebound.state import KeyState, PendingMessage, payload_key
from tables.kafka_errors import is_too_large
from tests.agents.conftest import eventually, nothing_waits
from tests.agents.support import tier_headers


class CustomAbort(BaseException):
    """A BaseException that is neither Exception, SystemExit, KeyboardInterrupt nor GeneratorExit."""


@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt(), CustomAbort("stop"), GeneratorExit()])
async def test_a_base_exception_from_the_handler_is_routed_and_the_agent_goes_on(
    make_runtime: Any, raised: BaseException
) -> None:
    runtime = make_runtime()
    seen: list[bytes | None] = []

    async def handler(event: RetryEvent) -> None:
        seen.append(event.key)
        if event.key == b"aborts":
            raise raised

    runtime.handler = handler
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(b"{}", key=b"aborts")
        await agent.put(b"{}", key=b"healthy")
    assert seen == [b"aborts", b"healthy"]
    [forwarded] = runtime.tier_topics["items.retry.1s"].sent
    assert forwarded.key == b"aborts"
    assert forwarded.headers[h.ERROR_CLASS].endswith(type(raised).__qualname__.encode())
    outcomes = [AttemptEvent.from_json(sent.value).outcome for sent in runtime.attempts_topic.sent]
    assert outcomes == ["scheduled", "succeeded"]


async def test_a_base_exception_classified_permanent_goes_to_the_failed_topic(make_runtime: Any) -> None:
    runtime = make_runtime(permanent_errors="SystemExit")

    async def handler(event: RetryEvent) -> None:
        raise SystemExit(1)

    runtime.handler = handler
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(b"payload", key=b"k")
    [failed] = runtime.failed_topics["items"].sent
    assert (failed.value, failed.headers[h.REASON], failed.headers[h.ERROR_CLASS]) == (
        b"payload",
        b"permanent",
        b"SystemExit",
    )


def test_too_large_is_recognised_wrapped_by_faust_and_bare_from_the_broker() -> None:
    from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError

    try:
        try:
            raise MessageSizeTooLargeError("too big")
        except MessageSizeTooLargeError as exc:
            raise ProducerSendError(f"Error while sending: {exc!r}") from exc
    except ProducerSendError as wrapped:
        assert is_too_large(wrapped)
    assert is_too_large(MessageSizeTooLargeError("from the broker"))
    assert not is_too_large(ProducerSendError("other"))
    try:
        try:
            raise KafkaConnectionError("down")
        except KafkaConnectionError as exc:
            raise ProducerSendError("Error while sending") from exc
    except ProducerSendError as wrapped:
        assert not is_too_large(wrapped)


async def test_a_record_that_fits_its_main_topic_but_not_with_retry_headers_is_dead_lettered_up_front(
    make_runtime: Any,
) -> None:
    """The seen wedge: Faust's ProducerSendError was not recognised, and the send was retried every 5 s for ever."""
    limit = 4096
    runtime = make_runtime(producer_max_request_bytes=limit)
    for topic in [*runtime.tier_topics.values(), *runtime.failed_topics.values()]:
        topic.max_request_bytes = limit

    async def handler(event: RetryEvent) -> None:
        if event.key == b"big":
            raise RetryableError("dependency down: " + "d" * 900)  # the retry headers carry the whole message

    runtime.handler = handler
    # Fits a record of its own, and a dead letter with the error message cut short, but not the tier record.
    big = b"v" * 3400
    assert estimated_record_bytes(b"big", big, []) < limit
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(big, key=b"big")
        for index in range(5):
            await agent.put(b"{}", key=f"healthy-{index}".encode())
    assert runtime.tier_topics["items.retry.1s"].refused == 0  # decided before sending, not by a refusal
    assert runtime.tier_topics["items.retry.1s"].sent == []
    [failed] = runtime.failed_topics["items"].sent
    assert failed.headers[h.REASON] == b"too-large"
    assert failed.value == big  # the dead letter itself fits without the retry headers' weight
    outcomes = [AttemptEvent.from_json(sent.value) for sent in runtime.attempts_topic.sent]
    assert [event.outcome for event in outcomes] == ["dead"] + ["succeeded"] * 5


async def test_a_dead_letter_refused_by_the_producer_falls_back_without_wedging(make_runtime: Any) -> None:
    limit = 2048
    runtime = make_runtime(producer_max_request_bytes=limit)
    runtime.failed_topics["items"].max_request_bytes = limit
    big = json.dumps({"permanent": True, "padding": "x" * 3000}).encode()
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(big, key=b"big")
        await agent.put(b"{}", key=b"healthy")
    [failed] = runtime.failed_topics["items"].sent
    assert failed.value is None
    assert failed.headers[h.REASON] == b"too-large"
    assert failed.headers[h.ORIGINAL_TOPIC] == b"items"
    assert b"was permanent" in failed.headers[h.ERROR_MESSAGE]
    assert runtime.failed_topics["items"].refused == 0


async def test_a_tier_record_whose_parked_copy_would_be_too_large_is_dead_lettered(
    make_runtime: Any, clock: Any
) -> None:
    """The payload table's changelog record carries the key twice plus the value: it can exceed the limit."""
    limit = 4096
    runtime = make_runtime(producer_max_request_bytes=limit)
    runtime.schedule.adopt(0, [])
    key = b"k" * 1500
    value = b"v" * 2500
    async with runtime.agents["items.retry.1s"].test_context() as agent:
        await agent.put(value, key=key, headers=tier_headers(clock), partition=0)
    [failed] = runtime.failed_topics["items"].sent
    assert failed.headers[h.REASON] == b"too-large"
    assert nothing_waits(runtime, key)


async def test_tier_record_timestamp_zero_does_not_skip_the_due_time_bound(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    async with runtime.agents["items.retry.1s"].test_context() as agent:
        for stamp in (0.0, -0.001):
            await agent.put(
                b"payload", key=b"forever", headers=tier_headers(clock, due_in_ms=365 * 86_400_000), timestamp=stamp
            )
    failed = runtime.failed_topics["items"].sent
    assert [sent.headers[h.REASON] for sent in failed] == [b"invalid-retry-headers"] * 2
    assert nothing_waits(runtime, b"forever")


async def test_a_redelivered_tier_record_writes_its_state_and_payload_again(make_runtime: Any, clock: Any) -> None:
    """After a crash the local store may hold a park whose changelog records were never acknowledged."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    sent: list[tuple[bytes, bytes | None]] = []
    for table in (runtime.store.states, runtime.store.payloads):
        original = table.send_changelog

        def record(partition: Any, key: Any, value: Any, *args: Any, _send: Any = original, **kwargs: Any) -> Any:
            sent.append((key, value))
            return _send(partition, key, value, *args, **kwargs)

        table.send_changelog = record
    headers = tier_headers(clock)
    async with runtime.agents["items.retry.1s"].test_context() as agent:
        await agent.put(b'{"succeed_on": 1}', key=b"k", headers=headers, partition=0)
        first = list(sent)
        await agent.put(b'{"succeed_on": 1}', key=b"k", headers=headers, partition=0)
    assert {key for key, _ in first} == {b"k", payload_key(b"k", "items/0/7")}
    assert sent[len(first) :] and {key for key, _ in sent[len(first) :]} == {key for key, _ in first}
    assert all(value is not None for _, value in sent)
    [entry] = runtime.store.load(b"k", entries=True, with_payloads=True).pending
    assert entry.value == b'{"succeed_on": 1}'


async def test_a_stale_release_request_writes_the_settle_again(make_runtime: Any, clock: Any) -> None:
    """The settle's records are written again: the payload's tombstone, and the key's index (which remembers the
    ended message, so it is written as a value, not deleted)."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    tombstones: list[bytes] = []
    indexes: list[bytes] = []
    for table in (runtime.store.states, runtime.store.payloads):
        original = table.send_changelog

        def record(partition: Any, key: Any, value: Any, *args: Any, _send: Any = original, **kwargs: Any) -> Any:
            if value is None:
                tombstones.append(key)
            elif key == b"k":
                indexes.append(value)
            return _send(partition, key, value, *args, **kwargs)

        table.send_changelog = record
    request = json.dumps({"origin": "items/0/7", "attempt": 1}).encode()
    async with (
        runtime.agents["items.retry.1s"].test_context() as tier,
        runtime.agents["release"].test_context() as releaser,
    ):
        await tier.put(b'{"succeed_on": 1}', key=b"k", headers=tier_headers(clock), partition=0)
        clock.advance(1000)
        await releaser.put(request, key=b"k", partition=0)
        await eventually(lambda: nothing_waits(runtime, b"k"))
        settled, settled_index = list(tombstones), indexes[-1]
        await releaser.put(request, key=b"k", partition=0)
        await eventually(lambda: runtime.counters["release.stale"] == 1)
    assert settled == [payload_key(b"k", "items/0/7")]
    assert KeyState.from_json(settled_index).mark_of("items/0/7") is not None
    assert tombstones[len(settled) :] == settled
    assert indexes[-1] == settled_index


async def test_give_up_does_not_erase_a_message_parked_while_its_dead_letter_was_sent(
    make_runtime: Any, clock: Any, monkeypatch: Any
) -> None:
    import agents.release

    runtime = make_runtime()
    runtime.schedule.adopt(0, [])

    async def broken_release(*args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("corrupt entry")

    monkeypatch.setattr(agents.release, "release", broken_release)
    failed_topic = runtime.failed_topics["items"]
    plain_send = failed_topic.send
    newcomer = PendingMessage(
        origin="items/0/8",
        key=b"k",
        value=b"second",
        headers=(),
        provenance=h.Provenance("items", 0, 8, clock.now_ms, clock.now_ms),
        attempt=1,
        tier="1s",
        tier_topic="items.retry.1s",
        partition=0,
        due_at_ms=clock.now_ms + 1000,
        parked_at_ms=clock.now_ms,
        error_class="x",
        error_message="y",
    )

    async def send_while_another_message_parks(**kwargs: Any) -> Any:
        before = runtime.store.load(b"k", entries=True)
        runtime.store.save(b"k", before, before.park(newcomer)[0])
        return await plain_send(**kwargs)

    failed_topic.send = send_while_another_message_parks
    request = json.dumps({"origin": "items/0/7", "attempt": 1}).encode()
    async with (
        runtime.agents["items.retry.1s"].test_context() as tier,
        runtime.agents["release"].test_context() as releaser,
    ):
        await tier.put(b'{"succeed_on": 1}', key=b"k", headers=tier_headers(clock), partition=0)
        clock.advance(1000)
        for _ in range(3):
            await releaser.put(request, key=b"k", partition=0)
        await eventually(lambda: bool(failed_topic.sent))
    [failed] = failed_topic.sent
    assert failed.headers[h.REASON] == b"internal-error"
    state = runtime.store.load(b"k", entries=True)
    assert [entry.origin for entry in state.pending] == ["items/0/8"]


async def test_a_real_key_starting_with_nul_does_not_share_state_with_a_null_key(make_runtime: Any, clock: Any) -> None:
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    lookalike = b"\x00items/0/7"  # exactly the table key a null-keyed record from items/0/7 used to get
    async with runtime.agents["items.retry.1s"].test_context() as agent:
        await agent.put(b'{"null": 1}', key=None, headers=tier_headers(clock), partition=0)
        await agent.put(b'{"real": 1}', key=lookalike, headers=tier_headers(clock), partition=0)
    slots = runtime.schedule.pop_due(clock.now_ms + 1000)
    assert len(slots) == 2
    loaded = {
        slot.table_key: runtime.store.load(slot.table_key, entries=True, with_payloads=True).pending
        for _, slot in slots
    }
    assert len(loaded) == 2
    assert {(entries[0].key, entries[0].value) for entries in loaded.values()} == {
        (None, b'{"null": 1}'),
        (lookalike, b'{"real": 1}'),
    }
    assert runtime.counters["tier.duplicates"] == 0


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
async def test_an_exit_raised_in_a_handlers_own_subtask_is_routed_not_raised_into_the_loop(
    make_runtime: Any, raised: type[BaseException]
) -> None:
    """asyncio re-raises these two out of any task into the event loop: that would stop the worker."""
    import asyncio

    runtime = make_runtime()

    async def subtask() -> None:
        raise raised("from a sub-task")

    async def handler(event: RetryEvent) -> None:
        if event.key == b"spawns":
            await asyncio.gather(subtask())

    runtime.handler = handler
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(b"{}", key=b"spawns")
        await agent.put(b"{}", key=b"healthy")
    [forwarded] = runtime.tier_topics["items.retry.1s"].sent
    assert forwarded.key == b"spawns"
    assert forwarded.headers[h.ERROR_CLASS] == raised.__name__.encode()
    outcomes = [AttemptEvent.from_json(sent.value).outcome for sent in runtime.attempts_topic.sent]
    assert outcomes == ["scheduled", "succeeded"]


async def test_a_message_with_neither_key_nor_value_is_retried_and_dead_lettered_not_wedged(make_runtime: Any) -> None:
    """aiokafka asserts against such a record: forwarding it as it is used to loop for ever."""
    runtime = make_runtime()
    seen: list[tuple[int, bytes | None]] = []

    async def handler(event: RetryEvent) -> None:
        seen.append((event.attempt, event.value))
        if event.key is None and event.value is None:
            raise PermanentError("a tombstone without a key")

    runtime.handler = handler
    async with runtime.agents["main"].test_context() as agent:
        await agent.put(None, key=None)
        await agent.put(b"{}", key=b"healthy")
    [failed] = runtime.failed_topics["items"].sent
    assert (failed.key, failed.value, failed.headers[h.NULL_VALUE]) == (None, b"", b"1")
    assert h.restore_null_value(failed.value, list(failed.headers.items())) is None
    assert seen == [(0, None), (0, b"{}")]


async def test_a_failed_release_goes_back_to_the_schedule_with_a_backoff_not_to_the_busy_window(
    make_runtime: Any, clock: Any, monkeypatch: Any
) -> None:
    """A release that raised is confirmed and put back, due after a back-off: left in flight, it would wait for its
    partition to fall silent, which a partition busy with other releases never does."""
    import agents.release
    from agents.release import release_due

    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    calls = 0
    real_release = agents.release.release

    async def failing_once(*args: Any, **kwargs: Any) -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a database hiccup of ours")
        return await real_release(*args, **kwargs)

    monkeypatch.setattr(agents.release, "release", failing_once)
    async with (
        runtime.agents["items.retry.1s"].test_context() as tier,
        runtime.agents["release"].test_context() as releaser,
    ):
        await tier.put(b'{"succeed_on": 1}', key=b"k", headers=tier_headers(clock), partition=0)
        clock.advance(1000)
        assert await release_due(runtime) == 1
        [request] = runtime.release_topic.sent
        await releaser.put(request.value, key=request.key, partition=0)
        [(partition, slot)] = list(runtime.schedule.slots())
        assert (partition, slot.due_at_ms, slot.tier) == (0, clock.now_ms + 1000, "1s")  # back in the heap, later
        assert await release_due(runtime) == 0  # not before its back-off
        clock.advance(1000)
        assert await release_due(runtime) == 1
        await releaser.put(runtime.release_topic.sent[-1].value, key=b"k", partition=0)
    assert calls == 2
    assert runtime.store.load(b"k", entries=True).pending == ()  # it ran and settled
    assert list(runtime.schedule.slots()) == []
