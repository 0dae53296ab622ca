"""Tier agents: one per tier topic. They validate the retry headers and park the message in the state table.

Parking (not sleeping) is what keeps a tier partition flowing: a record is read as soon as it arrives, whatever its
due time, and the timer releases it later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from agents.attempt import dead_letter
from agents.records import header_pairs
from app.runtime import Runtime
from rebound.errors import InvalidRetryHeadersError, KeyBacklogFullError
from rebound.headers import Provenance, RetryHeaders, parse_retry_headers, without_rebound_headers
from rebound.policy import parse_duration_ms
from rebound.routing import Reason
from rebound.schedule import Slot
from rebound.state import PendingMessage, table_key
from rebound.topics import RETRY_INFIX

log = logging.getLogger(__name__)
CLOCK_SKEW_TOLERANCE_MS = 60_000
STATE_ERROR_CHARS = 256  # the full message travels in the record's headers; the state keeps it short


def validate_against_tier(parsed: RetryHeaders, *, tier_topic: str, group: str, record_timestamp_ms: int) -> None:
    """Checks that need the tier itself: the main topic and delay must match the topic the record arrived on."""
    main, _, label = tier_topic.partition(RETRY_INFIX)
    if parsed.provenance.topic != main:
        raise InvalidRetryHeadersError(f"original topic {parsed.provenance.topic!r} does not own tier {tier_topic!r}")
    if parsed.group != group:
        raise InvalidRetryHeadersError(f"group {parsed.group!r} is not this application's {group!r}")
    delay = parse_duration_ms(label, variable="tier topic")
    if record_timestamp_ms and parsed.due_at_ms > record_timestamp_ms + delay + CLOCK_SKEW_TOLERANCE_MS:
        raise InvalidRetryHeadersError(
            f"due time {parsed.due_at_ms} is further than the tier's {label} after the record's timestamp"
        )


def register_tier_agent(runtime: Runtime, topic_name: str) -> Any:
    async def tier_agent(stream: Any) -> None:
        async for event in stream.events():
            await handle_tier_record(runtime, event.message, topic_name)

    topic = runtime.tier_topics[topic_name]
    return runtime.app.agent(topic, name=f"rebound.tier.{topic_name}", concurrency=1)(tier_agent)


@dataclass(frozen=True)
class TierRecord:
    """A record read from a tier topic, with what a rejection needs to send it on byte-exact."""

    message: Any
    topic_name: str
    headers: list[tuple[str, bytes]]

    @property
    def main_topic(self) -> str:
        return self.topic_name.partition(RETRY_INFIX)[0]

    @property
    def label(self) -> str:
        return self.topic_name.partition(RETRY_INFIX)[2]

    @property
    def timestamp_ms(self) -> int:
        return max(0, int(self.message.timestamp * 1000)) if self.message.timestamp else 0


async def handle_tier_record(runtime: Runtime, message: Any, topic_name: str) -> None:
    record = TierRecord(message, topic_name, header_pairs(message.headers))
    runtime.counters[f"tier.{record.label}.received"] += 1
    try:
        parsed = parse_retry_headers(record.headers, main_topics=runtime.settings.topics)
        validate_against_tier(
            parsed, tier_topic=topic_name, group=runtime.group, record_timestamp_ms=record.timestamp_ms
        )
    except InvalidRetryHeadersError as exc:
        log.warning("invalid retry headers on %s[%d]@%d: %s", topic_name, message.partition, message.offset, exc)
        # Nothing in the headers can be trusted, so the provenance is the tier record itself.
        itself = Provenance(topic_name, message.partition, message.offset, record.timestamp_ms, runtime.clock())
        await reject(runtime, record, Reason.INVALID_RETRY_HEADERS, itself, 0, type(exc).__name__, str(exc))
        return
    if parsed.provenance.partition % runtime.partitions != message.partition:
        text = f"original partition {parsed.provenance.partition} does not map to tier partition {message.partition}"
        itself = Provenance(topic_name, message.partition, message.offset, record.timestamp_ms, runtime.clock())
        await reject(runtime, record, Reason.INVALID_RETRY_HEADERS, itself, 0, "InvalidRetryHeadersError", text)
        return
    try:
        park(runtime, message, record.headers, parsed, topic_name, record.label)
        await runtime.store.confirm()
    except KeyBacklogFullError as exc:
        text = f"{parsed.error_message} ({exc})"
        await reject(
            runtime, record, Reason.KEY_BACKLOG_FULL, parsed.provenance, parsed.attempt, parsed.error_class, text
        )
    except Exception as exc:
        log.exception("could not park %s[%d]@%d", topic_name, message.partition, message.offset)
        await reject(runtime, record, "internal-error", parsed.provenance, parsed.attempt, type(exc).__name__, str(exc))


async def reject(
    runtime: Runtime,
    record: TierRecord,
    reason: Reason | str,
    provenance: Provenance,
    attempt: int,
    error_class: str,
    error_message: str,
) -> None:
    await dead_letter(
        runtime,
        main_topic=record.main_topic,
        key=record.message.key,
        value=record.message.value,
        headers=record.headers,
        provenance=provenance,
        attempt=attempt,
        tier=record.label,
        reason=reason,
        error_class=error_class,
        error_message=error_message,
    )


def park(
    runtime: Runtime,
    message: Any,
    headers: list[tuple[str, bytes]],
    parsed: RetryHeaders,
    topic_name: str,
    label: str,
) -> bool:
    """Write the message into the state table and the release schedule; False if it was already parked."""
    entry = PendingMessage(
        origin=PendingMessage.origin_of(parsed.provenance),
        key=message.key,
        value=message.value,
        headers=tuple(without_rebound_headers(headers)),
        provenance=parsed.provenance,
        attempt=parsed.attempt,
        tier=label,
        tier_topic=topic_name,
        partition=message.partition,
        due_at_ms=parsed.due_at_ms,
        parked_at_ms=runtime.clock(),
        error_class=parsed.error_class,
        error_message=parsed.error_message[:STATE_ERROR_CHARS],
        value_size=None if message.value is None else len(message.value),
    )
    key = table_key(message.key, parsed.provenance)
    before = runtime.store.load(key, with_payloads=False)
    if len(before.pending) >= runtime.settings.max_pending_per_key and before.find(entry.origin) is None:
        raise KeyBacklogFullError(
            f"key already has {len(before.pending)} parked messages (REBOUND_MAX_PENDING_PER_KEY)"
        )
    state, changed = before.park(entry)
    if not changed:
        runtime.counters["tier.duplicates"] += 1
        current = before.find(entry.origin)
        if current is not None and current.attempt == entry.attempt:
            runtime.store.repair_payload(key, entry)
        return False
    runtime.store.save(key, before, state)
    runtime.schedule.add(message.partition, Slot(entry.due_at_ms, key, entry.origin, entry.attempt, label))
    runtime.release_wakeup.set()
    runtime.counters["parked"] += 1
    return True
