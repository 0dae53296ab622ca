"""The settings every worker of one group must share, their fingerprint, and what differs between two workers.

Each worker decides on its own what happens to the messages of the partitions it holds: a message's fate must not
depend on which worker that is. These settings change such a decision or where a message goes, so they are carried
(fingerprint and values) in every status summary and compared by every worker (``agents/status.py``):

- ``main_topics``: which topics are consumed, and so the tier and failed topics derived from them (``REBOUND_MAIN_TOPICS``);
- ``retry_sequence`` and ``max_retry_duration``: how many retries, after which delays, through which tier topics, and
  when a message is dead-lettered as exhausted or expired (``REBOUND_RETRY_SEQUENCE``, ``REBOUND_MAX_RETRY_DURATION``);
  compared as delays, so ``60s`` and ``1m`` agree;
- ``retry_after_max``: how far ahead a Retry-After may set a due time, which a tier also checks on the records it
  parks (``REBOUND_RETRY_AFTER_MAX``);
- ``error_classes``: which failures are retried and which are dead-lettered at once (``REBOUND_PERMANENT_ERRORS``,
  ``REBOUND_RETRYABLE_ERRORS``, ``REBOUND_UNKNOWN_ERRORS``);
- ``ordering``: whether a key's later messages wait behind its retrying one, and whether a dead letter keeps blocking
  it (``REBOUND_ORDERING``, ``REBOUND_ORDERING_DEAD_LETTER_BLOCKS``);
- ``release_mode``: whether a retry runs in place or is re-published to the main topic, where other consumer groups
  see it again (``REBOUND_RELEASE_MODE``).

Left out: what only sizes or paces one worker (concurrency, buffers, release rate, RocksDB), limits per key
(``REBOUND_MAX_PENDING_PER_KEY``), the handler itself (a rolling deploy changes its code, not its name), and
``REBOUND_HEADER_SECRET`` (a digest of a secret in a topic would let anyone reading it test guesses offline).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rebound.policy import format_duration
from rebound.settings import Settings

FINGERPRINT_CHARS = 12


def _listed(names: Iterable[str]) -> str:
    return ",".join(sorted(set(names))) or "-"


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


@dataclass(frozen=True)
class GroupSettings:
    """The values (as short text) of the settings a group must agree on, and their fingerprint."""

    values: Mapping[str, str]

    @property
    def fingerprint(self) -> str:
        canonical = json.dumps(dict(self.values), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:FINGERPRINT_CHARS]

    def to_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "values": dict(self.values)}

    @classmethod
    def from_dict(cls, data: Any) -> GroupSettings | None:
        """From a summary; None for one without them (a worker from before) or with a shape it cannot read."""
        if not isinstance(data, Mapping) or not isinstance(data.get("values"), Mapping):
            return None
        return cls({str(name): str(value) for name, value in data["values"].items()})


def group_settings(settings: Settings) -> GroupSettings:
    """Computed once at start (the settings are frozen)."""
    policy = settings.policy
    cap = policy.max_duration_ms
    ordering: str = settings.ordering
    if settings.key_ordered and settings.ordering_dead_letter_blocks:
        ordering += " (dead letters block)"
    return GroupSettings(
        {
            "main_topics": _listed(settings.topics),
            "retry_sequence": ",".join(format_duration(delay) for delay in policy.delays_ms),
            "max_retry_duration": format_duration(cap) if cap is not None else "none",
            "retry_after_max": format_duration(settings.retry_after_max_ms),
            "error_classes": (
                f"permanent={_listed(_split(settings.permanent_errors))} "
                f"retryable={_listed(_split(settings.retryable_errors))} other={settings.unknown_errors}"
            ),
            "ordering": ordering,
            "release_mode": settings.release_mode,
        }
    )


def differences(mine: GroupSettings, theirs: GroupSettings) -> dict[str, list[str | None]]:
    """Each setting whose value differs, as ``[mine, theirs]`` (None where one side does not have it)."""
    names = sorted(set(mine.values) | set(theirs.values))
    return {
        name: [mine.values.get(name), theirs.values.get(name)]
        for name in names
        if mine.values.get(name) != theirs.values.get(name)
    }


def describe_differences(differs: Mapping[str, list[str | None]]) -> str:
    """``retry_sequence: 2s,5s,10s here, 1m there; ordering: ...`` for a log line."""
    return "; ".join(f"{name}: {here} here, {there} there" for name, (here, there) in differs.items())
