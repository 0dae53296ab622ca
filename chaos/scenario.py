"""The message plan: what is produced, how the handler treats each message, and which terminal state it must reach.

The handler's behaviour is a pure function of the message's bytes and the attempt number (:func:`decide`), shared by
:mod:`chaos.handler` and the checker's expectations, so the two can never disagree about what a message should end as.
Such a handler cannot show a message with two lifecycles: both run the same attempts to the same end. With
``--outcome random`` every message is of kind ``random`` instead: each call's outcome is drawn afresh
(:func:`random_outcome`), whatever the attempt, so two lifecycles of one message can end differently (a *fork*: the
checker fails on it). The only memory is the one an idempotent handler has: once a call of a message succeeded, every
later call of it succeeds (its effect is done; :mod:`chaos.handler` keeps that across workers).
A value is a small JSON script, except for undecodable messages, whose raw bytes are not JSON but still carry the id
so that a dead letter can be traced back by its bytes as well as by its provenance headers.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

SUCCEEDED = "succeeded"
"""The terminal state of a message whose handler call succeeded; the others are ``rebound.reason`` values."""


class Kind(StrEnum):
    SUCCESS = "success"
    RETRY = "retry"
    EXHAUSTED = "exhausted"
    PERMANENT = "permanent"
    UNDECODABLE = "undecodable"
    RANDOM = "random"
    """``--outcome random``: the outcome of each call is drawn afresh (:func:`random_outcome`)."""


RANDOM = "random"
"""The ``expected`` terminal state of a ``random`` message: whatever its calls led to, as long as it is one."""
OUTCOMES = ("scripted", "random")
"""``python -m chaos --outcome``: the handler decides by the attempt number (scripted), or at random per call."""


class CallOutcome(StrEnum):
    """What one handler call did; written to the call log so the checker need not re-derive it."""

    OK = "ok"
    RETRYABLE = "retryable"
    PERMANENT = "permanent"
    UNDECODABLE = "undecodable"


DEFAULT_MIX: dict[Kind, float] = {
    Kind.SUCCESS: 0.50,
    Kind.RETRY: 0.25,
    Kind.EXHAUSTED: 0.08,
    Kind.PERMANENT: 0.10,
    Kind.UNDECODABLE: 0.07,
}

_UNDECODABLE_PREFIX = b"<<chaos undecodable "
_UNDECODABLE_RE = re.compile(rb"^<<chaos undecodable (?P<mid>[A-Za-z0-9_-]+)>>")


@dataclass(frozen=True, slots=True)
class PlannedMessage:
    mid: str
    key: bytes
    kind: Kind
    value: bytes
    expected: str
    """``succeeded`` or the ``rebound.reason`` the dead letter must carry."""
    expected_attempt: int
    """The attempt whose outcome is terminal: the succeeding call, or the ``rebound.attempt`` of the dead letter."""


def script(mid: str, kind: Kind, *, succeed_on: int = 0, permanent_on: int = 0) -> bytes:
    if kind is Kind.UNDECODABLE:
        return _UNDECODABLE_PREFIX + mid.encode("ascii") + b">> \xff not json"
    body: dict[str, object] = {"id": mid, "kind": kind.value}
    if kind in (Kind.SUCCESS, Kind.RETRY):
        body["succeed_on"] = succeed_on
    if kind is Kind.PERMANENT:
        body["permanent_on"] = permanent_on
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


RANDOM_WEIGHTS: dict[CallOutcome, float] = {
    CallOutcome.OK: 0.5,
    CallOutcome.RETRYABLE: 0.4,
    CallOutcome.PERMANENT: 0.1,
}
"""Per call of a ``random`` message: half succeed; of the others most are retried (with 3 retries about 2.6 % of
messages exhaust them), some end at once. Every path to every terminal state is taken many times in a run."""


def random_outcome(draw: float) -> CallOutcome:
    """The outcome of one call of a ``random`` message, for a uniform ``draw`` in [0, 1)."""
    bound = 0.0
    for outcome, weight in RANDOM_WEIGHTS.items():
        bound += weight
        if draw < bound:
            return outcome
    return CallOutcome.PERMANENT


def is_random(value: bytes | None) -> bool:
    """Whether ``value`` is the script of a ``random`` message (its outcome is not :func:`decide`'s)."""
    try:
        body = json.loads(value or b"")
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("kind") == Kind.RANDOM


def decide(value: bytes | None, attempt: int) -> tuple[str | None, CallOutcome]:
    """The message id carried by ``value`` and what the handler does with it on ``attempt`` (for a ``random``
    message: what it does unless :func:`random_outcome` says otherwise, which the handler asks first)."""
    try:
        body = json.loads(value or b"")
    except ValueError:
        match = _UNDECODABLE_RE.match(value or b"")
        return (match.group("mid").decode("ascii") if match else None), CallOutcome.UNDECODABLE
    if not isinstance(body, dict):
        return None, CallOutcome.UNDECODABLE
    mid = body.get("id")
    mid = mid if isinstance(mid, str) else None
    kind = body.get("kind")
    if kind in (Kind.SUCCESS, Kind.RETRY):
        return mid, CallOutcome.OK if attempt >= int(body.get("succeed_on", 0)) else CallOutcome.RETRYABLE
    if kind == Kind.PERMANENT:
        return mid, CallOutcome.PERMANENT if attempt >= int(body.get("permanent_on", 0)) else CallOutcome.RETRYABLE
    return mid, CallOutcome.RETRYABLE  # exhausted: never succeeds


def message_id(index: int) -> str:
    return f"m{index:06d}"


def plan_messages(
    count: int,
    *,
    seed: int,
    max_retries: int,
    keys: int | None = None,
    mix: dict[Kind, float] | None = None,
    outcome: str = "scripted",
) -> list[PlannedMessage]:
    """A seeded, reproducible plan; several messages share each key so keys with parked messages keep receiving more.

    ``outcome="random"``: every message is of kind ``random`` (its terminal state is not planned, see the module)."""
    if outcome == "random":
        return _random_plan(count, seed=seed, max_retries=max_retries, keys=keys)
    rng = random.Random(seed)
    weights = mix or DEFAULT_MIX
    kinds: Sequence[Kind] = list(weights)
    key_count = keys or max(1, count // 8)
    planned = []
    for index in range(count):
        mid = message_id(index)
        kind = rng.choices(kinds, weights=[weights[kind] for kind in kinds])[0]
        key = f"k{rng.randrange(key_count):05d}".encode("ascii")
        if kind is Kind.SUCCESS:
            value, expected, attempt = script(mid, kind), SUCCEEDED, 0
        elif kind is Kind.RETRY:
            succeed_on = rng.randint(1, max_retries)
            value, expected, attempt = script(mid, kind, succeed_on=succeed_on), SUCCEEDED, succeed_on
        elif kind is Kind.EXHAUSTED:
            value, expected, attempt = script(mid, kind), "exhausted", max_retries
        elif kind is Kind.PERMANENT:
            # Mostly on the first try; some only on a retry, so a permanent failure also leaves from a tier.
            permanent_on = 0 if rng.random() < 0.7 else rng.randint(1, max_retries)
            value, expected, attempt = script(mid, kind, permanent_on=permanent_on), "permanent", permanent_on
        else:
            value, expected, attempt = script(mid, kind), "undecodable", 0
        planned.append(PlannedMessage(mid, key, kind, value, expected, attempt))
    return planned


def _random_plan(count: int, *, seed: int, max_retries: int, keys: int | None) -> list[PlannedMessage]:
    """Every message ``random``; ``expected_attempt`` is the last attempt, the one an exhausted message ends with."""
    rng = random.Random(seed)
    key_count = keys or max(1, count // 8)
    planned = []
    for index in range(count):
        mid = message_id(index)
        key = f"k{rng.randrange(key_count):05d}".encode("ascii")
        planned.append(PlannedMessage(mid, key, Kind.RANDOM, script(mid, Kind.RANDOM), RANDOM, max_retries))
    return planned
