"""Sleep-until-due retry: failures go at once to one retry topic; a second agent sleeps until each record is due.

The main topic never blocks, but the retry topic does: one record sleeping holds every record behind it (a longer
delay in front of a shorter one, or a consumer that sleeps past ``max.poll.interval.ms`` on a real cluster). Headers
``attempt`` and ``due`` (epoch ms) travel with the record.
"""

from __future__ import annotations

import asyncio
import os
import time

from bench.baselines._app import env_float, make_app, raw_topic
from bench.handlers import call

app = make_app()
source = raw_topic(app, os.environ["BENCH_TOPIC"])
retry = raw_topic(app, os.environ["BENCH_TOPIC"] + ".retry")
DELAY_MS = int(env_float("BENCH_DELAY", 5.0) * 1000)
MAX_ATTEMPTS = int(os.environ.get("BENCH_MAX_ATTEMPTS", "10"))


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def forward(event, attempt: int) -> None:  # type: ignore[no-untyped-def]
    if attempt + 1 >= MAX_ATTEMPTS:
        return
    headers = [("attempt", str(attempt + 1).encode()), ("due", str(now_ms() + DELAY_MS).encode())]
    await retry.send(key=event.key, value=event.value, headers=headers, partition=event.message.partition)


@app.agent(source)
async def main(stream):  # type: ignore[no-untyped-def]
    async for event in stream.events():
        if not call(event.key, event.value, 0):
            await forward(event, 0)


@app.agent(retry)
async def retrier(stream):  # type: ignore[no-untyped-def]
    async for event in stream.events():
        headers = dict(event.headers or {})
        attempt = int(headers.get("attempt", b"1"))
        wait_ms = int(headers.get("due", b"0")) - now_ms()
        if wait_ms > 0:
            await asyncio.sleep(wait_ms / 1000)
        if not call(event.key, event.value, attempt):
            await forward(event, attempt)
