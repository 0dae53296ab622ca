"""Retry tiers as objects built once from the configuration, never re-parsed from topic names.

A tier topic name such as ``pay.retry.retry.1s`` cannot be split back into its main topic and delay reliably (the main
topic may itself contain ``.retry``), so every consumer of tier names (provisioning, agents, views) looks the tier up
in a :class:`Tiers` map built from the configured main topics and policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from rebound.errors import ConfigurationError, InvalidRetryHeadersError
from rebound.headers import RetryHeaders
from rebound.policy import RetryPolicy, format_duration, parse_duration_ms
from rebound.topics import (
    admin_topic,
    attempts_topic,
    control_topic,
    failed_topic,
    release_topic,
    status_topic,
    tier_topic,
)

CLOCK_SKEW_TOLERANCE_MS = 60_000


@dataclass(frozen=True, slots=True)
class Tier:
    """One delay tier of one main topic: where its records come from and how long they wait."""

    main_topic: str
    label: str
    delay_ms: int
    draining: bool = False

    @property
    def topic(self) -> str:
        return tier_topic(self.main_topic, self.label)

    def validate(
        self,
        parsed: RetryHeaders,
        *,
        group: str,
        partition: int,
        partitions: int,
        record_timestamp_ms: int,
        now_ms: int,
        skew_tolerance_ms: int = CLOCK_SKEW_TOLERANCE_MS,
        longest_wait_ms: int = 0,
    ) -> None:
        """Checks a tier record's headers must pass against the tier it arrived on; raises InvalidRetryHeadersError.

        The due time is bounded by the tier's delay (plus the clock-skew tolerance) after the record's timestamp, or
        after the worker's own clock where the timestamp is missing (0, -1) or further ahead than the tolerance: a
        forged or broken timestamp cannot park a message for ever and fill its key's backlog, and a parking worker
        whose clock lags the forwarding one (within the tolerance) still accepts genuine records. A due time later
        than the delay, up to ``longest_wait_ms`` (``REBOUND_RETRY_AFTER_MAX``), is a ``Retry-After`` honoured
        (``rebound.routing.decide``), accepted too.
        """
        if parsed.provenance.topic != self.main_topic:
            raise InvalidRetryHeadersError(
                f"original topic {parsed.provenance.topic!r} does not own tier {self.topic!r}"
            )
        if parsed.group != group:
            raise InvalidRetryHeadersError(f"group {parsed.group!r} is not this application's {group!r}")
        if parsed.provenance.partition % partitions != partition:
            raise InvalidRetryHeadersError(
                f"original partition {parsed.provenance.partition} does not map to tier partition {partition}"
            )
        # The record's timestamp is the forwarding worker's clock: trusted within the skew tolerance of ours.
        trusted = 0 < record_timestamp_ms <= now_ms + skew_tolerance_ms
        reference = record_timestamp_ms if trusted else now_ms
        latest = reference + max(self.delay_ms, longest_wait_ms) + skew_tolerance_ms
        if parsed.due_at_ms > latest:
            raise InvalidRetryHeadersError(
                f"due time {parsed.due_at_ms} is more than the tier's {self.label} (or REBOUND_RETRY_AFTER_MAX, plus "
                f"{skew_tolerance_ms} ms of clock skew) after {reference}"
            )


def _tier_of(name: str, main_topics: Iterable[str]) -> Tier | None:
    """The tier of ``name`` if it is ``<main>.retry.<duration>`` for one of ``main_topics`` (longest main first)."""
    for main in sorted(main_topics, key=len, reverse=True):
        prefix = tier_topic(main, "")
        if not name.startswith(prefix):
            continue
        label = name[len(prefix) :]
        try:
            delay = parse_duration_ms(label, variable="tier topic")
        except ConfigurationError:
            continue
        if format_duration(delay) == label:  # only canonical labels are tiers Rebound could have created
            return Tier(main, label, delay, draining=True)
    return None


@dataclass(frozen=True)
class Tiers(Mapping[str, Tier]):
    """Tier topic name to :class:`Tier`: the current policy's tiers plus tiers of earlier sequences still draining.

    Iterated main topic by main topic as configured, each one's tiers by delay (``2s, 5s, 10s``, never by name,
    which would put ``10s`` first; nor in the sequence's order: ``1m,10s`` lists ``10s`` first), the order every view
    of the tiers shows (the backlog, the history, the command line, the dashboard)."""

    by_topic: Mapping[str, Tier]

    @classmethod
    def build(cls, main_topics: Iterable[str], policy: RetryPolicy, existing_topics: Iterable[str] = ()) -> Tiers:
        mains = tuple(main_topics)
        tiers: dict[str, Tier] = {}
        for main in mains:
            for label in policy.tier_labels:
                tier = Tier(main, label, parse_duration_ms(label, variable="REBOUND_RETRY_SEQUENCE"))
                tiers[tier.topic] = tier
        for name in sorted(existing_topics):
            if name in mains:  # a main topic is never taken for another's old tier, whatever its name
                continue
            if name not in tiers and (old := _tier_of(name, mains)) is not None:
                tiers[name] = old
        rank = {main: index for index, main in enumerate(mains)}
        ordered = sorted(tiers.values(), key=lambda tier: (rank[tier.main_topic], tier.delay_ms, tier.topic))
        return cls({tier.topic: tier for tier in ordered})

    def __getitem__(self, topic: str) -> Tier:
        return self.by_topic[topic]

    def __iter__(self) -> Iterator[str]:
        return iter(self.by_topic)

    def __len__(self) -> int:
        return len(self.by_topic)

    def tier_for(self, main_topic: str, label: str) -> Tier:
        return self.by_topic[tier_topic(main_topic, label)]

    @property
    def draining(self) -> tuple[str, ...]:
        return tuple(topic for topic, tier in self.by_topic.items() if tier.draining)


def check_topic_names(main_topics: Iterable[str], policy: RetryPolicy, app_id: str) -> None:
    """Refuse a configuration in which two of Rebound's topics would share a name, naming the topic.

    Tier names cannot collide with each other for canonical labels, but a main topic can be named like another main
    topic's tier, failed or internal topic (``items.failed`` as a main topic next to ``items``); one topic would then
    carry two kinds of records and a message could be taken for what it is not.
    """
    mains = tuple(main_topics)
    owners: dict[str, str] = {main: f"main topic {main!r}" for main in mains}

    def claim(name: str, what: str) -> None:
        if name in owners:
            raise ConfigurationError(
                f"REBOUND_MAIN_TOPICS: topic {name!r} would be both the {owners[name]} and the {what}; rename one"
            )
        owners[name] = what

    for internal, what in (
        (attempts_topic(app_id), "attempts topic"),
        (release_topic(app_id), "release topic"),
        (status_topic(app_id), "status topic"),
        (admin_topic(app_id), "admin topic"),
        (control_topic(app_id), "control topic"),
    ):
        claim(internal, what)
    for main in mains:
        claim(failed_topic(main), f"failed topic of {main!r}")
        for label in policy.tier_labels:
            claim(tier_topic(main, label), f"{label} tier of {main!r}")
