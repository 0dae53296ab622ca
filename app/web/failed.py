"""``GET /retry/failed``: what is on each main topic's failed topic, read incrementally and bounded.

Depth is not taken from ``ListOffsets(latest)``: the embedded broker answers it with the base offset of the last
batch plus one, which undercounts multi-record batches. Instead the reader keeps one group-less consumer per worker
whose position only moves forward: it reads what arrived since the last request (at most ``limit`` records per
request) and folds each record's headers into running counts. Once caught up, its position is the true end, so
``depth = position - start`` (``start`` from ``ListOffsets(earliest)``, which is reliable). Results are cached for a
few seconds, so a dashboard polling every worker does not turn into a read storm.

The counts by reason/class/topic cover the records read since this worker started; after retention deleted old
records they may exceed ``depth`` (which is always exact once caught up).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rebound import headers as h

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 5_000
MAX_LIMIT = 100_000
LATEST = 20
CACHE_TTL_S = 3.0
READ_BUDGET_S = 3.0
MAX_SHOWN_VALUE_BYTES = 4096


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", errors="backslashreplace")


@dataclass
class FailedTopicSummary:
    """Running counts over the records of one failed topic (pure: fed record by record)."""

    topic: str
    latest_size: int = LATEST
    counted: int = 0
    by_reason: Counter[str] = field(default_factory=Counter)
    by_error_class: Counter[str] = field(default_factory=Counter)
    by_original_topic: Counter[str] = field(default_factory=Counter)
    oldest_ms: int | None = None
    newest_ms: int | None = None
    latest: deque[dict[str, Any]] = field(default_factory=deque)

    def add(
        self,
        *,
        partition: int,
        offset: int,
        timestamp_ms: int,
        key: bytes | None,
        value: bytes | None,
        headers: Iterable[tuple[str, bytes]],
    ) -> None:
        pairs = list(headers)
        named = dict(pairs)
        reason = _text(named.get(h.REASON)) or "unknown"
        error_class = _text(named.get(h.ERROR_CLASS)) or "unknown"
        original = _text(named.get(h.ORIGINAL_TOPIC)) or "unknown"
        self.counted += 1
        self.by_reason[reason] += 1
        self.by_error_class[error_class] += 1
        self.by_original_topic[original] += 1
        if timestamp_ms:
            self.oldest_ms = timestamp_ms if self.oldest_ms is None else min(self.oldest_ms, timestamp_ms)
            self.newest_ms = timestamp_ms if self.newest_ms is None else max(self.newest_ms, timestamp_ms)
        self.latest.append(
            {
                "partition": partition,
                "offset": offset,
                "timestamp": timestamp_ms,
                "key": _text(key),
                "value_bytes": None if value is None else len(value),
                "headers": {name: _text(raw) for name, raw in pairs},
                "_value": value,
            }
        )
        while len(self.latest) > self.latest_size:
            self.latest.popleft()

    def to_dict(self, *, show_payloads: bool = False) -> dict[str, Any]:
        latest = []
        for item in reversed(self.latest):  # newest first
            shown = {name: value for name, value in item.items() if name != "_value"}
            if show_payloads:
                value = item["_value"]
                shown["value"] = None if value is None else _text(value[:MAX_SHOWN_VALUE_BYTES])
            latest.append(shown)
        return {
            "counted": self.counted,
            "by_reason": dict(self.by_reason.most_common()),
            "by_error_class": dict(self.by_error_class.most_common()),
            "by_original_topic": dict(self.by_original_topic.most_common()),
            "oldest_record": self.oldest_ms,
            "newest_record": self.newest_ms,
            "latest": latest,
        }


def depth(start: Mapping[int, int], position: Mapping[int, int]) -> int:
    """Records currently on the topic: per partition, the read position (the end, once caught up) minus the start."""
    return sum(max(0, position.get(partition, begin) - begin) for partition, begin in start.items())


class FailedTopicReader:
    """One group-less consumer per worker over every failed topic; never joins the app's consumer group."""

    def __init__(self, bootstrap: str, topics: Iterable[str], *, fetch_max_wait_ms: int = 100) -> None:
        self.bootstrap = bootstrap
        self.topics = list(topics)
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.summaries = {topic: FailedTopicSummary(topic) for topic in self.topics}
        self._consumer: Any = None
        self._partitions: list[Any] = []
        self._lock = asyncio.Lock()
        self._cached: tuple[float, dict[str, Any]] | None = None

    async def _start(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=self.fetch_max_wait_ms,
        )
        await consumer.start()
        try:
            partitions = []
            for topic in self.topics:
                found = consumer.partitions_for_topic(topic)
                for _ in range(20):
                    if found:
                        break
                    await consumer._client.force_metadata_update()
                    await asyncio.sleep(0.1)
                    found = consumer.partitions_for_topic(topic)
                partitions += [TopicPartition(topic, p) for p in sorted(found or ())]
            consumer.assign(partitions)
            if partitions:
                await consumer.seek_to_beginning(*partitions)
        except BaseException:
            await consumer.stop()
            raise
        self._consumer, self._partitions = consumer, partitions

    async def close(self) -> None:
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.stop()
            self._consumer = None

    async def _read(self, limit: int) -> tuple[int, bool]:
        """Read up to ``limit`` new records; returns how many and whether the consumer is caught up."""
        read = 0
        deadline = time.monotonic() + READ_BUDGET_S
        while read < limit and time.monotonic() < deadline:
            batch = await self._consumer.getmany(
                timeout_ms=2 * self.fetch_max_wait_ms, max_records=min(500, limit - read)
            )
            if not batch:
                return read, True
            for tp, messages in batch.items():
                summary = self.summaries[tp.topic]
                for message in messages:
                    summary.add(
                        partition=tp.partition,
                        offset=message.offset,
                        timestamp_ms=message.timestamp or 0,
                        key=message.key,
                        value=message.value,
                        headers=message.headers or (),
                    )
                    read += 1
        return read, False

    async def summary(self, *, limit: int = DEFAULT_LIMIT, show_payloads: bool = False) -> dict[str, Any]:
        limit = max(1, min(limit, MAX_LIMIT))
        async with self._lock:
            if self._cached is not None and time.monotonic() - self._cached[0] < CACHE_TTL_S:
                return {**self._cached[1], "cached": True}
            if self._consumer is None:
                await self._start()
            read, caught_up = await self._read(limit)
            starts = await self._consumer.beginning_offsets(self._partitions) if self._partitions else {}
            topics: dict[str, Any] = {}
            for topic, summary in self.summaries.items():
                start = {tp.partition: offset for tp, offset in starts.items() if tp.topic == topic}
                position = {
                    tp.partition: await self._consumer.position(tp) for tp in self._partitions if tp.topic == topic
                }
                highwater = {tp.partition: self._consumer.highwater(tp) for tp in self._partitions if tp.topic == topic}
                topics[topic] = {
                    "depth": depth(start, position),
                    "partitions": {
                        str(p): {"start": start.get(p), "position": position.get(p), "highwater": highwater.get(p)}
                        for p in sorted(position)
                    },
                    **summary.to_dict(show_payloads=show_payloads),
                }
            result = {"read_this_request": read, "caught_up": caught_up, "limit": limit, "topics": topics}
            self._cached = (time.monotonic(), result)
            return {**result, "cached": False}
