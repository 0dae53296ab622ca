"""RetryStore's layout: one record per parked message plus a small index per key, and key-ordered mode's held
messages next to them.

Parking, releasing or settling one message must write that message's record and the key's index, whatever else the
key has parked. A held message and its later retry share an origin; their records must never share a payload-table
key, or settling one would delete (or overwrite) the other's bytes. The tables here are plain dicts with the few
table methods the store uses (as in ``test_retry_store.py``), synchronous: no write is confirmed, so no event loop
is needed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import pytest

from rebound.errors import RecordTooLargeError
from rebound.fencing import epoch_key, replay_point_key
from rebound.headers import Provenance
from rebound.ordering import HELD_PAYLOAD_PREFIX, block, held_entry, hold, without_held
from rebound.state import Intent, KeyState, PendingMessage, payload_key, survey_fields, with_intent
from tables.retry_state import RetryStore

T0 = 1_700_000_000_000
KEY = b"item-1"


@dataclass
class FakeTable:
    """Local values plus every changelog send (key, value); a deletion is a send of None."""

    data: dict[bytes, bytes] = field(default_factory=dict)
    sends: list[tuple[bytes, bytes | None]] = field(default_factory=list)

    def get(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        return iter(list(self.data.items()))

    def __contains__(self, key: object) -> bool:
        return key in self.data

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self.data[key] = value
        self.send_changelog(0, key, value)

    def __delitem__(self, key: bytes) -> None:
        del self.data[key]
        self.send_changelog(0, key, None)

    def send_changelog(self, partition: Any, key: bytes, value: bytes | None, **options: Any) -> None:
        self.sends.append((key, value))

    def partition_for_key(self, key: bytes) -> int:
        return 0


@pytest.fixture
def store() -> RetryStore:
    return RetryStore(FakeTable(), FakeTable(), confirm_writes=False)


def provenance(offset: int, *, topic: str = "items", partition: int = 0) -> Provenance:
    return Provenance(topic=topic, partition=partition, offset=offset, timestamp_ms=T0 - 1_000, first_received_at_ms=T0)


def held(offset: int, value: bytes | None = b"held-bytes", **overrides: Any) -> PendingMessage:
    entry = held_entry(
        key=KEY,
        value=value,
        headers=(("trace-id", b"held"),),
        provenance=provenance(offset),
        now_ms=T0,
        blocked_by="items/0/5",
    )
    return replace(entry, **overrides)


def parked(offset: int, value: bytes | None = b"retry-bytes", *, attempt: int = 1) -> PendingMessage:
    source = provenance(offset)
    return PendingMessage(
        origin=PendingMessage.origin_of(source),
        key=KEY,
        value=value,
        headers=(("trace-id", b"retry"),),
        provenance=source,
        attempt=attempt,
        tier="5m",
        tier_topic="items.retry.5m",
        partition=0,
        due_at_ms=T0 + 300_000 * attempt,
        parked_at_ms=T0,
        error_class="app.errors.RetryableError",
        error_message=f"item missing (attempt {attempt})",
        value_size=None if value is None else len(value),
    )


def held_key(offset: int, table_key: bytes = KEY) -> bytes:
    return payload_key(table_key, HELD_PAYLOAD_PREFIX + f"items/0/{offset}")


def retry_key(offset: int, table_key: bytes = KEY) -> bytes:
    return payload_key(table_key, f"items/0/{offset}")


def holding(*entries: PendingMessage, state: KeyState | None = None) -> KeyState:
    state = state or KeyState(blocked_by="items/0/5")
    for entry in entries:
        state, _ = hold(state, entry)
    return state


def test_held_payloads_are_written_under_the_held_prefix(store: RetryStore) -> None:
    state = holding(held(6, b"six"), held(7, b"seven"))
    store.save(KEY, KeyState(), state)
    assert set(store.payloads.data) == {held_key(6), held_key(7)}
    assert store.payloads.data[held_key(6)] == held(6, b"six").encode_held()
    assert retry_key(6) not in store.payloads.data  # the plain origin is the retry's, never the held copy's
    stored = json.loads(store.states.data[KEY])
    assert stored["held"] == ["items/0/6", "items/0/7"]  # origins only: the metadata is in the held records
    assert stored["blocked_by"] == "items/0/5"
    assert b"six" not in store.states.data[KEY]  # metadata only in the state


def test_payloads_are_written_before_the_state(store: RetryStore) -> None:
    """A crash between the writes leaves at worst an orphan payload, never a held entry whose bytes are gone."""
    order: list[str] = []
    store.payloads.send_changelog = lambda *args, **kwargs: order.append("payload")  # type: ignore[method-assign]
    store.states.send_changelog = lambda *args, **kwargs: order.append("state")  # type: ignore[method-assign]
    store.save(KEY, KeyState(), holding(held(6)))
    assert order == ["payload", "state"]


def test_holding_one_more_writes_only_its_payload(store: RetryStore) -> None:
    """Held payloads already stored are not rewritten when the line grows (nor when it is saved unloaded)."""
    first = holding(held(6))
    store.save(KEY, KeyState(), first)
    store.payloads.sends.clear()
    loaded = store.load(KEY, entries=True)
    second, _ = hold(loaded, held(7))
    store.save(KEY, loaded, second)
    assert [key for key, _ in store.payloads.sends] == [held_key(7)]
    assert set(store.payloads.data) == {held_key(6), held_key(7)}


def test_a_held_entry_leaving_deletes_its_payload(store: RetryStore) -> None:
    state = holding(held(6), held(7))
    store.save(KEY, KeyState(), state)
    after = without_held(store.load(KEY, entries=True), "items/0/6")
    store.save(KEY, state, after)
    assert set(store.payloads.data) == {held_key(7)}
    assert (held_key(6), None) in store.payloads.sends


def test_the_last_held_entry_leaving_an_unblocked_key_deletes_the_key(store: RetryStore) -> None:
    state = holding(held(6), state=KeyState())
    store.save(KEY, KeyState(), state)
    store.save(KEY, state, without_held(state, "items/0/6"))
    assert store.states.data == {}
    assert store.payloads.data == {}


def test_a_blocked_key_holding_nothing_is_kept(store: RetryStore) -> None:
    """Only a block, between a release and the next park: still state, or the key's next record would run early."""
    blocked = block(KeyState(), "items/0/5")
    store.save(KEY, KeyState(), blocked)
    assert store.load(KEY, entries=True, with_payloads=True).blocked_by == "items/0/5"


