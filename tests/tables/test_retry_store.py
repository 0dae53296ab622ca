"""RetryStore.confirm(): each agent confirms its own changelog writes, whatever the others do.

The fake table fails its sends the way Faust's changelog path does: the FutureMessage returned by ``send_changelog``
gets aiokafka's exception class set on it (``Topic._on_published``), unwrapped.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError

from rebound.errors import RecordTooLargeError
from rebound.headers import Provenance
from rebound.state import PendingMessage, payload_key
from tables.retry_state import RetryStore


@dataclass
class FakeTable:
    """Local values plus every changelog send, each with a future the test settles."""

    data: dict[bytes, bytes] = field(default_factory=dict)
    sends: list[tuple[bytes, bytes | None, asyncio.Future[Any]]] = field(default_factory=list)

    def get(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self.data[key] = value
        self.send_changelog(0, key, value)

    def __delitem__(self, key: bytes) -> None:
        del self.data[key]
        self.send_changelog(0, key, None)

    def __contains__(self, key: object) -> bool:
        return key in self.data

    def items(self) -> list[tuple[bytes, bytes]]:
        return list(self.data.items())

    def partition_for_key(self, key: bytes) -> int:
        return 0

    def send_changelog(self, partition: Any, key: bytes, value: bytes | None, **options: Any) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.sends.append((key, value, future))
        return future

    def settle(self, index: int, error: BaseException | None = None) -> None:
        future = self.sends[index][2]
        if error is None:
            future.set_result("ack")
        else:
            future.set_exception(error)


async def until(predicate: Any) -> None:
    async with asyncio.timeout(2):
        while not predicate():
            await asyncio.sleep(0)


@pytest.fixture
def store() -> RetryStore:
    return RetryStore(FakeTable(), FakeTable())


async def test_each_agent_waits_for_its_own_writes_and_not_for_the_others(store: RetryStore) -> None:
    table = store.states

    async def agent(key: bytes) -> None:
        table[key] = b"v"
        await store.confirm()

    first = asyncio.create_task(agent(b"a"))
    second = asyncio.create_task(agent(b"b"))
    await until(lambda: len(table.sends) == 2)
    table.settle(1)
    await until(second.done)
    assert not first.done()  # its own write is still unacknowledged
    table.settle(0)
    await first


async def test_a_cancelled_agent_does_not_cancel_the_send_nor_poison_the_others(store: RetryStore) -> None:
    table = store.states

    async def agent(key: bytes) -> None:
        table[key] = b"v"
        await store.confirm()

    cancelled = asyncio.create_task(agent(b"a"))
    other = asyncio.create_task(agent(b"b"))
    await until(lambda: len(table.sends) == 2)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert not table.sends[0][2].cancelled()  # the shared send goes on
    table.settle(1)
    await other  # returns normally
    table["c"] = b"v"
    table.settle(2)
    await store.confirm()


async def test_a_failed_write_is_written_again_with_the_current_value(store: RetryStore) -> None:
    table = store.states

    async def agent() -> None:
        table[b"k"] = b"old"
        await store.confirm()

    waiting = asyncio.create_task(agent())
    await until(lambda: len(table.sends) == 1)
    table.data[b"k"] = b"new"  # a later write of the same key (by this or another agent)
    table.settle(0, KafkaTimeoutError())
    await until(lambda: len(table.sends) == 2)
    assert table.sends[1][:2] == (b"k", b"new")
    table.settle(1)
    await waiting


async def test_a_write_of_a_key_gone_meanwhile_is_written_again_as_a_tombstone(store: RetryStore) -> None:
    table = store.states

    async def agent() -> None:
        table[b"k"] = b"v"
        await store.confirm()

    waiting = asyncio.create_task(agent())
    await until(lambda: len(table.sends) == 1)
    del table.data[b"k"]
    table.settle(0, KafkaTimeoutError())
    await until(lambda: len(table.sends) == 2)
    assert table.sends[1][:2] == (b"k", None)
    table.settle(1)
    await waiting


async def test_a_record_refused_twice_as_too_large_is_reported_to_its_writer_only(store: RetryStore) -> None:
    table = store.states
    outcome: dict[str, Any] = {}

    async def agent(key: bytes) -> None:
        table[key] = b"v"
        try:
            await store.confirm()
            outcome[key.decode()] = "ok"
        except RecordTooLargeError as exc:
            outcome[key.decode()] = exc

    writer = asyncio.create_task(agent(b"big"))
    bystander = asyncio.create_task(agent(b"small"))
    await until(lambda: len(table.sends) == 2)
    # aiokafka fails the whole batch with the large record's error: the small one is refused once, innocently.
    table.settle(0, MessageSizeTooLargeError())
    table.settle(1, MessageSizeTooLargeError())
    await until(lambda: len(table.sends) == 4)
    table.settle(2, MessageSizeTooLargeError())  # the large one again
    table.settle(3)  # the small one, sent alone, passes
    await asyncio.gather(writer, bystander)
    assert outcome["small"] == "ok"
    assert isinstance(outcome["big"], RecordTooLargeError)


# --- a settled message's record is deleted only after the index that stopped counting it is durable -------------


def parked_message(offset: int, attempt: int = 1) -> PendingMessage:
    provenance = Provenance("items", 0, offset, 1, 2)
    return PendingMessage(
        origin=PendingMessage.origin_of(provenance),
        key=b"k",
        value=b"v",
        headers=(),
        provenance=provenance,
        attempt=attempt,
        tier="1s",
        tier_topic="items.retry.1s",
        partition=0,
        due_at_ms=10,
        parked_at_ms=1,
        error_class="E",
        error_message="e",
    )


async def settle_then_confirm(store: RetryStore, entry: PendingMessage) -> None:
    """What the release agent does, in one task: a save's deferred deletions belong to the task that saved."""
    before = store.load(b"k", origin=entry.origin)
    store.save(b"k", before, before.settle(entry.origin, entry.attempt)[0])
    await store.confirm()


