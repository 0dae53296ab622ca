"""The records Rebound sends itself (``rebound/commands.py``): release requests and admin commands, byte for byte."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rebound.commands import (
    RELEASE_BATCH_BYTES,
    AdminCommand,
    ReleaseBatch,
    ReleaseRequest,
    element_json,
    read_release_record,
    release_record_bytes,
    release_records,
)
from rebound.records import estimated_record_bytes, plain_record_bytes


def test_a_release_request_is_the_json_workers_already_send() -> None:
    assert ReleaseRequest("items:0:42", 2).to_json() == b'{"origin": "items:0:42", "attempt": 2}'
    assert ReleaseRequest("items:0:42", 2, 7).to_json() == b'{"origin": "items:0:42", "attempt": 2, "n": 7}'
    assert ReleaseRequest.from_json(b'{"origin": "items:0:42", "attempt": "2", "n": 7}') == ReleaseRequest(
        "items:0:42", 2, 7
    )
    assert ReleaseRequest.from_json(ReleaseRequest("o", 1).to_json()) == ReleaseRequest("o", 1, None)


@pytest.mark.parametrize(
    "raw", [b"not json", b"[]", b'{"origin": "o"}', b'{"attempt": 1}', b'{"origin": "o", "attempt": "x"}', None]
)
def test_a_malformed_release_request_raises_value_error(raw: bytes | None) -> None:
    with pytest.raises(ValueError):
        ReleaseRequest.from_json(raw)  # type: ignore[arg-type]


def test_an_admin_command_round_trips_with_a_binary_key() -> None:
    command = AdminCommand("c1", "retry-now", b"\x00\xffkey", "alice", 1_700_000_000_000)
    raw = command.to_json()
    assert b'"key": "AP9rZXk="' in raw
    assert AdminCommand.from_json(raw) == command


def test_an_unknown_admin_action_is_refused() -> None:
    raw = AdminCommand("c1", "retry-now", b"k").to_json().replace(b"retry-now", b"delete-all")
    with pytest.raises(ValueError, match="unknown admin action"):
        AdminCommand.from_json(raw)


UNREADABLE_COMMANDS = [
    b'{"id": "c", "action": "retry-now", "key": "aw==", "requested_at": 1e999}',  # int(inf): OverflowError
    b"[" * 100_000 + b"]" * 100_000,  # RecursionError in json.loads
    b'{"id": "c", "action": "retry-now", "key": 12}',  # TypeError in b64decode
    b'{"id": "c", "action": "retry-now"}',  # KeyError
    b"null",  # TypeError
    b"\xff\xfe not utf-8",  # UnicodeDecodeError
]


@pytest.mark.parametrize("raw", UNREADABLE_COMMANDS)
def test_whatever_reading_an_admin_command_raises_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError, match="not an admin command"):
        AdminCommand.from_json(raw)


def test_a_release_batch_names_each_table_key_and_send_number() -> None:
    batch = ReleaseBatch(((b"\x00k", ReleaseRequest("items/0/1", 1, 5)), (b"j", ReleaseRequest("items/0/2", 3))))
    raw = batch.to_json()
    assert json.loads(raw) == {
        "releases": [
            {"key": "AGs=", "origin": "items/0/1", "attempt": 1, "n": 5},
            {"key": "ag==", "origin": "items/0/2", "attempt": 3},
        ]
    }
    assert read_release_record(raw) == batch


def test_a_single_request_is_still_read_as_one() -> None:
    assert read_release_record(b'{"origin": "o", "attempt": 2, "n": 9}') == ReleaseRequest("o", 2, 9)
    assert read_release_record(b'{"origin": "o", "attempt": 2}') == ReleaseRequest("o", 2, None)


def test_a_worker_from_before_batches_reads_a_batch_as_a_malformed_request() -> None:
    """What an older worker does with a batch during a rolling upgrade: ``ReleaseRequest.from_json`` (its only
    reader) refuses it, so it logs it, acknowledges it and releases nothing of it; the entries stay parked."""
    raw = ReleaseBatch(((b"k", ReleaseRequest("o", 1, 1)), (b"j", ReleaseRequest("p", 1, 2)))).to_json()
    with pytest.raises(ValueError):
        ReleaseRequest.from_json(raw)


def test_a_malformed_element_is_left_out_and_the_others_kept() -> None:
    raw = json.dumps(
        {
            "releases": [
                {"key": "aw==", "origin": "o", "attempt": 1, "n": 1},
                {"key": "not base64!", "origin": "p", "attempt": 1},
                {"origin": "q", "attempt": 1},
                {"key": "aw==", "origin": "r", "attempt": "x"},
                "text",
                {"key": "ag==", "origin": "s", "attempt": 2, "n": 5},
            ]
        }
    ).encode()
    batch = read_release_record(raw)
    assert isinstance(batch, ReleaseBatch)
    assert batch.requests == ((b"k", ReleaseRequest("o", 1, 1)), (b"j", ReleaseRequest("s", 2, 5)))
    assert [reason.split(":")[0] for reason in batch.malformed] == ["element 1", "element 2", "element 3", "element 4"]


@pytest.mark.parametrize(
    "raw", [b"not json", b"[]", b'{"releases": []}', b'{"releases": {"key": "aw=="}}', b'{"origin": "o"}', None]
)
def test_a_malformed_release_record_raises_value_error(raw: bytes | None) -> None:
    with pytest.raises(ValueError):
        read_release_record(raw)  # type: ignore[arg-type]


def requests(*items: tuple[int, bytes, str]) -> list[tuple[int, bytes, ReleaseRequest]]:
    return [
        (partition, key, ReleaseRequest(origin, 1, number)) for number, (partition, key, origin) in enumerate(items)
    ]


def test_release_records_group_each_partition_up_to_the_setting() -> None:
    due = requests((0, b"a", "o1"), (0, b"b", "o2"), (0, b"c", "o3"), (1, b"d", "o4"), (1, b"e", "o5"), (2, b"f", "o6"))
    records = release_records(due, 2)
    assert [(partition, key) for partition, key, _ in records] == [(0, b"a"), (0, b"c"), (1, b"d"), (2, b"f")]
    read = [read_release_record(value) for _, _, value in records]
    assert read[0] == ReleaseBatch(((b"a", ReleaseRequest("o1", 1, 0)), (b"b", ReleaseRequest("o2", 1, 1))))
    assert read[2] == ReleaseBatch(((b"d", ReleaseRequest("o4", 1, 3)), (b"e", ReleaseRequest("o5", 1, 4))))
    # One alone in its record: today's single request, byte for byte, keyed by its table key.
    assert records[1][2] == ReleaseRequest("o3", 1, 2).to_json()
    assert records[3][2] == ReleaseRequest("o6", 1, 5).to_json()


def test_release_records_of_one_are_todays_records_exactly() -> None:
    due = requests((0, b"a", "o1"), (0, b"b", "o2"), (1, b"c", "o3"))
    assert release_records(due, 1) == [(p, key, request.to_json()) for p, key, request in due]


def test_release_records_stop_short_of_the_byte_bound() -> None:
    key = b"k" * 20_000
    due = requests(*[(0, key, f"o{i}") for i in range(12)])
    records = release_records(due, 1000)
    assert len(records) > 1
    assert all(len(value) <= RELEASE_BATCH_BYTES for _, _, value in records)
    carried = [r for _, _, value in records for r in _carried(value)]
    assert carried == [request for _, _, request in due]


def _carried(value: bytes) -> list[ReleaseRequest]:
    read = read_release_record(value)
    return [request for _, request in read.requests] if isinstance(read, ReleaseBatch) else [read]


def test_release_records_count_the_record_key_and_never_pass_the_bound() -> None:
    """The record's key (its first element's table key) counts as well as the value, which carries that key again
    in base64: a 60 kB key with a short one made a 140 kB record under a 100 kB bound. One that does not fit a batch
    with another goes alone, a single request's record as before batches."""
    big = b"k" * 60_000
    due = requests((0, big, "o1"), (0, b"a", "o2"), (0, b"b", "o3"), (0, big, "o4"), (0, big, "o5"))
    records = release_records(due, 64, 100_000)
    assert [(key, _carried(value)) for _, key, value in records] == [
        (big, [due[0][2]]),
        (b"a", [due[1][2], due[2][2], due[3][2]]),  # 80 kB of base64 with two short ones: it fits
        (big, [due[4][2]]),
    ]
    assert records[0][2] == due[0][2].to_json() and records[2][2] == due[4][2].to_json()
    assert all(estimated_record_bytes(key, value, []) <= 100_000 for _, key, value in records[1:2])