def test_a_held_entry_and_a_retry_of_the_same_origin_never_share_bytes(store: RetryStore) -> None:
    """The held copy of 6 ran and failed: its retry is parked while the held copy is still in the line (it leaves
    the line only after it ran). Each keeps its own bytes, and the held one leaving leaves the retry's."""
    state = holding(held(6, b"held-6"))
    store.save(KEY, KeyState(), state)
    blocked = block(store.load(KEY, entries=True), "items/0/6")
    with_retry, _ = blocked.park(parked(6, b"retry-6"))
    store.save(KEY, blocked, with_retry)
    assert store.payloads.data[held_key(6)] == held(6, b"held-6").encode_held()
    assert store.payloads.data[retry_key(6)] == parked(6, b"retry-6").encode_entry()

    loaded = store.load(KEY, entries=True, with_payloads=True)
    assert loaded.held[0].value == b"held-6"
    assert loaded.pending[0].value == b"retry-6"
    assert loaded.held[0].headers == (("trace-id", b"held"),)
    assert loaded.pending[0].headers == (("trace-id", b"retry"),)

    settled = without_held(store.load(KEY, entries=True), "items/0/6")
    store.save(KEY, with_retry, settled)
    assert set(store.payloads.data) == {retry_key(6)}
    assert store.load(KEY, entries=True, with_payloads=True).pending[0].value == b"retry-6"


def test_a_held_entry_becoming_a_retry_in_one_write_moves_its_bytes(store: RetryStore) -> None:
    """Leaving the line and being parked in the same save: the retry's bytes are written, the held ones deleted."""
    state = holding(held(6, b"held-6"))
    store.save(KEY, KeyState(), state)
    before = store.load(KEY, entries=True)
    after, _ = without_held(block(before, "items/0/6"), "items/0/6").park(parked(6, b"retry-6"))
    store.save(KEY, before, after)
    assert set(store.payloads.data) == {retry_key(6)}
    assert store.load(KEY, entries=True, with_payloads=True).pending[0].value == b"retry-6"


