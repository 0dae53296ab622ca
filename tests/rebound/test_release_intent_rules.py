"""A release's intent (issue 22): the pure rule that sends a release's outcome again rather than run it again.

A release writes what it decided to send on its entry, confirmed, before the send (:func:`rebound.state.with_intent`);
a request for that attempt read again finds it (:func:`rebound.state.sent_intent`, ``Verdict.RESEND``) and sends the
same. Carried out in ``agents/release.py`` (``tests/agents/test_release_intent.py``).
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from rebound.attempts import Outcome
from rebound.release import STALE, Verdict, check_release
from rebound.state import Intent, KeyState, after_settle, sent_intent, tier_duplicate, with_intent
from tests.rebound.test_lifecycle_rules import MEMORY, NOW, ORIGIN, parked

DEAD = Intent(1, True, "items.failed", "permanent", "PermanentError", "no")
RETRY = Intent(1, False, "items.retry.1s", "", "RetryableError", "later", tier="1s", next_attempt=2, due_at_ms=NOW)


def test_an_intent_goes_on_the_entry_of_its_attempt_only() -> None:
    state, _ = KeyState().park(parked(attempt=1))
    written = with_intent(state, ORIGIN, 1, DEAD)
    found = written.find(ORIGIN)
    assert found is not None and found.intent == DEAD
    assert with_intent(written, ORIGIN, 1, DEAD) is written, "written again though it says the same"
    assert with_intent(state, ORIGIN, 2, DEAD) == state, "an intent for an attempt that is not parked"
    assert with_intent(KeyState(), ORIGIN, 1, DEAD) == KeyState(), "an intent for a settled message"


def test_a_request_of_the_attempt_that_decided_sends_it_again_and_a_later_park_forgets_it() -> None:
    entry = replace(parked(attempt=1), intent=RETRY)
    assert sent_intent(entry, 1) == RETRY
    assert sent_intent(entry, 2) is None
    state, changed = KeyState().park(entry)
    later, changed = state.park(parked(attempt=2))  # the retry it sent arrived first
    assert changed and later.find(ORIGIN) is not None
    assert sent_intent(later.find(ORIGIN), 2) is None  # type: ignore[arg-type]


def test_resend_is_the_verdict_before_the_due_time_and_the_breaker() -> None:
    entry = replace(parked(attempt=1), intent=DEAD)
    never = lambda _entry: False  # noqa: E731
    assert check_release(entry, 1, entry.due_at_ms - 1, breaker_open=True, would_retry=never) is Verdict.RESEND
    assert check_release(entry, 2, NOW, breaker_open=False, would_retry=never) is Verdict.SUPERSEDED
    assert check_release(None, 1, NOW, breaker_open=False, would_retry=never) is Verdict.SETTLED
    assert check_release(parked(attempt=1), 1, NOW, breaker_open=False, would_retry=never) is Verdict.EARLY


# --- a model: one message's releases, a handler deciding anew each call, a worker killed anywhere -------------------

CRASH_POINTS = ("none", "before intent", "before send", "before settle")
steps = st.lists(
    st.tuples(
        st.sampled_from(("release", "tier")),
        st.sampled_from(("dead", "retry", "success")),
        st.sampled_from(CRASH_POINTS),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=400, deadline=None)
@given(steps=steps)
def test_a_message_killed_anywhere_in_its_releases_keeps_one_lifecycle(steps: list[tuple[str, str, str]]) -> None:
    """Requests read again, retries delivered to their tier (maybe twice), any handler outcome per call and a crash
    at any point of a failing release: every attempt's outcome is sent one way only, and no message ends at an
    attempt whose retry was sent. (A success killed before its settle runs again: the healthy path writes nothing,
    so that case, at-least-once, is outside the rule and this model.)"""
    state, _ = KeyState().park(parked(attempt=1))
    sent: dict[int, set[tuple[bool, str]]] = {}  # attempt -> the outcomes sent for it (dead?, where)
    retries_on_the_way: list[int] = []
    ends: set[tuple[str, int]] = set()
    for kind, decided, crash in steps:
        if kind == "tier":  # a sent retry arrives (a copy sent twice arrives twice)
            if retries_on_the_way:
                attempt = retries_on_the_way.pop(0)
                arrived = replace(parked(attempt=attempt), due_at_ms=NOW)
                if tier_duplicate(state, arrived.provenance, attempt, now_ms=NOW, memory=MEMORY) is None:
                    state, _ = state.park(arrived)
            continue
        entry = next(iter(state.pending), None)
        if entry is None:
            continue
        attempt = entry.attempt
        verdict = check_release(entry, attempt, NOW + 10_000, breaker_open=False, would_retry=lambda _e: True)
        assert verdict not in STALE
        intent = sent_intent(entry, attempt)
        if intent is None:  # the handler runs and decides, anew
            if decided == "success":
                ends.add(("succeeded", attempt))
                state = after_settle(state, ORIGIN, attempt, Outcome.SUCCEEDED, now_ms=NOW, memory=MEMORY)
                continue
            intent = replace(DEAD if decided == "dead" else RETRY, attempt=attempt, next_attempt=attempt + 1)
            if crash == "before intent":
                continue
            state = with_intent(state, ORIGIN, attempt, intent)
            if crash == "before send":
                continue
        sent.setdefault(attempt, set()).add((intent.dead, intent.topic))
        if intent.dead:
            ends.add(("dead", attempt))
        else:
            retries_on_the_way.append(intent.next_attempt)
        if crash == "before settle":
            continue
        state = after_settle(state, ORIGIN, attempt, intent.outcome, now_ms=NOW, memory=MEMORY)
    assert all(len(outcomes) == 1 for outcomes in sent.values()), f"an attempt's outcome forked: {sent}"
    assert len(ends) <= 1, f"the message ended twice: {ends}"
    retried = {attempt for attempt, outcomes in sent.items() if (False, RETRY.topic) in outcomes}
    assert not [end for end in ends if end[1] in retried], f"ended at an attempt whose retry was sent: {ends}"
