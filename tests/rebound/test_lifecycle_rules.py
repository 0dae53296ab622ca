"""One lifecycle per message (issue 22, defect 4): the pure rules of :mod:`rebound.state` that refuse a second one.

A main record delivered again must not start its message over while its retry is parked, on its way to a tier, or
after it ended; a tier record of an ended message (a copy read after the first one's retry settled) must not run the
retry again. Checked here without Faust; the agents carry them out (``tests/agents/test_lifecycle_agents.py``) and a real
worker shows them end to end (``tests/integration/test_one_lifecycle.py``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from rebound.attempts import Outcome
from rebound.headers import Provenance
from rebound.state import (
    KeyState,
    Known,
    LifecycleMemory,
    Mark,
    PendingMessage,
    after_settle,
    forget_expired,
    record_digest,
    redelivery,
    remember,
    remembers_outcome,
    tier_duplicate,
)

RECORD_MS = 1_700_000_000_000
NOW = RECORD_MS + 60_000
MEMORY = LifecycleMemory(keep_ms=3_600_000, per_key=4)
ORIGIN = "items/0/7"


def provenance(offset: int = 7, record_ms: int = RECORD_MS) -> Provenance:
    return Provenance("items", 0, offset, record_ms, record_ms + 5)


def parked(attempt: int = 1, offset: int = 7, record_ms: int = RECORD_MS) -> PendingMessage:
    return PendingMessage(
        origin=f"items/0/{offset}",
        key=b"k",
        value=b"v",
        headers=(),
        provenance=provenance(offset, record_ms),
        attempt=attempt,
        tier="1s",
        tier_topic="items.retry.1s",
        partition=0,
        due_at_ms=NOW + 1000,
        parked_at_ms=NOW,
        error_class="RetryableError",
        error_message="not yet",
    )


def remembered(*, attempt: int, ended: bool, at_ms: int = NOW, record_ms: int = RECORD_MS) -> KeyState:
    return KeyState(marks=(Mark(ORIGIN, attempt, at_ms, ended, record_ms),), partition_hint=0)


# --- redelivery: a main-topic record --------------------------------------------------------------------------------


def test_a_first_delivery_of_a_message_nothing_knows_runs() -> None:
    assert redelivery(KeyState(), provenance(), 0) is None


def test_a_first_delivery_whose_retry_is_parked_is_a_redelivery() -> None:
    """The defect: the main agent started such a record over as attempt 0 while its retry waited."""
    assert redelivery(KeyState(pending=(parked(attempt=1),)), provenance(), 0) is Known.PARKED


def test_a_first_delivery_whose_retry_is_on_its_way_to_a_tier_is_a_redelivery() -> None:
    assert redelivery(remembered(attempt=1, ended=False), provenance(), 0) is Known.FORWARDED


def test_a_first_delivery_of_a_message_that_ended_is_a_redelivery() -> None:
    assert redelivery(remembered(attempt=3, ended=True), provenance(), 0) is Known.ENDED


def test_another_record_at_the_same_origin_is_not_a_redelivery() -> None:
    """Same topic, partition and offset, another timestamp: the topic was deleted and created again."""
    other = provenance(record_ms=RECORD_MS + 1)
    assert redelivery(remembered(attempt=3, ended=True), other, 0) is None
    assert redelivery(remembered(attempt=1, ended=False), other, 0) is None
    assert redelivery(KeyState(pending=(parked(attempt=1),)), other, 0) is None


def test_other_messages_of_the_key_are_not_redeliveries() -> None:
    state = KeyState(pending=(parked(offset=3),), marks=(Mark("items/0/5", 1, NOW, True, RECORD_MS),))
    assert redelivery(state, provenance(offset=7), 0) is None


def test_a_republished_record_runs_with_its_own_attempt_but_not_an_older_one() -> None:
    """Release mode ``republish``: the main record carries attempt 2; it runs while attempt 2 is what is on its way
    (or still parked: its release has not settled), never once attempt 3 is, nor after the message ended."""
    assert redelivery(remembered(attempt=2, ended=False), provenance(), 2) is None
    assert redelivery(KeyState(pending=(parked(attempt=2),)), provenance(), 2) is None
    assert redelivery(remembered(attempt=3, ended=False), provenance(), 2) is Known.FORWARDED
    assert redelivery(KeyState(pending=(parked(attempt=3),)), provenance(), 2) is Known.PARKED
    assert redelivery(remembered(attempt=2, ended=True), provenance(), 2) is Known.ENDED


def test_a_state_read_without_the_origins_entry_cannot_answer() -> None:
    """A redelivery check on a state loaded for another message would take "not loaded" for "not parked"."""
    state = KeyState(others=1, loaded=frozenset({"items/0/1"}))
    with pytest.raises(LookupError):
        redelivery(state, provenance(), 0)


# --- tier_duplicate: a tier record ----------------------------------------------------------------------------------


def test_a_tier_record_of_a_message_that_ended_is_a_duplicate() -> None:
    """The chaos finding: park() took a copy arriving after the retry settled for a new retry and ran it again."""
    assert tier_duplicate(remembered(attempt=1, ended=True), provenance(), 1) is Known.ENDED


def test_a_tier_record_of_an_older_attempt_than_the_one_on_its_way_is_a_duplicate() -> None:
    assert tier_duplicate(remembered(attempt=3, ended=False), provenance(), 2) is Known.FORWARDED


def test_the_tier_record_the_mark_waits_for_is_parked() -> None:
    assert tier_duplicate(remembered(attempt=2, ended=False), provenance(), 2) is None
    assert tier_duplicate(KeyState(), provenance(), 1) is None


def test_a_tier_record_older_than_the_parked_attempt_is_a_duplicate() -> None:
    assert tier_duplicate(KeyState(pending=(parked(attempt=3),)), provenance(), 2) is Known.PARKED
    assert tier_duplicate(KeyState(pending=(parked(attempt=1),)), provenance(), 2) is None


def test_parking_the_awaited_retry_replaces_its_mark() -> None:
    state, changed = remembered(attempt=1, ended=False).park(parked(attempt=1))
    assert changed and state.marks == () and state.find(ORIGIN) is not None


# --- remember / after_settle ----------------------------------------------------------------------------------------


def test_a_retry_sent_to_its_tier_is_remembered_until_it_is_parked() -> None:
    state = remember(KeyState(), provenance(), attempt=1, ended=False, partition=0, now_ms=NOW, memory=MEMORY)
    assert state.marks == (Mark(ORIGIN, 1, NOW, False, RECORD_MS),)
    assert not state.is_idle and state.partition == 0
    assert KeyState.from_json(state.to_json()).marks == state.marks


def test_nothing_is_remembered_over_a_parked_entry_of_that_attempt_or_a_later_one() -> None:
    """The tier agent parked the retry before the main agent wrote its mark (the order is not fixed)."""
    state = KeyState(pending=(parked(attempt=2),))
    for attempt, ended in ((1, False), (1, True), (2, False)):
        after = remember(state, provenance(), attempt=attempt, ended=ended, partition=0, now_ms=NOW, memory=MEMORY)
        assert after.marks == ()


def test_an_end_is_remembered_even_while_its_own_attempt_is_parked() -> None:
    """Release mode republish: the re-published record of attempt 2 ran and ended before the release that sent it
    settled; without the mark, the settle would remember it as on its way and a copy of it would run again."""
    state = KeyState(pending=(parked(attempt=2),))
    after = remember(state, provenance(), attempt=2, ended=True, partition=0, now_ms=NOW, memory=MEMORY)
    assert after.marks == (Mark(ORIGIN, 2, NOW, True, RECORD_MS),)
    settled = after_settle(after, ORIGIN, 2, Outcome.SUCCEEDED, now_ms=NOW + 1, memory=MEMORY, republished=True)
    assert settled.pending == () and settled.marks == (Mark(ORIGIN, 2, NOW, True, RECORD_MS),)
    assert redelivery(settled, provenance(), 2) is Known.ENDED


def test_an_end_replaces_the_retry_on_its_way_but_never_the_other_way() -> None:
    ended = remember(
        remembered(attempt=1, ended=False), provenance(), attempt=1, ended=True, partition=0, now_ms=NOW, memory=MEMORY
    )
    assert ended.marks == (Mark(ORIGIN, 1, NOW, True, RECORD_MS),)
    again = remember(ended, provenance(), attempt=2, ended=False, partition=0, now_ms=NOW + 1, memory=MEMORY)
    assert again.marks == ended.marks


@pytest.mark.parametrize(
    ("outcome", "republished", "expected"),
    [
        (Outcome.SCHEDULED, False, Mark(ORIGIN, 2, NOW, False, RECORD_MS)),
        (Outcome.SUCCEEDED, False, Mark(ORIGIN, 1, NOW, True, RECORD_MS)),
        (Outcome.DEAD, False, Mark(ORIGIN, 1, NOW, True, RECORD_MS)),
        (Outcome.EXPIRED, False, Mark(ORIGIN, 1, NOW, True, RECORD_MS)),
        (Outcome.SUCCEEDED, True, Mark(ORIGIN, 1, NOW, False, RECORD_MS)),
    ],
)
def test_a_settled_release_remembers_where_the_message_went(
    outcome: Outcome, republished: bool, expected: Mark
) -> None:
    state = after_settle(
        KeyState(pending=(parked(attempt=1),)),
        ORIGIN,
        1,
        outcome,
        now_ms=NOW,
        memory=MEMORY,
        republished=republished,
    )
    assert state.pending == () and state.marks == (replace(expected, digest=record_digest(b"k", b"v")),)


def test_a_settle_of_an_attempt_no_longer_parked_remembers_nothing() -> None:
    """A newer attempt was parked meanwhile: it is where the message is."""
    state = KeyState(pending=(parked(attempt=2),))
    after = after_settle(state, ORIGIN, 1, Outcome.SUCCEEDED, now_ms=NOW, memory=MEMORY)
    assert after == state


def test_only_a_first_try_success_leaves_nothing_behind() -> None:
    """The healthy path writes nothing; everything that leaves the main topic, or ends a re-published retry, does."""
    assert not remembers_outcome(Outcome.SUCCEEDED, 0)
    assert not remembers_outcome(Outcome.HELD, 0)
    assert remembers_outcome(Outcome.SUCCEEDED, 2)
    for outcome in (Outcome.SCHEDULED, Outcome.DEAD, Outcome.EXPIRED):
        assert remembers_outcome(outcome, 0)


def test_a_held_messages_first_try_success_is_remembered() -> None:
    """Its record's offset was acknowledged when it was held, maybe not committed: a copy read again must find its
    end. Held, it has not run: nothing to remember yet."""
    assert remembers_outcome(Outcome.SUCCEEDED, 0, was_held=True)
    assert not remembers_outcome(Outcome.HELD, 0, was_held=True)
    state = remember(KeyState(), provenance(), attempt=0, ended=True, partition=0, now_ms=NOW, memory=MEMORY)
    assert redelivery(state, provenance(), 0, now_ms=NOW, memory=MEMORY) is Known.ENDED


# --- forgetting -----------------------------------------------------------------------------------------------------


def test_marks_are_forgotten_after_the_memorys_time() -> None:
    state = remembered(attempt=1, ended=True, at_ms=NOW)
    assert forget_expired(state, NOW + MEMORY.keep_ms - 1, MEMORY) == state
    forgotten = forget_expired(state, NOW + MEMORY.keep_ms, MEMORY)
    assert forgotten.marks == () and forgotten.is_idle


def test_a_key_remembers_at_most_its_count_the_oldest_go_first() -> None:
    state = KeyState()
    for offset in range(6):
        state = remember(
            state, provenance(offset), attempt=1, ended=True, partition=0, now_ms=NOW + offset, memory=MEMORY
        )
    assert [mark.origin for mark in state.marks] == [f"items/0/{offset}" for offset in range(2, 6)]


def test_a_mark_costs_about_seventy_bytes_of_the_keys_index() -> None:
    """What docs/guarantees.md states: a remembered message is one JSON list in its key's index record."""
    empty = KeyState(partition_hint=0).to_json()
    mark = Mark(ORIGIN, 6, NOW, True, RECORD_MS, digest=record_digest(b"k", b"v"))
    one = KeyState(marks=(mark,), partition_hint=0).to_json()
    assert 55 <= len(one) - len(empty) <= 75


