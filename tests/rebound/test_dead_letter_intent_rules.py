"""A first try's dead letter and its intent (issue 22): the pure rules of :mod:`rebound.state`.

Before the send, a *dead-lettering* mark (:attr:`rebound.state.Mark.intent`) is written and confirmed
(:func:`~rebound.state.with_dead_letter_intent`); a record read again finds it (:attr:`~rebound.state.Known.DEAD_LETTERING`,
:func:`~rebound.state.intended_dead_letter`) and sends the same dead letter rather than run the handler; the *ended*
mark written after the send replaces it. A run that ends a message whose retry a *sending* mark said may be out wins
over that retry if it was parked meanwhile (:func:`~rebound.state.without_orphan`). Carried out in
``agents/lifecycle.py`` (``tests/agents/test_dead_letter_intent.py``).
"""

from __future__ import annotations

import json
from dataclasses import replace

from hypothesis import example, given, settings
from hypothesis import strategies as st

from rebound.attempts import Outcome
from rebound.ordering import in_transit
from rebound.state import (
    Intent,
    KeyState,
    Known,
    Mark,
    after_settle,
    forget_expired,
    intended_dead_letter,
    redelivery,
    remember,
    remembers_outcome,
    tier_duplicate,
    with_dead_letter_intent,
    without_orphan,
)
from tests.rebound.test_lifecycle_rules import MEMORY, NOW, ORIGIN, parked, provenance

DEAD = Intent(0, True, "items.failed", "permanent", "PermanentError", "no")
RECORD = provenance()


def intended(state: KeyState | None = None, *, orphan: int | None = None, at_ms: int = NOW) -> KeyState:
    before = KeyState() if state is None else state
    return with_dead_letter_intent(before, RECORD, DEAD, partition=0, now_ms=at_ms, memory=MEMORY, orphan=orphan)


def ended(state: KeyState, *, orphan: int | None = None) -> KeyState:
    return remember(state, RECORD, attempt=0, ended=True, partition=0, now_ms=NOW, memory=MEMORY, orphan=orphan)


def test_a_record_read_again_after_its_intent_sends_that_dead_letter_and_its_retries_are_refused() -> None:
    state = intended()
    [mark] = state.marks
    assert (mark.origin, mark.attempt, mark.ended, mark.sending, mark.intent) == (ORIGIN, 0, False, False, DEAD)
    assert redelivery(state, RECORD, 0, now_ms=NOW, memory=MEMORY) is Known.DEAD_LETTERING
    assert intended_dead_letter(state, RECORD, 0, now_ms=NOW, memory=MEMORY) == DEAD
    assert redelivery(state, RECORD, 1, now_ms=NOW, memory=MEMORY) is Known.ENDED, "a later attempt's record ran"
    assert tier_duplicate(state, RECORD, 1, now_ms=NOW, memory=MEMORY) is Known.ENDED, "its retry would be parked"
    assert in_transit(state) == [], "key order would wait for a retry that is not coming"
    assert intended(state) is state or intended(state) == state, "written again though it says the same"


def test_the_end_replaces_the_intent_and_a_retry_mark_never_does() -> None:
    state = intended()
    [end] = ended(state).marks
    assert end.ended and end.intent is None
    retry = remember(state, RECORD, attempt=1, ended=False, partition=0, now_ms=NOW, memory=MEMORY, sending=True)
    assert retry.marks == state.marks, "a retry mark replaced the dead letter's intent"
    assert intended(ended(state)) == ended(state), "an intent written over an end"


def test_an_expired_intent_counts_for_nothing_and_is_never_dropped_by_count() -> None:
    state = intended(at_ms=NOW - MEMORY.keep_ms)
    assert redelivery(state, RECORD, 0, now_ms=NOW, memory=MEMORY) is None
    assert intended_dead_letter(state, RECORD, 0, now_ms=NOW, memory=MEMORY) is None
    crowded = intended()
    for offset in range(20, 20 + MEMORY.per_key + 2):  # more ended marks than a key keeps
        other = provenance(offset)
        crowded = remember(crowded, other, attempt=0, ended=True, partition=0, now_ms=NOW, memory=MEMORY)
    assert forget_expired(crowded, NOW, MEMORY).mark_of(ORIGIN) == intended().marks[0]


