"""Replay one failed record: read it by partition and offset, send it back to its main topic (``POST
/retry/admin/replay/{topic}/{partition}/{offset}``).

Only this app's failed topics (``<main>.failed`` for each configured main topic) can be named; the target is that
failed topic's main topic, from the configuration. What may be replayed and with which headers is decided by
:func:`rebound.replay.plan_replay` (the redrive job's rules). The record is read with a group-less consumer, assigned
the one partition and positioned at the offset, as the failed-topic view reads (``app/web/failed.py``); the send goes
through the worker's producer (``acks=all``) to the original partition.

A broker error while reading answers 503 (nothing was sent); a send not acknowledged in time answers 504 saying the
record may still have been written (look at the main topic before replaying it again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import KafkaError

from agents.admin import audit_line
from agents.delivery import deliver
from agents.readers import groupless_consumer, topic_partitions
from agents.runtime import Runtime
from rebound.display import logged_key, utc_time
from rebound.errors import RecordTooLargeError, UnsendableRecordError
from rebound.headers import Header
from rebound.replay import ReplayRefused, plan_replay
from rebound.topics import failed_topic

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0
PAST_END_WAIT_S = 2.0
SEND_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict[str, Any]


@dataclass(frozen=True)
class FailedRecord:
    key: bytes | None
    value: bytes | None
    headers: list[Header]
    timestamp_ms: int


def failed_topics(runtime: Runtime) -> dict[str, str]:
    """Failed topic -> its main topic, for this app's main topics only."""
    return {failed_topic(main): main for main in runtime.settings.topics}


async def read_one(
    bootstrap: str, topic: str, partition: int, offset: int, *, fetch_max_wait_ms: int = 200
) -> FailedRecord | None:
    """The record at ``offset``, or None when the partition has no record there (before its start, past its end, or
    an offset the log skips). Raises ``TimeoutError`` if the broker does not answer in time."""
    from aiokafka import TopicPartition
    from aiokafka.errors import OffsetOutOfRangeError

    # (auto_offset_reset "none": an offset outside the log raises rather than reading from elsewhere)
    consumer = groupless_consumer(bootstrap, auto_offset_reset="none", fetch_max_wait_ms=fetch_max_wait_ms)
    try:
        await consumer.start()
        found = await topic_partitions(consumer, topic, tries=20, every_s=0.1)
        if partition not in found:
            return None
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        start = (await consumer.beginning_offsets([tp]))[tp]
        if offset < start:
            return None
        # (ListOffsets(latest) can answer low on some brokers, so past it the record is still looked for, briefly.)
        end = (await consumer.end_offsets([tp]))[tp]
        consumer.seek(tp, offset)
        deadline = time.monotonic() + (PAST_END_WAIT_S if offset >= end else READ_TIMEOUT_S)
        while time.monotonic() < deadline:
            try:
                batch = await consumer.getmany(tp, timeout_ms=2 * fetch_max_wait_ms + 100, max_records=1)
            except OffsetOutOfRangeError:
                return None
            for message in batch.get(tp, []):
                if message.offset < offset:
                    continue
                if message.offset > offset:
                    return None  # the log has no record at that offset (a transaction marker, or compacted away)
                return FailedRecord(message.key, message.value, list(message.headers or ()), message.timestamp or 0)
        if offset >= end:
            return None
        raise TimeoutError(f"no answer for {topic} partition {partition} offset {offset} within {READ_TIMEOUT_S}s")
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()


async def replay_one(
    runtime: Runtime,
    topic: str,
    partition: int,
    offset: int,
    *,
    max_redrives: int,
    by: str,
    source: str,
    force_other_group: bool = False,
) -> Answer:
    """Read, check and send one failed record; the answer for the admin view (the audit line is logged here)."""
    where = {"topic": topic, "partition": partition, "offset": offset}
    allowed = failed_topics(runtime)
    main = allowed.get(topic)
    if main is None:
        return Answer(
            404, {"error": f"{topic!r} is not a failed topic of this app", "failed_topics": sorted(allowed), **where}
        )
    try:
        record = await read_one(
            runtime.settings.bootstrap_servers,
            topic,
            partition,
            offset,
            fetch_max_wait_ms=min(runtime.settings.fetch_max_wait_ms, 200),
        )
    except TimeoutError as exc:
        return Answer(504, {"error": f"{exc}; nothing was sent", **where})
    except KafkaError as exc:
        return Answer(
            503,
            {
                "error": f"could not read {topic} partition {partition} from the broker: {exc!r}; nothing was sent",
                **where,
            },
        )
    if record is None:
        return Answer(404, {"error": f"{topic} partition {partition} has no record at offset {offset}", **where})
    try:
        plan = plan_replay(
            failed_topic=topic,
            main_topic=main,
            key=record.key,
            value=record.value,
            headers=record.headers,
            max_redrives=max_redrives,
            partitions=runtime.partitions,
            group=runtime.group,
            force_other_group=force_other_group,
        )
    except ReplayRefused as refused:
        log.warning(
            "admin replay of %s/%d@%d refused (%s) for %s from %s: %s",
            topic,
            partition,
            offset,
            refused.code,
            by,
            source,
            refused.message,
        )
        return Answer(409, {"error": refused.message, "refused": refused.code, **where})
    try:
        metadata = await asyncio.wait_for(
            deliver(
                runtime.main_topics[main],
                key=plan.key,
                value=plan.value,
                headers=plan.headers,
                partition=plan.target_partition,
            ),
            SEND_TIMEOUT_S,
        )
    except (RecordTooLargeError, UnsendableRecordError) as exc:
        return Answer(
            409, {"error": f"the record cannot be produced to {main}: {exc}", "refused": "unsendable", **where}
        )
    except TimeoutError:
        log.warning(
            "admin replay of %s/%d@%d to %s not acknowledged within %ss", topic, partition, offset, main, SEND_TIMEOUT_S
        )
        return Answer(
            504,
            {
                "error": f"{main} did not acknowledge the record within {SEND_TIMEOUT_S}s: it may still have been "
                f"written; check {main} (a record with rebound.redrive-count {plan.redrive_count} and this key) "
                f"before replaying it again, or it runs twice",
                "maybe_sent": True,
                **where,
            },
        )
    target = {
        "topic": main,
        "partition": getattr(metadata, "partition", plan.target_partition),
        "offset": getattr(metadata, "offset", None),
    }
    key_text = None if record.key is None else record.key.decode("utf-8", errors="backslashreplace")
    runtime.counters["admin.replayed"] += 1
    with audit_line(f"admin replay of {topic}/{partition}@{offset}"):
        log.warning(
            "admin replay of %s/%d@%d (key %s, reason %s) to %s/%s@%s with redrive-count %d, by %s from %s at %s",
            topic,
            partition,
            offset,
            logged_key(record.key),
            plan.reason,
            main,
            target["partition"],
            target["offset"],
            plan.redrive_count,
            by,
            source,
            utc_time(runtime.clock()),
        )
    return Answer(
        200,
        {
            "action": "replay",
            "failed": where,
            "target": target,
            "key": key_text,
            "reason": plan.reason,
            "redrive_count": plan.redrive_count,
            "max_redrives": max_redrives,
            "forced_other_group": force_other_group and plan.original.get("group") not in (None, runtime.group),
            "original": plan.original,
            "by": by,
        },
    )
