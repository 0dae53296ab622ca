"""An orphan entry (issue 22): a parked entry whose message the key's index says ended, or is being dead-lettered.

A stale copy of the payload table (a half-read changelog recovery) held such entries while the index, complete, had
an *ended* mark for each; their release requests ran the handler again. :func:`rebound.release.ended_mark` tells them
apart, ``Verdict.ENDED`` drops them (:func:`rebound.release.without_ended`). Carried out in ``agents/release.py``
(``tests/agents/test_ended_orphan.py``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from rebound.release import Verdict, check_release, ended_mark, without_ended
from rebound.state import Intent, KeyState, Mark
from tests.rebound.test_lifecycle_rules import MEMORY, NOW, ORIGIN, RECORD_MS, parked

DEAD = Intent(2, True, "items.failed", "permanent", "PermanentError", "no")


def never(_entry: object) -> bool:
    return False


def stale(mark: Mark, attempt: int = 1, **index: object) -> KeyState:
    """A key's index remembering ``mark``, read with a parked entry of ``attempt`` (a stale copy's)."""
    return replace(KeyState(marks=(mark,)), pending=(parked(attempt=attempt),), loaded=frozenset({ORIGIN}), **index)


def verdict(state: KeyState | None, attempt: int = 1, now_ms: int = NOW) -> Verdict:
    entry = parked(attempt=attempt)
    return check_release(entry, attempt, now_ms, breaker_open=True, would_retry=never, state=state, memory=MEMORY)


@pytest.mark.parametrize("ended_at", [0, 1, 2])
def test_an_ended_mark_of_any_attempt_makes_the_entry_an_orphan(ended_at: int) -> None:
    """An earlier attempt's end too: a run read again ended the message and removed this retry (``without_orphan``)
    in the index; a stale copy of the payloads still has it."""
    state = stale(Mark(ORIGIN, ended_at, NOW, True, RECORD_MS))
    assert ended_mark(state, parked(attempt=1), now_ms=NOW, memory=MEMORY) is not None
    # Before the due time, the breaker and an intent of its own: none of them may run it.
    assert verdict(state) is Verdict.ENDED
    with_intent = replace(state, pending=(replace(parked(attempt=1), intent=DEAD),))
    assert check_release(with_intent.pending[0], 1, NOW, breaker_open=False, would_retry=never, state=with_intent,
                         memory=MEMORY) is Verdict.ENDED  # fmt: skip


def test_a_dead_lettering_mark_makes_it_an_orphan_too() -> None:
    state = stale(Mark(ORIGIN, 2, NOW, False, RECORD_MS, intent=DEAD), attempt=2)
    assert verdict(state, attempt=2) is Verdict.ENDED


@pytest.mark.parametrize(
    ("mark", "why"),
    [
        (Mark(ORIGIN, 2, NOW, False, RECORD_MS), "a retry on its way (forwarded), not an end"),
        (Mark(ORIGIN, 2, NOW, False, RECORD_MS, sending=True), "a retry about to be sent, not an end"),
        (Mark(ORIGIN, 1, NOW - MEMORY.keep_ms, True, RECORD_MS), "forgotten: older than REBOUND_ENDED_MEMORY"),
        (Mark(ORIGIN, 1, NOW, True, RECORD_MS + 1), "another record with the same origin"),
        (Mark("items/0/8", 1, NOW, True, RECORD_MS), "another message of the key"),
    ],
)
def test_any_other_mark_leaves_the_verdict_as_it_was(mark: Mark, why: str) -> None:
    state = stale(mark)
    assert ended_mark(state, parked(attempt=1), now_ms=NOW, memory=MEMORY) is None, why
    assert verdict(state) is Verdict.EARLY, why
    assert verdict(None) is Verdict.EARLY  # (no index given: not checked)


def test_the_orphan_goes_and_a_block_it_holds_once_ended_goes_unless_a_dead_letter_keeps_it() -> None:
    mark = Mark(ORIGIN, 1, NOW, True, RECORD_MS)
    lifted = without_ended(stale(mark, blocked_by=ORIGIN), mark, dead_letter_blocks=True)
    assert lifted.find(ORIGIN) is None and lifted.pending == () and not lifted.is_blocked
    assert lifted.marks == (mark,), "its end is forgotten"
    kept = without_ended(stale(mark, blocked_by=ORIGIN, blocked_dead=True), mark, dead_letter_blocks=True)
    assert (kept.blocked_by, kept.blocked_dead, kept.pending) == (ORIGIN, True, ())
    off = without_ended(stale(mark, blocked_by=ORIGIN, blocked_dead=True), mark, dead_letter_blocks=False)
    assert not off.is_blocked
    other = without_ended(stale(mark, blocked_by="items/0/3"), mark, dead_letter_blocks=False)
    assert other.blocked_by == "items/0/3", "another message's block lifted"


def test_a_message_being_dead_lettered_keeps_its_block_for_the_run_that_sends_it() -> None:
    mark = Mark(ORIGIN, 1, NOW, False, RECORD_MS, intent=replace(DEAD, attempt=1))
    after = without_ended(stale(mark, blocked_by=ORIGIN), mark, dead_letter_blocks=False)
    assert after.pending == () and after.blocked_by == ORIGIN
