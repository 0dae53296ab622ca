"""A handler for the header tests: writes each call's headers exactly (a null stays ``null``, bytes as base64) to
``$HEADER_CALLS`` (JSON lines), then behaves as :mod:`tests.scripted_handler` says."""

from __future__ import annotations

import base64
import json
import os

from rebound.event import RetryEvent
from tests.scripted_handler import handle as scripted

CALLS_ENV = "HEADER_CALLS"


def header_text(value: bytes | None) -> str | None:
    """A header value as JSON can say it: base64 text, or None for a null value (never confused with ``b""``)."""
    return None if value is None else base64.b64encode(value).decode("ascii")


async def handle(event: RetryEvent) -> None:
    path = os.environ.get(CALLS_ENV)
    if path:
        line = {
            "key": None if event.key is None else event.key.decode("utf-8", "replace"),
            "attempt": event.attempt,
            "headers": [[name, header_text(value)] for name, value in event.headers.items()],
        }
        with open(path, "a", encoding="utf-8") as calls:
            calls.write(json.dumps(line) + "\n")
    await scripted(event)
