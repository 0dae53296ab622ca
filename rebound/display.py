"""How keys and times are shown to a person: the command line's output and the admin audit log lines (pure).

A key comes from a record anyone can produce: shown as text, every character that is not printable is escaped
(``\\x1b``, ``\\u2028``), so no key can drive a terminal or split a log line, and a key its text does not name
(:func:`rebound.key_names.needs_base64`: not UTF-8, control characters, ``.``) is followed by the base64 to name it
back with (``--key-encoding base64``, ``?key_encoding=base64``). A time is UTC in ISO 8601 to the second, and the
number as it came when it is no time of the years 1 to 9999 (a command's field is written by whoever wrote the record).

The admin audit lines (``agents/admin.py``, ``app/web/admin.py``, ``app/replay.py``) name a key with
:func:`logged_key` and a time with :func:`utc_time`, one way for every action.
"""

from __future__ import annotations

import datetime

from rebound.key_names import base64_of_key, needs_base64


def printable(text: str) -> str:
    """``text`` with each character that is not printable escaped as Python writes it (``\\x1b``, ``\\t``)."""
    return "".join(char if char.isprintable() else ascii(char)[1:-1] for char in text)


def key_label(text: str, base64: str | None = None) -> str:
    """A key as a person reads it: its text (non-printable characters escaped), and ``(base64 ...)`` when given."""
    shown = printable(text)
    return f"{shown} (base64 {base64})" if base64 else shown


def logged_key(key: bytes | None) -> str:
    """A key in an audit line: its text in quotes, with its base64 when the text alone does not name it (not UTF-8,
    control characters, ``.``: :func:`rebound.key_names.needs_base64`; or any character :func:`printable` escapes:
    ``U+00A0``, ``U+200B``, ``U+2028``): ``'item-42'``, ``'retry-\\xff' (base64 cmV0cnkt_w==)``; ``None`` for a null
    key. Quoted as Python quotes: ``\\`` and ``'`` are escaped too (``'it\\'s'``), so a key holding
    ``' (base64 ...)`` cannot pass for another key, and a byte that is not UTF-8 is ``\\xff``."""
    if key is None:
        return "None"
    text = key.decode("utf-8", errors="surrogateescape")
    shown = "".join(_QUOTED.get(char) or _escaped(char) for char in text)
    base64 = needs_base64(key) or printable(text) != text
    return key_label(f"'{shown}'", base64_of_key(key) if base64 else None)


_QUOTED = {"\\": "\\\\", "'": "\\'"}


def _escaped(char: str) -> str:
    if "\udc80" <= char <= "\udcff":  # a byte that is not UTF-8 (surrogateescape)
        return f"\\x{ord(char) - 0xDC00:02x}"
    return printable(char)


_EPOCH = datetime.datetime(1970, 1, 1)


def utc_time(ms: int) -> str:
    """``2025-05-01T10:00:00Z``: epoch milliseconds in UTC, to the second (rounded down). Never raises: a value
    outside the years 1 to 9999 (or no number) is shown as it is, escaped as :func:`printable`."""
    try:
        return (_EPOCH + datetime.timedelta(milliseconds=ms)).isoformat(timespec="seconds") + "Z"
    except (OverflowError, ValueError, TypeError):
        return printable(str(ms))
