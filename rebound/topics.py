"""Every topic name Rebound derives, in one place, so producers, agents, views and the pipeline agree."""

from __future__ import annotations

RETRY_INFIX = ".retry."
FAILED_SUFFIX = ".failed"


def tier_topic(main_topic: str, delay_label: str) -> str:
    """``items`` and ``30m`` give ``items.retry.30m``: one topic per distinct delay, never mixed."""
    return f"{main_topic}{RETRY_INFIX}{delay_label}"


def failed_topic(main_topic: str) -> str:
    return f"{main_topic}{FAILED_SUFFIX}"


def attempts_topic(app_id: str) -> str:
    return f"{app_id}.attempts"


def release_topic(app_id: str) -> str:
    """Internal topic through which timers ask the owning stream to release due messages."""
    return f"{app_id}.release"


def status_topic(app_id: str) -> str:
    """Internal: every worker's periodic backlog summary, read by every worker for the cluster-wide view."""
    return f"{app_id}.status"


def admin_topic(app_id: str) -> str:
    """Internal: operator commands (dead-letter, retry-now), co-partitioned with the state table."""
    return f"{app_id}.admin"


CHANGELOG_SUFFIX = "-changelog"


def changelog_topic(app_id: str, table: str) -> str:
    """Faust's name for a table's changelog (``Collection._changelog_topic_name``): ``<app id>-<table>-changelog``."""
    return f"{app_id}-{table}{CHANGELOG_SUFFIX}"


CONTROL_PARTITIONS = 1
"""The control topic has one partition, whatever the main topics have: every worker reads all of it."""


def control_topic(app_id: str) -> str:
    """Internal: the operator's pause of the main topics, one partition, compacted (the latest record of its one key is
    the cluster's state; no time-based deletion, so a pause outlasts any stop of the cluster)."""
    return f"{app_id}.control"
