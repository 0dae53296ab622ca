"""Option parsing for the ``pykafka`` data source: the same names and rules as Spark's JVM Kafka connector.

Everything here is pure Python (no JVM, no broker) so that every rule can be unit-tested quickly, and so that a
mistake in a query is reported on the driver, with the option's name, before any task starts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

EARLIEST = -2
"""Kafka's (and Spark's) marker for "the first offset still in the log" in per-partition offset JSON."""
LATEST = -1
"""Marker for "the offset after the last record" (the end of the log)."""

TopicPartition = tuple[str, int]

SUBSCRIBE = "subscribe"
SUBSCRIBE_PATTERN = "subscribepattern"
ASSIGN = "assign"
STRATEGY_OPTION_KEYS = (SUBSCRIBE, SUBSCRIBE_PATTERN, ASSIGN)

DEFAULT_POLL_TIMEOUT_MS = 120_000
DEFAULT_MAX_BATCH_BYTES = 64 * 1024 * 1024
"""Arrow batches the reader hands Spark stay below about this many bytes of keys, values and headers."""

# Kafka client settings the source must own: it tracks offsets itself (Spark's checkpoint is the truth), reads raw
# bytes, and never joins a consumer group. The wording follows Spark's KafkaSourceProvider so people find the docs.
_CONSUMER_REJECTED = {
    "group.id": (
        "Kafka option 'group.id' is not supported. This source never joins a consumer group: it assigns "
        "partitions itself and Spark's checkpoint (or the caller) owns the offsets, so a shared group id "
        "could only make concurrent queries interfere with each other."
    ),
    "auto.offset.reset": (
        "Kafka option 'auto.offset.reset' is not supported. Instead set the source option 'startingOffsets' to "
        "'earliest' or 'latest' to specify where to start. Structured Streaming manages which offsets are "
        "consumed internally, rather than relying on the kafkaConsumer to do it. Note that 'startingOffsets' only "
        "applies when a new streaming query is started, and that resuming will always pick up from where the "
        "query left off."
    ),
    "key.deserializer": (
        "Kafka option 'key.deserializer' is not supported as keys are deserialized as byte arrays. Use DataFrame "
        "operations to explicitly deserialize the keys."
    ),
    "value.deserializer": (
        "Kafka option 'value.deserializer' is not supported as values are deserialized as byte arrays. Use "
        "DataFrame operations to explicitly deserialize the values."
    ),
    "enable.auto.commit": "Kafka option 'enable.auto.commit' is not supported",
    "interceptor.classes": "Kafka option 'interceptor.classes' is not supported",
}
_PRODUCER_REJECTED = {
    "key.serializer": (
        "Kafka option 'key.serializer' is not supported as keys are serialized as byte arrays. Use DataFrame "
        "operations to explicitly serialize the keys into either strings or byte arrays."
    ),
    "value.serializer": (
        "Kafka option 'value.serializer' is not supported as values are serialized as byte arrays. Use DataFrame "
        "operations to explicitly serialize the values into either strings or byte arrays."
    ),
    "interceptor.classes": "Kafka option 'interceptor.classes' is not supported",
    "acks": (
        "Kafka option 'acks' is not supported: the writer always uses acks=all so that a task only succeeds once "
        "every in-sync replica has the records."
    ),
}


# Options of Spark's connector that this source does not implement: refused rather than silently ignored, because
# ignoring them would change what a query reads or when it triggers.
_UNSUPPORTED_READ_OPTIONS = {
    "minOffsetsPerTrigger": "micro-batches are never delayed to accumulate records; use 'maxOffsetsPerTrigger' only",
    "maxTriggerDelay": "micro-batches are never delayed to accumulate records (see 'minOffsetsPerTrigger')",
    "maxRecordsPerPartition": "split large reads with 'minPartitions' instead",
}


class KafkaOptionError(ValueError):
    """A data source option is missing, unknown in this combination, or malformed."""


@dataclass(frozen=True)
class Strategy:
    """Which topic-partitions to read: ``subscribe`` (topic list), ``subscribePattern`` (regex) or ``assign``."""

    kind: str
    topics: tuple[str, ...] = ()
    pattern: str | None = None
    partitions: tuple[TopicPartition, ...] = ()

    def select_topics(self, existing: set[str]) -> list[str]:
        """The topics this strategy reads among those the cluster has (a pattern must match the whole name)."""
        if self.kind == SUBSCRIBE:
            return [t for t in self.topics if t in existing]
        if self.kind == SUBSCRIBE_PATTERN:
            assert self.pattern is not None
            regex = re.compile(self.pattern)
            return sorted(t for t in existing if regex.fullmatch(t))
        return sorted({t for t, _ in self.partitions})


NO_MATCH_ERROR = "error"
NO_MATCH_LATEST = "latest"


@dataclass(frozen=True)
class OffsetSpec:
    """``earliest``, ``latest``, a JSON map of per-partition offsets (with -2/-1 as earliest/latest), or a time.

    A time (``kind == "timestamp"``) is one epoch-ms for every partition (``startingTimestamp``/``endingTimestamp``)
    or one per partition (``...OffsetsByTimestamp``); it stands for the first offset whose record timestamp is at or
    after it, which needs the broker, so :func:`pipeline.kafka_source.planning.resolve` gets the looked-up offsets.
    ``no_match`` says what a time after the last record means: ``latest`` (the end offset) or ``error``.
    """

    kind: str  # "earliest" | "latest" | "specific" | "timestamp"
    offsets: Mapping[TopicPartition, int] = field(default_factory=dict)
    timestamp: int | None = None
    timestamps: Mapping[TopicPartition, int] = field(default_factory=dict)
    option: str = ""
    no_match: str = NO_MATCH_LATEST

    def times_for(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        """The time to look up for each partition read (none unless the spec is a time).

        A by-partition map must name exactly the partitions read, as in Spark: a partition left out would otherwise
        be read from an offset nobody asked for.
        """
        if self.kind != "timestamp":
            return {}
        if self.timestamp is not None:
            return dict.fromkeys(partitions, self.timestamp)
        if set(self.timestamps) != set(partitions):
            raise KafkaOptionError(
                f"option '{self.option}' must name every topic-partition read, and only those. "
                f"Specified: {_names(self.timestamps)}; read: {_names(partitions)}"
            )
        return dict(self.timestamps)

    def for_partition(self, tp: TopicPartition, default: int) -> int:
        if self.kind == "earliest":
            return EARLIEST
        if self.kind == "latest":
            return LATEST
        return self.offsets.get(tp, default)


@dataclass(frozen=True)
class SourceOptions:
    bootstrap_servers: str
    strategy: Strategy
    starting: OffsetSpec
    ending: OffsetSpec
    min_partitions: int | None
    max_offsets_per_trigger: int | None
    fail_on_data_loss: bool
    include_headers: bool
    poll_timeout_ms: int
    client_config: dict[str, str]
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES


@dataclass(frozen=True)
class SinkOptions:
    bootstrap_servers: str
    topic: str | None
    client_config: dict[str, str]


def _lower(options: Mapping[str, str]) -> dict[str, str]:
    # Spark's own option maps are case-insensitive; so are ours (``startingOffsets`` == ``startingoffsets``).
    return {str(k).lower(): str(v) for k, v in options.items() if v is not None}


def _bool(opts: Mapping[str, str], key: str, default: bool, name: str) -> bool:
    raw = opts.get(key)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value not in ("true", "false"):
        raise KafkaOptionError(f"option '{name}' must be 'true' or 'false', got {raw!r}")
    return value == "true"


def _positive_int(opts: Mapping[str, str], key: str, name: str) -> int | None:
    raw = opts.get(key)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise KafkaOptionError(f"option '{name}' must be a whole number, got {raw!r}") from None
    if value <= 0:
        raise KafkaOptionError(f"{name} must be positive")
    return value


def client_config(opts: Mapping[str, str], rejected: Mapping[str, str]) -> dict[str, str]:
    """The ``kafka.*`` options without their prefix, after refusing those the source must own."""
    config = {k[len("kafka.") :]: v for k, v in opts.items() if k.startswith("kafka.")}
    for name, message in rejected.items():
        if name in config:
            raise KafkaOptionError(message)
    if not config.get("bootstrap.servers", "").strip():
        raise KafkaOptionError("Option 'kafka.bootstrap.servers' must be specified for configuring Kafka consumer")
    return config


def parse_assign(value: str) -> tuple[TopicPartition, ...]:
    """``{"topicA":[0,1],"topicB":[2]}`` as in Spark's ``assign`` option."""
    if not value.strip().startswith("{"):
        raise KafkaOptionError(f"No topicpartitions to assign as specified value for option 'assign' is '{value}'")
    try:
        data = json.loads(value)
        pairs = tuple((str(topic), int(p)) for topic, parts in data.items() for p in parts)
    except (ValueError, TypeError, AttributeError) as exc:
        raise KafkaOptionError(f'Expected e.g. {{"topicA":[0,1],"topicB":[0,1]}}, got {value} ({exc})') from None
    if not pairs:
        raise KafkaOptionError(f"No topicpartitions to assign as specified value for option 'assign' is '{value}'")
    return pairs


