"""Reading what Rebound produced, group-less (``demo.harness.Tail``), so observing never moves the workers' partitions.

Every topic the checker needs is read from the beginning: ``<main>.failed`` (terminal dead letters),
``<app id>.attempts`` (due times of ``scheduled`` events, and ``succeeded`` events for a cross-check), every tier topic
(the ``rebound.due-at`` header of each record actually parked), and the main topic itself, to confirm the broker holds
each acknowledged record at its offset, so a broker fault is never mistaken for a loss by Rebound. Parsing is lenient: a record this module cannot read is
counted, never dropped silently, and never stops the run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from chaos.checker import DeadLetter, DueTime, Origin
from demo.harness import Record, Tail
from rebound import headers as h


def _decimal(headers: dict[str, bytes], name: str) -> int | None:
    try:
        return int(headers[name].decode("ascii"))
    except (KeyError, ValueError, UnicodeDecodeError):
        return None


def _origin(headers: dict[str, bytes]) -> Origin | None:
    topic = headers.get(h.ORIGINAL_TOPIC)
    partition, offset = _decimal(headers, h.ORIGINAL_PARTITION), _decimal(headers, h.ORIGINAL_OFFSET)
    if topic is None or partition is None or offset is None:
        return None
    return (topic.decode("utf-8", "replace"), partition, offset)


@dataclass
class Observed:
    dead_letters: list[DeadLetter] = field(default_factory=list)
    due_times: list[DueTime] = field(default_factory=list)
    succeeded_events: list[tuple[Origin, int]] = field(default_factory=list)
    attempt_events: int = 0
    tier_records: int = 0
    unreadable: int = 0
    main_log: dict[Origin, tuple[bytes | None, bytes | None]] = field(default_factory=dict)

    def add(self, record: Record, *, main_topic: str, failed_topic: str, attempts_topic: str) -> None:
        if record.topic == main_topic:
            self.main_log[(record.topic, record.partition, record.offset)] = (record.key, record.value)
        elif record.topic == failed_topic:
            reason = record.headers.get(h.REASON)
            self.dead_letters.append(
                DeadLetter(
                    origin=_origin(record.headers),
                    reason=None if reason is None else reason.decode("utf-8", "replace"),
                    attempt=_decimal(record.headers, h.ATTEMPT),
                    key=record.key,
                    value=record.value,
                    partition=record.partition,
                    offset=record.offset,
                )
            )
        elif record.topic == attempts_topic:
            self.attempt_events += 1
            try:
                event: dict[str, Any] = json.loads(record.value or b"")
                origin: Origin = (
                    str(event["original_topic"]),
                    int(event["original_partition"]),
                    int(event["original_offset"]),
                )
                attempt = int(event["attempt"])
            except (ValueError, KeyError, TypeError):
                self.unreadable += 1
                return
            if event.get("outcome") == "scheduled" and event.get("due_at") is not None:
                # A scheduled event reports the attempt that failed; its due time is the next attempt's.
                self.due_times.append(DueTime(origin, attempt + 1, int(event["due_at"]), "scheduled-event"))
            elif event.get("outcome") == "succeeded":
                self.succeeded_events.append((origin, attempt))
        else:
            self.tier_records += 1
            origin_or_none = _origin(record.headers)
            attempt_or_none, due = _decimal(record.headers, h.ATTEMPT), _decimal(record.headers, h.DUE_AT)
            if origin_or_none is None or attempt_or_none is None or due is None:
                self.unreadable += 1
                return
            self.due_times.append(DueTime(origin_or_none, attempt_or_none, due, "tier-header"))


class Observer:
    """A Tail over the main, failed, attempts and tier topics, feeding :class:`Observed` as records arrive."""

    def __init__(
        self, bootstrap: str, *, main_topic: str, failed_topic: str, attempts_topic: str, tier_topics: list[str]
    ) -> None:
        self.main_topic = main_topic
        self.failed_topic = failed_topic
        self.attempts_topic = attempts_topic
        self.tail = Tail(bootstrap, [main_topic, failed_topic, attempts_topic, *tier_topics])
        self.observed = Observed()

    async def __aenter__(self) -> Observer:
        await self.tail.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.tail.__aexit__(*exc)

    async def poll(self, timeout_ms: int = 200) -> int:
        new = await self.tail.poll(timeout_ms)
        for record in new:
            self.observed.add(
                record, main_topic=self.main_topic, failed_topic=self.failed_topic, attempts_topic=self.attempts_topic
            )
        self.tail.records.clear()  # parsed already; the Tail need not keep a second copy
        return len(new)


async def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """The group's committed offset per partition of ``topic``: below it a lost message was skipped, not wedged.

    A consumer that never subscribes only fetches offsets and never joins the group (the embedded broker's answer
    to the admin client's OffsetFetch version does not decode).
    """
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = sorted(consumer.partitions_for_topic(topic) or ())
        if not partitions:
            await consumer._client.force_metadata_update()
            partitions = sorted(consumer.partitions_for_topic(topic) or ())
        found = {p: await consumer.committed(TopicPartition(topic, p)) for p in partitions}
    finally:
        await consumer.stop()
    return {p: offset for p, offset in found.items() if offset is not None}
