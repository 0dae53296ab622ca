"""RetryStore.confirm_later(): a writer hands its unconfirmed writes to a wait of their own and goes on; the wait
completes only once every one of them is acknowledged (a failed one written again), then makes the deletions the
writer's saves deferred, confirmed the same way."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError

from rebound.state import payload_key
from tables.retry_state import ChangelogRefusedError, RetryStore
from tests.tables.test_retry_store import park, parked_message, settle_every_send, store, until

__all__ = ["store"]  # (the fixture)


async def test_the_writer_goes_on_while_the_detached_wait_confirms_its_writes(store: RetryStore) -> None:
    table = store.states

    async def writer() -> asyncio.Future[None] | None:
        table[b"k"] = b"v"
        later = store.confirm_later()
        await store.confirm()  # nothing of its own is left to wait for
        return later

    later = await asyncio.wait_for(writer(), 1)
    assert later is not None
    await asyncio.sleep(0.01)
    assert not later.done(), "completed before the write was acknowledged"
    table.settle(0, KafkaTimeoutError())  # failed: written again, not counted as durable
    await until(lambda: len(table.sends) == 2)
    assert table.sends[1][:2] == (b"k", b"v")
    await asyncio.sleep(0.01)
    assert not later.done()
    table.settle(1)
    await asyncio.wait_for(later, 1)


async def test_nothing_written_needs_no_wait(store: RetryStore) -> None:
    assert store.confirm_later() is None


async def test_a_settle_s_deletion_follows_its_index_in_the_detached_wait(store: RetryStore) -> None:
    entry = parked_message(5)
    await park(store, entry)
    key = payload_key(b"k", entry.origin)

    async def settle() -> asyncio.Future[None] | None:
        before = store.load(b"k", origin=entry.origin)
        store.save(b"k", before, before.settle(entry.origin, entry.attempt)[0])
        return store.confirm_later()

    later = await settle()
    assert later is not None
    assert store.entry(b"k", entry.origin) is None, "gone for every reader at once"
    await until(lambda: store.states.sends[-1][:2] == (b"k", None))
    await asyncio.sleep(0.01)
    assert (key, None) not in [(k, v) for k, v, _ in store.payloads.sends], "deleted before its index was durable"
    settle_every_send(store.states)
    await until(lambda: store.payloads.sends[-1][:2] == (key, None))
    assert not later.done()
    settle_every_send(store.payloads)
    await asyncio.wait_for(later, 1)
    assert key not in store.payloads.data


async def test_a_refusal_goes_to_the_writer_s_handler_not_to_the_waiter(store: RetryStore) -> None:
    table = store.states
    refusals: list[Exception] = []

    async def writer() -> asyncio.Future[None] | None:
        table[b"big"] = b"v"
        return store.confirm_later(failed=refusals.append)

    later = await writer()
    assert later is not None
    table.settle(0, MessageSizeTooLargeError())
    await until(lambda: len(table.sends) == 2)
    table.settle(1, MessageSizeTooLargeError())  # refused twice: it counts as refused
    await asyncio.wait_for(later, 1)
    assert [type(error) for error in refusals] == [ChangelogRefusedError]


async def test_a_detached_wait_never_makes_a_deletion_a_later_save_deferred_before_that_save_is_durable(
    store: RetryStore,
) -> None:
    """A settle's wait is still confirming when the same message, parked again, is released and settled again (its
    lane is free): the first wait must not make the second settle's deletion, whose index is not durable yet."""
    first, second = parked_message(5), parked_message(5, attempt=2)
    key = payload_key(b"k", first.origin)
    await park(store, first)

    async def settle(entry: Any) -> asyncio.Future[None] | None:
        before = store.load(b"k", origin=entry.origin)
        store.save(b"k", before, before.settle(entry.origin, entry.attempt)[0])
        return store.confirm_later()

    earlier = await asyncio.create_task(settle(first))
    assert earlier is not None
    earlier_index = len(store.states.sends) - 1

    async def park_again() -> None:  # (the tier agent: its own writes confirmed, the first settle's still pending)
        sent = {name: len(table.sends) for name, table in (("states", store.states), ("payloads", store.payloads))}
        before = store.load(b"k", origin=second.origin)
        store.save(b"k", before, before.park(second)[0])
        for name, table in (("states", store.states), ("payloads", store.payloads)):
            for index in range(sent[name], len(table.sends)):
                table.settle(index)
        await store.confirm()

    await asyncio.create_task(park_again())
    assert store.payloads.data[key] != store.payloads.sends[0][1]
    later = await asyncio.create_task(settle(second))
    assert later is not None
    later_index = len(store.states.sends) - 1
    store.states.settle(earlier_index)  # the first settle's index is durable, the second's not yet
    await asyncio.sleep(0.01)
    assert (key, None) not in [(k, v) for k, v, _ in store.payloads.sends], (
        "deleted before the index that stopped counting it was durable"
    )
    await asyncio.wait_for(earlier, 1)
    store.states.settle(later_index)
    await until(lambda: store.payloads.sends[-1][:2] == (key, None))
    settle_every_send(store.payloads)
    await asyncio.wait_for(later, 1)
    assert key not in store.payloads.data


async def test_a_detached_wait_cancelled_before_it_starts_holds_nothing(store: RetryStore) -> None:
    """A shutdown can cut the wait short in the loop pass that made it: its writes and deletions are let go of (the
    record is read again), not kept for ever, nor is the record treated as gone."""
    entry = parked_message(5)
    await park(store, entry)
    key = payload_key(b"k", entry.origin)

    async def settle() -> asyncio.Task[None]:
        before = store.load(b"k", origin=entry.origin)
        store.save(b"k", before, before.settle(entry.origin, entry.attempt)[0])
        later = store.confirm_later()
        assert later is not None
        later.cancel()
        return later

    later = await asyncio.create_task(settle())
    with pytest.raises(asyncio.CancelledError):
        await later
    await asyncio.sleep(0)  # (its done callbacks)
    assert store._unconfirmed == {} and store._deferred == {}
    assert store._deleting == {}, "the record would read as gone for as long as the worker runs"
    assert key in store.payloads.data


async def test_a_read_again_sees_a_deletion_marked_since_though_the_record_is_still_there(store: RetryStore) -> None:
    """A settle's deletion waits for its confirm (the record stays in the table, marked): the writers see it gone at
    once, and so does a read compared with one made before the mark (:meth:`RetryStore.read`), even were the index
    the same bytes (the mark alone, set by hand here; a settle changes the index too)."""
    entry = parked_message(5)
    await park(store, entry)
    key = payload_key(b"k", entry.origin)
    first = store.read(b"k", entry.origin)
    assert first.state.find(entry.origin) is not None
    store._deleting[key] = (store.payloads.data[key], 0)
    marked = store.read(b"k", entry.origin, since=first)
    assert marked is not first and marked.state.find(entry.origin) is None
    del store._deleting[key]
    before = store.load(b"k", origin=entry.origin)
    store.save(b"k", before, before.settle(entry.origin, entry.attempt)[0])
    assert key in store.payloads.data  # deferred
    settled = store.read(b"k", entry.origin, since=first)
    assert settled is not first and settled.state.find(entry.origin) is None
