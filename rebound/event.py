"""What a handler receives: the original record plus where it stands in its retry policy."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RetryEvent:
    """One delivery of a record to the handler.

    ``topic``, ``partition`` and ``offset`` always describe the original record on the main topic, also on retries,
    so a handler can use them as an idempotency key: delivery is at-least-once.
    """

    key: bytes | None
    value: bytes | None
    headers: Mapping[str, bytes | None]
    """The record's headers by name (the last value of a repeated name); a header sent with a null value (legal in
    Kafka, and what Java producers send for ``null``) is ``None``, an empty one ``b""``."""
    topic: str
    partition: int
    offset: int
    attempt: int
    timestamp_ms: int = 0
    first_received_at_ms: int = 0
    tier: str | None = None
    extra: Mapping[str, object] = field(default_factory=dict)
    header_list: tuple[tuple[str, bytes | None], ...] = ()
    """Every header of the record in its order, repeated names included (Kafka allows both): what the HTTP push
    handler sends (``Rebound-Header-List``), since ``headers`` keeps only a name's last value. Empty when the event
    was built without it: then ``headers`` is all there is."""


Handler = Callable[[RetryEvent], Awaitable[object]]
