"""A handler whose one call waits on a file the test controls, for the worker tests of a partition moving while a
first try runs (``tests/integration/test_revoked_first_try.py``, ``tests/integration/test_finished_not_run_again.py``).

``$GATE_DIR`` holds the flags. A record whose value is ``{"gated": "permanent"}`` (or ``"retryable"``) claims the file
``hold`` there when its call starts, by renaming it to ``held-<pid>`` (atomic: one call in all the workers claims it);
that call then waits until the file ``release`` exists, and fails as its value says (``"succeed"``: it succeeds). Every other call, and every call
once ``hold`` is claimed, goes to the scripted handler (``tests/scripted_handler.py``: ``{}`` succeeds). Every call is
appended to ``$SCRIPTED_CALLS`` with its pid, as the scripted handler does, the held one with ``"held": true``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from rebound import PermanentError, RetryableError, RetryEvent
from tests.scripted_handler import CALLS_ENV
from tests.scripted_handler import handle as scripted

GATE_ENV = "GATE_DIR"
POLL_S = 0.02


def claimed(gate: Path) -> bool:
    try:
        (gate / "hold").rename(gate / f"held-{os.getpid()}")
    except FileNotFoundError:
        return False
    return True


def record_held_call(event: RetryEvent) -> None:
    line = {
        "key": None if event.key is None else event.key.decode("utf-8", "replace"),
        "attempt": event.attempt,
        "offset": event.offset,
        "now_ms": time.time_ns() // 1_000_000,
        "pid": os.getpid(),
        "held": True,
    }
    with open(os.environ[CALLS_ENV], "a", encoding="utf-8") as calls:
        calls.write(json.dumps(line) + "\n")


async def handle(event: RetryEvent) -> None:
    gate = Path(os.environ[GATE_ENV])
    try:
        outcome = json.loads(event.value or b"").get("gated")
    except ValueError:
        outcome = None
    if outcome is None or not claimed(gate):
        await scripted(event)
        return
    record_held_call(event)
    while not (gate / "release").exists():
        await asyncio.sleep(POLL_S)
    if outcome == "succeed":
        return
    if outcome == "permanent":
        raise PermanentError("the gated call fails permanently")
    raise RetryableError("the gated call fails retryably")
