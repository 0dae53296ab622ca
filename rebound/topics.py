"""Every topic name Rebound derives, in one place, so producers, agents, views and the pipeline agree."""

from __future__ import annotations

from collections.abc import Iterable

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


def parse_tier_topic(name: str, main_topics: Iterable[str]) -> tuple[str, str] | None:
    """``items.retry.30m`` gives ``("items", "30m")`` when ``items`` is a main topic and ``30m`` a duration."""
    from rebound.errors import ConfigurationError
    from rebound.policy import parse_duration_ms

    main, infix, label = name.partition(RETRY_INFIX)
    if not infix or main not in set(main_topics):
        return None
    try:
        parse_duration_ms(label, variable="tier topic")
    except ConfigurationError:
        return None
    return main, label
