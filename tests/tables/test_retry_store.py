"""RetryStore.confirm(): each agent confirms its own changelog writes, whatever the others do.

The fake table fails its sends the way Faust's changelog path does: the FutureMessage returned by ``send_changelog``
gets aiokafka's exception class set on it (``Topic._on_published``), unwrapped.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError

from rebound.errors import RecordTooLargeError
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
