"""The bytes of ``bare_retry``'s table entries and release requests: pure, no Faust (unit-tested on their own).

An entry is what the tier agent parks under the message key: the due time (epoch ms), the record's headers and its
value (``None`` kept apart from ``b""``). A release request record carries the keys of up to a batch of due entries
of one partition, each length-prefixed.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

_HEAD = struct.Struct(">qH")  # due ms, header count
_HEADER = struct.Struct(">HI")  # name length, value length
_LENGTH = struct.Struct(">i")  # value length, -1 for None
_KEY = struct.Struct(">I")

Headers = Sequence[tuple[str, bytes]]


def encode_entry(due_ms: int, value: bytes | None, headers: Headers = ()) -> bytes:
    parts = [_HEAD.pack(due_ms, len(headers))]
    for name, raw in headers:
        encoded = name.encode()
        parts += [_HEADER.pack(len(encoded), len(raw)), encoded, raw]
    parts.append(_LENGTH.pack(-1 if value is None else len(value)))
    if value is not None:
        parts.append(value)
    return b"".join(parts)


def decode_entry(data: bytes) -> tuple[int, bytes | None, list[tuple[str, bytes]]]:
    """(due ms, value, headers) of :func:`encode_entry`'s bytes."""
    due_ms, count = _HEAD.unpack_from(data)
    at = _HEAD.size
    headers = []
    for _ in range(count):
        name_length, value_length = _HEADER.unpack_from(data, at)
        at += _HEADER.size
        name = data[at : at + name_length].decode()
        at += name_length
        headers.append((name, data[at : at + value_length]))
        at += value_length
    (length,) = _LENGTH.unpack_from(data, at)
    at += _LENGTH.size
    return due_ms, None if length < 0 else data[at : at + length], headers


def encode_keys(keys: Iterable[bytes]) -> bytes:
    return b"".join(_KEY.pack(len(key)) + key for key in keys)


def decode_keys(data: bytes) -> list[bytes]:
    keys, at = [], 0
    while at < len(data):
        (length,) = _KEY.unpack_from(data, at)
        at += _KEY.size
        keys.append(data[at : at + length])
        at += length
    return keys


def batches(keys: Sequence[bytes], size: int) -> list[Sequence[bytes]]:
    """``keys`` in order, ``size`` (at least 1) to a batch."""
    size = max(1, size)
    return [keys[at : at + size] for at in range(0, len(keys), size)]
