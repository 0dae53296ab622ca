"""What every group-less reader of a topic needs (status, control, failed topics, replay): one way to make its
consumer and one way to wait for a topic's partitions to show up in the metadata."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


def groupless_consumer(
    bootstrap: str, *, auto_offset_reset: str, fetch_max_wait_ms: int, isolation_level: str = "read_committed"
) -> Any:
    """A consumer outside any group (no commits, no rebalances): it reads what it assigns itself. Not started.

    Every such reader reads a topic only Rebound writes (status, control, failed), and Rebound's producer is never
    transactional, so both isolation levels read the same records there; read_committed, the worker's default, keeps
    a tool that writes one of them in a transaction from showing what it aborted.
    """
    from aiokafka import AIOKafkaConsumer

    return AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset=auto_offset_reset,
        fetch_max_wait_ms=fetch_max_wait_ms,
        isolation_level=isolation_level,
    )


async def topic_partitions(
    consumer: Any,
    topic: str,
    *,
    tries: int | None,
    every_s: float,
    on_wait: Callable[[int], None] | None = None,
) -> set[int]:
    """The partition numbers of ``topic`` (empty if still unknown after ``tries`` more metadata requests; ``None``
    asks until it is known). ``on_wait(n)`` is told of the n-th wait."""
    found = consumer.partitions_for_topic(topic)
    waited = 0
    while not found and (tries is None or waited < tries):
        await consumer._client.force_metadata_update()
        await asyncio.sleep(every_s)
        waited += 1
        if on_wait is not None:
            on_wait(waited)
        found = consumer.partitions_for_topic(topic)
    return set(found or ())
