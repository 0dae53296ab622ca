"""The records Rebound sends itself (``rebound/commands.py``): release requests and admin commands, byte for byte."""

from __future__ import annotations

import pytest

from rebound.commands import AdminCommand, ReleaseRequest


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
