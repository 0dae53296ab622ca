"""Key-ordered mode's pure decisions (``rebound/ordering.py``) and the key state fields they rest on.

The agents only carry these decisions out, so a key's order is kept (or lost) here: where a record goes, when a held
message may run, and what each outcome does to the key's block. No broker, no Faust.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rebound.attempts import Outcome
from rebound.headers import Provenance
from rebound.ordering import (
    HELD_TIER,
    Placement,
    after_outcome,
    block,
    first_unsettled_offset,
    held_entry,
    hold,
    is_unsettled,
    next_held,
    origin_of,
    place,
    retry_block,
    settle_blocker,
    unblock,
    without_held,
)
from rebound.state import KeyState, PendingMessage

T0 = 1_700_000_000_000
TOPIC = "items"


def provenance(offset: int, *, topic: str = TOPIC, partition: int = 0) -> Provenance:
    return Provenance(topic=topic, partition=partition, offset=offset, timestamp_ms=T0 - 1_000, first_received_at_ms=T0)


def origin(offset: int, *, topic: str = TOPIC, partition: int = 0) -> str:
    return f"{topic}/{partition}/{offset}"


def parked(
    offset: int, *, topic: str = TOPIC, partition: int = 0, attempt: int = 1, **overrides: Any
) -> PendingMessage:
    """A message retrying in a tier (what the unordered mode, or a blocker's retry, leaves in ``pending``)."""
    source = provenance(offset, topic=topic, partition=partition)
    fields: dict[str, Any] = {
        "origin": origin_of(source),
        "key": b"item-1",
        "value": b'{"type":"UpdateItem"}',
        "headers": (("trace-id", b"abc"),),
        "provenance": source,
        "attempt": attempt,
        "tier": "5m",
        "tier_topic": "items.retry.5m",
        "partition": partition,
        "due_at_ms": T0 + 300_000 * attempt,
        "parked_at_ms": T0,
        "error_class": "app.errors.RetryableError",
        "error_message": f"item missing (attempt {attempt})",
    }
    fields.update(overrides)
    value = fields["value"]
    fields.setdefault("value_size", None if value is None else len(value))
    return PendingMessage(**fields)


def held(
    offset: int,
    *,
    topic: str = TOPIC,
    partition: int = 0,
    value: bytes | None = b"v",
    blocked_by: str | None = None,
) -> PendingMessage:
    """A message waiting behind its key's blocking one, built the way the main agent builds it."""
    return held_entry(
        key=b"item-1",
        value=value,
        headers=(("trace-id", b"abc"),),
        provenance=provenance(offset, topic=topic, partition=partition),
        now_ms=T0,
        blocked_by=blocked_by,
    )


def holding(*offsets: int, **state: Any) -> KeyState:
    """A key state holding messages at ``offsets`` (of ``items/0``), plus any other fields."""
    return KeyState(held=tuple(held(offset) for offset in offsets), **state)


# --- place -------------------------------------------------------------------------------------------------------


def test_a_key_with_nothing_unsettled_runs_its_record() -> None:
    """The common case: a free key's record runs at once, like in unordered mode."""
    assert not is_unsettled(KeyState())
    assert place(KeyState(), provenance(10)) is Placement.RUN
    # Running totals alone (a key that retried once and settled) do not block.
    assert place(KeyState(attempts=3, released=3, last_error="x"), provenance(10)) is Placement.RUN


@pytest.mark.parametrize(
    "state",
    [
        pytest.param(KeyState(blocked_by=origin(5)), id="blocked"),
        pytest.param(KeyState(blocked_by=origin(5), blocked_dead=True), id="blocked-by-dead-letter"),
        pytest.param(holding(6), id="held"),
        pytest.param(KeyState(pending=(parked(5),)), id="pending-from-unordered-mode"),
    ],
)
def test_a_later_record_of_a_key_with_anything_unsettled_is_held(state: KeyState) -> None:
    """Anything of the key still unsettled (a block, a held message, a retry left by unordered mode) comes first."""
    assert is_unsettled(state)
    assert place(state, provenance(10)) is Placement.HOLD


def test_a_record_held_already_is_recognised() -> None:
    """A held record redelivered (a crash before the commit) must not be held twice, nor run ahead of its turn."""
    state = holding(6, 7, blocked_by=origin(5))
    assert place(state, provenance(6)) is Placement.ALREADY_HELD
    assert place(state, provenance(7)) is Placement.ALREADY_HELD
    # Even when nothing blocks any more (the key is being drained), a held one is still held.
    assert place(holding(6), provenance(6)) is Placement.ALREADY_HELD


@pytest.mark.parametrize(
    "state",
    [
        pytest.param(KeyState(blocked_by=origin(5)), id="blocked"),
        pytest.param(KeyState(blocked_by=origin(5), blocked_dead=True), id="blocked-by-dead-letter"),
        pytest.param(KeyState(pending=(parked(5),)), id="pending"),
        pytest.param(KeyState(blocked_by=origin(5), pending=(parked(5),), held=(held(8),)), id="all"),
    ],
)
@pytest.mark.parametrize("offset", [5, 4, 0])
def test_a_redelivered_record_at_or_before_the_first_unsettled_one_runs(state: KeyState, offset: int) -> None:
    """The blocker itself redelivered runs again (at-least-once); an earlier record replayed after a crash was
    handled already before the block, so running it keeps the order a consumer replaying the partition sees."""
    assert place(state, provenance(offset)) is Placement.RUN


def test_a_record_just_after_the_first_unsettled_one_is_held() -> None:
    state = KeyState(blocked_by=origin(5))
    assert place(state, provenance(6)) is Placement.HOLD


@pytest.mark.parametrize(
    "state",
    [
        pytest.param(KeyState(blocked_by=origin(107), pending=(parked(107),), held=(held(110),)), id="retrying"),
        pytest.param(KeyState(blocked_by=origin(107), blocked_dead=True, held=(held(110),)), id="dead-letter-blocks"),
        pytest.param(holding(107, 110, blocked_by=origin(107)), id="held-head-blocking-itself"),
    ],
)
def test_a_record_read_again_below_a_later_blocking_one_runs_at_once(state: KeyState) -> None:
    """K@105, lost on its way and read again after K@107 ran and blocked the key: it is not 107's redelivery and
    not held behind 107 (107 has not succeeded, so 105 running first keeps the key's successes in offset order)."""
    assert place(state, provenance(105)) is Placement.RUN


def test_a_record_read_again_between_an_earlier_blocker_and_later_held_ones_is_held_in_their_place() -> None:
    """K@100 retrying, K@107 and K@110 held behind it, K@105 read again: held, and it runs before 107 and 110."""
    state = KeyState(blocked_by=origin(100), pending=(parked(100),), held=(held(107), held(110)))
    assert place(state, provenance(105)) is Placement.HOLD
    state, changed = hold(state, held(105, blocked_by=state.blocked_by))
    assert changed
    assert [entry.origin for entry in state.held] == [origin(105), origin(107), origin(110)]
    assert next_held(state) is None
    state, _ = state.settle(origin(100), 1)
    state = after_outcome(state, origin(100), Outcome.SUCCEEDED, dead_letter_blocks=False)
    head = next_held(state)
    assert head is not None and head.origin == origin(105)


@pytest.mark.parametrize(
    "record",
    [
        pytest.param(provenance(1, partition=1), id="other-partition"),
        pytest.param(provenance(1, topic="orders"), id="other-topic"),
        pytest.param(provenance(1, topic="items.v2"), id="topic-with-a-dot"),
        pytest.param(provenance(1, topic="item"), id="topic-prefix"),
    ],
)
def test_a_record_of_another_topic_or_partition_is_held_whatever_its_offset(record: Provenance) -> None:
    """Offsets of different partitions are not comparable: a low offset elsewhere is no redelivery."""
    state = KeyState(blocked_by=origin(5), held=(held(8),), pending=(parked(5),))
    assert place(state, record) is Placement.HOLD


# --- first_unsettled_offset -----------------------------------------------------------------------------------------


def test_first_unsettled_offset_of_a_free_key_is_none() -> None:
    assert first_unsettled_offset(KeyState(), TOPIC, 0) is None


def test_first_unsettled_offset_takes_the_lowest_of_blocker_pending_and_held() -> None:
    """Each of the three can be the lowest: the blocker, a retry left by unordered mode, a held one (replayed)."""
    assert first_unsettled_offset(KeyState(blocked_by=origin(3), pending=(parked(7),), held=(held(9),)), TOPIC, 0) == 3
    assert first_unsettled_offset(KeyState(blocked_by=origin(7), pending=(parked(3),), held=(held(9),)), TOPIC, 0) == 3
    assert first_unsettled_offset(KeyState(blocked_by=origin(9), pending=(parked(7),), held=(held(3),)), TOPIC, 0) == 3
    assert first_unsettled_offset(holding(12, 11), TOPIC, 0) == 11


def test_first_unsettled_offset_ignores_other_partitions_and_topics() -> None:
    state = KeyState(
        blocked_by=origin(1, partition=1),
        pending=(parked(2, topic="orders"), parked(3, topic="items.v2")),
        held=(held(4, topic="item"), held(50), held(60, partition=1)),
    )
    assert first_unsettled_offset(state, TOPIC, 0) == 50
    assert first_unsettled_offset(state, TOPIC, 1) == 1
    assert first_unsettled_offset(state, "orders", 0) == 2
    assert first_unsettled_offset(state, "items.v2", 0) == 3
    assert first_unsettled_offset(state, "item", 0) == 4
    assert first_unsettled_offset(state, TOPIC, 2) is None
    assert first_unsettled_offset(state, "other", 0) is None


@pytest.mark.parametrize("topic", ["my.items-v2", "a.b.c", "x-y-z", "t_1.2", "10"])
def test_first_unsettled_offset_parses_topics_with_dots_dashes_and_digits(topic: str) -> None:
    """Origins are ``topic/partition/offset``, split from the right: the topic may be any legal name."""
    state = KeyState(blocked_by=origin(17, topic=topic, partition=3))
    assert first_unsettled_offset(state, topic, 3) == 17
    assert first_unsettled_offset(state, topic, 0) is None
    assert place(state, provenance(17, topic=topic, partition=3)) is Placement.RUN
    assert place(state, provenance(18, topic=topic, partition=3)) is Placement.HOLD


def test_first_unsettled_offset_does_not_take_partition_10_for_partition_1() -> None:
    state = KeyState(blocked_by=origin(5, partition=10), held=(held(20, partition=1),))
    assert first_unsettled_offset(state, TOPIC, 1) == 20
    assert first_unsettled_offset(state, TOPIC, 10) == 5


# --- hold / without_held -------------------------------------------------------------------------------------------


def test_held_entry_is_a_not_yet_failed_message() -> None:
    entry = held(6, value=b"abc", blocked_by=origin(5))
    assert entry.origin == origin(6)
    assert entry.tier == HELD_TIER
    assert entry.attempt == 0
    assert entry.value_size == 3
    assert entry.error_message == f"held behind {origin(5)}"
    assert held(6, value=None).value_size is None
    assert held(6).error_message == "held"


def test_hold_keeps_offset_order_within_a_partition() -> None:
    """A record delivered again after an earlier one of its key could not be held goes back to its place in line."""
    state = KeyState(blocked_by=origin(5))
    for offset in (6, 8, 7):
        state, changed = hold(state, held(offset))
        assert changed is True
    assert [entry.origin for entry in state.held] == [origin(6), origin(7), origin(8)]
    assert state.blocked_by == origin(5)  # holding never touches the block


def test_hold_is_idempotent_by_origin() -> None:
    """A record redelivered while held keeps its first copy and its place in the line."""
    state, _ = hold(KeyState(), held(6))
    state, _ = hold(state, held(7))
    again, changed = hold(state, held(6, value=b"another copy"))
    assert changed is False
    assert again is state
    assert [entry.origin for entry in again.held] == [origin(6), origin(7)]
    assert again.held[0].value == b"v"


def test_without_held_removes_only_that_origin() -> None:
    state = holding(6, 7, 8, blocked_by=origin(5))
    after = without_held(state, origin(7))
    assert [entry.origin for entry in after.held] == [origin(6), origin(8)]
    assert after.blocked_by == origin(5)
    assert without_held(after, origin(99)) == after
    assert without_held(without_held(after, origin(6)), origin(8)).held == ()


# --- next_held -----------------------------------------------------------------------------------------------------


def test_next_held_of_a_key_holding_nothing_is_none() -> None:
    assert next_held(KeyState()) is None
    assert next_held(KeyState(blocked_by=origin(5))) is None


def test_next_held_waits_while_another_message_blocks() -> None:
    assert next_held(holding(6, 7, blocked_by=origin(5))) is None
    assert next_held(holding(6, 7, blocked_by=origin(7, partition=1))) is None  # a block of another partition
    assert next_held(holding(6, blocked_by=origin(5), blocked_dead=True)) is None


def test_next_held_waits_while_anything_is_retrying() -> None:
    """A retry of the key still parked (its own, or one left by unordered mode) must settle first."""
    assert next_held(holding(6, pending=(parked(5),))) is None
    assert next_held(holding(6, pending=(parked(6),), blocked_by=origin(6))) is None


def test_next_held_is_not_held_by_a_later_offset_of_its_partition_blocking_or_retrying() -> None:
    """That one waits for it (``waits_for``): held behind it as well, the two would wait for each other for ever."""
    state = holding(6, 7, blocked_by=origin(7))
    assert next_held(state) == state.held[0]
    state = holding(6, blocked_by=origin(9), pending=(parked(9),))
    assert next_held(state) == state.held[0]
    # Unless the key's parked messages were not loaded: then any retry of the key comes first, as it always did.
    assert next_held(replace(state, pending=(), others=1, loaded=frozenset())) is None


def test_next_held_is_the_first_held_once_the_key_is_free() -> None:
    state = holding(6, 7)
    assert next_held(state) == state.held[0]


def test_next_held_runs_again_a_first_held_message_that_blocks_the_key_itself() -> None:
    """It was running when its worker stopped: its block was written, its retry maybe not. Waiting for it would wait
    for ever, so it runs again (at-least-once)."""
    state = holding(6, 7, blocked_by=origin(6))
    assert next_held(state) == state.held[0]


# --- after_outcome / block / settle_blocker / unblock -----------------------------------------------------------------

BLOCKED = KeyState(blocked_by=origin(5), held=(held(6),))


@pytest.mark.parametrize("outcome", [Outcome.SCHEDULED, Outcome.HELD])
@pytest.mark.parametrize("dead_letter_blocks", [False, True])
@pytest.mark.parametrize(
    "state",
    [BLOCKED, KeyState(), KeyState(blocked_by=origin(5), blocked_dead=True)],
    ids=["blocked", "free", "blocked-dead"],
)
def test_a_scheduled_or_held_outcome_leaves_the_state(
    state: KeyState, outcome: Outcome, dead_letter_blocks: bool
) -> None:
    """The block of a scheduled retry was written before the retry was sent; a refusal since may have lifted it,
    and this outcome must not put it back."""
    assert after_outcome(state, origin(5), outcome, dead_letter_blocks=dead_letter_blocks) is state


@pytest.mark.parametrize("dead_letter_blocks", [False, True])
def test_success_lifts_the_block_that_message_held(dead_letter_blocks: bool) -> None:
    after = after_outcome(BLOCKED, origin(5), Outcome.SUCCEEDED, dead_letter_blocks=dead_letter_blocks)
    assert after.blocked_by is None
    assert after.blocked_dead is False
    assert after.held == BLOCKED.held
    assert next_held(after) == BLOCKED.held[0]


@pytest.mark.parametrize("dead_letter_blocks", [False, True])
def test_success_of_a_dead_lettered_blocker_lifts_its_block(dead_letter_blocks: bool) -> None:
    state = replace(BLOCKED, blocked_dead=True)
    after = after_outcome(state, origin(5), Outcome.SUCCEEDED, dead_letter_blocks=dead_letter_blocks)
    assert (after.blocked_by, after.blocked_dead) == (None, False)


@pytest.mark.parametrize("outcome", [Outcome.SUCCEEDED, Outcome.DEAD, Outcome.EXPIRED])
@pytest.mark.parametrize("dead_letter_blocks", [False, True])
def test_an_end_of_another_message_leaves_the_block(outcome: Outcome, dead_letter_blocks: bool) -> None:
    """A stale release (or a retry left by unordered mode) ending is not the blocker's end."""
    assert after_outcome(BLOCKED, origin(4), outcome, dead_letter_blocks=dead_letter_blocks) is BLOCKED


@pytest.mark.parametrize("outcome", [Outcome.DEAD, Outcome.EXPIRED])
def test_a_dead_letter_lifts_the_block_unless_dead_letters_block(outcome: Outcome) -> None:
    after = after_outcome(BLOCKED, origin(5), outcome, dead_letter_blocks=False)
    assert (after.blocked_by, after.blocked_dead) == (None, False)
    assert after.held == BLOCKED.held


@pytest.mark.parametrize("outcome", [Outcome.DEAD, Outcome.EXPIRED])
def test_a_dead_letter_keeps_the_block_when_dead_letters_block(outcome: Outcome) -> None:
    """The operator decides: the key's later messages wait until the dead letter is dealt with."""
    after = after_outcome(BLOCKED, origin(5), outcome, dead_letter_blocks=True)
    assert (after.blocked_by, after.blocked_dead) == (origin(5), True)
    assert next_held(after) is None


@pytest.mark.parametrize("outcome", [Outcome.DEAD, Outcome.EXPIRED])
def test_a_first_try_dead_lettered_blocks_a_free_key_when_dead_letters_block(outcome: Outcome) -> None:
    """A message dead-lettered at once (never scheduled, so never blocking) still stops the key's later ones."""
    after = after_outcome(KeyState(), origin(5), outcome, dead_letter_blocks=True)
    assert (after.blocked_by, after.blocked_dead) == (origin(5), True)
    assert not after.is_idle
    # ... and one held whose first run is dead-lettered blocks the rest of the line.
    drained = after_outcome(holding(7), origin(6), outcome, dead_letter_blocks=True)
    assert (drained.blocked_by, drained.blocked_dead) == (origin(6), True)
    assert next_held(drained) is None


@pytest.mark.parametrize("outcome", [Outcome.DEAD, Outcome.EXPIRED, Outcome.SUCCEEDED])
def test_an_end_on_a_free_key_leaves_it_free_when_dead_letters_do_not_block(outcome: Outcome) -> None:
    after = after_outcome(KeyState(), origin(5), outcome, dead_letter_blocks=False)
    assert after == KeyState()
    assert after.is_idle


def test_every_outcome_is_covered() -> None:
    """A new outcome must be given a meaning for the key's block (and a test above)."""
    assert set(Outcome) == {Outcome.SUCCEEDED, Outcome.SCHEDULED, Outcome.DEAD, Outcome.EXPIRED, Outcome.HELD}


def test_block_sets_the_blocker_and_whether_it_is_a_dead_letter() -> None:
    state = holding(6)
    blocked = block(state, origin(5))
    assert (blocked.blocked_by, blocked.blocked_dead, blocked.held) == (origin(5), False, state.held)
    dead = block(blocked, origin(5), dead=True)
    assert (dead.blocked_by, dead.blocked_dead) == (origin(5), True)
    # A scheduled retry of the same message turns a dead-letter block back into a plain one.
    assert block(dead, origin(5)).blocked_dead is False


def test_settle_blocker() -> None:
    blocked = KeyState(blocked_by=origin(5))
    assert settle_blocker(blocked, origin(5), dead=False, dead_letter_blocks=True).blocked_by is None
    assert settle_blocker(blocked, origin(5), dead=True, dead_letter_blocks=False).blocked_by is None
    kept = settle_blocker(blocked, origin(5), dead=True, dead_letter_blocks=True)
    assert (kept.blocked_by, kept.blocked_dead) == (origin(5), True)
    assert settle_blocker(blocked, origin(4), dead=False, dead_letter_blocks=False) is blocked
    assert settle_blocker(blocked, origin(4), dead=True, dead_letter_blocks=True) is blocked
    assert settle_blocker(KeyState(), origin(5), dead=False, dead_letter_blocks=False) == KeyState()


def test_unblock_lifts_any_block_and_keeps_the_held_line() -> None:
    state = holding(6, 7, blocked_by=origin(5), blocked_dead=True)
    lifted = unblock(state)
    assert (lifted.blocked_by, lifted.blocked_dead) == (None, False)
    assert lifted.held == state.held
    assert next_held(lifted) == state.held[0]
    assert unblock(KeyState()) == KeyState()


# --- KeyState fields -----------------------------------------------------------------------------------------------


def test_find_held() -> None:
    state = holding(6, 7)
    assert state.find_held(origin(7)) == state.held[1]
    assert state.find_held(origin(8)) is None
    assert state.find(origin(7)) is None  # held messages are not pending ones


def test_a_key_only_blocked_or_only_holding_is_not_idle() -> None:
    """An idle key is deleted from the table: a block or a held message alone must keep it."""
    assert KeyState().is_idle
    assert not KeyState(blocked_by=origin(5)).is_idle
    assert not KeyState(blocked_by=origin(5), blocked_dead=True).is_idle
    assert not holding(6).is_idle
    assert not KeyState(pending=(parked(5),)).is_idle


def test_json_round_trip_keeps_the_held_line_and_the_blocker() -> None:
    """Payloads stay out of the state (they live in the payload table), the rest comes back exactly."""
    state = KeyState(
        pending=(parked(5, attempt=2),),
        attempts=2,
        first_failure_ms=T0,
        released=1,
        held=(held(8, value=b"secret-8"), held(6, value=None, blocked_by=origin(5))),
        blocked_by=origin(5),
        blocked_dead=True,
    )
    raw = state.to_json()
    data = json.loads(raw)
    assert data["blocked_by"] == origin(5)
    assert data["blocked_dead"] is True
    # The state lists held messages by origin only: their metadata lives with their bytes (RetryStore), so a key
    # holding many messages keeps a small state.
    assert data["held"] == [origin(8), origin(6)]
    assert b"secret-8" not in raw
    restored = KeyState.from_json(raw)
    assert [entry.origin for entry in restored.held] == [origin(8), origin(6)]
    assert [entry.provenance.offset for entry in restored.held] == [8, 6]
    assert not any(entry.has_payload for entry in restored.held)
    full = state.held[0]
    back = restored.held[0].with_held_payload(full.encode_held())
    assert back == full  # metadata and bytes, from the held record alone
    assert (restored.blocked_by, restored.blocked_dead) == (origin(5), True)
    assert restored.parked == 1  # the retrying message has its own record; the state counts it
    assert restored.to_json() == raw


def test_json_of_a_key_without_ordering_state_stays_as_before() -> None:
    """Unordered mode writes exactly what earlier versions wrote: no new keys in its records."""
    data = json.loads(KeyState(pending=(parked(5),), attempts=1).to_json())
    assert not {"held", "blocked_by", "blocked_dead"} & data.keys()


def test_json_of_a_blocked_key_holding_nothing() -> None:
    state = KeyState(blocked_by=origin(5))
    assert KeyState.from_json(state.to_json()) == replace(state, partition_hint=0)  # (the blocker's partition)


def test_json_written_before_key_ordered_mode_loads_with_defaults() -> None:
    entry = parked(5)
    old = {
        "v": 2,
        "pending": [entry.to_dict()],
        "attempts": 1,
        "first_failure_ms": T0,
        "last_error": "x",
        "last_error_class": "E",
        "released": 0,
        "extra": {},
    }
    state = KeyState.from_json(json.dumps(old).encode())
    assert state.held == ()
    assert state.blocked_by is None
    assert state.blocked_dead is False
    assert [item.origin for item in state.pending] == [entry.origin]
    assert place(state, provenance(9)) is Placement.HOLD  # its retry still comes first in key-ordered mode


def test_summary_of_a_free_key_is_not_blocked() -> None:
    summary = KeyState().summary()
    assert summary["blocked"] is False
    assert summary["blocked_by"] is None
    assert summary["blocked_by_dead_letter"] is False
    assert summary["held"] == []
    # Retries of unordered mode alone do not show as a block.
    assert KeyState(pending=(parked(5),)).summary()["blocked"] is False


def test_summary_reports_the_block_and_the_held_line_without_payloads() -> None:
    state = KeyState(blocked_by=origin(5), blocked_dead=True, held=(held(6, value=b"secret-payload"),))
    summary = state.summary()
    assert summary["blocked"] is True
    assert summary["blocked_by"] == origin(5)
    assert summary["blocked_by_dead_letter"] is True
    assert summary["held"] == [
        {
            "origin": origin(6),
            "original_topic": TOPIC,
            "original_partition": 0,
            "original_offset": 6,
            "attempt": 0,
            "tier": HELD_TIER,
            "due_at": T0,
            "first_received_at": T0,
            "error_class": "",
            "error_message": "held",
            "value_bytes": len(b"secret-payload"),
        }
    ]
    assert "secret-payload" not in json.dumps(summary)


def test_summary_shows_held_payloads_when_switched_on() -> None:
    summary = holding(6).summary(show_payloads=True)
    assert summary["blocked"] is True  # holding alone (a key being drained) still shows as blocked
    assert summary["blocked_by"] is None
    assert summary["held"][0]["value"] == "v"
    # Loaded without its payload, nothing to show.
    restored = KeyState.from_json(holding(6).to_json())
    assert "value" not in restored.summary(show_payloads=True)["held"][0]


# --- the agents, modelled ------------------------------------------------------------------------------------------

RUN_OUTCOMES = st.sampled_from([Outcome.SUCCEEDED, Outcome.SCHEDULED, Outcome.DEAD])


@dataclass
class KeyModel:
    """One key's state driven the way the main, tier and release agents drive it, with a log of every run."""

    dead_letter_blocks: bool
    state: KeyState = field(default_factory=KeyState)
    arrived: list[int] = field(default_factory=list)
    first_runs: list[int] = field(default_factory=list)
    runs: list[tuple[int, int]] = field(default_factory=list)
    """(offset, attempt) of every handler call."""

    def block_before_retry(self, name: str) -> None:
        """``agents.ordering.blocker``: a block by an earlier message stays (its retry keeps the key waiting too); a
        later one's moves to this lower one (``retry_block``)."""
        self.state = retry_block(self.state, name)

    def check_success(self, offset: int) -> None:
        """The key's successes come in offset order: nothing of the key below a message that succeeds is unsettled
        (parked, held or blocking). Records not read yet (lost on their way) are the model's to check."""
        unsettled = [entry.origin for entry in (*self.state.pending, *self.state.held)] + [self.state.blocked_by]
        lower = sorted(
            other for name in unsettled if name is not None and (other := int(name.rsplit("/", 1)[1])) < offset
        )
        assert not lower, f"{offset} succeeded while {lower}, below it, were unsettled: {self.runs}"

    def run(self, offset: int, attempt: int, outcome: Outcome) -> None:
        """A handler call and what the agents write around it (``run_attempt`` with the blocker, ``record_outcome``).

        A scheduled retry blocks the key before it is sent (unless another message blocks it already), then the
        tier agent parks it.
        """
        self.runs.append((offset, attempt))
        if attempt == 0:
            self.first_runs.append(offset)
        if outcome is Outcome.SUCCEEDED:
            self.check_success(offset)
        name = origin(offset)
        if outcome is Outcome.SCHEDULED:
            self.block_before_retry(name)
        self.state = after_outcome(self.state, name, outcome, dead_letter_blocks=self.dead_letter_blocks)
        if outcome is Outcome.SCHEDULED:
            self.state, changed = self.state.park(parked(offset, attempt=attempt + 1))
            assert changed

    def arrive(self, outcome: Outcome) -> None:
        offset = len(self.arrived)
        self.arrived.append(offset)
        placement = place(self.state, provenance(offset))
        assert placement is not Placement.ALREADY_HELD  # a new record is never held already
        if placement is Placement.RUN:
            self.run(offset, 0, outcome)
        else:
            self.state, changed = hold(self.state, held(offset, blocked_by=self.state.blocked_by))
            assert changed

    def retry(self, outcome: Outcome) -> None:
        """The release agent runs the key's parked retry (the blocker's), settling it first."""
        entry = self.state.pending[0]
        self.state, settled = self.state.settle(entry.origin, entry.attempt)
        assert settled
        self.run(entry.provenance.offset, entry.attempt, outcome)

    def drain(self, outcomes: st.DataObject) -> None:
        """``run_held``: run the first held message while one may run, each leaving the line after it ran."""
        while (head := next_held(self.state)) is not None:
            outcome = outcomes.draw(RUN_OUTCOMES)
            offset = head.provenance.offset
            self.runs.append((offset, 0))
            self.first_runs.append(offset)
            if outcome is Outcome.SUCCEEDED:
                self.check_success(offset)
            if outcome is Outcome.SCHEDULED:
                self.block_before_retry(head.origin)
            self.state = after_outcome(
                without_held(self.state, head.origin),
                head.origin,
                outcome,
                dead_letter_blocks=self.dead_letter_blocks,
            )
            if outcome is Outcome.SCHEDULED:
                self.state, _ = self.state.park(parked(offset, attempt=1))

    def finish(self, data: st.DataObject) -> None:
        """Every blocker finally succeeds (an operator lifts dead-letter blocks): the key must end idle."""
        for _ in range(4 * len(self.arrived) + 4):
            if self.state.pending:
                self.retry(Outcome.SUCCEEDED)
            elif self.state.blocked_dead:
                self.state = unblock(self.state)
            self.drain(data)
            if self.state.is_idle:
                return
        raise AssertionError(f"the key never became idle: {self.state}")


@settings(max_examples=300, deadline=None)
@given(data=st.data(), dead_letter_blocks=st.booleans())
def test_a_key_runs_its_records_in_order_and_drops_none(data: st.DataObject, dead_letter_blocks: bool) -> None:
    """Model: one key of one partition; records arrive with increasing offsets. Each step is one of

    * a new record arrives: ``place`` runs it (ending SUCCEEDED, DEAD, or SCHEDULED: blocked, then parked) or holds it;
    * the parked retry (the blocker's) runs: SUCCEEDED, DEAD or SCHEDULED again;
    * a drain: while ``next_held`` gives a message, it runs with a random outcome, leaves the line
      (``without_held``), and ``after_outcome`` applies (a SCHEDULED one blocks the key first and is parked).

    Then every remaining blocker succeeds (dead-letter blocks are lifted by an operator) and the key drains. The key's
    order is kept iff records first run in increasing offset order; nothing is dropped iff each arrived record first
    ran exactly once. Each parked retry runs only after its previous attempt: the retries are idempotent by origin.
    """
    model = KeyModel(dead_letter_blocks=dead_letter_blocks)
    steps = data.draw(st.lists(st.sampled_from(["arrive", "retry", "drain"]), max_size=40))
    for step in steps:
        if step == "arrive":
            model.arrive(data.draw(RUN_OUTCOMES))
        elif step == "retry" and model.state.pending:
            model.retry(data.draw(RUN_OUTCOMES))
        elif step == "drain":
            model.drain(data)
        assert model.first_runs == sorted(model.first_runs), model.runs
        assert len(model.state.pending) <= 1  # one blocker at a time: nothing else of the key retries
        if model.state.pending:
            assert model.state.blocked_by == model.state.pending[0].origin
    model.finish(data)
    assert model.first_runs == model.arrived
    assert model.state.is_idle
