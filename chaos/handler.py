"""The chaos run's handler (``REBOUND_HANDLER=chaos.handler:handle``): the message's bytes script its outcome.

Every call is committed to the call log before the handler returns or raises, so a call Rebound saw is a call the
checker sees. The call time is taken on entry: a retry that started before its due time is early even if it was slow.

A ``random`` message (``python -m chaos --outcome random``) draws each call's outcome afresh, and is idempotent the
way a real handler is: once a call of it succeeded, its effect is done and every later call succeeds too. That memory
is a file per message in ``$CHAOS_EFFECTS``, shared by every worker of the run (they run on one machine), written
before the call returns.
"""

from __future__ import annotations

import functools
import os
import random
import time
from pathlib import Path

from chaos.calllog import Call, CallLogWriter
from chaos.scenario import CallOutcome, decide, is_random, random_outcome
from rebound.errors import PermanentError, RetryableError, UndecodableError
from rebound.event import RetryEvent

CALL_LOG_ENV = "CHAOS_CALL_LOG"
"""Path of this worker's SQLite call log."""
WORKER_ENV = "CHAOS_WORKER"
"""The harness's name for this worker incarnation, written with each call for the evidence trail."""
EFFECTS_ENV = "CHAOS_EFFECTS"
"""Directory of the ``random`` messages whose effect is done (a file per message id), shared by the workers."""


@functools.cache
def _log() -> CallLogWriter | None:
    """One connection per worker process, opened on the first call (the worker imports the handler early)."""
    path = os.environ.get(CALL_LOG_ENV)
    return CallLogWriter(Path(path)) if path else None


def _due_ms(event: RetryEvent) -> int | None:
    """The due time, if this Rebound version hands it to the handler; the checker has other sources."""
    for name in ("due_at_ms", "due_at"):
        value = event.extra.get(name)
        if isinstance(value, int):
            return value
    return None


def _effects() -> Path | None:
    path = os.environ.get(EFFECTS_ENV)
    return Path(path) if path else None


def idempotent_random(mid: str | None, draw: float, effects: Path | None) -> CallOutcome:
    """A ``random`` message's outcome: OK if its effect is done already, else drawn; a drawn OK is recorded first."""
    done = effects / mid if effects is not None and mid is not None else None
    if done is not None and done.exists():
        return CallOutcome.OK
    outcome = random_outcome(draw)
    if outcome is CallOutcome.OK and done is not None:
        done.parent.mkdir(parents=True, exist_ok=True)
        done.touch()
    return outcome


async def handle(event: RetryEvent) -> None:
    call_ms = time.time_ns() // 1_000_000
    mid, outcome = decide(event.value, event.attempt)
    if is_random(event.value):
        outcome = idempotent_random(mid, random.random(), _effects())
    log = _log()
    if log is not None:
        log.write(
            Call(
                mid=mid,
                topic=event.topic,
                partition=event.partition,
                offset=event.offset,
                attempt=event.attempt,
                call_ms=call_ms,
                outcome=outcome.value,
                pid=os.getpid(),
                worker=os.environ.get(WORKER_ENV),
                tier=event.tier,
                due_ms=_due_ms(event),
            )
        )
    if outcome is CallOutcome.UNDECODABLE:
        raise UndecodableError(f"not JSON (message {mid})")
    if outcome is CallOutcome.PERMANENT:
        raise PermanentError(f"message {mid}: permanent on attempt {event.attempt}")
    if outcome is CallOutcome.RETRYABLE:
        raise RetryableError(f"message {mid}: not yet on attempt {event.attempt}")
