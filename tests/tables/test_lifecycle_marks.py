"""The store's side of one lifecycle per message: the in-memory index of keys that remember a message, and the
forgetting of expired marks (issue 22, defect 4). The rules themselves: ``tests/rebound/test_lifecycle_rules.py``."""

from __future__ import annotations

from rebound.headers import Provenance
from rebound.state import KeyState, LifecycleMemory, remember
from tables.retry_state import RetryStore
from tests.tables.test_retry_store_entries import FakeTable

T0 = 1_700_000_000_000
MEMORY = LifecycleMemory(keep_ms=60_000, per_key=8)


def ended(store: RetryStore, key: bytes, offset: int, now_ms: int) -> None:
    before = store.load(key)
    provenance = Provenance("items", 0, offset, T0 - 1_000, T0)
    after = remember(before, provenance, attempt=1, ended=True, partition=0, now_ms=now_ms, memory=MEMORY)
    store.save(key, before, after)


def fresh() -> RetryStore:
    store = RetryStore(FakeTable(), FakeTable(), confirm_writes=False)
    store.index_partition(0)  # adopted: its index is complete
    return store


def test_a_key_that_remembers_a_message_is_one_a_record_may_be_a_redelivery_of() -> None:
    store = fresh()
    assert not store.may_know(b"k", 0)
    ended(store, b"k", 7, T0)
    assert store.may_know(b"k", 0) and not store.may_be_unsettled(b"k", 0)
    assert not store.may_know(b"other", 0)
    assert store.states.get(b"k") is not None  # the index stays for the mark


def test_a_partition_not_adopted_yet_is_always_read() -> None:
    store = RetryStore(FakeTable(), FakeTable(), confirm_writes=False)
    assert store.may_know(b"k", 3)


def test_expired_marks_are_forgotten_and_an_empty_index_is_deleted() -> None:
    store = fresh()
    ended(store, b"a", 1, T0)
    ended(store, b"b", 2, T0 + 30_000)
    assert store.forget_marks(0, T0 + MEMORY.keep_ms - 1, MEMORY) == 0
    assert store.forget_marks(0, T0 + MEMORY.keep_ms, MEMORY) == 1
    assert store.states.get(b"a") is None and not store.may_know(b"a", 0)
    assert store.states.get(b"b") is not None and store.may_know(b"b", 0)
    assert store.forget_marks(0, T0 + 30_000 + MEMORY.keep_ms, MEMORY) == 1
    assert store.states.get(b"b") is None


def test_forgetting_is_bounded_per_call() -> None:
    store = fresh()
    for index in range(5):
        ended(store, f"k{index}".encode(), index, T0)
    assert store.forget_marks(0, T0 + MEMORY.keep_ms, MEMORY, limit=2) == 2
    assert store.forget_marks(0, T0 + MEMORY.keep_ms, MEMORY, limit=10) == 3


def test_a_key_marked_again_is_forgotten_only_when_its_newest_marks_expire() -> None:
    store = fresh()
    ended(store, b"k", 1, T0)
    ended(store, b"k", 2, T0 + 50_000)
    store.forget_marks(0, T0 + MEMORY.keep_ms, MEMORY)
    assert [mark.origin for mark in KeyState.from_json(store.states.get(b"k")).marks] == ["items/0/2"]
    store.forget_marks(0, T0 + 50_000 + MEMORY.keep_ms, MEMORY)
    assert store.states.get(b"k") is None


def test_an_adoption_indexes_the_remembering_keys_again() -> None:
    """What ``slots_by_partition`` does for a partition that moved here: each key's state is counted again."""
    store = fresh()
    ended(store, b"k", 1, T0)
    moved = RetryStore(store.states, store.payloads, confirm_writes=False)
    moved.index_partition(0)
    for key, state in moved.key_states(frozenset({0})):
        moved.count_blocked(key, None, state)
    assert moved.may_know(b"k", 0)
    assert moved.forget_marks(0, T0 + MEMORY.keep_ms, MEMORY) == 1


def forwarded_then_ended(store: RetryStore, key: bytes, offset: int, now_ms: int) -> None:
    provenance = Provenance("items", 0, offset, T0 - 1_000, T0)
    for ended_now in (False, True):  # its retry sent, then its end: two mark writes of one message
        before = store.load(key)
        after = remember(before, provenance, attempt=1, ended=ended_now, partition=0, now_ms=now_ms, memory=MEMORY)
        store.save(key, before, after)


def test_the_expiry_heap_holds_one_item_per_remembered_key_not_one_per_mark_written() -> None:
    """Before, every mark write pushed an item: 1,000 failures on 100 keys made 2,000 items (about 1 GB an hour at
    1,000 failures a second)."""
    store = fresh()
    for index in range(1_000):
        forwarded_then_ended(store, b"key-%d" % (index % 100), index, T0 + index)
    assert len(store.remembered[0]) == 100
    assert len(store._expiries[0]) == 100


def test_a_key_popped_before_all_its_marks_expired_gets_its_item_back() -> None:
    store = fresh()
    ended(store, b"k", 1, T0)
    ended(store, b"k", 2, T0 + 30_000)  # a second mark: the key keeps its one item, at its oldest mark
    assert len(store._expiries[0]) == 1
    assert store.forget_marks(0, T0 + MEMORY.keep_ms, MEMORY) == 1  # the first mark goes, the second stays
    assert [mark.origin for mark in KeyState.from_json(store.states.get(b"k")).marks] == ["items/0/2"]
    assert len(store._expiries[0]) == 1
    assert store.forget_marks(0, T0 + 30_000 + MEMORY.keep_ms, MEMORY) == 1
    assert store.states.get(b"k") is None and store._expiries[0] == []