def settle_every_send(table: FakeTable) -> None:
    for index, (_key, _value, future) in enumerate(table.sends):
        if not future.done():
            table.settle(index)


async def park(store: RetryStore, entry: PendingMessage) -> None:
    before = store.load(b"k", origin=entry.origin)
    store.save(b"k", before, before.park(entry)[0])
    settle_every_send(store.payloads)
    settle_every_send(store.states)
    await store.confirm()


async def test_a_settle_deletes_the_record_only_once_the_index_is_acknowledged(store: RetryStore) -> None:
    entry = parked_message(5)
    await park(store, entry)
    key = payload_key(b"k", entry.origin)
    settling = asyncio.create_task(settle_then_confirm(store, entry))
    await until(lambda: store.states.sends[-1][:2] == (b"k", None))  # the index first
    assert store.load(b"k", origin=entry.origin).find(entry.origin) is None  # gone for every reader at once
    assert list(store.parked()) == []
    await asyncio.sleep(0.01)
    assert (key, None) not in [(k, v) for k, v, _ in store.payloads.sends]  # no tombstone while it is unacknowledged
    store.states.settle(len(store.states.sends) - 1)
    await until(lambda: store.payloads.sends[-1][:2] == (key, None))
    store.payloads.settle(len(store.payloads.sends) - 1)
    await settling
    assert key not in store.payloads.data


async def test_a_newer_attempt_parked_before_the_deletion_is_kept(store: RetryStore) -> None:
    entry = parked_message(5)
    await park(store, entry)
    settling = asyncio.create_task(settle_then_confirm(store, entry))
    await until(lambda: store.states.sends[-1][:2] == (b"k", None))
    retry = parked_message(5, attempt=2)  # its next attempt, parked while the settle waits for its index
    again = store.load(b"k", origin=retry.origin)
    assert again.find(retry.origin) is None  # the settled record counts as gone: this park counts one more
    store.save(b"k", again, again.park(retry)[0])
    settle_every_send(store.states)
    settle_every_send(store.payloads)
    await settling
    [(_key, kept)] = list(store.parked())
    assert (kept.origin, kept.attempt) == (retry.origin, 2)
    assert json.loads(store.states.data[b"k"])["parked"] == 1


async def test_a_confirm_cut_short_keeps_the_record(store: RetryStore) -> None:
    """A writer cancelled (a revocation) before its index was acknowledged deletes nothing: the message runs again
    on whoever owns the partition, rather than vanish."""
    entry = parked_message(5)
    await park(store, entry)
    settling = asyncio.create_task(settle_then_confirm(store, entry))
    await until(lambda: store.states.sends[-1][:2] == (b"k", None))
    settling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await settling
    assert store.entry(b"k", entry.origin) is not None
    assert payload_key(b"k", entry.origin) in store.payloads.data
