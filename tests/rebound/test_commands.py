"""The records Rebound sends itself (``rebound/commands.py``): release requests and admin commands, byte for byte."""

from __future__ import annotations

import json

import pytest

from rebound.commands import (
    RELEASE_BATCH_BYTES,
    AdminCommand,
    ReleaseBatch,
    ReleaseRequest,
    read_release_record,
    release_records,
)


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