def test_a_retry_settling_leaves_the_held_copy_of_the_same_origin(store: RetryStore) -> None:
    """The other way round: a redelivered record held while its own retry was parked (a replay after a crash)."""
    blocked = block(KeyState(), "items/0/6")
    retrying, _ = blocked.park(parked(6, b"retry-6"))
    state = holding(held(6, b"held-6"), state=retrying)
    store.save(KEY, KeyState(), state)
    settled, changed = store.load(KEY, entries=True).settle("items/0/6", 1)
    assert changed
    store.save(KEY, state, settled)
    assert set(store.payloads.data) == {held_key(6)}
    assert store.load(KEY, entries=True, with_payloads=True).held[0].value == b"held-6"


def test_load_with_payloads_fills_the_held_ones(store: RetryStore) -> None:
    retrying, _ = KeyState(blocked_by="items/0/5").park(parked(5, b"retry-5"))
    state = holding(held(6, b"six"), held(7, None), state=retrying)
    store.save(KEY, KeyState(), state)
    loaded = store.load(KEY, entries=True, with_payloads=True)
    assert [(entry.value, entry.has_payload) for entry in loaded.held] == [(b"six", True), (None, True)]
    assert loaded.held[0].key == KEY
    assert loaded.pending[0].value == b"retry-5"
    assert loaded == state
    bare = store.load(KEY, entries=True)
    assert not any(entry.has_payload for entry in (*bare.held, *bare.pending))


def test_load_with_payloads_of_a_key_only_holding(store: RetryStore) -> None:
    """No pending entry at all (the key is being drained): the held payloads are still read."""
    store.save(KEY, KeyState(), holding(held(6, b"six"), state=KeyState()))
    assert store.load(KEY, entries=True, with_payloads=True).held[0].value == b"six"


def test_a_missing_held_payload_loads_as_an_entry_without_bytes(store: RetryStore) -> None:
    store.save(KEY, KeyState(), holding(held(6)))
    del store.payloads.data[held_key(6)]
    entry = store.load(KEY, entries=True, with_payloads=True).held[0]
    assert entry.has_payload is False
    assert entry.value is None


def test_with_payload_reads_only_the_entry_asked_for(store: RetryStore) -> None:
    """A release reads the one payload it runs: the held copy when asked for it, else the retry's."""
    retrying, _ = block(KeyState(), "items/0/6").park(parked(6, b"retry-6"))
    state = holding(held(6, b"held-6"), held(7, b"held-7"), state=retrying)
    store.save(KEY, KeyState(), state)
    bare = store.load(KEY, entries=True)
    reads: list[bytes] = []
    get = store.payloads.get

    def counting_get(key: bytes) -> bytes | None:
        reads.append(key)
        return get(key)

    store.payloads.get = counting_get  # type: ignore[method-assign]
    assert store.with_payload(KEY, bare.held[0], held=True).value == b"held-6"
    assert reads == [held_key(6)]
    assert store.with_payload(KEY, bare.held[1], held=True).value == b"held-7"
    assert store.with_payload(KEY, bare.pending[0]).value == b"retry-6"
    assert reads == [held_key(6), held_key(7), retry_key(6)]
    # A held entry read as if it were a retry finds the retry's bytes, never the held ones: the flag matters.
    assert store.with_payload(KEY, bare.held[0]).value == b"retry-6"


def test_held_payloads_are_in_the_keys_own_namespace(store: RetryStore) -> None:
    """Another key holding a record of the same origin (impossible but forged) never touches this key's bytes."""
    store.save(KEY, KeyState(), holding(held(6, b"mine")))
    store.save(b"other", KeyState(), holding(held(6, b"theirs")))
    assert store.load(KEY, entries=True, with_payloads=True).held[0].value == b"mine"
    assert store.load(b"other", with_payloads=True).held[0].value == b"theirs"
    assert held_key(6, b"other") in store.payloads.data


