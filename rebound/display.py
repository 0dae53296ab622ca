"""How keys and times are shown to a person: the command line's output and the admin audit log lines (pure).

A key comes from a record anyone can produce: shown as text, every character that is not printable is escaped
(``\\x1b``, ``\\u2028``), so no key can drive a terminal or split a log line, and a key its text does not name
(:func:`rebound.key_names.needs_base64`: not UTF-8, control characters, ``.``) is followed by the base64 to name it
back with (``--key-encoding base64``, ``?key_encoding=base64``). A time is UTC in ISO 8601 to the second.

The admin audit lines (``agents/admin.py``, ``app/web/admin.py``, ``app/replay.py``) name a key with
:func:`logged_key` and a time with :func:`utc_time`, one way for every action.
"""

from __future__ import annotations

import time

from rebound.attempts import key_text
from rebound.key_names import base64_of_key, needs_base64


def printable(text: str) -> str:
    """``text`` with each character that is not printable escaped as Python writes it (``\\x1b``, ``\\t``)."""
    return "".join(char if char.isprintable() else ascii(char)[1:-1] for char in text)


def key_label(text: str, base64: str | None = None) -> str:
    """A key as a person reads it: its text (non-printable characters escaped), and ``(base64 ...)`` when given."""
    shown = printable(text)
    return f"{shown} (base64 {base64})" if base64 else shown


def logged_key(key: bytes | None) -> str:
    """A key in an audit line: its text in quotes (escaped as :func:`key_label`), with its base64 when its text does
    not name it: ``'item-42'``, ``'retry-\\xff' (base64 cmV0cnkt_w==)``; ``None`` for a null key."""
    if key is None:
        return "None"
    return key_label(f"'{key_text(key)}'", base64_of_key(key) if needs_base64(key) else None)


def utc_time(ms: int) -> str:
    """``2025-05-01T10:00:00Z``: epoch milliseconds in UTC, to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))
