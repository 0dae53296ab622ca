"""What an operator's per-key actions do to the key's state: the state changes of ``retry-now`` and ``dead-letter``.

The admin agent (``agents/admin.py``) runs on the worker that owns the key's partition, reads the state, sends what
must be sent (the dead letters) and writes what these functions return. ``unblock`` is key-ordered mode's
(:func:`rebound.ordering.unblock`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from rebound.state import KeyState


def retry_now(state: KeyState, *, partition: int, now_ms: int) -> tuple[KeyState, frozenset[str]]:
    """The key's parked messages of ``partition`` that wait for a later due time become due now; the others (due
    already, or another partition's, which this worker may not own) are left as they are. Also returns the origins
    it moved, for the schedule and the operator's answer."""
    changed = frozenset(
        entry.origin for entry in state.pending if entry.partition == partition and entry.due_at_ms > now_ms
    )
    if not changed:
        return state, changed
    pending = tuple(replace(entry, due_at_ms=now_ms) if entry.origin in changed else entry for entry in state.pending)
    return replace(state, pending=pending), changed


def dead_lettered(state: KeyState, sent: Iterable[tuple[str, int]]) -> KeyState:
    """The key's state once an operator's dead letters were sent: each message sent, ``(origin, attempt)``, removed
    if it is still parked at that attempt. A message parked again meanwhile at a later attempt (the sends awaited)
    stays: the operator did not see that attempt."""
    sent = set(sent)
    return state.without({entry.origin for entry in state.pending if (entry.origin, entry.attempt) in sent})