def test_key_states_yields_every_key_and_skips_internal_keys(store: RetryStore) -> None:
    retrying, _ = block(KeyState(), "items/0/5").park(parked(5))
    store.save(b"a", KeyState(), retrying)
    store.save(b"b", KeyState(), holding(held(6)))
    store.save(b"c", KeyState(), block(KeyState(), "items/0/9", dead=True))
    store.states.data[epoch_key(0)] = b"7"  # the writer-epoch markers: not JSON, never a key's state
    store.states.data[replay_point_key(0)] = b"12 7"
    states = dict(store.key_states())
    assert set(states) == {b"a", b"b", b"c"}
    assert states[b"a"].parked == 1
    assert [entry.origin for entry in states[b"b"].held] == ["items/0/6"]
    assert (states[b"c"].blocked_by, states[b"c"].blocked_dead) == ("items/0/9", True)
    assert not any(entry.has_payload for state in states.values() for entry in (*state.pending, *state.held))


def test_parked_yields_only_retrying_entries(store: RetryStore) -> None:
    """The scheduler rebuilds its due list from ``parked``: a held message has no due time, it is not due."""
    retrying, _ = block(KeyState(), "items/0/5").park(parked(5))
    store.save(b"a", KeyState(), holding(held(6), held(7), state=retrying))
    store.save(b"b", KeyState(), holding(held(8)))
    store.states.data[epoch_key(1)] = b"3"
    assert [(table_key, entry.origin) for table_key, entry in store.parked()] == [(b"a", "items/0/5")]


def test_a_state_written_before_key_ordered_mode_still_loads_and_saves(store: RetryStore) -> None:
    """State written by the previous version (no ``held``/``blocked_by``/``blocked_dead``) must load unchanged."""
    entry = parked(5, b"retry-5")
    old = {
        "v": 2,
        "pending": [entry.to_dict()],
        "attempts": 1,
        "first_failure_ms": T0,
        "last_error": entry.error_message,
        "last_error_class": entry.error_class,
        "released": 0,
        "extra": {},
    }
    store.states.data[KEY] = json.dumps(old).encode()
    store.payloads.data[retry_key(5)] = entry.encode_payload()
    loaded = store.load(KEY, entries=True, with_payloads=True)
    assert (loaded.held, loaded.blocked_by, loaded.blocked_dead) == ((), None, False)
    assert loaded.pending == (entry,)
    [(table_key, scanned)] = list(store.key_states())
    assert table_key == KEY
    assert (scanned.held, scanned.blocked_by, scanned.blocked_dead) == ((), None, False)
    assert [(table_key, item.origin) for table_key, item in store.parked()] == [(KEY, "items/0/5")]
    # Key-ordered mode takes it over: holding behind its retry keeps both payloads apart.
    before = store.load(KEY, entries=True)
    after = holding(held(6, b"held-6"), state=block(before, entry.origin))
    store.save(KEY, before, after)
    assert set(store.payloads.data) == {retry_key(5), held_key(6)}
    assert store.load(KEY, entries=True, with_payloads=True).pending[0].value == b"retry-5"


def test_a_held_payload_too_large_is_refused_before_anything_is_written() -> None:
    store = RetryStore(FakeTable(), FakeTable(), max_record_bytes=2_000, confirm_writes=False)
    big = held(6, b"x" * 4_000)
    with pytest.raises(RecordTooLargeError):
        store.save(KEY, KeyState(), holding(big))
    assert store.states.data == {}
    assert store.payloads.data == {}


def test_a_held_record_written_before_its_metadata_moved_to_it_still_loads(store: RetryStore) -> None:
    """States written by the first key-ordered version listed each held entry in full and kept only the bytes in
    the payload table: both still read."""
    entry = held(6, b"six")
    legacy_state = {"v": 2, "pending": [], "held": [entry.to_dict()], "blocked_by": "items/0/5"}
    store.states.data[KEY] = json.dumps(legacy_state).encode()
    store.payloads.data[held_key(6)] = entry.encode_payload()  # the old held record: bytes only
    [loaded] = store.load(KEY, entries=True, with_payloads=True).held
    assert (loaded.value, loaded.provenance) == (b"six", entry.provenance)


# --- one record per parked message -------------------------------------------------------------------------------


