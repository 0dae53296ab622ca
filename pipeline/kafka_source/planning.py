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

from pipeline.kafka_source.options import (
    EARLIEST,
    LATEST,
    NO_MATCH_ERROR,
    KafkaOptionError,
    OffsetSpec,
    TopicPartition,
)

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
    found_by_time: Mapping[TopicPartition, int | None] | None = None,
) -> dict[TopicPartition, int]:
    """Turn a spec (and its -2/-1 markers) into real offsets for ``partitions``; unnamed partitions get ``default``.

    A time spec takes its offsets from ``found_by_time`` (the client's checked offsets-for-times); a partition with
    no record at or after the time gets its end offset, or, for a start with
    ``startingOffsetsByTimestampStrategy=error`` (Spark's default), fails the query, as in Spark.
    """
    if spec.kind == "timestamp":
        return _resolve_times(spec, partitions, latest, found_by_time or {})
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


def _resolve_times(
    spec: OffsetSpec,
    partitions: list[TopicPartition],
    latest: Mapping[TopicPartition, int],
    found_by_time: Mapping[TopicPartition, int | None],
) -> dict[TopicPartition, int]:
    times = spec.times_for(partitions)
    resolved = {}
    for tp in partitions:
        found = found_by_time.get(tp)
        if found is not None:
            resolved[tp] = found
        elif spec.no_match == NO_MATCH_ERROR:
            raise KafkaOptionError(
                f"No offset matched from request of topic-partition {tp[0]}-{tp[1]} and timestamp {times[tp]} "
                f"({spec.option}): no record at or after that time. Set the option "
                "'startingOffsetsByTimestampStrategy' to 'latest' to start such partitions at their end instead."
            )
        else:
            resolved[tp] = latest[tp]
    return resolved


def check_time_window(
    start: Mapping[TopicPartition, int],
    end: Mapping[TopicPartition, int],
    starting: OffsetSpec,
    ending: OffsetSpec,
) -> None:
    """A batch start after its end because of a time option is the query's mistake, not data loss.

    (Without a time option, an end below the start keeps meaning a recreated topic, see :func:`check_ranges`.)
    Spark fails the same way, on the executor, with "Beginning offset ... is after the ending offset".
    """
    if starting.kind != "timestamp" and ending.kind != "timestamp":
        return
    for tp in sorted(set(start) & set(end)):
        if start[tp] > end[tp]:
            raise KafkaOptionError(
                f"{starting.option} resolves to offset {start[tp]} of {tp[0]}-{tp[1]}, which is after the ending "
                f"offset {end[tp]} from {ending.option}"
            )


def check_ranges(
    start: Mapping[TopicPartition, int],
    end: Mapping[TopicPartition, int],
    earliest: Mapping[TopicPartition, int],
    *,
    fail_on_data_loss: bool,
) -> list[OffsetRange]:
    """One range per partition in ``end``; offsets the range needs that Kafka no longer has are data loss.

    ``earliest`` is the broker's log start of every partition in ``end``. Data loss, as in Spark's
    KafkaMicroBatchStream and KafkaOffsetReader: a start below the log start (records aged out or deleted), an end
    below the start (the offsets went backwards: a truncated log, or the topic was deleted and recreated), a
    partition in ``start`` missing from ``end`` (deleted), and a partition new since ``start`` whose log does not
    start at 0. A partition missing from ``start`` is new (created after the query began) and is read from its
    beginning, as Spark does.

    ``failOnDataLoss=true`` raises :class:`DataLossError`; ``false`` logs the topic-partition and the offsets skipped
    and goes on. When the offsets went backwards the partition gets no range and a stream goes on from the new end,
    as in Spark: re-reading the new log from its start would be one batch of the whole retained partition
    (``maxOffsetsPerTrigger`` is applied before), and after a truncation would read records already processed.
    """

    def report(message: str) -> None:
        if fail_on_data_loss:
            raise DataLossError(f"{message} {DATA_LOSS_HINT}")
        log.warning("%s Continuing because failOnDataLoss is false.", message)

    gone = sorted(tp for tp in start if tp not in end)
    if gone:
        names = ", ".join(f"{t}-{p}" for t, p in gone)
        skipped = ", ".join(f"{t}-{p} from offset {start[(t, p)]}" for t, p in gone)
        report(f"Partitions {names} are gone (topic deleted?); any records not yet read are skipped: {skipped}.")
    ranges = []
    for tp in sorted(end):
        name = f"{tp[0]}-{tp[1]}"
        stop = end[tp]
        first = earliest.get(tp, 0)
        if tp in start:
            begin = start[tp]
        else:
            begin = first
            if first > 0:
                report(f"Added partition {name} starts from {first} instead of 0: offsets 0..{first - 1} are skipped.")
        if stop < begin:
            recreated = (
                f", and any records now at offsets {first}..{stop - 1} (a recreated topic) are skipped"
                if stop > first
                else ""
            )
            report(
                f"Partition {name}'s offset was changed from {begin} to {stop} (log truncated, or topic deleted and "
                f"recreated?): the query goes on from offset {stop}; the records it read at offsets {stop}..{begin - 1} "
                f"are no longer in Kafka{recreated}."
            )
            continue
        elif begin < first:
            report(
                f"{name}: offsets {begin}..{first - 1} are no longer in Kafka (the log now starts at {first}); "
                f"they are skipped."
            )
            begin = first
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
