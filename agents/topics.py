"""One constructor for the topics Rebound reads and writes byte for byte (raw keys and values, no codec)."""

from __future__ import annotations

from typing import Any

import faust


def raw_topic(app: faust.App, *names: str, partitions: int | None = None, maxsize: int | None = None) -> Any:
    """Keys and values pass as bytes, untouched: a dead letter must be the original record byte-exact, and internal
    records (release requests, status, commands) are Rebound's own JSON. Several names make one channel over all of
    them (the main agent's, when there are several main topics). ``maxsize`` bounds the stream queue of an agent
    reading it (Faust's ``stream_buffer_maxsize`` when None)."""
    topic = app.topic(
        *names,
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
        partitions=partitions,
    )
    # faust-streaming 0.15.3's App.topic takes ``maxsize`` but never passes it on: set on the topic, every clone (an
    # agent's stream) keeps it and sizes its queue from it (pinned in tests/contract).
    topic.maxsize = maxsize
    return topic
