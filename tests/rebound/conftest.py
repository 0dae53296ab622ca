"""Small factories for the pure-core unit tests: provenance, parked messages and a fake clock."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from rebound.headers import Provenance
from rebound.state import PendingMessage

T0 = 1_700_000_000_000  # a fixed epoch-ms "now" for every test


class FakeClock:
    """A mutable epoch-ms clock; the only time source the code under test gets."""

    def __init__(self, now_ms: int = T0) -> None:
        self.now_ms = now_ms
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_provenance() -> Callable[..., Provenance]:
    def factory(**overrides: Any) -> Provenance:
        fields: dict[str, Any] = {
            "topic": "items",
            "partition": 0,
            "offset": 42,
            "timestamp_ms": T0 - 1_000,
            "first_received_at_ms": T0,
        }
        fields.update(overrides)
        return Provenance(**fields)

    return factory


@pytest.fixture
def make_pending(make_provenance: Callable[..., Provenance]) -> Callable[..., PendingMessage]:
    def factory(*, offset: int = 42, attempt: int = 1, **overrides: Any) -> PendingMessage:
        provenance = overrides.pop("provenance", None) or make_provenance(offset=offset)
        fields: dict[str, Any] = {
            "origin": PendingMessage.origin_of(provenance),
            "key": b"item-1",
            "value": b'{"type":"UpdateItem"}',
            "headers": (("trace-id", b"abc"),),
            "provenance": provenance,
            "attempt": attempt,
            "tier": "5m",
            "tier_topic": "items.retry.5m",
            "partition": provenance.partition,
            "due_at_ms": T0 + 300_000 * attempt,
            "parked_at_ms": T0,
            "error_class": "app.errors.RetryableError",
            "error_message": f"item missing (attempt {attempt})",
        }
        fields.update(overrides)
        value = fields["value"]
        fields.setdefault("value_size", None if value is None else len(value))
        return PendingMessage(**fields)

    return factory


@pytest.fixture
def t0() -> int:
    """The epoch-ms instant the fake clock starts at and the factories are built around."""
    return T0