def parse_strategy(opts: Mapping[str, str]) -> Strategy:
    chosen = [k for k in STRATEGY_OPTION_KEYS if k in opts]
    names = ", ".join(STRATEGY_OPTION_KEYS)
    if not chosen:
        raise KafkaOptionError(
            f"One of the following options must be specified for Kafka source: {names}. See the docs for more details."
        )
    if len(chosen) > 1:
        raise KafkaOptionError(
            f"Only one of the following options can be specified for Kafka source: {names}. "
            "See the docs for more details."
        )
    key = chosen[0]
    value = opts[key]
    if key == SUBSCRIBE:
        topics = tuple(t.strip() for t in value.split(",") if t.strip())
        if not topics:
            raise KafkaOptionError(f"No topics to subscribe to as specified value for option 'subscribe' is '{value}'")
        return Strategy(SUBSCRIBE, topics=topics)
    if key == SUBSCRIBE_PATTERN:
        pattern = value.strip()
        if not pattern:
            raise KafkaOptionError(
                f"Pattern to subscribe is empty as specified value for option 'subscribePattern' is '{value}'"
            )
        try:
            re.compile(pattern)
        except re.error as exc:
            raise KafkaOptionError(f"option 'subscribePattern' is not a valid regular expression: {exc}") from None
        return Strategy(SUBSCRIBE_PATTERN, pattern=pattern)
    return Strategy(ASSIGN, partitions=parse_assign(value))


