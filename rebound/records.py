"""Records Rebound produces, and whether they fit: decided up front, before anything is sent.

A record that fits its main topic can stop fitting once Rebound adds its headers (a tier forward), or once it is
stored with its key twice (the parked payload's changelog record). Sending it anyway fails on every try, and a
changelog record that cannot be produced stops Faust's producer buffer for the whole worker. So every producing path
asks :func:`fits` first, with the same upper bound the producer itself applies (aiokafka's
``DefaultRecordBatchBuilder.estimate_size_in_bytes``), and routes what does not fit as ``too-large``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rebound.headers import NULL_VALUE, Header

# aiokafka's DefaultRecordBatchBuilder: the v2 batch header, and the most a single record's framing can add.
BATCH_HEADER_BYTES = 61
MAX_RECORD_OVERHEAD = 21


def _varint_size(value: int) -> int:
    """Bytes of a zig-zag varint, as the Kafka record format writes lengths."""
    value = (value << 1) ^ (value >> 63)
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size


def _field_size(data: bytes | None) -> int:
    return 1 if data is None else _varint_size(len(data)) + len(data)


def estimated_record_bytes(key: bytes | None, value: bytes | None, headers: Sequence[Header]) -> int:
    """Upper bound of the bytes one record takes in a produce request: what the producer compares with its limit."""
    size = _field_size(key) + _field_size(value) + _varint_size(len(headers))
    for name, header_value in headers:
        size += _field_size(name.encode("utf-8")) + _field_size(header_value)
    return BATCH_HEADER_BYTES + MAX_RECORD_OVERHEAD + size


def plain_record_bytes(key_size: int, value_size: int) -> int:
    """:func:`estimated_record_bytes` of a record with a key and a value of these lengths and no headers, without the
    bytes themselves (a value being built)."""
    return (
        BATCH_HEADER_BYTES
        + MAX_RECORD_OVERHEAD
        + _varint_size(key_size)
        + key_size
        + _varint_size(value_size)
        + value_size
        + 1
    )


def producible(key: bytes | None, value: bytes | None, headers: Sequence[Header]) -> tuple[bytes | None, list[Header]]:
    """Value and headers to actually send: a record with neither key nor value cannot be produced.

    aiokafka asserts against it before any Kafka error could be raised, so resending would loop for ever; the value
    becomes an empty one with ``rebound.null-value: 1``, which :func:`rebound.headers.restore_null_value` undoes.
    """
    if key is None and value is None:
        return b"", [*headers, (NULL_VALUE, b"1")]
    return value, list(headers)


def fits(key: bytes | None, value: bytes | None, headers: Sequence[Header], limit: int) -> bool:
    return estimated_record_bytes(key, *producible(key, value, headers)) <= limit


@dataclass(frozen=True, slots=True)
class OutgoingRecord:
    """What to produce; the topic and partition are the caller's."""

    key: bytes | None
    value: bytes | None
    headers: tuple[Header, ...]

    @property
    def size(self) -> int:
        return estimated_record_bytes(self.key, *producible(self.key, self.value, self.headers))

    def fits(self, limit: int) -> bool:
        return self.size <= limit
