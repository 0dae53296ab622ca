"""A handler standing in for a service of limited capacity, for the adaptive concurrency test: it serves
``$CAPACITY_SLOTS`` calls at once, each for ``$CAPACITY_SERVICE_MS``, and queues the rest (the wait adds to their
latency, as a saturated service's queue does). Every call is appended to ``$SCRIPTED_CALLS`` with how many calls were
at the service when it arrived (served and queued, itself included)."""

from __future__ import annotations

import asyncio
import json
import os
import time

from rebound.event import RetryEvent

SLOTS = int(os.environ.get("CAPACITY_SLOTS", "4"))
SERVICE_S = float(os.environ.get("CAPACITY_SERVICE_MS", "20")) / 1000
_service = asyncio.Semaphore(SLOTS)
_present = [0]
"""Calls at the service now, served and queued."""


async def handle(event: RetryEvent) -> None:
    _present[0] += 1
    arrived = _present[0]
    try:
        async with _service:
            await asyncio.sleep(SERVICE_S)
    finally:
        _present[0] -= 1
    path = os.environ.get("SCRIPTED_CALLS")
    if path:
        line = {
            "key": (event.key or b"").decode(),
            "offset": event.offset,
            "at_service": arrived,
            "now_ms": time.time_ns() // 1_000_000,
        }
        with open(path, "a", encoding="utf-8") as calls:
            calls.write(json.dumps(line) + "\n")
