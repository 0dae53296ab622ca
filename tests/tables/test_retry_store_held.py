"""RetryStore with key-ordered mode's held messages: where their bytes live, and when they go.

A held message and its later retry share an origin; their payloads must never share a payload-table key, or settling
one would delete (or overwrite) the other's bytes. The tables here are plain dicts with the few table methods the
store uses (as in ``test_retry_store.py``), synchronous: no write is confirmed, so no event loop is needed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from rebound.errors import RecordTooLargeError
from rebound.fencing import epoch_key, replay_point_key
from rebound.headers import Provenance
from rebound.ordering import HELD_PAYLOAD_PREFIX, block, held_entry, hold, without_held
from rebound.state import KeyState, PendingMessage, payload_key
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
    loaded = store.load(KEY, with_payloads=False)
    second, _ = hold(loaded, held(7))
    store.save(KEY, loaded, second)
    assert [key for key, _ in store.payloads.sends] == [held_key(7)]
    assert set(store.payloads.data) == {held_key(6), held_key(7)}


def test_a_held_entry_leaving_deletes_its_payload(store: RetryStore) -> None:
    state = holding(held(6), held(7))
    store.save(KEY, KeyState(), state)
    after = without_held(store.load(KEY, with_payloads=False), "items/0/6")
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
    assert store.load(KEY).blocked_by == "items/0/5"


def test_a_held_entry_and_a_retry_of_the_same_origin_never_share_bytes(store: RetryStore) -> None:
    """The held copy of 6 ran and failed: its retry is parked while the held copy is still in the line (it leaves
    the line only after it ran). Each keeps its own bytes, and the held one leaving leaves the retry's."""
    state = holding(held(6, b"held-6"))
    store.save(KEY, KeyState(), state)
    blocked = block(store.load(KEY, with_payloads=False), "items/0/6")
    with_retry, _ = blocked.park(parked(6, b"retry-6"))
    store.save(KEY, blocked, with_retry)
    assert store.payloads.data[held_key(6)] == held(6, b"held-6").encode_held()
    assert store.payloads.data[retry_key(6)] == parked(6, b"retry-6").encode_payload()

    loaded = store.load(KEY)
    assert loaded.held[0].value == b"held-6"
    assert loaded.pending[0].value == b"retry-6"
    assert loaded.held[0].headers == (("trace-id", b"held"),)
    assert loaded.pending[0].headers == (("trace-id", b"retry"),)

    settled = without_held(store.load(KEY, with_payloads=False), "items/0/6")
    store.save(KEY, with_retry, settled)
    assert set(store.payloads.data) == {retry_key(6)}
    assert store.load(KEY).pending[0].value == b"retry-6"


def test_a_held_entry_becoming_a_retry_in_one_write_moves_its_bytes(store: RetryStore) -> None:
    """Leaving the line and being parked in the same save: the retry's bytes are written, the held ones deleted."""
    state = holding(held(6, b"held-6"))
    store.save(KEY, KeyState(), state)
    before = store.load(KEY, with_payloads=False)
    after, _ = without_held(block(before, "items/0/6"), "items/0/6").park(parked(6, b"retry-6"))
    store.save(KEY, before, after)
    assert set(store.payloads.data) == {retry_key(6)}
    assert store.load(KEY).pending[0].value == b"retry-6"


def test_a_retry_settling_leaves_the_held_copy_of_the_same_origin(store: RetryStore) -> None:
    """The other way round: a redelivered record held while its own retry was parked (a replay after a crash)."""
    blocked = block(KeyState(), "items/0/6")
    retrying, _ = blocked.park(parked(6, b"retry-6"))
    state = holding(held(6, b"held-6"), state=retrying)
    store.save(KEY, KeyState(), state)
    settled, changed = store.load(KEY, with_payloads=False).settle("items/0/6", 1)
    assert changed
    store.save(KEY, state, settled)
    assert set(store.payloads.data) == {held_key(6)}
    assert store.load(KEY).held[0].value == b"held-6"


def test_load_with_payloads_fills_the_held_ones(store: RetryStore) -> None:
    retrying, _ = KeyState(blocked_by="items/0/5").park(parked(5, b"retry-5"))
    state = holding(held(6, b"six"), held(7, None), state=retrying)
    store.save(KEY, KeyState(), state)
    loaded = store.load(KEY)
    assert [(entry.value, entry.has_payload) for entry in loaded.held] == [(b"six", True), (None, True)]
    assert loaded.held[0].key == KEY
    assert loaded.pending[0].value == b"retry-5"
    assert loaded == state
    bare = store.load(KEY, with_payloads=False)
    assert not any(entry.has_payload for entry in (*bare.held, *bare.pending))


def test_load_with_payloads_of_a_key_only_holding(store: RetryStore) -> None:
    """No pending entry at all (the key is being drained): the held payloads are still read."""
    store.save(KEY, KeyState(), holding(held(6, b"six"), state=KeyState()))
    assert store.load(KEY).held[0].value == b"six"


def test_a_missing_held_payload_loads_as_an_entry_without_bytes(store: RetryStore) -> None:
    store.save(KEY, KeyState(), holding(held(6)))
    del store.payloads.data[held_key(6)]
    entry = store.load(KEY).held[0]
    assert entry.has_payload is False
    assert entry.value is None


def test_with_payload_reads_only_the_entry_asked_for(store: RetryStore) -> None:
    """A release reads the one payload it runs: the held copy when asked for it, else the retry's."""
    retrying, _ = block(KeyState(), "items/0/6").park(parked(6, b"retry-6"))
    state = holding(held(6, b"held-6"), held(7, b"held-7"), state=retrying)
    store.save(KEY, KeyState(), state)
    bare = store.load(KEY, with_payloads=False)
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
    assert store.load(KEY).held[0].value == b"mine"
    assert store.load(b"other").held[0].value == b"theirs"
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
    assert [entry.origin for entry in states[b"a"].pending] == ["items/0/5"]
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
    loaded = store.load(KEY)
    assert (loaded.held, loaded.blocked_by, loaded.blocked_dead) == ((), None, False)
    assert loaded.pending == (entry,)
    [(table_key, scanned)] = list(store.key_states())
    assert table_key == KEY
    assert (scanned.held, scanned.blocked_by, scanned.blocked_dead) == ((), None, False)
    assert [(table_key, item.origin) for table_key, item in store.parked()] == [(KEY, "items/0/5")]
    # Key-ordered mode takes it over: holding behind its retry keeps both payloads apart.
    before = store.load(KEY, with_payloads=False)
    after = holding(held(6, b"held-6"), state=block(before, entry.origin))
    store.save(KEY, before, after)
    assert set(store.payloads.data) == {retry_key(5), held_key(6)}
    assert store.load(KEY).pending[0].value == b"retry-5"


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
    [loaded] = store.load(KEY).held
    assert (loaded.value, loaded.provenance) == (b"six", entry.provenance)
