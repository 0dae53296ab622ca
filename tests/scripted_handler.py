"""A scripted handler for agent and integration tests: the record's value says how it behaves.

``{"succeed_on": 2}`` fails retryably until attempt 2; ``{"permanent": true}`` fails permanently; ``{"fail": "always"}``
never succeeds; ``{"sleep": 5}`` takes 5 s on its first try; ``{"raise": "TimeoutError"}`` raises the handler's own
``TimeoutError`` until attempt 1 (or ``succeed_on``); ``{"abort": "SystemExit", "succeed_on": 1}`` raises that ``BaseException`` (``SystemExit``,
``KeyboardInterrupt`` or ``Abort``, a custom one) until attempt 1; ``{"outage_until": <epoch ms>}`` fails retryably
until then (a dependency down for everyone); anything that is not JSON is undecodable. Every call is appended to ``$SCRIPTED_CALLS`` (JSON lines),
so tests can check when each attempt really ran.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from app.errors import PermanentError, RetryableError, UndecodableError
from rebound.event import RetryEvent

CALLS_ENV = "SCRIPTED_CALLS"


def record_call(event: RetryEvent) -> None:
    path = os.environ.get(CALLS_ENV)
    if not path:
        return
    line = {
        "key": None if event.key is None else event.key.decode("utf-8", "replace"),
        "attempt": event.attempt,
        "topic": event.topic,
        "partition": event.partition,
        "offset": event.offset,
        "tier": event.tier,
        "now_ms": time.time_ns() // 1_000_000,
        "pid": os.getpid(),
        "headers": sorted(event.headers),
    }
    with open(path, "a", encoding="utf-8") as calls:
        calls.write(json.dumps(line) + "\n")


class Abort(BaseException):
    """A handler's own BaseException subclass: not an Exception, so ``except Exception`` does not catch it."""


ABORTS: dict[str, type[BaseException]] = {
    "SystemExit": SystemExit,
    "KeyboardInterrupt": KeyboardInterrupt,
    "Abort": Abort,
}


async def handle(event: RetryEvent) -> None:
    record_call(event)
    try:
        script = json.loads(event.value or b"")
    except ValueError as exc:
        raise UndecodableError(f"not JSON: {exc}") from exc
    if script.get("permanent"):
        raise PermanentError("bad data: the script says permanent")
    if script.get("fail") == "always":
        raise RetryableError("dependency still down")
    if time.time_ns() // 1_000_000 < int(script.get("outage_until", 0)):
        raise RetryableError("dependency down (outage)")
    if script.get("sleep") and event.attempt == 0:
        await asyncio.sleep(float(script["sleep"]))
    if script.get("abort") and event.attempt < int(script.get("succeed_on", 1)):
        raise ABORTS[script["abort"]]("the script says abort")
    if script.get("raise") == "KeyError":
        raise KeyError("unclassified error")
    if script.get("raise") == "TimeoutError" and event.attempt < int(script.get("succeed_on", 1)):
        raise TimeoutError("the handler's own call timed out")
    if event.attempt < int(script.get("succeed_on", 0)):
        raise RetryableError(f"not yet (attempt {event.attempt})")
