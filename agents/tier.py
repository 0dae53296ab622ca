"""Tier agents: one per tier topic. They validate the retry headers and park the message in the state table.

Parking (not sleeping) is what keeps a tier partition flowing: a record is read as soon as it arrives, whatever its
due time, and the timer releases it later. Whatever a record carries, it is either parked or sent on to the failed
topic byte-exact with a reason: nothing raises out of the agent (Faust would ack the record).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from agents.attempt import dead_letter
from agents.ordering import retry_refused
from agents.ownership import owned_partitions
from agents.records import header_pairs
from app.runtime import Runtime
from rebound.errors import InvalidRetryHeadersError, KeyBacklogFullError, RecordTooLargeError
from rebound.headers import (
    Provenance,
    RetryHeaders,
    parse_retry_headers,
    restore_null_value,
    without_rebound_headers,
)
from rebound.routing import DeadLetter, Reason
from rebound.schedule import Slot
from rebound.state import KeyState, PendingMessage, legacy_table_key, null_table_key, table_key
from rebound.tiers import Tier
from rebound.topics import failed_topic

log = logging.getLogger(__name__)
STATE_ERROR_CHARS = 256  # the full message travels in the record's headers; the state keeps it short


def register_tier_agent(runtime: Runtime, topic_name: str) -> Any:
    tier = runtime.tiers[topic_name]

    async def tier_agent(stream: Any) -> None:
        async for event in stream.events():
            await handle_tier_record(runtime, event.message, tier)

    topic = runtime.tier_topics[topic_name]
    return runtime.app.agent(topic, name=f"rebound.tier.{topic_name}", concurrency=1)(tier_agent)


@dataclass(frozen=True)
class TierRecord:
    """A record read from a tier topic, with what a rejection needs to send it on byte-exact."""

    message: Any
    tier: Tier
    headers: list[tuple[str, bytes]]

    @property
    def value(self) -> bytes | None:
        return restore_null_value(self.message.value, self.headers)

    @property
    def timestamp_ms(self) -> int:
        return max(0, int(self.message.timestamp * 1000)) if self.message.timestamp else 0

    def itself(self, now_ms: int) -> Provenance:
        """Provenance for a record whose headers cannot be trusted: the tier record itself."""
        return Provenance(self.tier.topic, self.message.partition, self.message.offset, self.timestamp_ms, now_ms)


async def handle_tier_record(runtime: Runtime, message: Any, tier: Tier) -> None:
    record = TierRecord(message, tier, header_pairs(message.headers))
    runtime.counters[f"tier.{tier.label}.received"] += 1
    parsed: RetryHeaders | None = None
    try:
        parsed = parse_retry_headers(record.headers, main_topics=runtime.settings.topics)
        tier.validate(
            parsed,
            group=runtime.group,
            partition=message.partition,
            partitions=runtime.partitions,
            record_timestamp_ms=record.timestamp_ms,
            now_ms=runtime.clock(),
        )
    except InvalidRetryHeadersError as exc:
        log.warning("invalid retry headers on %s[%d]@%d: %s", tier.topic, message.partition, message.offset, exc)
        itself = record.itself(runtime.clock())
        await reject(runtime, record, Reason.INVALID_RETRY_HEADERS, itself, 0, type(exc).__name__, str(exc))
        if _own_record(runtime, tier, message, parsed):
            # Our own retry, refused for its due time (clocks apart): in key-ordered mode its key stops waiting.
            await _lift_block(runtime, message, parsed)
        return
    try:
        written = park(runtime, record, parsed)
        try:
            await runtime.store.confirm()
        except RecordTooLargeError:
            # The broker refused one of this park's changelog records (its limit is below the producer's).
            if written is None or not await take_back(runtime, written, parsed.attempt, message.partition):
                # A duplicate whose first write stands, or a message already released: it is not this one's to end.
                log.error(
                    "changelog write of %s[%d]@%d refused; the entry stays",
                    tier.topic,
                    message.partition,
                    message.offset,
                )
                return
            raise
    except (KeyBacklogFullError, RecordTooLargeError) as exc:
        reason = Reason.KEY_BACKLOG_FULL if isinstance(exc, KeyBacklogFullError) else Reason.TOO_LARGE
        text = f"{parsed.error_message} ({exc})"
        await reject(runtime, record, reason, parsed.provenance, parsed.attempt, parsed.error_class, text)
    except Exception as exc:
        log.exception("could not park %s[%d]@%d", tier.topic, message.partition, message.offset)
        await reject(
            runtime, record, Reason.INTERNAL_ERROR, parsed.provenance, parsed.attempt, type(exc).__name__, str(exc)
        )
    else:
        return
    await _lift_block(runtime, message, parsed)


def _own_record(runtime: Runtime, tier: Tier, message: Any, parsed: RetryHeaders | None) -> bool:
    """Headers that parse and name this group, this tier's main topic and this partition: our own retry."""
    return (
        parsed is not None
        and parsed.group == runtime.group
        and parsed.provenance.topic == tier.main_topic
        and parsed.provenance.partition % runtime.partitions == message.partition
    )


