"""The operator's pause of the main topics: the control record that carries it, and who asked when.

The record lives on the one partition of ``<app id>.control`` (compacted, no time-based deletion) under
:data:`CONTROL_KEY`; every worker reads that partition from the beginning with a group-less consumer, so the latest
record is the cluster's state, for workers started later too and across restarts, however long the cluster stops. Pure (no Faust, no Kafka), so it is unit-tested alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CONTROL_KEY = b"rebound.control/main-topics"
CONTROL_PARTITION = 0
CONTROL_TYPE = "main-topics"
MAX_WHO_CHARS = 200


def clean_who(text: str | None) -> str:
    """An operator's name as given (header or address), printable and bounded, for the state and the audit log."""
    cleaned = "".join(ch for ch in (text or "") if ch.isprintable()).strip()
    return cleaned[:MAX_WHO_CHARS]


@dataclass(frozen=True, slots=True)
class PauseState:
    """Whether the main topics are paused, and the action that made it so (``at_ms`` 0: nobody ever acted)."""

    paused: bool
    by: str = ""
    source: str = ""
    at_ms: int = 0
    action_id: str = ""
    written_at_ms: int = 0
    """When this record was written (``at_ms``; records of an earlier version could be later copies of an action)."""

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "type": CONTROL_TYPE,
                "v": 1,
                "paused": self.paused,
                "by": self.by,
                "source": self.source,
                "at": self.at_ms,
                "id": self.action_id,
                "written_at": self.written_at_ms or self.at_ms,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes | None) -> PauseState:
        """Raises ``ValueError`` on anything that is not a control record of this kind."""
        if raw is None:
            raise ValueError("empty control record")
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("type") != CONTROL_TYPE:
            raise ValueError("not a main-topics control record")
        paused = data.get("paused")
        if not isinstance(paused, bool):
            raise ValueError("control record without a boolean 'paused'")
        at_ms = int(data.get("at") or 0)
        return cls(
            paused=paused,
            by=clean_who(str(data.get("by") or "")),
            source=clean_who(str(data.get("source") or "")),
            at_ms=at_ms,
            action_id=str(data.get("id") or "")[:64],
            written_at_ms=int(data.get("written_at") or at_ms),
        )

    def same_action(self, other: PauseState) -> bool:
        """A copy of a record (same action id and time) is the same action, not a new one."""
        return (self.paused, self.action_id, self.at_ms) == (other.paused, other.action_id, other.at_ms)

    def to_view(self) -> dict[str, Any]:
        return {
            "paused": self.paused,
            "by": self.by or None,
            "source": self.source or None,
            "at": self.at_ms or None,
        }


NOT_PAUSED = PauseState(paused=False)


def describe_who(operator: str | None, remote: str | None) -> tuple[str, str]:
    """``(by, source)``: the name the operator gave (``X-Rebound-Operator``), else the address the request came from."""
    source = clean_who(remote) or "?"
    by = clean_who(operator) or source
    return by, source
