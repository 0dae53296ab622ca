"""Create the topics Rebound derives (tiers, failed, attempts, release, the tables' changelogs) with the main topics'
partition count.

Co-partitioning is what lets a worker release only what it owns: the tier, release and changelog partitions with the
same number as a main-topic partition land on the same worker, so every topic must have the same partition count.
The one exception is ``<app id>.control`` (the operator's pause of the main topics, ``agents/control.py``): one
partition by design, read whole by every worker, compacted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rebound.errors import ConfigurationError, ReboundError
from rebound.settings import Settings
from rebound.tiers import Tiers
from rebound.topic_configs import topic_configs
from rebound.topics import (
    CONTROL_PARTITIONS,
    admin_topic,
    attempts_topic,
    changelog_topic,
    control_topic,
    failed_topic,
    release_topic,
    status_topic,
    tier_topic,
)
from tables.retry_state import PAYLOAD_TABLE, STATE_TABLE

log = logging.getLogger(__name__)
DEFAULT_PARTITIONS = 4
PROVISION_TIMEOUT_S = 60.0
"""How long start-up waits for the broker to answer topic provisioning."""


class BrokerUnavailableError(ReboundError):
    """Topic provisioning got no answer from ``REBOUND_BROKER``, or failed for a reason the broker reported: not a
    setting found wrong (that is a :class:`ConfigurationError`), so a later start may succeed (a broker that was down,
    restarting, or not reachable yet). ``faust -A app worker`` exits with status 75 on it (``app/startup.py``)."""


def derived_topics(settings: Settings) -> list[str]:
    """The co-partitioned topics Rebound derives (not the control topic: see :func:`plan_topics`)."""
    topics = []
    for main in settings.topics:
        topics += [tier_topic(main, label) for label in settings.policy.tier_labels]
        topics.append(failed_topic(main))
    topics += [attempts_topic(settings.app_id), release_topic(settings.app_id)]
    topics += [status_topic(settings.app_id), admin_topic(settings.app_id)]
    return topics


def changelog_topics(settings: Settings) -> list[str]:
    """The tables' changelogs. Created here, before the worker starts, rather than left to Faust's declaration when
    its tables start: a broker that creates a topic on a metadata request (Tansu; Kafka's default) would otherwise
    create one with its default partition count as soon as anything asks about it first."""
    return [changelog_topic(settings.app_id, table) for table in (STATE_TABLE, PAYLOAD_TABLE)]


@dataclass(frozen=True)
class Provisioned:
    """The partition count every Rebound topic shares, and tiers of earlier retry sequences still to drain."""

    partitions: int
    draining_tiers: tuple[str, ...] = ()


def draining_tiers(settings: Settings, existing_topics: Iterable[str]) -> tuple[str, ...]:
    """Tier topics of a main topic that the current sequence no longer uses.

    Records in them were sent under an earlier ``REBOUND_RETRY_SEQUENCE``; they keep being read and parked, so a
    reconfiguration never strands a message in a topic nobody consumes.
    """
    return Tiers.build(settings.topics, settings.policy, existing_topics).draining


async def _provision(settings: Settings, create: bool) -> Provisioned:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers, request_timeout_ms=15_000)
    await admin.start()
    try:
        old_tiers = draining_tiers(settings, await admin.list_topics())
        wanted = [*settings.topics, *derived_topics(settings), *changelog_topics(settings), *old_tiers]
        wanted.append(control_topic(settings.app_id))
        partitions, missing = plan_topics(settings, await _partition_counts(admin, wanted))
        if missing and create:
            log.info("creating topics %s (partitions: %d; the control topic 1)", list(missing), partitions)
            await admin.create_topics(
                [
                    NewTopic(
                        topic,
                        count,
                        settings.replication_factor,
                        topic_configs=topic_configs(topic, settings),
                    )
                    for topic, count in missing.items()
                ]
            )
        elif missing:
            raise ConfigurationError(f"topics {list(missing)} are missing and REBOUND_PROVISION_TOPICS is off")
        if old_tiers:
            log.info("draining tier topics of an earlier retry sequence: %s", ", ".join(old_tiers))
        return Provisioned(partitions, old_tiers)
    finally:
        await admin.close()


def plan_topics(settings: Settings, existing: dict[str, int]) -> tuple[int, dict[str, int]]:
    """From the partition counts of the topics that exist: the count every co-partitioned topic shares, and the
    missing topics with the count each is to be created with. Raises ``ConfigurationError`` on a mismatch.

    The control topic is left out of the co-partitioning check: it must have exactly one partition.
    """
    control = control_topic(settings.app_id)
    main_counts = {topic: existing[topic] for topic in settings.topics if topic in existing}
    if len(set(main_counts.values())) > 1:
        raise ConfigurationError(
            f"REBOUND_MAIN_TOPICS: main topics must have the same partition count, found {main_counts}"
        )
    partitions = next(iter(main_counts.values()), settings.partitions or DEFAULT_PARTITIONS)
    if settings.partitions is not None and settings.partitions != partitions:
        raise ConfigurationError(
            f"REBOUND_PARTITIONS={settings.partitions} but the main topics have {partitions} partitions"
        )
    for changelog in changelog_topics(settings):
        if changelog in existing and existing[changelog] != partitions:
            raise ConfigurationError(
                f"the changelog topic {changelog} has {existing[changelog]} partitions but the main topics have "
                f"{partitions}: every write to its table would fail (Faust's PartitionsMismatch). A broker that "
                f"creates topics on a metadata request makes one with its default count if asked before the tables "
                f"start; if it holds no retry state yet, delete it and start again (Rebound creates it), otherwise "
                f"recreate it with {partitions} partitions from its records"
            )
    wrong = {topic: count for topic, count in existing.items() if count != partitions and topic != control}
    if wrong:
        raise ConfigurationError(
            f"topics {wrong} do not have the main topics' {partitions} partitions; co-partitioning is required"
        )
    if control in existing and existing[control] != CONTROL_PARTITIONS:
        raise ConfigurationError(
            f"the control topic {control} has {existing[control]} partitions; it must have exactly "
            f"{CONTROL_PARTITIONS} (and cleanup.policy=compact): delete it and let Rebound create it, or create it so"
        )
    partitioned = [*settings.topics, *derived_topics(settings), *changelog_topics(settings)]
    missing = {topic: partitions for topic in partitioned if topic not in existing}
    if control not in existing:
        missing[control] = CONTROL_PARTITIONS
    return partitions, missing


async def _partition_counts(admin: Any, topics: list[str]) -> dict[str, int]:
    # Describe only topics that exist: brokers with auto-creation on (the embedded one) would create the rest, with
    # their default partition count, just by being asked about them.
    existing = set(await admin.list_topics())
    wanted = [topic for topic in topics if topic in existing]
    if not wanted:
        return {}
    counts: dict[str, int] = {}
    for description in await admin.describe_topics(wanted):
        if description.get("error_code", 0) == 0 and description.get("partitions"):
            counts[description["topic"]] = len(description["partitions"])
    return counts


def provision(settings: Settings, *, create: bool = True) -> Provisioned:
    """Return the partition count shared by all of Rebound's topics (creating missing topics first) and old tiers.

    Runs on a private thread and event loop: it is called while the app module is being imported, before (or while)
    Faust owns the main loop, which must not be touched. Raises :class:`ConfigurationError` for what the settings get
    wrong (see :func:`plan_topics`; missing topics with ``REBOUND_PROVISION_TOPICS`` off), and
    :class:`BrokerUnavailableError` for anything else: no answer within :data:`PROVISION_TIMEOUT_S`, a connection
    refused, an error the broker or the client reported.
    """
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = asyncio.run(_provision(settings, create))
        except BaseException as exc:
            result["error"] = exc

    client_log = logging.getLogger("aiokafka")
    held = _HeldWarnings() if not client_log.hasHandlers() else None
    if held is not None:
        client_log.addHandler(held)
    thread = threading.Thread(target=run, name="rebound-provision", daemon=True)
    try:
        thread.start()
        thread.join(PROVISION_TIMEOUT_S)
    finally:
        if held is not None:
            client_log.removeHandler(held)
    if "error" in result or "value" not in result:
        error = result.get("error")
        if isinstance(error, ConfigurationError):
            raise error
        what = f"could not provision topics: {error!r}" if error else f"no answer within {PROVISION_TIMEOUT_S:g}s"
        last = held.last_message() if held is not None else ""
        raise BrokerUnavailableError(
            f"REBOUND_BROKER={settings.broker}: {what}{f' ({last})' if last else ''}"
        ) from error
    if held is not None:
        held.pass_on()
    provisioned: Provisioned = result["value"]
    return provisioned


class _HeldWarnings(logging.Handler):
    """The Kafka client's warnings during provisioning, held while nothing but Python's last resort would print them
    (Faust's command line sets logging up later): a failure's one line ends with the last one (``Connect call failed``,
    the reason), a success lets them all through as they would have gone."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def last_message(self) -> str:
        return " ".join(self.records[-1].getMessage().split()) if self.records else ""

    def pass_on(self) -> None:
        for record in self.records:
            logging.getLogger(record.name).handle(record)