def parse_partition_offsets(value: str, name: str) -> dict[TopicPartition, int]:
    """``{"topicA":{"0":23,"1":-1}}`` to ``{("topicA", 0): 23, ("topicA", 1): -1}``."""
    try:
        data = json.loads(value)
        result = {(str(t), int(p)): int(o) for t, parts in data.items() for p, o in parts.items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise KafkaOptionError(
            f"option '{name}' must be 'earliest', 'latest' or JSON like "
            f'{{"topicA":{{"0":23,"1":-1}}}}, got {value!r} ({exc})'
        ) from None
    for tp, offset in result.items():
        if offset < EARLIEST:
            raise KafkaOptionError(f"option '{name}': offset {offset} for {tp[0]}-{tp[1]} is below -2")
    return result


def offsets_to_json(offsets: Mapping[TopicPartition, int]) -> dict[str, dict[str, int]]:
    """The inverse of :func:`offsets_from_json`: Spark's offset layout, ready for ``json.dumps``."""
    out: dict[str, dict[str, int]] = {}
    for (topic, partition), offset in sorted(offsets.items()):
        out.setdefault(topic, {})[str(partition)] = int(offset)
    return out


def offsets_from_json(data: Mapping[str, Any] | str) -> dict[TopicPartition, int]:
    parsed: Mapping[str, Any] = json.loads(data) if isinstance(data, str) else data
    return {(str(t), int(p)): int(o) for t, parts in parsed.items() for p, o in parts.items()}


def parse_offset_spec(opts: Mapping[str, str], key: str, name: str, default: str) -> OffsetSpec:
    raw = opts.get(key, default).strip()
    lowered = raw.lower()
    if lowered in ("earliest", "latest"):
        return OffsetSpec(lowered, option=name)
    return OffsetSpec("specific", parse_partition_offsets(raw, name), option=name)


def _names(partitions: Iterable[TopicPartition]) -> str:
    return ", ".join(f"{t}-{p}" for t, p in sorted(partitions)) or "(none)"


def parse_partition_timestamps(value: str, name: str) -> dict[TopicPartition, int]:
    """``{"topicA":{"0":1700000000000}}`` to ``{("topicA", 0): 1700000000000}`` (epoch milliseconds)."""
    try:
        data = json.loads(value)
        result = {(str(t), int(p)): int(ts) for t, parts in data.items() for p, ts in parts.items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise KafkaOptionError(
            f'option \'{name}\' must be JSON like {{"topicA":{{"0":1700000000000,"1":1700000000000}}}} '
            f"(epoch milliseconds), got {value!r} ({exc})"
        ) from None
    if not result:
        raise KafkaOptionError(f"option '{name}' names no topic-partition: {value!r}")
    for (topic, partition), ts in result.items():
        if ts < 0:
            raise KafkaOptionError(f"option '{name}': timestamp {ts} for {topic}-{partition} is negative")
    return result


def _timestamp(raw: str, name: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise KafkaOptionError(
            f"option '{name}' must be a single epoch-milliseconds value (a whole number), got {raw!r}"
        ) from None
    if value < 0:
        raise KafkaOptionError(f"option '{name}' must not be negative, got {value}")
    return value


def parse_range_limit(opts: Mapping[str, str], *, starting: bool, streaming: bool) -> OffsetSpec:
    """Where to start (or end), with Spark's precedence: ``...Timestamp`` over ``...OffsetsByTimestamp`` over
    ``...Offsets``; a lower-precedence option given as well is ignored, as in Spark.

    ``startingOffsetsByTimestampStrategy`` (``error``, the default, or ``latest``) decides what a starting time
    after the last record of a partition means; an ending time there always means the end of the partition.
    """
    prefix = "starting" if starting else "ending"
    global_name, by_name = f"{prefix}Timestamp", f"{prefix}OffsetsByTimestamp"
    no_match = NO_MATCH_LATEST
    if starting:
        raw_strategy = opts.get("startingoffsetsbytimestampstrategy", NO_MATCH_ERROR).strip().lower()
        if raw_strategy not in (NO_MATCH_ERROR, NO_MATCH_LATEST):
            raise KafkaOptionError(
                "option 'startingOffsetsByTimestampStrategy' must be 'error' or 'latest', "
                f"got {opts['startingoffsetsbytimestampstrategy']!r}"
            )
        no_match = raw_strategy
    if global_name.lower() in opts:
        ts = _timestamp(opts[global_name.lower()], global_name)
        return OffsetSpec("timestamp", timestamp=ts, option=global_name, no_match=no_match)
    if by_name.lower() in opts:
        times = parse_partition_timestamps(opts[by_name.lower()].strip(), by_name)
        return OffsetSpec("timestamp", timestamps=times, option=by_name, no_match=no_match)
    name = f"{prefix}Offsets"
    default = ("latest" if streaming else "earliest") if starting else "latest"
    return parse_offset_spec(opts, name.lower(), name, default)


def _check_time_window(starting: OffsetSpec, ending: OffsetSpec) -> None:
    """A batch whose start time is after its end time is a mistake in the query, said here rather than read empty."""
    if starting.kind != "timestamp" or ending.kind != "timestamp":
        return
    names = set(starting.timestamps) | set(ending.timestamps)
    if starting.timestamp is not None and ending.timestamp is not None:
        if starting.timestamp > ending.timestamp:
            raise KafkaOptionError(
                f"startingTimestamp ({starting.timestamp}) is after endingTimestamp ({ending.timestamp})"
            )
        return
    for tp in sorted(names):
        start = starting.timestamp if starting.timestamp is not None else starting.timestamps.get(tp)
        end = ending.timestamp if ending.timestamp is not None else ending.timestamps.get(tp)
        if start is not None and end is not None and start > end:
            raise KafkaOptionError(f"{starting.option} for {tp[0]}-{tp[1]} ({start}) is after {ending.option} ({end})")


def parse_source_options(options: Mapping[str, str], *, streaming: bool) -> SourceOptions:
    """Validate reader options the way Spark's KafkaSourceProvider does (batch and streaming differ)."""
    opts = _lower(options)
    if streaming and "endingoffsets" in opts:
        raise KafkaOptionError("ending offset not valid in streaming queries")
    if streaming and ("endingoffsetsbytimestamp" in opts or "endingtimestamp" in opts):
        # Spark ignores endingTimestamp in a stream; refused here like every option that would be ignored.
        raise KafkaOptionError("ending timestamp not valid in streaming queries")
    for unsupported, why in _UNSUPPORTED_READ_OPTIONS.items():
        if unsupported.lower() in opts:
            raise KafkaOptionError(f"option '{unsupported}' is not supported by the pykafka source: {why}")
    strategy = parse_strategy(opts)
    config = client_config(opts, _CONSUMER_REJECTED)
    starting = parse_range_limit(opts, starting=True, streaming=streaming)
    ending = parse_range_limit(opts, starting=False, streaming=streaming)
    if not streaming:
        if starting.kind == "latest":
            raise KafkaOptionError("starting offset can't be latest for batch queries on Kafka")
        for tp, off in starting.offsets.items():
            if off == LATEST:
                raise KafkaOptionError(
                    f"startingOffsets for {tp[0]}-{tp[1]} can't be latest for batch queries on Kafka"
                )
        if ending.kind == "earliest":
            raise KafkaOptionError("ending offset can't be earliest for batch queries on Kafka")
        for tp, off in ending.offsets.items():
            if off == EARLIEST:
                raise KafkaOptionError(
                    f"ending offset for {tp[0]}-{tp[1]} can't be earliest for batch queries on Kafka"
                )
        if starting.kind == "specific" and ending.kind == "specific":
            if set(starting.offsets) != set(ending.offsets):
                raise KafkaOptionError(
                    "startingOffsets and endingOffsets must name the same topic-partitions: "
                    f"{sorted(starting.offsets)} vs {sorted(ending.offsets)}"
                )
            for tp, start in starting.offsets.items():
                end = ending.offsets[tp]
                if start >= 0 and end >= 0 and start > end:
                    raise KafkaOptionError(
                        f"startingOffsets for {tp[0]}-{tp[1]} ({start}) is greater than endingOffsets ({end})"
                    )
        _check_time_window(starting, ending)
    if strategy.kind == ASSIGN:
        assigned = set(strategy.partitions)
        for spec in (starting, ending):
            name = spec.option
            extra = (set(spec.offsets) | set(spec.timestamps)) - assigned
            if extra:
                raise KafkaOptionError(f"{name} names partitions that are not assigned: {sorted(extra)}")
    poll = _positive_int(opts, "kafkaconsumer.polltimeoutms", "kafkaConsumer.pollTimeoutMs")
    return SourceOptions(
        bootstrap_servers=config["bootstrap.servers"].strip(),
        strategy=strategy,
        starting=starting,
        ending=ending,
        min_partitions=_positive_int(opts, "minpartitions", "minPartitions"),
        max_offsets_per_trigger=_positive_int(opts, "maxoffsetspertrigger", "maxOffsetsPerTrigger"),
        fail_on_data_loss=_bool(opts, "failondataloss", True, "failOnDataLoss"),
        include_headers=_bool(opts, "includeheaders", False, "includeHeaders"),
        poll_timeout_ms=poll or DEFAULT_POLL_TIMEOUT_MS,
        client_config={k: v for k, v in config.items() if k != "bootstrap.servers"},
        max_batch_bytes=_positive_int(opts, "maxbatchbytes", "maxBatchBytes") or DEFAULT_MAX_BATCH_BYTES,
    )


def parse_sink_options(options: Mapping[str, str]) -> SinkOptions:
    opts = _lower(options)
    if opts.get("kafka.acks", "").strip().lower() in ("all", "-1"):
        del opts["kafka.acks"]  # what the writer does anyway
    try:
        config = client_config(opts, _PRODUCER_REJECTED)
    except KafkaOptionError as exc:
        raise KafkaOptionError(str(exc).replace("Kafka consumer", "Kafka producer")) from None
    topic = opts.get("topic")
    return SinkOptions(
        bootstrap_servers=config["bootstrap.servers"].strip(),
        topic=topic.strip() if topic and topic.strip() else None,
        client_config={k: v for k, v in config.items() if k != "bootstrap.servers"},
    )


def include_headers(options: Mapping[str, str]) -> bool:
    return _bool(_lower(options), "includeheaders", False, "includeHeaders")
