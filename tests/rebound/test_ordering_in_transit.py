"""Key-ordered mode: a message whose retry is on its way to a tier (sent, not parked yet) keeps its key unsettled.

The key's block can move off such a message: a lower record of its key read again fails too, takes the block
(:func:`rebound.ordering.retry_block`), and settles. Nothing but the forwarded mark (:class:`rebound.state.Mark`)
then says the first one is still retrying; counted as unsettled, a new later message is held behind it rather than
run before its retry (issue 22, defect 3 follow-up).
"""

from __future__ import annotations

from dataclasses import replace

from rebound.attempts import Outcome
from rebound.ordering import (
    Placement,
    after_outcome,
    block,
    first_unsettled_offset,
    hold,
    is_unsettled,
    next_held,
    place,
    retry_block,
    waits_for,
)
from rebound.state import KeyState, LifecycleMemory, remember
from tests.rebound.test_ordering import held, origin, parked, provenance

MEMORY = LifecycleMemory()
NOW = 1_700_000_000_000


def forwarded(state: KeyState, offset: int) -> KeyState:
    """``offset``'s retry was sent to its tier (the key-ordered main agent writes this mark after the send)."""
    return remember(state, provenance(offset), attempt=1, ended=False, partition=0, now_ms=NOW, memory=MEMORY)


def moved_block() -> KeyState:
    """L@7 failed (its retry on its way); X@5, read again below it, failed too and took the block, then settled."""
    lower, later = origin(5), origin(7)
    state = forwarded(block(KeyState(), later), 7)
    assert place(state, provenance(5)) is Placement.RUN  # read again below the block: it runs
    state = retry_block(state, lower)
    assert state.blocked_by == lower
    state = replace(state, pending=(parked(5),))  # X's retry parks ...
    state = replace(state, pending=())  # ... and succeeds
    return after_outcome(state, lower, Outcome.SUCCEEDED, dead_letter_blocks=False)


def test_a_later_message_waits_while_a_retry_is_still_on_its_way_after_the_block_moved_off_it() -> None:
    state = moved_block()
    assert state.blocked_by is None
    assert is_unsettled(state), "L@7's retry is still on the tier topic"
    assert place(state, provenance(9)) is Placement.HOLD, "N@9 would run before L@7's retry"
    assert first_unsettled_offset(state, "items", 0) == 7


def test_a_message_held_behind_a_retry_on_its_way_runs_only_once_that_retry_parked_and_settled() -> None:
    state, _ = hold(moved_block(), held(9))
    assert next_held(state) is None, "held N@9 runs before L@7's retry arrived"
    arrived, _ = state.park(parked(7))  # the park replaces the mark: the entry says where L is now
    assert arrived.marks == ()
    assert next_held(arrived) is None and waits_for(arrived, arrived.pending[0]) is None
    settled = after_outcome(replace(arrived, pending=()), origin(7), Outcome.SUCCEEDED, dead_letter_blocks=False)
    assert next_held(settled) is not None and next_held(settled).origin == origin(9)  # type: ignore[union-attr]


def test_a_later_retry_waits_for_a_lower_retry_on_its_way() -> None:
    state = replace(forwarded(KeyState(), 7), pending=(parked(9),))
    assert waits_for(state, state.pending[0]) == origin(7)
    assert waits_for(replace(forwarded(KeyState(), 11), pending=(parked(9),)), parked(9)) is None


def test_an_ended_mark_keeps_nothing_waiting() -> None:
    state = remember(KeyState(), provenance(7), attempt=1, ended=True, partition=0, now_ms=NOW, memory=MEMORY)
    assert not is_unsettled(state)
    assert place(state, provenance(9)) is Placement.RUN
