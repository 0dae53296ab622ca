"""Sleep-until-due retry: failures go at once to one retry topic; a second agent sleeps until each record is due.

The main topic never blocks, but the retry topic does: one record sleeping holds every record behind it (a longer
delay in front of a shorter one, or a consumer that sleeps past ``max.poll.interval.ms`` on a real cluster). Headers
``attempt`` and ``due`` (epoch ms) travel with the record.

``BENCH_RETRY_SEQUENCE`` (seconds, comma-separated, e.g. ``2,30``) gives retry ``n`` the ``n``-th delay (the last
one repeats), so one retry topic carries several delays, as in the ``mixed-delays`` scenario; without it every
retry waits ``BENCH_DELAY``. ``BENCH_MAX_POLL_INTERVAL`` (seconds) sets Faust's ``broker_max_poll_interval``
(aiokafka's ``max_poll_interval_ms``) for the ``long-delay`` scenario; with ``BENCH_REBALANCE_LOG`` each partition
assignment and revocation is appended there as a JSON line, so a scenario can see the group rebalance.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from bench.baselines._app import env_float, make_app, raw_topic
from bench.handlers import call

app = make_app()
source = raw_topic(app, os.environ["BENCH_TOPIC"])
retry = raw_topic(app, os.environ["BENCH_TOPIC"] + ".retry")
DELAY_MS = int(env_float("BENCH_DELAY", 5.0) * 1000)
MAX_ATTEMPTS = int(os.environ.get("BENCH_MAX_ATTEMPTS", "10"))
SEQUENCE_MS = [int(float(s) * 1000) for s in os.environ.get("BENCH_RETRY_SEQUENCE", "").split(",") if s.strip()]
if os.environ.get("BENCH_MAX_POLL_INTERVAL"):
    app.conf.broker_max_poll_interval = env_float("BENCH_MAX_POLL_INTERVAL", 1000.0)


def _log_rebalance(kind: str, partitions: set) -> None:  # type: ignore[type-arg]
    path = os.environ.get("BENCH_REBALANCE_LOG")
    if path:
        line = {"event": kind, "t": now_ms(), "partitions": sorted(f"{tp.topic}:{tp.partition}" for tp in partitions)}
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps(line) + "\n")


@app.on_partitions_assigned.connect
async def _assigned(sender, assigned, **kwargs):  # type: ignore[no-untyped-def]
    _log_rebalance("assigned", assigned)


@app.on_partitions_revoked.connect
async def _revoked(sender, revoked, **kwargs):  # type: ignore[no-untyped-def]
    _log_rebalance("revoked", revoked)


def delay_ms(attempt: int) -> int:
    """The delay before retry ``attempt + 1``."""
    if not SEQUENCE_MS:
        return DELAY_MS
    return SEQUENCE_MS[min(attempt, len(SEQUENCE_MS) - 1)]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def forward(event, attempt: int) -> None:  # type: ignore[no-untyped-def]
    if attempt + 1 >= MAX_ATTEMPTS:
        return
    headers = [("attempt", str(attempt + 1).encode()), ("due", str(now_ms() + delay_ms(attempt)).encode())]
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
