"""The configs Rebound creates its topics with: a retention by what each topic is for, and a record size limit that
admits every record Rebound itself produces.

Only topics Rebound creates get them; topics that exist already keep what their operators set (changing a live
topic's retention is an operator's decision, not a side effect of a worker starting).
"""

from __future__ import annotations

from rebound.settings import Settings
from rebound.topics import (
    CHANGELOG_SUFFIX,
    admin_topic,
    attempts_topic,
    control_topic,
    failed_topic,
    release_topic,
    status_topic,
    tier_topic,
)

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
TIER_RETENTION_MS = 7 * DAY_MS
"""A tier record is parked as soon as it is read; the retention covers workers being down, not the delay."""
STATUS_RETENTION_MS = HOUR_MS
"""Workers publish a summary every few seconds and only the latest of each counts."""
RELEASE_RETENTION_MS = HOUR_MS
"""A release request is read within moments, and one that was not is sent again by the schedule."""
ADMIN_RETENTION_MS = DAY_MS
"""Operator commands are applied within seconds; a day keeps them readable for an investigation."""
BATCH_OVERHEAD_BYTES = 1024
"""``max.message.bytes`` limits a whole record batch: room for the batch header over the largest record."""
KAFKA_DEFAULT_MAX_MESSAGE_BYTES = 1_048_588


def topic_configs(topic: str, settings: Settings) -> dict[str, str]:
    """The configs ``topic`` is created with; empty for a main topic (the application's, not Rebound's)."""
    max_bytes = max(KAFKA_DEFAULT_MAX_MESSAGE_BYTES, settings.producer_max_request_bytes + BATCH_OVERHEAD_BYTES)
    if topic == control_topic(settings.app_id):
        # The pause state: compacted, never deleted by age (Kafka keeps the latest record of each key of a compacted
        # topic), so a pause outlasts any stop of the whole cluster. ``retention.ms=-1`` in case an operator later
        # adds ``delete`` to the policy.
        return {"cleanup.policy": "compact", "retention.ms": "-1", "max.message.bytes": str(max_bytes)}
    if topic.startswith(f"{settings.app_id}-") and topic.endswith(CHANGELOG_SUFFIX):
        # A table's changelog, as Faust declares it (``Collection._new_changelog_topic``: compacted, no retention):
        # the latest record of each key is the table.
        return {"cleanup.policy": "compact", "max.message.bytes": str(max_bytes)}
    retention = _retention_ms(topic, settings)
    if retention is None:
        return {}
    return {"cleanup.policy": "delete", "retention.ms": str(retention), "max.message.bytes": str(max_bytes)}


def _retention_ms(topic: str, settings: Settings) -> int | None:
    app_id = settings.app_id
    fixed = {
        attempts_topic(app_id): settings.attempts_retention_ms,
        release_topic(app_id): RELEASE_RETENTION_MS,
        status_topic(app_id): STATUS_RETENTION_MS,
        admin_topic(app_id): ADMIN_RETENTION_MS,
    }
    if topic in fixed:
        return fixed[topic]
    for main in settings.topics:
        if topic == failed_topic(main):
            return settings.failed_retention_ms
        if topic.startswith(tier_topic(main, "")):
            return TIER_RETENTION_MS
    return None
