"""A bare Faust agent that calls a Rebound handler (``BENCH_HANDLER``, ``module:callable``) once per record.

The baseline of the ``concurrency`` scenario: the same handler as Rebound's worker gets, with the same
``RetryEvent`` (attempt 0), and nothing else: no retries, no attempt events, no tables. Concurrency 1, as a Faust
agent must be for per-key order and for commits that never pass a record still in flight (faust-streaming#606).
"""

from __future__ import annotations

import os

from app.handlers import load_handler
from bench.baselines._app import make_app, raw_topic
from rebound.event import RetryEvent

app = make_app()
source = raw_topic(app, os.environ["BENCH_TOPIC"])
handler = load_handler(os.environ["BENCH_HANDLER"])


@app.agent(source, concurrency=1)
async def handle(stream):  # type: ignore[no-untyped-def]
    async for event in stream.events():
        message = event.message
        await handler(
            RetryEvent(
                key=message.key,
                value=message.value,
                headers={},
                topic=message.topic,
                partition=message.partition,
                offset=message.offset,
                attempt=0,
                timestamp_ms=int((message.timestamp or 0) * 1000),
            )
        )