def park_one(store: RetryStore, entry: PendingMessage, table_key: bytes = KEY) -> None:
    """What the tier agent does: read the key's index with this one origin, park, save."""
    before = store.load(table_key, origin=entry.origin)
    after, changed = before.park(entry)
    assert changed
    store.save(table_key, before, after)


def settle_one(store: RetryStore, entry: PendingMessage, table_key: bytes = KEY) -> None:
    before = store.load(table_key, origin=entry.origin)
    after, changed = before.settle(entry.origin, entry.attempt)
    assert changed
    store.save(table_key, before, after)


def test_the_nth_park_and_settle_of_a_key_write_one_entry_and_the_index(store: RetryStore) -> None:
    """The cost per park does not grow with the key's backlog: the earlier layout rewrote every entry's metadata."""
    for offset in range(1, 201):
        store.payloads.sends.clear()
        store.states.sends.clear()
        park_one(store, parked(offset))
        assert [key for key, _ in store.payloads.sends] == [retry_key(offset)]
        assert len(store.states.sends) == 1
        assert len(store.states.data[KEY]) < 300  # the index stays small however many are parked
    assert json.loads(store.states.data[KEY])["parked"] == 200
    for offset in range(1, 201):
        store.payloads.sends.clear()
        store.states.sends.clear()
        settle_one(store, parked(offset))
        assert store.payloads.sends == [(retry_key(offset), None)]
        assert store.states.sends == ([(KEY, None)] if offset == 200 else [(KEY, store.states.data[KEY])])
    assert store.payloads.data == {} and store.states.data == {}


def test_one_origin_loaded_answers_for_that_origin_only(store: RetryStore) -> None:
    park_one(store, parked(5))
    park_one(store, parked(6))
    state = store.load(KEY, origin="items/0/6", with_payloads=True)
    assert [entry.value for entry in state.pending] == [b"retry-bytes"]
    assert (state.parked, state.others) == (2, 1)
    assert store.load(KEY, origin="items/0/7").find("items/0/7") is None
    with pytest.raises(LookupError):
        state.find("items/0/5")
    assert [entry.origin for entry in store.load(KEY, entries=True).pending] == ["items/0/5", "items/0/6"]


def test_a_redelivered_park_of_the_same_attempt_changes_nothing(store: RetryStore) -> None:
    park_one(store, parked(5))
    before = store.load(KEY, origin="items/0/5")
    assert before.park(parked(5))[1] is False
    assert before.park(parked(5, attempt=2))[1] is True  # a later attempt replaces it, still one entry
    store.save(KEY, before, before.park(parked(5, attempt=2))[0])
    state = store.load(KEY, entries=True)
    assert [(entry.origin, entry.attempt) for entry in state.pending] == [("items/0/5", 2)]
    assert state.parked == 1


def test_an_entry_whose_metadata_changes_keeps_its_stored_bytes(store: RetryStore) -> None:
    """retry-now moves a due time with the entries loaded without their bytes: the bytes are kept."""
    park_one(store, parked(5, b"\x00\xffbytes"))
    before = store.load(KEY, entries=True)
    moved = replace(before, pending=tuple(replace(entry, due_at_ms=T0) for entry in before.pending))
    store.save(KEY, before, moved)
    [entry] = store.load(KEY, entries=True, with_payloads=True).pending
    assert (entry.due_at_ms, entry.value, entry.headers) == (T0, b"\x00\xffbytes", (("trace-id", b"retry"),))


def test_an_entry_the_index_did_not_count_keeps_the_index_alive(store: RetryStore) -> None:
    """A crash between an entry's write and its index's: settling the counted one must not delete the index while
    another entry of the key exists; the count heals."""
    park_one(store, parked(5))
    store.payloads.data[retry_key(6)] = parked(6).encode_entry()  # written, but its index write was lost
    settle_one(store, parked(5))
    assert json.loads(store.states.data[KEY])["parked"] == 1
    assert [entry.origin for entry in store.load(KEY, entries=True).pending] == ["items/0/6"]
    settle_one(store, parked(6))
    assert store.states.data == {} and store.payloads.data == {}