def test_forwarded_marks_are_never_evicted_by_count_ended_ones_go_first() -> None:
    """A forwarded mark stands for a retry still on the tier topic: evicted by count, a redelivery of its record would
    start the message over (a fork) while that retry is on its way."""
    state = KeyState()
    for offset in range(3):  # three retries on their way, written first (the oldest)
        state = remember(state, provenance(offset), attempt=1, ended=False, partition=0, now_ms=NOW, memory=MEMORY)
    for offset in range(3, 8):
        state = remember(
            state, provenance(offset), attempt=1, ended=True, partition=0, now_ms=NOW + offset, memory=MEMORY
        )
    assert len(state.marks) == MEMORY.per_key
    assert [mark.origin for mark in state.marks if not mark.ended] == [f"items/0/{offset}" for offset in range(3)]
    assert [mark.origin for mark in state.marks if mark.ended] == ["items/0/7"]
    for offset in range(3):
        assert redelivery(state, provenance(offset), 0) is Known.FORWARDED
    more = remember(state, provenance(9), attempt=1, ended=False, partition=0, now_ms=NOW + 9, memory=MEMORY)
    assert len([mark for mark in more.marks if not mark.ended]) == 4, "a forwarded mark was evicted by count"


def test_an_expired_mark_not_yet_forgotten_refuses_nothing() -> None:
    """The expiry heap forgets marks lazily (a partition that falls silent keeps them): once past the memory's time
    they must not refuse a record any more."""
    later = NOW + MEMORY.keep_ms
    ended, forwarded = remembered(attempt=1, ended=True), remembered(attempt=2, ended=False)
    assert redelivery(ended, provenance(), 0, now_ms=later - 1, memory=MEMORY) is Known.ENDED
    assert redelivery(ended, provenance(), 0, now_ms=later, memory=MEMORY) is None
    assert redelivery(forwarded, provenance(), 0, now_ms=later, memory=MEMORY) is None
    assert tier_duplicate(ended, provenance(), 1, now_ms=later - 1, memory=MEMORY) is Known.ENDED
    assert tier_duplicate(ended, provenance(), 1, now_ms=later, memory=MEMORY) is None
    assert tier_duplicate(forwarded, provenance(), 1, now_ms=later, memory=MEMORY) is None


