"""Partitions stopped at a record batch the consumer cannot decode, and when to try each one again.

A batch with a corrupt CRC, or compressed with a codec the client does not know (one Kafka adds later), cannot be
read, and its offsets must not be passed over silently: nothing after it on its partition is read until the batch
decodes (a transient corruption, fixed in the next fetch) or an operator moves the group's offset past it
(docs/undecodable-batches.md). Every other partition goes on. This module only decides: which partitions are
stopped where, when one is tried again, when a failure is worth another log line, and when a partition is free
again. The consumer thread (``app/fetch_guard.py``, ``app/consumer.py``) does the reading, pausing and resuming.

Written by the consumer thread, read by the web views and the metrics from the main thread: the state is an
immutable mapping replaced whole on every change, so a reader always sees one consistent snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

RETRY_INTERVAL_S = 30.0
"""How long a stopped partition waits before it is fetched again: a corruption in transit heals at the next fetch,
a missing codec or a corrupt log never does, and each try costs a fetch of up to ``max_partition_fetch_bytes``."""

TopicPartitionKey = tuple[str, int]


@dataclass(frozen=True)
class StuckPartition:
    """A partition whose reading stops at ``offset``: the first offset of the batch that cannot be decoded.
    ``next_offset`` is the first offset after that batch, as its header says (None when unknown): where the group's
    offset goes to skip it."""

    topic: str
    partition: int
    offset: int
    next_offset: int | None
    error: str
    since_ms: int
    failures: int
    retry_at: float
    logged_at: float

    def as_dict(self) -> dict[str, object]:
        """What ``/ready`` shows: enough for the operator's procedure (topic, partition, offset), no payload."""
        return {
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "next_offset": self.next_offset,
            "error": self.error,
            "since_ms": self.since_ms,
            "failures": self.failures,
        }


@dataclass(frozen=True)
class Failure:
    """The answer to :meth:`UndecodableBatches.failed`: the entry, and whether to log it now (the first failure at
    an offset, then at most once per retry interval, however often something else resumes the partition)."""

    stuck: StuckPartition
    log: bool


class UndecodableBatches:
    """The partitions this worker's consumer is stopped on, with a cumulative count of failed decodes per partition
    (a Prometheus counter: it never goes down, not even when the partition is freed or revoked)."""

    def __init__(self, retry_interval_s: float = RETRY_INTERVAL_S) -> None:
        self.retry_interval_s = retry_interval_s
        self._stuck: Mapping[TopicPartitionKey, StuckPartition] = MappingProxyType({})
        self._failures: Mapping[TopicPartitionKey, int] = MappingProxyType({})

    def failed(
        self, topic: str, partition: int, offset: int, next_offset: int | None, error: str, *, now: float, now_ms: int
    ) -> Failure:
        """Record a batch at ``offset`` that could not be decoded; the partition is next tried ``retry_interval_s``
        from ``now`` (monotonic seconds). ``now_ms`` is the wall clock, for reports."""
        key = (topic, partition)
        self._failures = MappingProxyType({**self._failures, key: self._failures.get(key, 0) + 1})
        before = self._stuck.get(key)
        retry_at = now + self.retry_interval_s
        if before is None or before.offset != offset:
            stuck = StuckPartition(topic, partition, offset, next_offset, error, now_ms, 1, retry_at, now)
            log = True
        else:
            log = now - before.logged_at >= self.retry_interval_s
            stuck = replace(
                before,
                next_offset=next_offset if next_offset is not None else before.next_offset,
                error=error,
                failures=before.failures + 1,
                retry_at=retry_at,
                logged_at=now if log else before.logged_at,
            )
        self._stuck = MappingProxyType({**self._stuck, key: stuck})
        return Failure(stuck, log)

    def due(self, now: float) -> list[StuckPartition]:
        """Partitions whose next try is due; each is due once per interval (the try is pushed back here)."""
        due = [stuck for stuck in self._stuck.values() if stuck.retry_at <= now]
        if due:
            later = {(s.topic, s.partition): replace(s, retry_at=now + self.retry_interval_s) for s in due}
            self._stuck = MappingProxyType({**self._stuck, **later})
        return due

    def decoded(self, topic: str, partition: int, up_to_offset: int) -> StuckPartition | None:
        """Records up to ``up_to_offset`` of the partition were decoded: free it if that reaches its stopping offset
        (the entry it had is returned), else None."""
        key = (topic, partition)
        stuck = self._stuck.get(key)
        if stuck is None or up_to_offset < stuck.offset:
            return None
        self._stuck = MappingProxyType({k: v for k, v in self._stuck.items() if k != key})
        return stuck

    def keep_only(self, assigned: Iterable[TopicPartitionKey]) -> list[StuckPartition]:
        """Forget partitions no longer assigned here (their new owner finds the batch itself); answer those."""
        keep = set(assigned)
        gone = [stuck for key, stuck in self._stuck.items() if key not in keep]
        if gone:
            self._stuck = MappingProxyType({k: v for k, v in self._stuck.items() if k in keep})
        return gone

    def any_stuck(self) -> bool:
        return bool(self._stuck)

    def is_stuck(self, topic: str, partition: int) -> bool:
        return (topic, partition) in self._stuck

    def snapshot(self) -> tuple[StuckPartition, ...]:
        """The partitions stopped now, by topic and partition."""
        return tuple(sorted(self._stuck.values(), key=lambda s: (s.topic, s.partition)))

    def failures(self) -> Mapping[TopicPartitionKey, int]:
        """Failed decodes per partition since the worker started."""
        return self._failures
