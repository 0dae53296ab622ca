"""Key-ordered mode with two messages of a key retrying at once: their retries take turns in offset order.

A record read again below a retrying one (K@105 below K@107) runs at once; if it fails too, the key has two parked
retries, and 107's, scheduled earlier, comes due first. Released by due time alone, 107 would succeed before 105.
``waits_for`` defers it until 105 settles, ``retry_block`` makes 105 the key's blocker, and ``next_held`` lets a
message held between the two run before the later one, so that no two messages wait for each other.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from rebound.attempts import Outcome
from rebound.ordering import (
    DEFER_RECHECK_MAX_MS,
    DEFER_RECHECK_MIN_MS,
    after_outcome,
    block,
    next_held,
    recheck_at,
    retry_block,
    waits_for,
)
from rebound.state import KeyState, PendingMessage
from tests.rebound.test_ordering import T0, held, origin, parked

# --- waits_for -------------------------------------------------------------------------------------------------------


def test_a_later_retry_waits_for_a_lower_one_of_its_key_and_the_lower_one_for_nothing() -> None:
    """The gap: 107's retry due before 105's must not run first."""
    state = KeyState(pending=(parked(107, due_at_ms=T0), parked(105, due_at_ms=T0 + 500)), blocked_by=origin(105))
    assert waits_for(state, state.pending[0]) == origin(105)
    assert waits_for(state, state.pending[1]) is None


def test_a_retry_waits_for_the_lowest_unsettled_message_below_it() -> None:
    """Parked, held or blocking (its retry on its way to a tier): the lowest of them is what it waits for."""
    state = KeyState(pending=(parked(107), parked(104)), held=(held(102),), blocked_by=origin(103))
    assert waits_for(state, state.pending[0]) == origin(102)
    assert waits_for(KeyState(pending=(parked(107),), blocked_by=origin(105)), parked(107)) == origin(105)
    assert waits_for(KeyState(pending=(parked(107),), held=(held(110),)), parked(107)) is None  # above it: no wait


def test_a_lone_retry_blocking_its_key_waits_for_nothing() -> None:
    state = KeyState(pending=(parked(107),), blocked_by=origin(107), held=(held(110), held(111)))
    assert waits_for(state, state.pending[0]) is None


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(parked(5, partition=1), id="other-partition"),
        pytest.param(parked(5, topic="orders"), id="other-topic"),
    ],
)
def test_a_retry_never_waits_for_another_partitions_message(other: PendingMessage) -> None:
    """Offsets of different partitions have no order: no wait, so nothing can wait in a circle across them."""
    state = KeyState(pending=(parked(107), other))
    assert waits_for(state, state.pending[0]) is None


def test_a_dead_letter_below_keeps_a_retry_waiting_only_while_dead_letters_block() -> None:
    """Like the held messages behind it: the operator decides when the key goes on."""
    state = KeyState(pending=(parked(107),), blocked_by=origin(105), blocked_dead=True)
    assert waits_for(state, state.pending[0], dead_letters_block=True) == origin(105)
    assert waits_for(state, state.pending[0], dead_letters_block=False) is None


def test_waits_for_needs_every_parked_message_of_the_key() -> None:
    state = KeyState(pending=(parked(107),), others=1, loaded=frozenset({origin(107)}))
    with pytest.raises(LookupError):
        waits_for(state, state.pending[0])


# --- retry_block -----------------------------------------------------------------------------------------------------


def test_a_lower_message_failing_takes_the_block_from_a_later_one() -> None:
    """105, read again below the retrying 107, fails: the lowest unsettled message blocks the key."""
    state = KeyState(pending=(parked(107),), blocked_by=origin(107), held=(held(110),))
    after = retry_block(state, origin(105))
    assert (after.blocked_by, after.blocked_dead) == (origin(105), False)
    assert after.held == state.held and after.pending == state.pending


@pytest.mark.parametrize(
    "state",
    [
        pytest.param(KeyState(blocked_by=origin(100)), id="earlier-blocker"),
        pytest.param(KeyState(blocked_by=origin(107), blocked_dead=True), id="dead-letter-that-blocks"),
        pytest.param(KeyState(blocked_by=origin(107, partition=1)), id="other-partition"),
        pytest.param(KeyState(blocked_by=origin(107, topic="orders")), id="other-topic"),
        pytest.param(KeyState(blocked_by=origin(105)), id="itself"),
    ],
)
def test_any_other_block_stays(state: KeyState) -> None:
    assert retry_block(state, origin(105)) is state


def test_a_free_key_or_its_own_dead_letter_block_is_blocked_behind_the_retry() -> None:
    assert retry_block(KeyState(), origin(5)) == block(KeyState(), origin(5))
    dead = KeyState(blocked_by=origin(5), blocked_dead=True)
    assert (retry_block(dead, origin(5)).blocked_by, retry_block(dead, origin(5)).blocked_dead) == (origin(5), False)


# --- next_held: no two messages waiting for each other ----------------------------------------------------------------


def test_a_message_held_between_two_retrying_ones_runs_before_the_later_one() -> None:
    """100 and 107 retry (100 blocks), 103 read again is held between them. Once 100 succeeds, 103 runs although
    107 is still parked: 107 waits for 103, so 103 waiting for 107 would wait for ever."""
    state = KeyState(pending=(parked(107), parked(100)), blocked_by=origin(100), held=(held(103), held(110)))
    assert next_held(state) is None  # 100, below it, first
    assert waits_for(state, state.pending[0]) == origin(100)
    state, _ = state.settle(origin(100), 1)
    state = after_outcome(state, origin(100), Outcome.SUCCEEDED, dead_letter_blocks=True)
    head = next_held(state)
    assert head is not None and head.origin == origin(103)
    assert waits_for(state, state.pending[0]) == origin(103)
    state = after_outcome(replace(state, held=state.held[1:]), origin(103), Outcome.SUCCEEDED, dead_letter_blocks=True)
    assert waits_for(state, state.pending[0]) is None  # 107's turn
    assert next_held(state) is None  # and 110 waits for it


def test_a_held_message_below_a_later_blocker_runs() -> None:
    """A state written before the block moved to the lowest message (107 blocking, 103 held below it): 107 waits
    for 103, so 103 runs."""
    state = KeyState(pending=(parked(107),), blocked_by=origin(107), held=(held(103),))
    assert waits_for(state, state.pending[0]) == origin(103)
    assert next_held(state) == state.held[0]


# --- recheck_at ------------------------------------------------------------------------------------------------------


def test_a_deferred_retry_is_asked_again_when_the_lower_one_comes_due() -> None:
    state = KeyState(pending=(parked(107, due_at_ms=T0), parked(105, due_at_ms=T0 + 500)))
    assert recheck_at(state, origin(105), state.pending[0], T0 + 100) == T0 + 500


def test_a_deferred_retry_waiting_for_something_not_parked_is_asked_again_after_a_bounded_backoff() -> None:
    """Its settle releases it at once; the recheck is the safety net for ends that pass through no settle."""
    entry = parked(107, due_at_ms=T0)
    state = KeyState(pending=(entry,), blocked_by=origin(105))
    assert recheck_at(state, origin(105), entry, T0) == T0 + DEFER_RECHECK_MIN_MS
    assert recheck_at(state, origin(105), entry, T0 + 20_000) == T0 + 20_000 + 5_000
    assert recheck_at(state, origin(105), entry, T0 + 3_600_000) == T0 + 3_600_000 + DEFER_RECHECK_MAX_MS
    overdue = KeyState(pending=(entry, parked(105, due_at_ms=T0 - 10)))  # the lower one due already: soon
    assert recheck_at(overdue, origin(105), entry, T0) == T0 + DEFER_RECHECK_MIN_MS


def test_a_retry_waiting_for_a_message_held_further_down_the_line_does_not_hold_the_line() -> None:
    """A key on two partitions: 50 of partition 1 heads the held line, 103 of partition 0 behind it, and 107 of
    partition 0 retries. 107 waits for 103; were 50 to wait for 107, none of the three would ever run."""
    state = KeyState(pending=(parked(107),), held=(held(50, partition=1), held(103)))
    assert waits_for(state, state.pending[0]) == origin(103)
    head = next_held(state)
    assert head is not None and head.origin == origin(50, partition=1)
    # A retry of another partition that waits for nothing still comes first, as it always did.
    assert next_held(KeyState(pending=(parked(107),), held=(held(50, partition=1),))) is None
