"""Key-ordered mode's one decision before a main-topic record runs (:func:`rebound.ordering.admit`) and the two rules
after it (:func:`~rebound.ordering.retry_may_be_out`, :func:`~rebound.ordering.keeps_key_unchanged`).

``admit`` is :func:`~rebound.ordering.place` (the key's order) plus the key's capacity: the agent side
(``agents/ordering.py`` ``KeyOrder``) only carries its verdict out.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rebound.attempts import Outcome
from rebound.headers import Provenance
from rebound.ordering import (
    Placement,
    admit,
    comes_first,
    holds_its_fill,
    is_held,
    is_unsettled,
    keeps_key_unchanged,
    place,
    retry_may_be_out,
)
from rebound.state import KeyState
from tests.rebound.test_ordering import held, holding, origin, parked, provenance

OFFSETS = st.integers(min_value=0, max_value=12)


@st.composite
def key_states(draw: st.DrawFn) -> KeyState:
    """A key of ``items/0`` with any mix of a block (a retry's or a dead letter's), one parked retry and held
    messages, every parked message loaded (as the agent loads them before it asks)."""
    blocker = draw(st.none() | OFFSETS)
    pending = draw(st.lists(OFFSETS, max_size=2, unique=True))
    held_offsets = sorted(draw(st.lists(OFFSETS, max_size=5, unique=True)))
    return KeyState(
        blocked_by=None if blocker is None else origin(blocker),
        blocked_dead=blocker is not None and draw(st.booleans()),
        pending=tuple(parked(offset) for offset in pending),
        held=tuple(held(offset) for offset in held_offsets),
    )


RECORDS = st.builds(provenance, OFFSETS) | st.builds(lambda offset: provenance(offset, partition=1), OFFSETS)


@given(state=key_states(), record=RECORDS, max_held=st.integers(min_value=1, max_value=6))
def test_admit_is_place_unless_a_record_to_hold_finds_its_key_full(
    state: KeyState, record: Provenance, max_held: int
) -> None:
    placement = place(state, record)
    expected = Placement.BACKLOG_FULL if placement is Placement.HOLD and len(state.held) >= max_held else placement
    assert admit(state, record, max_held=max_held) is expected


@given(state=key_states(), record=RECORDS)
def test_with_room_to_hold_admit_never_refuses(state: KeyState, record: Provenance) -> None:
    assert admit(state, record, max_held=len(state.held) + 1) is not Placement.BACKLOG_FULL


@given(state=key_states(), record=RECORDS, max_held=st.integers(min_value=1, max_value=6))
def test_admit_runs_exactly_what_nothing_unsettled_comes_before(
    state: KeyState, record: Provenance, max_held: int
) -> None:
    """RUN iff the record is not held already and the key is free or the record comes first; a record held
    already is recognised as such whatever else the key says."""
    verdict = admit(state, record, max_held=max_held)
    if is_held(state, record):
        assert verdict is Placement.ALREADY_HELD
    elif not is_unsettled(state) or comes_first(state, record):
        assert verdict is Placement.RUN
    else:
        assert verdict in (Placement.HOLD, Placement.BACKLOG_FULL)


def test_a_free_key_runs_its_record_even_with_no_room_to_hold() -> None:
    assert admit(KeyState(), provenance(10), max_held=1) is Placement.RUN


def test_a_blocked_key_full_of_held_messages_refuses_the_next_one() -> None:
    state = holding(6, 7, blocked_by=origin(5))
    assert admit(state, provenance(8), max_held=3) is Placement.HOLD
    assert admit(state, provenance(8), max_held=2) is Placement.BACKLOG_FULL
    assert holds_its_fill(state, 2) and not holds_its_fill(state, 3)


def test_a_held_record_delivered_again_to_a_full_key_is_still_held() -> None:
    """Its hold stands: refusing it would send a record to the failed topic that also waits in the held line."""
    state = holding(6, 7, blocked_by=origin(5))
    assert admit(state, provenance(7), max_held=1) is Placement.ALREADY_HELD


def test_the_blocker_redelivered_to_a_full_key_runs_again() -> None:
    state = holding(6, 7, blocked_by=origin(5))
    assert admit(state, provenance(5), max_held=1) is Placement.RUN


@pytest.mark.parametrize(
    ("blocked_by", "sending", "expected"),
    [
        pytest.param(None, False, False, id="free-key"),
        pytest.param(origin(4), False, False, id="blocked-by-another"),
        pytest.param(origin(5), False, True, id="blocked-by-itself"),
        pytest.param(None, True, True, id="sending-mark"),
    ],
)
def test_a_retry_may_be_out_when_the_message_blocked_its_key_or_was_sending(
    blocked_by: str | None, sending: bool, expected: bool
) -> None:
    assert retry_may_be_out(KeyState(blocked_by=blocked_by), origin(5), sending=sending) is expected


@pytest.mark.parametrize("outcome", list(Outcome))
@pytest.mark.parametrize("maybe_sent", [False, True])
def test_only_a_success_with_no_retry_out_leaves_the_key_unchanged(outcome: Outcome, maybe_sent: bool) -> None:
    expected = outcome is Outcome.SUCCEEDED and not maybe_sent
    assert keeps_key_unchanged(outcome, maybe_sent=maybe_sent) is expected
