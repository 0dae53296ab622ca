"""``_stored``: the retry store's reads of a RocksDB table, one store lookup each, with the table's answers.

Every mark, park and release reads its key's index and entry; through Faust's table a read is a membership test
and then the read (two RocksDB gets), so the store reads the serializing store once instead. These tests hold it
to the table's own answers, in a stream iteration (the current event's partition) and outside one (views, timers).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import pytest
from faust.streams import _current_event

from agents.runtime import Runtime
from tables.retry_state import _stored


class _Message:
    def __init__(self, partition: int) -> None:
        self.partition = partition


class _Event:
    def __init__(self, partition: int) -> None:
        self.message = _Message(partition)


@contextmanager
def in_iteration(partition: int) -> Iterator[None]:
    event: Any = _Event(partition)  # (Faust's table reads only its message's partition)
    token = _current_event.set(weakref.ref(event))
    try:
        yield
    finally:
        _current_event.reset(token)


def contains_calls(table: Any, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    calls: list[bytes] = []
    original = table.data._contains

    def counted(key: bytes) -> bool:
        calls.append(key)
        return bool(original(key))

    monkeypatch.setattr(table.data, "_contains", counted)
    return calls


async def test_reads_what_the_table_reads_in_one_lookup(
    rocksdb_runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = rocksdb_runtime.store.states
    table.data._db_for_partition(1).put(b"present", b'{"v":3}')
    table.data._db_for_partition(0).put(b"elsewhere", b'{"v":0}')  # a key of another partition only
    contains = contains_calls(table, monkeypatch)
    for inside in (True, False):
        scope: AbstractContextManager[None] = in_iteration(1) if inside else nullcontext()
        with scope:
            keys = (b"present", b"missing", b"elsewhere")
            expected = [table.get(key) for key in keys]
            del contains[:]
            assert [_stored(table, key) for key in keys] == expected
            assert contains == []  # the table's read asks whether the key is there first
            # In an iteration the table reads the current event's partition only, not every database
            assert expected[2] == (None if inside else b'{"v":0}')
    assert expected == [b'{"v":3}', None, b'{"v":0}']


def test_other_tables_are_read_through_the_table() -> None:
    class Fake:
        data = {b"k": b"v"}

        def get(self, key: bytes) -> bytes | None:
            return self.data.get(key)

    assert [_stored(Fake(), b"k"), _stored(Fake(), b"x")] == [b"v", None]
