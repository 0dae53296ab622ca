"""Reading what Faust hands an agent: headers in one shape, provenance of a first delivery."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rebound.headers import Header, Provenance
from rebound.state import escaped_key, null_key_of


def header_pairs(raw: Any) -> list[Header]:
    """Faust gives headers as a list of pairs or a mapping depending on the path; normalise to pairs.

    A null value stays ``None``: Kafka tells it from an empty one, and every hop writes it back as it came.
    """
    if not raw:
        return []
    items = raw.items() if isinstance(raw, Mapping) else raw
    pairs: list[Header] = []
    for name, value in items:
        text = name.decode("utf-8", errors="replace") if isinstance(name, bytes) else str(name)
        pairs.append((text, value if isinstance(value, bytes) or value is None else str(value).encode()))
    return pairs


def first_provenance(message: Any, received_at_ms: int) -> Provenance:
    timestamp = message.timestamp
    return Provenance(
        topic=message.topic,
        partition=message.partition,
        offset=message.offset,
        timestamp_ms=max(0, int(timestamp * 1000)) if timestamp else 0,
        first_received_at_ms=received_at_ms,
    )


def lane_of(message: Any) -> tuple[int, bytes]:
    """The dispatcher lane of a record: its partition and its key as the state table stores it.

    A main-topic record and the release requests of its retries (keyed by that table key, on the co-partitioned
    release topic) share a lane, so one key's first tries and retries never run at once. A null-keyed record has no
    key to share order with: it gets a lane of its own, like its own table key.
    """
    key = message.key
    if key is None:
        return message.partition, null_key_of(message.topic, message.partition, message.offset)
    return message.partition, escaped_key(key)


def release_lane(message: Any) -> tuple[int, bytes]:
    """The lane of a release request: its key is already the table key."""
    return message.partition, message.key