def test_a_version_2_key_is_read_and_written_as_it_is_until_it_drains(store: RetryStore) -> None:
    """State written before this layout: every parked entry's metadata in the key's state, bytes alone under the
    same payload keys. It keeps that layout until nothing of it is parked (a message that fit the old layout by a
    few bytes might not fit a record with its metadata); then the key starts afresh in the new one."""
    first, second = parked(5, b"five\x00"), parked(6, None)
    version_2 = {"v": 2, "pending": [first.to_dict(), second.to_dict()], "attempts": 2, "released": 0, "extra": {}}
    store.states.data[KEY] = json.dumps(version_2).encode()
    store.payloads.data[retry_key(5)] = first.encode_payload()
    store.payloads.data[retry_key(6)] = second.encode_payload()
    assert store.entry(KEY, "items/0/6") == replace(second, key=None, headers=(), has_payload=False)
    assert [(e.origin, e.value) for _k, e in store.parked()] == [("items/0/5", None), ("items/0/6", None)]
    loaded = store.load(KEY, origin="items/0/5", with_payloads=True)
    assert loaded.legacy and [e.value for e in loaded.pending] == [b"five\x00", None]
    after, _ = loaded.settle("items/0/5", 1)
    third = parked(7, b"seven")
    after, _ = after.park(third)
    store.save(KEY, loaded, after)
    state = json.loads(store.states.data[KEY])
    assert (state["v"], [item["origin"] for item in state["pending"]]) == (2, ["items/0/6", "items/0/7"])
    assert set(store.payloads.data) == {retry_key(6), retry_key(7)}
    assert store.payloads.data[retry_key(6)] == second.encode_payload()  # untouched
    assert store.payloads.data[retry_key(7)] == third.encode_payload()  # the layout of its key
    assert [e.value for e in store.load(KEY, entries=True, with_payloads=True).pending] == [None, b"seven"]
    for origin in ("items/0/6", "items/0/7"):
        before = store.load(KEY, origin=origin)
        store.save(KEY, before, before.settle(origin, 1)[0])
    assert store.states.data == {} and store.payloads.data == {}
    park_one(store, parked(8))  # drained: the key's next state is in the new layout
    assert json.loads(store.states.data[KEY])["v"] == 3


def test_a_version_2_key_with_a_record_of_the_new_layout_reads_both(store: RetryStore) -> None:
    """A message parked by a new worker, then the partition written by an older one (or a crash between two
    writes): the record of its own is newer than the list, and nothing is listed twice."""
    listed, recorded = parked(5), parked(6)
    store.states.data[KEY] = json.dumps({"v": 2, "pending": [listed.to_dict()]}).encode()
    store.payloads.data[retry_key(5)] = listed.encode_payload()
    store.payloads.data[retry_key(6)] = recorded.encode_entry()
    assert store.entry(KEY, "items/0/6") is not None  # not taken for settled (and deleted) by a stale request
    assert sorted(e.origin for _k, e in store.parked()) == ["items/0/5", "items/0/6"]


def test_a_version_2_entry_without_bytes_is_still_listed_and_ends_as_missing(store: RetryStore) -> None:
    lost = parked(5)
    store.states.data[KEY] = json.dumps({"v": 2, "pending": [lost.to_dict()]}).encode()
    before = store.load(KEY)
    store.save(KEY, before, replace(before, attempts=1))
    [entry] = store.load(KEY, entries=True, with_payloads=True).pending
    assert (entry.origin, entry.has_payload) == ("items/0/5", False)  # released as payload-missing, not dropped


def test_parked_lists_every_entry_with_its_table_key_and_skips_held_records(store: RetryStore) -> None:
    park_one(store, parked(5), table_key=b"a")
    park_one(store, parked(6), table_key=b"\x00null/0/6")
    store.save(b"b", KeyState(), holding(held(7)))
    assert sorted((key, entry.origin) for key, entry in store.parked()) == [
        (b"\x00null/0/6", "items/0/6"),
        (b"a", "items/0/5"),
    ]
    assert list(store.parked(frozenset({1}))) == []


class _PartitionedStore:
    """The shape of Faust's RocksDB store the scans rely on: one database per partition, an offset key in each."""

    offset_key = b"__faust\x00offset__"

    def __init__(self, dbs: dict[int, Any]) -> None:
        self._dbs = dbs


