"""Tier agents: one per tier topic. They validate the retry headers and park the message in the state table.

Parking (not sleeping) is what keeps a tier partition flowing: a record is read as soon as it arrives, whatever its
due time, and the timer releases it later.
"""

from __future__ import annotations

import logging
from typing import Any

from agents.attempt import dead_letter
from agents.records import header_pairs
from app.runtime import Runtime
from rebound.errors import InvalidRetryHeadersError, KeyBacklogFullError
from rebound.headers import Provenance, RetryHeaders, parse_retry_headers
from rebound.policy import parse_duration_ms
from rebound.routing import Reason
from rebound.schedule import Slot
from rebound.state import PendingMessage, table_key
from rebound.topics import RETRY_INFIX

log = logging.getLogger(__name__)
CLOCK_SKEW_TOLERANCE_MS = 60_000


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
    topic = runtime.tier_topics[topic_name]
    main_topic = topic_name.partition(RETRY_INFIX)[0]
    label = topic_name.partition(RETRY_INFIX)[2]

    async def tier_agent(stream: Any) -> None:
        async for event in stream.events():
            message = event.message
            headers = header_pairs(message.headers)
            runtime.counters[f"tier.{label}.received"] += 1
            timestamp_ms = int(message.timestamp * 1000) if message.timestamp else 0
            try:
                parsed = parse_retry_headers(headers, main_topics=runtime.settings.topics)
                validate_against_tier(
                    parsed, tier_topic=topic_name, group=runtime.group, record_timestamp_ms=timestamp_ms
                )
            except InvalidRetryHeadersError as exc:
                log.warning(
                    "invalid retry headers on %s[%d]@%d: %s", topic_name, message.partition, message.offset, exc
                )
                await dead_letter(
                    runtime,
                    main_topic=main_topic,
                    key=message.key,
                    value=message.value,
                    headers=headers,
                    provenance=Provenance(
                        topic=topic_name,
                        partition=message.partition,
                        offset=message.offset,
                        timestamp_ms=timestamp_ms,
                        first_received_at_ms=runtime.clock(),
                    ),
                    attempt=0,
                    tier=label,
                    reason=Reason.INVALID_RETRY_HEADERS,
                    error_class=type(exc).__name__,
                    error_message=str(exc),
                )
                continue
            try:
                park(runtime, message, headers, parsed, topic_name, label)
            except KeyBacklogFullError as exc:
                await dead_letter(
                    runtime,
                    main_topic=main_topic,
                    key=message.key,
                    value=message.value,
                    headers=headers,
                    provenance=parsed.provenance,
                    attempt=parsed.attempt,
                    tier=label,
                    reason=Reason.KEY_BACKLOG_FULL,
                    error_class=parsed.error_class,
                    error_message=f"{parsed.error_message} ({exc})",
                )
            except Exception as exc:
                log.exception("could not park %s[%d]@%d", topic_name, message.partition, message.offset)
                await dead_letter(
                    runtime,
                    main_topic=main_topic,
                    key=message.key,
                    value=message.value,
                    headers=headers,
                    provenance=parsed.provenance,
                    attempt=parsed.attempt,
                    tier=label,
                    reason="internal-error",
                    error_class=type(exc).__name__,
                    error_message=str(exc),
                )

    return runtime.app.agent(topic, name=f"rebound.tier.{topic_name}", concurrency=1)(tier_agent)


def park(
    runtime: Runtime,
    message: Any,
    headers: list[tuple[str, bytes]],
    parsed: RetryHeaders,
    topic_name: str,
    label: str,
) -> bool:
    """Write the message into the state table and the release schedule; False if it was already parked."""
    from rebound.headers import without_rebound_headers

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
        error_message=parsed.error_message,
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
        return False
    runtime.store.save(key, before, state)
    runtime.schedule.add(message.partition, Slot(entry.due_at_ms, key, entry.origin, entry.attempt, label))
    runtime.release_wakeup.set()
    runtime.counters["parked"] += 1
    return True
