"""Offset planning: which offset ranges a batch or a micro-batch reads, and how they are cut into Spark tasks.

Pure functions over ``{(topic, partition): offset}`` maps, so the rules (earliest/latest resolution, data-loss
checks, ``minPartitions`` splitting, ``maxOffsetsPerTrigger`` rate limiting) are unit-tested without a broker.
Ranges are half-open: ``[start, end)``, like Kafka's own end offsets.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.kafka_source.options import EARLIEST, LATEST, OffsetSpec, TopicPartition

log = logging.getLogger(__name__)

DATA_LOSS_HINT = (
    "Some data may have been lost because they are not available in Kafka any more; either the data was aged out "
    "by Kafka or the topic may have been deleted before all the data in the topic was processed. If you don't want "
    "your query to fail on such cases, set the source option 'failOnDataLoss' to 'false'."
)


class DataLossError(RuntimeError):
    """Offsets the query must read are gone (retention, deleted/recreated topic) and ``failOnDataLoss`` is on."""


@dataclass(frozen=True)
class OffsetRange:
    topic: str
    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return max(0, self.end - self.start)

    @property
    def topic_partition(self) -> TopicPartition:
        return (self.topic, self.partition)


def resolve(
    spec: OffsetSpec,
    partitions: list[TopicPartition],
    earliest: Mapping[TopicPartition, int],
    latest: Mapping[TopicPartition, int],
    *,
    default: int,
) -> dict[TopicPartition, int]:
    """Turn a spec (and its -2/-1 markers) into real offsets for ``partitions``; unnamed partitions get ``default``."""
    resolved = {}
    for tp in partitions:
        wanted = spec.for_partition(tp, default)
        if wanted == EARLIEST:
            resolved[tp] = earliest[tp]
        elif wanted == LATEST:
            resolved[tp] = latest[tp]
        else:
            resolved[tp] = wanted
    return resolved


def check_ranges(
    start: Mapping[TopicPartition, int],
    end: Mapping[TopicPartition, int],
    earliest: Mapping[TopicPartition, int],
    *,
    fail_on_data_loss: bool,
) -> list[OffsetRange]:
    """One range per partition in ``end``; a start below the log start or past the end is data loss.

    A partition missing from ``start`` is new (created after the query began) and is read from its beginning,
    as Spark does. With ``failOnDataLoss=false`` the lost part is skipped and logged instead of failing.
    """
    ranges = []
    for tp in sorted(end):
        stop = end[tp]
        begin = start.get(tp, earliest.get(tp, 0))
        first = earliest.get(tp, 0)
        if begin < first:
            message = f"{tp[0]}-{tp[1]}: offsets {begin}..{first - 1} are no longer in Kafka. {DATA_LOSS_HINT}"
            if fail_on_data_loss:
                raise DataLossError(message)
            log.warning(message)
            begin = first
        if stop < begin:
            message = (
                f"{tp[0]}-{tp[1]}: end offset {stop} is before start offset {begin} (was the topic recreated?). "
                f"{DATA_LOSS_HINT}"
            )
            if fail_on_data_loss:
                raise DataLossError(message)
            log.warning(message)
            continue
        if stop > begin:
            ranges.append(OffsetRange(tp[0], tp[1], begin, stop))
    return ranges


def split_ranges(ranges: list[OffsetRange], min_partitions: int | None) -> list[OffsetRange]:
    """One Spark partition per topic-partition, or more when ``minPartitions`` asks for more.

    Like Spark's KafkaOffsetRangeCalculator, large ranges are cut in proportion to their size, so that a busy
    partition is spread over several tasks while a small one stays whole.
    """
    ranges = [r for r in ranges if r.size > 0]
    if not min_partitions or len(ranges) >= min_partitions:
        return ranges
    total = sum(r.size for r in ranges)
    out: list[OffsetRange] = []
    for r in ranges:
        parts = max(1, min(r.size, math.ceil(r.size / total * min_partitions)))
        for i in range(parts):
            lo = r.start + r.size * i // parts
            hi = r.start + r.size * (i + 1) // parts
            if hi > lo:
                out.append(OffsetRange(r.topic, r.partition, lo, hi))
    return out


def rate_limit(
    start: Mapping[TopicPartition, int],
    latest: Mapping[TopicPartition, int],
    max_offsets: int,
) -> dict[TopicPartition, int]:
    """Cap a micro-batch at about ``max_offsets`` records, shared in proportion to each partition's backlog.

    Same rule as Spark: a partition's share is ``max_offsets * lag / total_lag``, rounded down, except that a
    share below one is rounded up so that a small backlog is never starved.
    """
    lags = {tp: max(0, latest[tp] - start.get(tp, latest[tp])) for tp in latest}
    total = sum(lags.values())
    if total <= max_offsets:
        return dict(latest)
    limited = {}
    for tp, end in latest.items():
        begin = start.get(tp, end)
        share = max_offsets * lags[tp] / total
        step = math.ceil(share) if share < 1 else math.floor(share)
        limited[tp] = min(end, begin + step)
    return limited


def cap(offsets: Mapping[TopicPartition, int], target: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
    """For ``Trigger.AvailableNow``: never go past the offsets seen when the query started."""
    return {tp: min(off, target[tp]) if tp in target else off for tp, off in offsets.items() if tp in target}
