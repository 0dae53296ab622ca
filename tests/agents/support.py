"""Helpers that more than one agent test module uses: tier records' headers, and changelog writes held until the test
acknowledges them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import faust.events
import pytest

from agents.runtime import Runtime
from rebound import headers as h


def tier_headers(clock: Any, *, attempt: int = 1, due_in_ms: int = 1000, **overrides: bytes) -> list[tuple[str, bytes]]:
    """A tier record's headers as a worker writes them (``items`` partition 0, offset 7), due ``due_in_ms`` after the
    clock's now; ``overrides`` replace headers by name."""
    provenance = h.Provenance("items", 0, 7, clock.now_ms - 10, clock.now_ms - 5)
    pairs = h.retry_headers(
        [("trace-id", b"abc")],
        provenance=provenance,
        group="agent-test",
        attempt=attempt,
        due_at_ms=clock.now_ms + due_in_ms,
        error_class="rebound.errors.RetryableError",
        error_message="not yet",
    )
    replaced = dict(pairs)
    replaced.update(overrides)
    return list(replaced.items())


class HeldChangelog:
    """A changelog topic's ``send_soon`` whose records are acknowledged only when the test says so."""

    def __init__(self, timeline: list[tuple[str, Any]]) -> None:
        self.timeline = timeline
        self.pending: list[tuple[bytes, Any]] = []

    def send_soon(self, *, key: Any, value: Any, partition: Any, **_: Any) -> Any:
        future: Any = asyncio.get_running_loop().create_future()
        future.message = SimpleNamespace(partition=0 if partition is None else partition)
        self.pending.append((key, future))
        self.timeline.append(("written", (key, value)))
        return future

    def acknowledge_all(self) -> int:
        pending, self.pending = self.pending, []
        for key, future in pending:
            self.timeline.append(("durable", key))
            future.set_result(None)
        return len(pending)


def hold_changelogs_and_record_acks(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[tuple[str, Any]], HeldChangelog]:
    """Both tables' changelog writes held until the test acknowledges them, and every event's ack recorded in the
    same timeline, so a test can say what was acknowledged before what became durable."""
    runtime.store.confirm_writes = True
    timeline: list[tuple[str, Any]] = []
    changelog = HeldChangelog(timeline)
    monkeypatch.setattr(runtime.store.states.changelog_topic, "send_soon", changelog.send_soon)
    monkeypatch.setattr(runtime.store.payloads.changelog_topic, "send_soon", changelog.send_soon)
    ack = faust.events.Event.ack

    def recording_ack(self: Any) -> Any:
        timeline.append(("acked", self.message.offset))
        return ack(self)

    monkeypatch.setattr(faust.events.Event, "ack", recording_ack)
    return timeline, changelog
