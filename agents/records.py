"""Reading what Faust hands an agent: headers in one shape, provenance of a first delivery."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rebound.headers import Provenance


def header_pairs(raw: Any) -> list[tuple[str, bytes]]:
    """Faust gives headers as a list of pairs or a mapping depending on the path; normalise to pairs."""
    if not raw:
        return []
    items = raw.items() if isinstance(raw, Mapping) else raw
    pairs = []
    for name, value in items:
        text = name.decode("utf-8", errors="replace") if isinstance(name, bytes) else str(name)
        pairs.append((text, value if isinstance(value, bytes) else (b"" if value is None else str(value).encode())))
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
