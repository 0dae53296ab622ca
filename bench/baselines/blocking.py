"""Blocking retry: the agent retries a failing message in place, ``asyncio.sleep(BENCH_DELAY)`` between attempts.

The simplest retry there is, and the one Rebound exists to avoid: while it sleeps, no other message of the agent
(on any partition this worker owns, since a Faust agent with concurrency 1 is one coroutine) moves.
"""

from __future__ import annotations

import asyncio
import os

from bench.baselines._app import env_float, make_app, raw_topic
from bench.handlers import call

app = make_app()
source = raw_topic(app, os.environ["BENCH_TOPIC"])
DELAY = env_float("BENCH_DELAY", 5.0)
MAX_ATTEMPTS = int(os.environ.get("BENCH_MAX_ATTEMPTS", "10"))


@app.agent(source)
async def blocking(stream):  # type: ignore[no-untyped-def]
    async for event in stream.events():
        for attempt in range(MAX_ATTEMPTS):
            if call(event.key, event.value, attempt):
                break
            await asyncio.sleep(DELAY)
