"""Per-key retry state: idempotent parking, settling, JSON round trip and the status summary."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import asdict, replace
from enum import StrEnum
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rebound.headers import Provenance
from rebound.state import (
    LEGACY_STATE_VERSION,
    STATE_VERSION,
    Intent,
    KeyState,
    LifecycleMemory,
    Mark,
    PendingMessage,
    is_entry_record,
    on_their_way,
    remember,
    split_entry,
    table_key,
)


def test_origin_of(make_provenance) -> None:
    assert PendingMessage.origin_of(make_provenance(topic="items", partition=2, offset=77)) == "items/2/77"


def test_park_into_empty_state(make_pending, t0) -> None:
    entry = make_pending(attempt=1)
    state, changed = KeyState().park(entry)
    assert changed is True
    assert state.pending == (entry,)
    assert state.attempts == 1
    assert state.first_failure_ms == t0
    assert state.last_error == "item missing (attempt 1)"
    assert state.last_error_class == "app.errors.RetryableError"
    assert state.next_due_ms == entry.due_at_ms
    assert state.tier == "5m"
    assert not state.is_idle
    assert KeyState().is_idle


def test_park_is_idempotent(make_pending) -> None:
    entry = make_pending(attempt=2)
    state, _ = KeyState().park(entry)
    again, changed = state.park(entry)
    assert changed is False
    assert again is state
    assert again.attempts == 1
    assert len(again.pending) == 1


def test_higher_attempt_replaces(make_pending) -> None:
    first = make_pending(attempt=1)
    second = make_pending(attempt=2, tier="30m", tier_topic="items.retry.30m")
    state, _ = KeyState().park(first)
    state, changed = state.park(second)
    assert changed is True
    assert state.pending == (second,)
    assert state.attempts == 2
    assert state.tier == "30m"
    assert state.last_error == "item missing (attempt 2)"


def test_lower_attempt_ignored(make_pending) -> None:
    state, _ = KeyState().park(make_pending(attempt=3))
    after, changed = state.park(make_pending(attempt=2))
    assert changed is False
    assert after is state
    assert after.pending[0].attempt == 3


def test_distinct_origins_coexist_and_earliest_due_wins(make_pending, make_provenance, t0) -> None:
    late = make_pending(offset=1, due_at_ms=t0 + 900, tier="30m")
    early = make_pending(provenance=make_provenance(offset=2, first_received_at_ms=t0 - 50), due_at_ms=t0 + 100)
    state, _ = KeyState().park(late)
    state, _ = state.park(early)
    assert {entry.origin for entry in state.pending} == {"items/0/1", "items/0/2"}
    assert state.next_due_ms == t0 + 100
    assert state.tier == "5m"
    assert state.first_failure_ms == t0 - 50  # the earliest first receipt across entries
    assert state.find("items/0/1") == late
    assert state.find("items/0/3") is None


def test_settle_removes_only_the_matching_attempt(make_pending) -> None:
    entry = make_pending(attempt=2)
    other = make_pending(offset=99, attempt=1)
    state, _ = KeyState().park(entry)
    state, _ = state.park(other)

    unchanged, changed = state.settle(entry.origin, 1)  # a newer attempt was parked meanwhile: keep it
    assert changed is False
    assert unchanged is state

    missing, changed = state.settle("items/0/12345", 2)
    assert changed is False
    assert missing is state

    settled, changed = state.settle(entry.origin, 2)
    assert changed is True
    assert settled.pending == (other,)
    assert settled.released == 1
    assert settled.attempts == 2  # running totals are kept

    done, changed = settled.settle(other.origin, 1)
    assert changed is True
    assert done.is_idle
    assert done.next_due_ms is None
    assert done.tier is None
    assert done.released == 2


def test_the_index_counts_parked_messages_and_lists_none(make_pending, make_provenance) -> None:
    binary = make_pending(offset=7, key=b"\xff\x00\xfe", value=bytes(range(256)), headers=(("bin", b"\x80"),))
    nulls = make_pending(provenance=make_provenance(offset=8), key=None, value=None, headers=())
    state, _ = KeyState().park(binary)
    state, _ = state.park(nulls)
    state, _ = state.settle(binary.origin, 1)
    state, _ = state.park(binary)

    raw = state.to_json()
    data = json.loads(raw)
    assert data["v"] == STATE_VERSION
    assert "pending" not in data  # each parked message has its own record: a park never rewrites the others
    assert (data["parked"], data["p"]) == (2, binary.partition)
    restored = KeyState.from_json(raw)
    assert (restored.parked, restored.pending, restored.others, restored.released) == (2, (), 2, 1)
    with pytest.raises(LookupError):
        restored.find(binary.origin)  # not loaded: asking is a bug, not a "not parked"
    assert restored.to_json() == raw


def test_an_entry_record_round_trips_metadata_and_bytes(make_pending) -> None:
    entry = make_pending(offset=7, key=b"\xff\x00", value=bytes(range(256)), headers=(("bin", b"\x80"),))
    raw = entry.encode_entry()
    assert is_entry_record(raw)
    meta_only = PendingMessage.from_entry(raw)
    assert not meta_only.has_payload
    assert meta_only == replace(entry, key=None, value=None, headers=(), has_payload=False)
    assert PendingMessage.from_entry(raw, with_payload=True) == entry
    # Metadata changed without the bytes loaded: the stored bytes are kept as they were.
    moved = replace(meta_only, due_at_ms=entry.due_at_ms + 5)
    rewritten = moved.encode_entry(split_entry(raw)[1])
    assert PendingMessage.from_entry(rewritten, with_payload=True) == replace(entry, due_at_ms=entry.due_at_ms + 5)


def test_a_version_2_state_is_read_complete_from_its_list(make_pending, make_provenance) -> None:
    first = make_pending(offset=7)
    second = make_pending(provenance=make_provenance(offset=8))
    version_2 = {
        "v": LEGACY_STATE_VERSION,
        "pending": [first.to_dict(), second.to_dict()],
        "attempts": 3,
        "first_failure_ms": 5,
        "last_error": "boom",
        "last_error_class": "E",
        "released": 1,
        "extra": {},
    }
    state = KeyState.from_json(json.dumps(version_2).encode())
    assert state.legacy and state.complete
    assert [entry.origin for entry in state.pending] == [first.origin, second.origin]
    assert state.find(first.origin) is not None and state.parked == 2
    assert KeyState.from_json(state.to_json()) == state  # written as it was read, until the key drains


@pytest.mark.parametrize(
    ("key", "value", "headers"),
    [
        (b"\xff\x00\xfe", bytes(range(256)), (("bin", b"\x80\x81"), ("empty", b""), ("text", "é".encode()))),
        (None, None, ()),
        (b"", b"", (("dup", b"1"), ("dup", b"2"))),
        (b"k", b"x" * 1_000_000, ()),
    ],
)
def test_payload_round_trip_is_byte_exact_and_unpadded(make_pending, key, value, headers) -> None:
    entry = make_pending(key=key, value=value, headers=headers)
    raw = entry.encode_payload()
    stripped = replace(entry, key=None, value=None, headers=(), has_payload=False)
    restored = stripped.with_payload(raw)
    assert (restored.key, restored.value, restored.headers, restored.has_payload) == (key, value, headers, True)
    overhead = len(raw) - len(key or b"") - len(value or b"") - sum(len(n) + len(v) for n, v in headers)
    assert overhead <= 16 + 6 * len(headers)  # framing only, no base64: a 1 MB value stays about 1 MB


def test_payload_rejects_foreign_bytes(make_pending) -> None:
    with pytest.raises(ValueError, match="not a Rebound payload"):
        make_pending().with_payload(b'{"json": true}')


def test_json_round_trip_of_extra_and_empty() -> None:
    state = KeyState(attempts=4, first_failure_ms=12, last_error="x", last_error_class="E", released=3, extra={"a": 1})
    assert KeyState.from_json(state.to_json()) == state
    assert KeyState.from_json(None) == KeyState()
    assert KeyState.from_json(b"") == KeyState()
    assert KeyState.from_json(b"{}") == KeyState()


def test_pending_dict_round_trip(make_pending) -> None:
    entry = make_pending(key=None, value=b"\x00\xff")
    data = entry.to_dict(with_payload=True)
    assert data["key"] is None
    assert data["value"] == "AP8="
    assert data["provenance"]["offset"] == 42
    assert PendingMessage.from_dict(json.loads(json.dumps(data))) == entry


def test_table_key_for_real_key_is_the_key(make_provenance) -> None:
    assert table_key(b"item-1", make_provenance()) == b"item-1"
    assert table_key(b"", make_provenance()) == b""  # an empty key is a key, not a null


def test_table_key_for_null_keys_is_unique_per_original_record(make_provenance) -> None:
    records = [
        make_provenance(topic=topic, partition=partition, offset=offset)
        for topic in ("items", "orders")
        for partition in (0, 1, 11)
        for offset in (0, 1, 11, 111)
    ]
    keys = [table_key(None, provenance) for provenance in records]
    assert len(set(keys)) == len(records)
    assert all(key.startswith(b"\x00") for key in keys)
    assert table_key(None, make_provenance(partition=1, offset=11)) == b"\x00items/1/11"
    # the same original record always maps to the same key (redelivery lands on the same state)
    assert table_key(None, make_provenance()) == table_key(None, make_provenance())
    # and never to what a plain-looking real key gives
    assert table_key(None, make_provenance()) != table_key(b"items/0/42", make_provenance())


def test_summary_hides_payload_by_default(make_pending, t0) -> None:
    entry = make_pending(value=b"secret-payload")
    state, _ = KeyState().park(entry)
    summary = state.summary()
    item = summary["pending"][0]
    assert "value" not in item
    assert "secret-payload" not in json.dumps(summary)
    assert item["value_bytes"] == len(b"secret-payload")
    assert item == {
        "origin": "items/0/42",
        "original_topic": "items",
        "original_partition": 0,
        "original_offset": 42,
        "attempt": 1,
        "tier": "5m",
        "due_at": t0 + 300_000,
        "first_received_at": t0,
        "error_class": "app.errors.RetryableError",
        "error_message": "item missing (attempt 1)",
        "value_bytes": 14,
    }
    assert summary["attempts"] == 1
    assert summary["next_due"] == t0 + 300_000
    assert summary["tier"] == "5m"
    assert summary["first_failure"] == t0
    assert summary["released"] == 0


def test_summary_shows_payload_when_switched_on(make_pending, make_provenance) -> None:
    state, _ = KeyState().park(make_pending(value=b"hello \xff"))
    state, _ = state.park(make_pending(provenance=make_provenance(offset=5), value=None))
    items = state.summary(show_payloads=True)["pending"]
    assert items[0]["value"] == "hello \\xff"
    assert items[1]["value"] is None
    assert items[1]["value_bytes"] is None


@pytest.mark.parametrize("key", [b"plain", b"", b"\x00items/0/7", b"\x01x", b"\x00", b"\x01", "ключ".encode()])
def test_table_keys_of_real_keys_never_collide_with_null_keys_and_invert(make_provenance, key) -> None:
    from rebound.state import message_key_of, table_key

    provenance = make_provenance(topic="items", partition=0, offset=7)
    assert table_key(key, provenance) != table_key(None, provenance)
    assert message_key_of(table_key(key, provenance), provenance) == key
    assert message_key_of(table_key(None, provenance), provenance) is None
    # State written by earlier versions stored every real key raw, NUL-prefixed ones included: still the real key
    # (except the one exact collision earlier versions could not tell apart: the null key of the same origin).
    if key != table_key(None, provenance):
        assert message_key_of(key, provenance) == key
    if key[:1] not in (b"\x00", b"\x01"):
        assert table_key(key, provenance) == key  # state written by earlier versions is found under the same key
    # A key named by a view or an admin action is looked for under the same table key: tests/rebound/test_key_names.py


@pytest.mark.parametrize("with_payload", [False, True])
def test_stored_json_is_what_asdict_and_dumps_wrote(
    make_pending: Callable[..., PendingMessage], with_payload: bool
) -> None:
    """``to_dict`` and the encoders are built for speed; the records they write must stay the same bytes (the
    table layout is fixed): the reference is the ``dataclasses.asdict`` form and ``json.dumps`` they replaced."""
    entry = make_pending(key=b"\xff", value=None, headers=(("a", None), ("b", b"\x00")), error_message='é\u2028"x')
    reference = asdict(entry)
    del reference["has_payload"], reference["intent"]  # (no intent: not written, the record as before)
    if with_payload:
        reference |= {"key": "/w==", "value": None, "headers": [["a", None], ["b", "AA=="]]}
    else:
        del reference["key"], reference["value"], reference["headers"]
    data = entry.to_dict(with_payload=with_payload)
    assert list(data) == list(reference) and data == reference
    assert list(data["provenance"]) == list(reference["provenance"])
    if not with_payload:  # the entry record's metadata part
        compact = json.dumps(reference, separators=(",", ":"), ensure_ascii=False).encode()
        assert split_entry(entry.encode_entry())[0] == compact
    state = KeyState(attempts=2, last_error="é", extra={"z": [1]})
    reference_state = json.loads(state.to_json())
    assert state.to_json() == json.dumps(reference_state, separators=(",", ":"), ensure_ascii=False).encode()


def test_an_intent_is_stored_with_its_entry_and_read_back(make_pending: Callable[..., PendingMessage]) -> None:
    """A release's intent (issue 22) goes in the entry's metadata, after the fields an entry always had."""
    intent = Intent(1, True, "items.failed", "permanent", "app.errors.PermanentError", "bad é")
    entry = replace(make_pending(), intent=intent)
    data = entry.to_dict()
    assert list(data)[-1] == "intent"
    meta, _payload = split_entry(entry.encode_entry())
    assert PendingMessage.from_dict(json.loads(meta)).intent == intent
    retry = Intent(1, False, "items.retry.1s", "", "E", "m", tier="1s", next_attempt=2, due_at_ms=5)
    assert Intent.from_dict(json.loads(json.dumps(retry.to_dict()))) == retry


def _base64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


class _Tier(StrEnum):
    FIVE_SECONDS = "5s"


_TEXT = st.text(st.characters(codec="utf-8"), max_size=12) | st.just(_Tier.FIVE_SECONDS)
_NUMBER = st.integers(-(2**70), 2**70) | st.booleans() | st.floats()  # (NaN and infinities included)
_BYTES = st.none() | st.binary(max_size=8)


@settings(max_examples=300, deadline=None)
@given(
    provenance=st.builds(Provenance, _TEXT, _NUMBER, _NUMBER, _NUMBER, _NUMBER),
    fields=st.fixed_dictionaries(
        {
            "origin": _TEXT,
            "key": _BYTES,
            "value": _BYTES,
            "headers": st.lists(st.tuples(_TEXT, _BYTES), max_size=2).map(tuple),
            "attempt": _NUMBER,
            "tier": _TEXT,
            "tier_topic": _TEXT,
            "partition": _NUMBER,
            "due_at_ms": _NUMBER,
            "parked_at_ms": _NUMBER,
            "error_class": _TEXT,
            "error_message": _TEXT | st.none(),
            "value_size": _NUMBER | st.none(),
        }
    ),
    with_payload=st.booleans(),
)
def test_stored_json_is_what_asdict_and_dumps_wrote_for_any_field_values(
    provenance: Provenance, fields: dict[str, Any], with_payload: bool
) -> None:
    """The same reference as above over generated values: enums, None, floats (NaN), bools, big ints, any text."""
    entry = PendingMessage(provenance=provenance, **fields)
    reference = asdict(entry)
    del reference["has_payload"], reference["intent"]  # (no intent: not written, the record as before)
    if with_payload:
        reference["key"], reference["value"] = _base64(entry.key), _base64(entry.value)
        reference["headers"] = [[name, _base64(value)] for name, value in entry.headers]
    else:
        del reference["key"], reference["value"], reference["headers"]

    def dumps(data: Any) -> str:
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False)

    assert dumps(entry.to_dict(with_payload=with_payload)) == dumps(reference)  # (NaN != NaN: compared as text)
    if not with_payload:
        assert split_entry(entry.encode_entry())[0] == dumps(reference).encode()
    state = KeyState(attempts=fields["attempt"], last_error=fields["error_message"], extra={"e": reference})
    assert state.to_json() == dumps(json.loads(state.to_json())).encode()


def test_on_their_way_lists_live_retry_marks_not_ends_expired_marks_or_parked_messages(
    make_pending: Callable[..., PendingMessage], make_provenance: Callable[..., Provenance], t0: int
) -> None:
    """The key view's "on its way" (a new user polled it while a message moved between tiers and read "found:
    false"): a *sending* or *forwarded* mark within the memory's time, unless its message is parked at that attempt
    or later; never an end, a dead letter about to be sent, or an expired mark not yet forgotten."""
    memory = LifecycleMemory(keep_ms=60_000, per_key=64)
    state = KeyState(pending=(make_pending(offset=5, attempt=2),))
    for offset, attempt, sending, ended, at in (
        (1, 1, False, False, t0),  # forwarded: listed
        (2, 3, True, False, t0 + 10),  # sending: listed
        (3, 1, False, True, t0),  # ended: not
        (4, 1, False, False, t0 - 60_000),  # forwarded, expired at t0 (not forgotten yet): not
        (5, 2, False, False, t0),  # its attempt 2 is parked (arrived): not
    ):
        mark = Mark(f"items/0/{offset}", attempt, at, ended, t0 - 1_000, sending)
        state = replace(state, marks=(*state.marks, mark))
    dead_lettering = Intent(1, True, "items.failed", "exhausted", "E", "boom")
    state = replace(
        state, marks=(*state.marks, Mark("items/0/6", 1, t0, False, t0 - 1_000, False, None, dead_lettering))
    )

    listed = on_their_way(state, now_ms=t0 + 40, memory=memory)

    assert listed == [
        {
            "origin": "items/0/1",
            "original_topic": "items",
            "original_partition": 0,
            "original_offset": 1,
            "attempt": 1,
            "state": "forwarded",
            "since_ms": 40,
        },
        {
            "origin": "items/0/2",
            "original_topic": "items",
            "original_partition": 0,
            "original_offset": 2,
            "attempt": 3,
            "state": "sending",
            "since_ms": 30,
        },
    ]
    # a mark written by the lifecycle itself reads the same, until its retry parks
    forwarded = remember(
        KeyState(),
        make_provenance(topic="items.v2", partition=3, offset=7),
        attempt=1,
        ended=False,
        partition=3,
        now_ms=t0,
        memory=memory,
    )
    assert [(item["origin"], item["state"]) for item in on_their_way(forwarded, now_ms=t0, memory=memory)] == [
        ("items.v2/3/7", "forwarded")
    ]
    parked, _ = forwarded.park(make_pending(provenance=make_provenance(topic="items.v2", partition=3, offset=7)))
    assert on_their_way(parked, now_ms=t0, memory=memory) == []