async def _lift_block(runtime: Runtime, message: Any, parsed: RetryHeaders | None) -> None:
    if parsed is not None and runtime.settings.key_ordered and message.key is not None:
        origin = PendingMessage.origin_of(parsed.provenance)
        await retry_refused(runtime, table_key(message.key, parsed.provenance), message.partition, origin)


async def reject(
    runtime: Runtime,
    record: TierRecord,
    reason: Reason,
    provenance: Provenance,
    attempt: int,
    error_class: str,
    error_message: str,
) -> None:
    await dead_letter(
        runtime,
        DeadLetter(failed_topic(record.tier.main_topic), reason),
        key=record.message.key,
        value=record.value,
        headers=record.headers,
        provenance=provenance,
        attempt=attempt,
        tier=record.tier.label,
        error_class=error_class,
        error_message=error_message,
    )


async def take_back(runtime: Runtime, written: tuple[bytes, KeyState, KeyState], attempt: int, partition: int) -> bool:
    """Remove a park whose changelog record was refused, so the message ends only on the failed topic.

    Done under the key's lock and on a fresh read (the confirm awaited: the key may have changed since); only this
    entry is removed, and only if it is still there. False if it is gone already (released): then it has ended.
    """
    key, _, after = written
    origin = after.pending[-1].origin
    async with runtime.key_locks.hold(key):
        if partition not in owned_partitions(runtime):
            return False
        current = runtime.store.load(key, origin=origin)
        entry = current.find(origin)
        if entry is None or entry.attempt != attempt:
            return False
        runtime.store.save(key, current, current.without({origin}))
        runtime.schedule.confirm(partition, key, origin, attempt)
        runtime.schedule.discard(partition, {(key, origin, attempt)})
        await runtime.store.confirm()
        return True


def _key_parked_under(runtime: Runtime, key: bytes | None, provenance: Provenance, origin: str) -> bytes:
    """The table key for this message: the escaped one, or the raw one an earlier version parked this origin under.

    The raw form is never the null key of this origin: that one belongs to a null-keyed record.
    """
    escaped = table_key(key, provenance)
    legacy = legacy_table_key(escaped)
    if legacy is None or legacy == null_table_key(provenance):
        return escaped
    if runtime.store.entry(legacy, origin) is not None:
        return legacy
    return escaped


def park(runtime: Runtime, record: TierRecord, parsed: RetryHeaders) -> tuple[bytes, KeyState, KeyState] | None:
    """Write the message into the state table and the release schedule; the key and its states before and after.

    None if it was already parked.

    A record delivered again for an entry already parked writes that entry again, because the first write may
    never have reached the changelog (see :meth:`RetryStore.rewrite_parked`).
    """
    message, tier = record.message, record.tier
    entry = PendingMessage(
        origin=PendingMessage.origin_of(parsed.provenance),
        key=message.key,
        value=record.value,
        headers=tuple(without_rebound_headers(record.headers)),
        provenance=parsed.provenance,
        attempt=parsed.attempt,
        tier=tier.label,
        tier_topic=tier.topic,
        partition=message.partition,
        due_at_ms=parsed.due_at_ms,
        parked_at_ms=runtime.clock(),
        error_class=parsed.error_class,
        error_message=parsed.error_message[:STATE_ERROR_CHARS],
        value_size=None if record.value is None else len(record.value),
    )
    key = _key_parked_under(runtime, message.key, parsed.provenance, entry.origin)
    before = runtime.store.load(key, origin=entry.origin)
    if before.parked >= runtime.settings.max_pending_per_key and before.find(entry.origin) is None:
        raise KeyBacklogFullError(f"key already has {before.parked} parked messages (REBOUND_MAX_PENDING_PER_KEY)")
    state, changed = before.park(entry)
    if not changed:
        runtime.counters["tier.duplicates"] += 1
        current = before.find(entry.origin)
        if current is not None and current.attempt == entry.attempt:
            runtime.store.rewrite_parked(key, entry)
        return None
    runtime.store.save(key, before, state)
    runtime.schedule.add(message.partition, Slot(entry.due_at_ms, key, entry.origin, entry.attempt, tier.label))
    runtime.release_wakeup.set()
    runtime.counters["parked"] += 1
    runtime.metrics.parked.labels(tier.main_topic, tier.label).inc()
    return key, before, state
