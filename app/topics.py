"""One constructor for the topics Rebound reads and writes byte for byte (raw keys and values, no codec)."""

from __future__ import annotations

from typing import Any

import faust


def raw_topic(app: faust.App, *names: str, partitions: int | None = None) -> Any:
    """Keys and values pass as bytes, untouched: a dead letter must be the original record byte-exact, and internal
    records (release requests, status, commands) are Rebound's own JSON. Several names make one channel over all of
    them (the main agent's, when there are several main topics)."""
    return app.topic(
        *names,
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
        partitions=partitions,
    )