def test_the_intent_is_stored_as_an_eighth_item_a_worker_without_it_takes_for_a_retry_of_its_attempt() -> None:
    state = intended()
    again = KeyState.from_json(state.to_json())
    assert again.marks == state.marks
    [item] = json.loads(state.to_json())["m"]
    assert len(item) == 8 and item[7] == ["items.failed", "permanent", "PermanentError", "no"]
    older = Mark.from_json(item[:7])  # what a worker reading seven items makes of it
    assert (older.attempt, older.ended, older.sending, older.intent) == (0, False, False, None)
    assert redelivery(replace(state, marks=(older,)), RECORD, 0, now_ms=NOW, memory=MEMORY) is None, "not run"
    assert [len(json.loads(ended(state).to_json())["m"][0])] == [7], "an end is stored as before"


def test_the_end_wins_over_the_orphan_retry_only_for_the_attempt_the_sending_mark_named() -> None:
    orphan, _ = KeyState().park(parked(attempt=1))
    assert without_orphan(orphan, ORIGIN, 1).find(ORIGIN) is None
    assert without_orphan(orphan, ORIGIN, None) == orphan
    later, _ = KeyState().park(parked(attempt=2))  # that retry ran, and its lifecycle went on
    assert without_orphan(later, ORIGIN, 1) == later
    written = intended(orphan, orphan=1)
    assert written.find(ORIGIN) is None and written.mark_of(ORIGIN) == intended().marks[0]
    assert intended(later, orphan=1) == later, "an intent written while a later attempt is parked"
    assert intended(orphan) == orphan, "no sending mark: the parked attempt says where the message is"
    finished = ended(orphan, orphan=1)
    mark = finished.mark_of(ORIGIN)
    assert finished.find(ORIGIN) is None and mark is not None and mark.ended
    assert ended(orphan) == orphan, "without the orphan rule an end is still refused under a later attempt"
    assert tier_duplicate(finished, RECORD, 1, now_ms=NOW, memory=MEMORY) is Known.ENDED


# --- a model: one message's first try read again and again, a handler deciding anew each call until it succeeded,
# --- retries arriving late (even while the record runs again), a worker killed anywhere --------------------------

CRASHES = ("none", "before mark", "before send", "before end")
deliveries = st.tuples(
    st.sampled_from(("main", "tier", "release")),
    st.sampled_from(("dead", "retry", "success")),
    st.sampled_from(CRASHES),
    st.booleans(),  # a retry on its way arrives while the record runs
)


class OneMessage:
    """One message's state, what was sent for it and how it ended, as the agents would leave them."""

    def __init__(self) -> None:
        self.state = KeyState()
        self.ends: set[tuple[str, int]] = set()
        self.dead_letters: set[Intent] = set()
        self.on_the_way: list[int] = []  # retries sent, not yet read by their tier
        self.succeeded = False
        self.held_ended = False  # it ran as a held message, to its confirmed write (key order)

    def decide(self, wanted: str) -> str:
        """The handler's call: anew each time, until one succeeded (then it succeeds: idempotent)."""
        if wanted == "success" or self.succeeded:
            self.succeeded = True
            return "success"
        return wanted

    def arrive(self) -> None:
        """The tier agent reads the oldest retry on its way and parks it, unless it is a duplicate."""
        if self.on_the_way:
            attempt = self.on_the_way.pop(0)
            if tier_duplicate(self.state, RECORD, attempt, now_ms=NOW, memory=MEMORY) is None:
                self.state, _ = self.state.park(parked(attempt=attempt))

    def release(self, wanted: str) -> None:
        """A parked retry runs to an end (its own intent rules are their own model's)."""
        entry = next(iter(self.state.pending), None)
        if entry is None:
            return
        success = self.decide(wanted) == "success"
        self.ends.add(("succeeded", 0) if success else ("dead", entry.attempt))
        outcome = Outcome.SUCCEEDED if success else Outcome.DEAD
        self.state = after_settle(self.state, entry.origin, entry.attempt, outcome, now_ms=NOW, memory=MEMORY)

    def read_main_record(self, wanted: str, crash: str, arrives_meanwhile: bool, *, held: bool = False) -> None:
        """The main record read (again): refused, its dead letter sent again, or run, killed at ``crash``.
        ``held``: it runs as a held message whose turn came (key order), its record's offset acknowledged long before;
        a copy of that record read after its confirmed end must not run it again."""
        known = redelivery(self.state, RECORD, 0, now_ms=NOW, memory=MEMORY)
        if known is Known.DEAD_LETTERING:
            intent = intended_dead_letter(self.state, RECORD, 0, now_ms=NOW, memory=MEMORY)
            assert intent is not None
            self.dead_letters.add(intent)
            self.ends.add(("dead", 0))
            if crash != "before end":
                self.state = ended(self.state)
            return
        if known not in (None, Known.SENDING):
            return  # refused: its retry or its end stands for it
        maybe_sent = known is Known.SENDING
        orphan = 1 if maybe_sent else None
        if arrives_meanwhile:  # the tier agent parks beside the run (not in the key's lane)
            self.arrive()
        assert not self.held_ended, "a held message that ended ran again from a copy of its record"
        outcome = self.decide(wanted)
        if outcome == "success":
            self.ends.add(("succeeded", 0))
            if remembers_outcome(Outcome.SUCCEEDED, 0, maybe_sent=maybe_sent, was_held=held) and crash == "none":
                self.state = ended(self.state, orphan=orphan)
            self.held_ended = held and crash == "none"
        elif outcome == "retry":
            self.send_retry(crash)
        else:
            self.send_dead_letter(crash, orphan)

    def send_retry(self, crash: str) -> None:
        if crash == "before mark":
            return
        self.state = remember(
            self.state, RECORD, attempt=1, ended=False, partition=0, now_ms=NOW, memory=MEMORY, sending=True
        )
        if crash == "before send":
            return
        self.on_the_way.append(1)
        if crash != "before end":
            self.state = remember(self.state, RECORD, attempt=1, ended=False, partition=0, now_ms=NOW, memory=MEMORY)

    def send_dead_letter(self, crash: str, orphan: int | None) -> None:
        if crash == "before mark":
            return
        self.state = intended(self.state, orphan=orphan)
        if crash == "before send":
            return
        self.dead_letters.add(DEAD)
        self.ends.add(("dead", 0))
        if crash != "before end":
            self.state = ended(self.state, orphan=orphan)


