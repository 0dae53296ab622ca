"""The records Rebound sends itself to make a worker act: release requests and admin commands.

Both travel on internal topics keyed by the message's table key, so they reach the worker that owns its partition
of the state table: release requests from the release timer to the release agent (``<app id>.release``), admin
commands from a web request to the admin agent (``<app id>.admin``). Their JSON is read by whichever version of
Rebound the owning worker runs, so it changes only compatibly. The other formats live beside these: the retry
headers in ``rebound/headers.py``, the state table's values in ``rebound/state.py``, the pause records in
``rebound/pause.py``, the status summaries in ``rebound/summary.py``.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

ACTIONS = ("dead-letter", "retry-now", "unblock")
"""The per-key admin actions (``POST /retry/admin/keys/{key}/<action>``)."""


@dataclass(frozen=True)
class ReleaseRequest:
    """Run ``attempt`` of the parked message ``origin`` if it is still parked and due (the release agent checks)."""

    origin: str
    attempt: int
    number: int | None = None
    """The send's number on its partition (``ReleaseSchedule.received``), ``n`` on the wire; None for none."""

    def to_json(self) -> bytes:
        request: dict[str, Any] = {"origin": self.origin, "attempt": self.attempt}
        if self.number is not None:
            request["n"] = self.number
        return json.dumps(request).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ReleaseRequest:
        """Raises ``ValueError`` for anything but a request: the agent logs it and goes on."""
        try:
            request = json.loads(raw)
            number = request.get("n")
            return cls(str(request["origin"]), int(request["attempt"]), None if number is None else int(number))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a release request: {exc!r}") from exc


@dataclass(frozen=True)
class AdminCommand:
    """An operator's action on one key, with the id its answer is matched by."""

    command_id: str
    action: str
    key: bytes
    requested_by: str = ""
    requested_at: int = 0

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "id": self.command_id,
                "action": self.action,
                "key": base64.b64encode(self.key).decode("ascii"),
                "requested_by": self.requested_by,
                "requested_at": self.requested_at,
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> AdminCommand:
        data = json.loads(raw)
        action = str(data["action"])
        if action not in ACTIONS:
            raise ValueError(f"unknown admin action {action!r}")
        return cls(
            command_id=str(data["id"]),
            action=action,
            key=base64.b64decode(data["key"]),
            requested_by=str(data.get("requested_by", "")),
            requested_at=int(data.get("requested_at", 0)),
        )
