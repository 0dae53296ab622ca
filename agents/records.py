"""Reading what Faust hands an agent: headers in one shape, provenance of a first delivery."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
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


async def handled_events(stream: Any) -> AsyncIterator[Any]:
    """The stream's events, each acked only once the loop body has finished with it.

    Faust acks an event when its iteration ends, however it ends: a worker stopping or a rebalance cancels the agent
    in the middle of a forward, and the stream's ``finally`` acks the event anyway, so its offset is committed with
    the forward never made. Here the stream runs without acks and this generator acks after the body returns to
    it; a body that is cancelled or raises never comes back, and the offset stays for the next owner to redo.
    """
    manual = stream.noack()
    async for event in manual.events():
        yield event
        await manual.ack(event)