# --- a retry about to be sent ---------------------------------------------------------------------------------------


def sending(attempt: int = 1) -> KeyState:
    return remember(
        KeyState(), provenance(), attempt=attempt, ended=False, partition=0, now_ms=NOW, memory=MEMORY, sending=True
    )


def test_a_sending_mark_refuses_no_redelivery_but_asks_for_its_end_to_be_remembered() -> None:
    """Written before the send: the worker may have stopped before it, so the record must run again."""
    state = sending()
    assert state.marks == (Mark(ORIGIN, 1, NOW, False, RECORD_MS, True),)
    assert KeyState.from_json(state.to_json()).marks == state.marks
    assert redelivery(state, provenance(), 0) is Known.SENDING
    assert remembers_outcome(Outcome.SUCCEEDED, 0, maybe_sent=True)
    assert tier_duplicate(state, provenance(), 1) is None, "its retry, if it was sent, parks"


def test_the_sent_retry_replaces_the_sending_mark_and_an_end_replaces_both() -> None:
    forwarded = remember(sending(), provenance(), attempt=1, ended=False, partition=0, now_ms=NOW + 1, memory=MEMORY)
    assert forwarded.marks == (Mark(ORIGIN, 1, NOW + 1, False, RECORD_MS),)
    assert redelivery(forwarded, provenance(), 0) is Known.FORWARDED
    back = remember(
        forwarded, provenance(), attempt=1, ended=False, partition=0, now_ms=NOW + 2, memory=MEMORY, sending=True
    )
    assert back == forwarded, "a sending mark never takes back a sent one"
    ended = remember(sending(), provenance(), attempt=0, ended=True, partition=0, now_ms=NOW + 1, memory=MEMORY)
    assert ended.marks == (Mark(ORIGIN, 0, NOW + 1, True, RECORD_MS),)
    assert tier_duplicate(ended, provenance(), 1) is Known.ENDED, "the orphan retry would run the ended message again"


# --- a record's identity ----------------------------------------------------------------------------------------------


def test_a_mark_refuses_only_the_record_with_its_bytes() -> None:
    """A topic recreated and refilled with the same timestamps (a mirror), or records with no timestamp (all 0),
    within the memory's time: same origin, same timestamp, other bytes. Refused as ended, such a record would be lost."""
    digest = record_digest(b"k", b"v")
    state = remember(
        KeyState(), provenance(), attempt=1, ended=True, partition=0, now_ms=NOW, memory=MEMORY, digest=digest
    )
    assert KeyState.from_json(state.to_json()).marks == state.marks
    assert redelivery(state, provenance(), 0, digest=digest) is Known.ENDED
    assert tier_duplicate(state, provenance(), 1, digest=digest) is Known.ENDED
    other = record_digest(b"k", b"another value")
    assert redelivery(state, provenance(), 0, digest=other) is None
    assert tier_duplicate(state, provenance(), 1, digest=other) is None
    assert record_digest(b"k", None) != record_digest(b"k", b""), "a null value is not an empty one"
