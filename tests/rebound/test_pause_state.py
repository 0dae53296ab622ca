"""The pause control record (``rebound/pause.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rebound.pause import NOT_PAUSED, PauseState, clean_who, describe_who


def test_a_state_round_trips_and_a_copy_written_again_is_the_same_action() -> None:
    state = PauseState(paused=True, by="alice@ops-1", source="10.0.0.5", at_ms=1_700_000_000_000, action_id="a1")
    assert PauseState.from_json(state.to_json()) == replace(state, written_at_ms=state.at_ms)
    copy = replace(state, written_at_ms=state.at_ms + 86_400_000)
    assert PauseState.from_json(copy.to_json()).same_action(state)
    assert not replace(state, paused=False, action_id="a2").same_action(state)
    assert state.to_view() == {"paused": True, "by": "alice@ops-1", "source": "10.0.0.5", "at": 1_700_000_000_000}
    assert NOT_PAUSED.to_view()["paused"] is False


@pytest.mark.parametrize(
    "raw",
    [None, b"", b"not json", b"[]", b'{"type": "other", "paused": true}', b'{"type": "main-topics", "paused": "yes"}'],
)
def test_anything_else_is_not_a_control_record(raw: bytes | None) -> None:
    with pytest.raises(ValueError):
        PauseState.from_json(raw)


def test_who_is_the_operator_s_name_else_the_address_and_is_bounded_and_printable() -> None:
    assert describe_who("alice@ops-1", "10.0.0.5") == ("alice@ops-1", "10.0.0.5")
    assert describe_who(None, "10.0.0.5") == ("10.0.0.5", "10.0.0.5")
    assert describe_who("  ", None) == ("?", "?")
    assert clean_who("eve\n2024-01-01 admin resume by root") == "eve2024-01-01 admin resume by root"
    assert len(clean_who("x" * 1000)) == 200
