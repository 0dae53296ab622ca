"""The attempt event: one small JSON record per outcome, produced to ``<app id>.attempts``.

It is the contract with the data pipeline (``pipeline/``), so its fields only ever grow. The event id is derived from
what identifies the outcome (group, original record, attempt, outcome), so an outcome re-emitted after a crash has
the same id and the pipeline's de-duplication removes it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any


class Outcome(StrEnum):
    SUCCEEDED = "succeeded"
    SCHEDULED = "scheduled"
    DEAD = "dead"
    EXPIRED = "expired"
    HELD = "held"
    """Key-ordered mode: the message waits behind its key's blocking message (it has not run yet)."""


@dataclass(frozen=True, slots=True)
class AttemptEvent:
    event_id: str
    group: str
    key: str | None
    original_topic: str
    original_partition: int
    original_offset: int
    attempt: int
    tier: str | None
    outcome: str
    reason: str | None
    error_class: str | None
    error_message: str | None
    first_received_at: int
    due_at: int | None
    event_time: int
    next_tier: str | None = None

    def to_json(self) -> bytes:
        # Every field is a scalar: ``dataclasses.asdict`` would deep-copy each one, on the path of every message.
        values = {name: getattr(self, name) for name in _FIELD_NAMES}
        return _ENCODER.encode(values).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes) -> AttemptEvent:
        data: dict[str, Any] = json.loads(raw)
        fields: dict[str, Any] = {name: data.get(name) for name in cls.__dataclass_fields__}
        return cls(**fields)


_FIELD_NAMES = tuple(field.name for field in fields(AttemptEvent))
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def event_id(group: str, topic: str, partition: int, offset: int, attempt: int, outcome: str) -> str:
    identity = f"{group}\x00{topic}\x00{partition}\x00{offset}\x00{attempt}\x00{outcome}"
    return hashlib.blake2b(identity.encode("utf-8"), digest_size=16).hexdigest()


def key_text(key: bytes | None) -> str | None:
    """Keys are bytes; events and views show them as text without ever failing on non-UTF-8 keys."""
    return None if key is None else key.decode("utf-8", errors="backslashreplace")
