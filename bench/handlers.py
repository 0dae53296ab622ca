"""Handlers for the benchmarks, shared by Rebound (``REBOUND_HANDLER=bench.handlers:...``) and the baselines.

The same decision and the same call log on every side keeps the comparison about the retry machinery, not the
handler. A record's value is JSON ``{"t": <produced at, epoch ms>, "fail_until": <attempt>}``: the handler fails
retryably while ``attempt < fail_until``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import IO, Any

from app.errors import RetryableError

CALLS_ENV = "BENCH_CALLS"
_log: IO[str] | None = None


def fails(value: bytes | None, attempt: int) -> bool:
    """Fails while ``attempt < fail_until``, and while the wall clock is in ``[down_from, down_until)`` (an outage of
    the handler's dependency, the same for every message)."""
    try:
        script = json.loads(value or b"{}")
    except ValueError:
        return False
    now = time.time_ns() // 1_000_000
    if int(script.get("down_from", 0)) <= now < int(script.get("down_until", 0)):
        return True
    return attempt < int(script.get("fail_until", 0))


def log_call(key: bytes | None, attempt: int, ok: bool) -> None:
    """Append one JSON line per call, line-buffered: the benchmark reads it while the worker runs."""
    line: dict[str, Any] = {"k": None if key is None else key.decode("utf-8", "replace"), "a": attempt, "ok": ok}
    line["t"] = time.time_ns() // 1_000_000
    _write(line)


def _write(line: dict[str, Any]) -> None:
    """One JSON line to ``$BENCH_CALLS`` (if set), through one line-buffered file kept open per worker process."""
    global _log  # noqa: PLW0603 - one log file per worker process
    path = os.environ.get(CALLS_ENV)
    if not path:
        return
    if _log is None:
        _log = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - kept open for the process
    _log.write(json.dumps(line, separators=(",", ":")) + "\n")


def call(key: bytes | None, value: bytes | None, attempt: int) -> bool:
    """Decide and log one call; True when it succeeded. The baselines use this directly."""
    ok = not fails(value, attempt)
    log_call(key, attempt, ok)
    return ok


async def scripted(event: Any) -> None:
    """Rebound handler: fail retryably as the value says, logging every call."""
    if not call(event.key, event.value, event.attempt):
        raise RetryableError(f"bench: not yet (attempt {event.attempt})")


async def noop(event: Any) -> None:
    """Rebound handler for raw throughput: does nothing, so what is measured is the pipeline itself."""


def log_span(event: Any, started_ms: float, ended_ms: float) -> None:
    """One JSON line per call with where the record sits and when the call ran: the per-key order check's input.

    ``k``, ``a``, ``ok`` and ``t`` (the end, epoch ms) as ``log_call`` writes them, so readiness and completion
    checks read both logs alike; plus ``p`` and ``o`` (partition, offset) and ``s`` (the start). Start and end are ms
    with µs decimals: two 20 ms calls of one key a fraction of a ms apart must still compare the right way round.
    """
    key = event.key
    line = {
        "k": None if key is None else key.decode("utf-8", "replace"),
        "a": event.attempt,
        "ok": True,
        "p": event.partition,
        "o": event.offset,
        "s": round(started_ms, 3),
        "t": round(ended_ms, 3),
    }
    _write(line)


def _ms() -> float:
    return time.time_ns() / 1_000_000


async def io20(event: Any) -> None:
    """I/O-bound handler: awaits 20 ms (a remote call) and always succeeds, logging the call's span.

    For the ``concurrency`` scenario: a worker running one call at a time tops out near 50 calls/s, so how far the
    rate rises with ``REBOUND_CONCURRENCY`` shows how much of the wait the worker overlaps.
    """
    started = _ms()
    await asyncio.sleep(0.02)
    log_span(event, started, _ms())


async def always_fail(event: Any) -> None:
    """Rebound handler that parks everything (with a long retry sequence): for the memory scenario."""
    raise RetryableError("bench: parked on purpose")
