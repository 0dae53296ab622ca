"""Attempt events: deterministic ids and a lossless JSON form."""

from __future__ import annotations

import json

import pytest

from rebound.attempts import AttemptEvent, Outcome, event_id, key_text

ID_ARGS = ("rebound", "items", 0, 42, 1, "scheduled")


def make_event(**overrides) -> AttemptEvent:
    fields = {
        "event_id": event_id(*ID_ARGS),
        "group": "rebound",
        "key": "item-1",
        "original_topic": "items",
        "original_partition": 0,
        "original_offset": 42,
        "attempt": 1,
        "tier": "5m",
        "outcome": "scheduled",
        "reason": None,
        "error_class": "app.errors.RetryableError",
        "error_message": "pas encore là ✓",
        "first_received_at": 1_700_000_000_000,
        "due_at": 1_700_000_300_000,
        "event_time": 1_700_000_000_005,
        "next_tier": "5m",
    }
    fields.update(overrides)
    return AttemptEvent(**fields)


def test_event_id_is_deterministic() -> None:
    assert event_id(*ID_ARGS) == event_id(*ID_ARGS)
    assert len(event_id(*ID_ARGS)) == 32
    int(event_id(*ID_ARGS), 16)  # hex


@pytest.mark.parametrize(
    "changed",
    [
        ("other", "items", 0, 42, 1, "scheduled"),
        ("rebound", "orders", 0, 42, 1, "scheduled"),
        ("rebound", "items", 1, 42, 1, "scheduled"),
        ("rebound", "items", 0, 43, 1, "scheduled"),
        ("rebound", "items", 0, 42, 2, "scheduled"),
        ("rebound", "items", 0, 42, 1, "dead"),
        ("rebound", "items", 0, 42, 1, "succeeded"),
    ],
)
def test_event_id_differs_by_identity(changed) -> None:
    assert event_id(*changed) != event_id(*ID_ARGS)


def test_event_id_fields_cannot_run_together() -> None:
    assert event_id("a", "b1", 2, 3, 4, "dead") != event_id("ab", "1", 2, 3, 4, "dead")
    assert event_id("g", "t", 1, 23, 4, "dead") != event_id("g", "t", 12, 3, 4, "dead")


def test_every_outcome_gets_its_own_id() -> None:
    ids = {event_id("rebound", "items", 0, 42, 1, outcome) for outcome in Outcome}
    assert len(ids) == len(Outcome) == 5
    assert {outcome.value for outcome in Outcome} == {"succeeded", "scheduled", "dead", "expired", "held"}


def test_json_round_trip() -> None:
    event = make_event()
    raw = event.to_json()
    assert AttemptEvent.from_json(raw) == event
    data = json.loads(raw)
    assert data["error_message"] == "pas encore là ✓"
    assert "pas encore là ✓".encode() in raw  # UTF-8, not \u escapes
    assert data["next_tier"] == "5m"


def test_json_round_trip_with_nulls() -> None:
    event = make_event(key=None, tier=None, reason=None, error_class=None, error_message=None, due_at=None)
    restored = AttemptEvent.from_json(event.to_json())
    assert restored == event
    assert restored.key is None


def test_from_json_tolerates_missing_and_unknown_fields() -> None:
    data = json.loads(make_event().to_json())
    del data["next_tier"]
    data["added_in_a_later_version"] = 1
    restored = AttemptEvent.from_json(json.dumps(data).encode())
    assert restored.next_tier is None
    assert restored.attempt == 1


def test_key_text() -> None:
    assert key_text(None) is None
    assert key_text(b"item-1") == "item-1"
    assert key_text(b"\xffab") == "\\xffab"