@pytest.mark.parametrize("limit", [1024, 1500, 4096, 1_048_576])
def test_release_records_fit_the_producers_limit(limit: int) -> None:
    bound = release_record_bytes(limit)
    assert bound == min(RELEASE_BATCH_BYTES, limit // 2)
    due = requests(*[(i % 2, bytes([97 + i % 26]) * (1 + (i * 37) % 300), f"items/{i % 2}/{i}") for i in range(200)])
    records = release_records(due, 64, bound)
    for _, key, value in records:
        read = read_release_record(value)
        if isinstance(read, ReleaseBatch):
            assert estimated_record_bytes(key, value, []) <= bound
        else:
            assert estimated_record_bytes(key, value, []) <= limit
    carried = sorted((r.number or 0) for _, _, value in records for r in _carried(value))
    assert carried == list(range(200))


def test_a_batch_value_is_the_json_of_the_whole() -> None:
    batch = ReleaseBatch(((b"\x00k", ReleaseRequest("items/0/1", 1, 5)), (b"j", ReleaseRequest("i\u00e9", 3))))
    assert (
        batch.to_json()
        == json.dumps(
            {"releases": [json.loads(element_json(key, request)) for key, request in batch.requests]}
        ).encode()
    )


def test_plain_record_bytes_is_the_estimate_of_such_a_record() -> None:
    for key_size, value_size in [(0, 0), (1, 63), (64, 64), (300, 8191), (60_000, 100_000)]:
        assert plain_record_bytes(key_size, value_size) == estimated_record_bytes(
            b"k" * key_size, b"v" * value_size, []
        )


UNREADABLE_VALUES = [
    b'{"origin": "o", "attempt": 1e999}',  # int(inf): OverflowError
    b'{"origin": "o", "attempt": NaN}',  # int(nan): ValueError
    b'{"origin": "o", "attempt": 1, "n": -Infinity}',
    b'{"origin": "o", "attempt": [1]}',  # TypeError
    b"[" * 100_000 + b"]" * 100_000,  # RecursionError in json.loads
    b'{"releases": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b"\xff\xfe not utf-8",  # UnicodeDecodeError
    b'"text"',
    b"null",
    b"12",
]


@pytest.mark.parametrize("raw", UNREADABLE_VALUES)
def test_whatever_reading_a_record_raises_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError, match="not a release request"):
        read_release_record(raw)
    with pytest.raises(ValueError, match="not a release request"):
        ReleaseRequest.from_json(raw)


def test_whatever_reading_an_element_raises_leaves_it_out() -> None:
    elements: list[Any] = [
        {"key": "aw==", "origin": "o", "attempt": 1e999},
        {"key": "aw==", "origin": "o", "attempt": 1, "n": float("nan")},
        {"key": "aw==", "origin": "o", "attempt": {"a": 1}},
        {"key": 12, "origin": "o", "attempt": 1},
        {"key": "\u00e9", "origin": "o", "attempt": 1},  # not ASCII: base64 refuses it
        {"key": "aw==", "origin": "o", "attempt": 1, "n": 7},
    ]
    raw = json.dumps({"releases": elements}).encode().replace(b"Infinity", b"1e999")
    batch = read_release_record(raw)
    assert isinstance(batch, ReleaseBatch)
    assert batch.requests == ((b"k", ReleaseRequest("o", 1, 7)),)
    assert len(batch.malformed) == 5
    deep = b'{"releases": [' + b"[" * 100_000 + b"]" * 100_000 + b', {"key": "aw==", "origin": "o", "attempt": 1}]}'
    with pytest.raises(ValueError):  # (json.loads itself cannot read it: the whole record is malformed)
        read_release_record(deep)