def test_scans_of_a_rocksdb_store_seek_the_key_and_read_only_the_partitions_asked(tmp_path: Any) -> None:
    """Real RocksDB databases (rocksdict): a key's records are one prefix seek away, and a partition's scan reads
    that partition's database only."""
    from rocksdict import Options, Rdict

    dbs = {number: Rdict(str(tmp_path / f"p{number}"), Options(raw_mode=True)) for number in (0, 1)}

    @dataclass
    class RocksTable(FakeTable):
        data: Any = None

        def get(self, key: bytes) -> bytes | None:
            for db in dbs.values():
                value = db.get(key)
                if value is not None:
                    return bytes(value)
            return None

        def __setitem__(self, key: bytes, value: bytes) -> None:
            dbs[json.loads(value[8 : 8 + int.from_bytes(value[4:8], "big")])["partition"]].put(key, value)

        def __delitem__(self, key: bytes) -> None:
            for db in dbs.values():
                db.delete(key)

        def __contains__(self, key: object) -> bool:
            return self.get(key) is not None  # type: ignore[arg-type]

    try:
        payloads = RocksTable(data=_PartitionedStore(dbs))
        rocks = RetryStore(FakeTable(), payloads, confirm_writes=False)
        for db in dbs.values():
            db.put(_PartitionedStore.offset_key, b"12")
        neighbour = KEY + b"x"  # a longer key sharing the bytes of this one: never in its prefix
        for offset in (5, 6):
            park_one(rocks, parked(offset))
        park_one(rocks, replace(parked(9), partition=1), table_key=neighbour)
        assert [e.origin for e in rocks.load(KEY, entries=True).pending] == ["items/0/5", "items/0/6"]
        assert [e.origin for e in rocks.load(neighbour, entries=True).pending] == ["items/0/9"]
        assert sorted(e.origin for _k, e in rocks.parked(frozenset({0}))) == ["items/0/5", "items/0/6"]
        assert [(k, e.origin) for k, e in rocks.parked(frozenset({1}))] == [(neighbour, "items/0/9")]
    finally:
        for db in dbs.values():
            db.close()


def test_the_store_notes_which_partitions_a_changelog_replay_wrote_to() -> None:
    """What an adoption reads again: partitions whose changelog was replayed into the local copy."""
    applied: list[Any] = []

    @dataclass
    class ReplayedTable(FakeTable):
        def apply_changelog_batch(self, batch: Any) -> None:
            applied.extend(batch)

    states, payloads = ReplayedTable(), ReplayedTable()
    store = RetryStore(states, payloads, confirm_writes=False)
    events = [SimpleNamespace(message=SimpleNamespace(partition=partition)) for partition in (2, 5, 2)]
    payloads.apply_changelog_batch(iter(events))  # Faust may hand a generator: it is read once, and passed on
    states.apply_changelog_batch([])
    assert store.replayed == {2, 5}
    assert applied == events


def test_a_chunked_walk_of_a_partition_reads_everything_once_and_holds_nothing_between_chunks(tmp_path: Any) -> None:
    """The first-receipt survey yields to the event loop between chunks: a chunk keeps no iterator or database
    handle (Faust's revocation only forgets a database: an iterator kept across it would keep it locked)."""
    from rocksdict import Options, Rdict

    db = Rdict(str(tmp_path / "p0"), Options(raw_mode=True))
    try:
        payloads = FakeTable()
        payloads.data = _PartitionedStore({0: db})  # type: ignore[assignment]
        store = RetryStore(FakeTable(), payloads, confirm_writes=False)
        db.put(_PartitionedStore.offset_key, b"1")
        for offset in range(25):
            db.put(retry_key(offset, b"k%02d" % offset), parked(offset).encode_entry())
        db.put(held_key(99), held(99).encode_held())
        seen, after, chunks = [], None, 0
        while True:
            entries, after = store.parked_chunk(0, after, 10)
            seen += [entry.origin for entry in entries]
            chunks += 1
            if after is None:
                break
        assert sorted(seen) == sorted(f"items/0/{offset}" for offset in range(25))
        assert chunks == 3
        assert store.parked_chunk(1, None, 10) == ([], None)  # a partition not open here
    finally:
        db.close()