def take(message: OneMessage, steps: list[tuple[str, str, str, bool]]) -> None:
    """Each delivery of ``steps`` in turn (a tier record arriving, a release, or the main record read again), then
    what is still on its way arrives and what is parked runs, until the message has nothing left anywhere."""
    for kind, wanted, crash, arrives_meanwhile in steps:
        if kind == "tier":
            message.arrive()
        elif kind == "release":
            message.release(wanted)
        else:
            message.read_main_record(wanted, crash, arrives_meanwhile)
    while message.on_the_way or message.state.pending:
        message.arrive()
        message.release("success")


@settings(max_examples=500, deadline=None)
@given(steps=st.lists(deliveries, min_size=1, max_size=12))
@example(steps=[("main", "dead", "before end", False)])  # the kill after the dead letter (then a success)
@example(steps=[("main", "retry", "before end", False), ("main", "dead", "none", True)])  # cause F
def test_a_first_try_killed_anywhere_keeps_one_lifecycle_and_loses_nothing(
    steps: list[tuple[str, str, str, bool]],
) -> None:
    """The main record read again (its offset never committed until the end: the last step delivers it once more),
    its retry delivered to the tier (maybe late, maybe while the record runs again), a parked retry released, a
    handler deciding anew on every call until one succeeded, and a kill at any point: the message ends one way only
    (a dead letter sent twice is the same end), never at attempt 0 after its retry ran, and it always ends."""
    message = OneMessage()
    take(message, [*steps, ("main", "dead", "none", False)])
    assert len(message.dead_letters) <= 1, f"two different dead letters: {message.dead_letters}"
    assert len(message.ends) == 1, f"the message ended {'twice' if message.ends else 'never'}: {message.ends}"


@settings(max_examples=300, deadline=None)
@given(first=deliveries, steps=st.lists(deliveries, min_size=1, max_size=8))
@example(first=("main", "success", "none", False), steps=[("main", "success", "none", False)])  # the chaos runs' case
def test_a_held_message_that_succeeded_is_not_run_again_by_a_copy_of_its_record(
    first: tuple[str, str, str, bool], steps: list[tuple[str, str, str, bool]]
) -> None:
    """Its first run as a held message (key order), then copies of its record read again (its offset acknowledged
    when it was held, maybe not committed), its retry arriving, released: once its end was written, even a first-try
    success's, no copy runs the handler again, and it still ends one way only."""
    message = OneMessage()
    _, wanted, crash, arrives_meanwhile = first
    message.read_main_record(wanted, crash, arrives_meanwhile, held=True)
    take(message, steps)
    assert len(message.dead_letters) <= 1, f"two different dead letters: {message.dead_letters}"
    assert len(message.ends) <= 1, f"the message ended twice: {message.ends}"