def test_the_survey_reads_tier_and_first_receipt_without_decoding_and_agrees_with_a_decode() -> None:
    """The first-receipt survey reads two fields of each record (about four times cheaper than a decode); a
    message whose own bytes look like those fields cannot fool it: only the metadata part is searched."""
    sneaky = replace(parked(5, b'{"tier_topic":"evil.retry.1s","first_received_at_ms":1}'), tier_topic="items.retry.5m")
    raw = sneaky.encode_entry()
    assert survey_fields(raw) == ("items.retry.5m", sneaky.provenance.first_received_at_ms)
    assert survey_fields(sneaky.encode_held()) is None and survey_fields(sneaky.encode_payload()) is None
    store = RetryStore(FakeTable(), FakeTable(), confirm_writes=False)
    for offset in (5, 6):
        park_one(store, parked(offset), table_key=b"k%d" % offset)
    found, after = store.first_received_chunk(0, None, 10)
    assert (sorted(found), after) == ([("items.retry.5m", T0), ("items.retry.5m", T0)], None)


def test_a_read_again_of_unchanged_records_is_the_earlier_read_itself(store: RetryStore) -> None:
    """A release reads its key before the handler and again at the settle: records unchanged byte for byte decode
    to the same state, so the second read returns the first (no decode); its state is load()'s."""
    park_one(store, parked(5))
    park_one(store, parked(6))
    first = store.read(KEY, "items/0/5")
    assert first.state == store.load(KEY, origin="items/0/5")
    again = store.read(KEY, "items/0/5", since=first)
    assert again is first
    assert store.read(KEY, "items/0/6", since=first).state == store.load(KEY, origin="items/0/6")  # another origin
    assert store.read(b"other", "items/0/5", since=first).state.find("items/0/5") is None  # another key


def test_a_read_again_after_any_write_to_the_key_decodes_afresh(store: RetryStore) -> None:
    """What the handler's await may let in: a park of another message of the key (its index changes), a newer
    attempt of the same message (its record changes), its settle (both go)."""
    park_one(store, parked(5))
    first = store.read(KEY, "items/0/5")
    park_one(store, parked(6))  # the index counts one more
    again = store.read(KEY, "items/0/5", since=first)
    assert again is not first and again.state.parked == 2
    assert again.state == store.load(KEY, origin="items/0/5")
    before = store.load(KEY, origin="items/0/5")
    store.save(KEY, before, before.park(parked(5, attempt=2))[0])  # its record changes (and the index's count)
    newer = store.read(KEY, "items/0/5", since=again)
    assert newer is not again and newer.state.find("items/0/5").attempt == 2
    settle_one(store, parked(5, attempt=2))
    gone = store.read(KEY, "items/0/5", since=newer)
    assert gone.state.find("items/0/5") is None and gone.state.parked == 1


def test_a_payload_taken_from_a_read_is_the_one_read_from_the_table(store: RetryStore) -> None:
    park_one(store, parked(5, b"\x00\xffbytes"))
    loaded = store.read(KEY, "items/0/5")
    [entry] = loaded.state.pending
    assert store.with_payload(KEY, entry, read=loaded) == store.with_payload(KEY, entry)
    assert store.with_payload(KEY, entry, read=loaded).value == b"\x00\xffbytes"


def test_a_read_again_after_an_intent_write_decodes_afresh(store: RetryStore) -> None:
    """The write that changes the entry's record and not the index (a release's own intent, written while its
    handler runs): the earlier read is not reused (review finding: nothing else checked the entry's comparison)."""
    park_one(store, parked(5))
    first = store.read(KEY, "items/0/5")
    before = store.load(KEY, origin="items/0/5")
    intent = Intent(1, True, "items.failed", "permanent", "E", "boom")
    store.save(KEY, before, with_intent(before, "items/0/5", 1, intent))
    again = store.read(KEY, "items/0/5", since=first)
    assert again.index_raw == first.index_raw  # only the entry record changed
    assert again is not first and again.state.find("items/0/5").intent == intent
