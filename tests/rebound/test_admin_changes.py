"""What an operator's retry-now and dead-letter do to a key's state (``rebound/admin.py``)."""

from __future__ import annotations

from collections.abc import Callable

from rebound.admin import dead_lettered, retry_now
from rebound.state import KeyState, PendingMessage


def test_retry_now_makes_this_partitions_waiting_messages_due_now_and_names_them(
    make_pending: Callable[..., PendingMessage], make_provenance: Callable[..., object], t0: int
) -> None:
    waiting = make_pending(offset=1, attempt=1)  # due at t0 + 5 min
    due_already = make_pending(offset=2, attempt=1, due_at_ms=t0 - 10)
    elsewhere = make_pending(provenance=make_provenance(partition=3, offset=7), attempt=1)
    state = KeyState(pending=(waiting, due_already, elsewhere), attempts=3)

    after, changed = retry_now(state, partition=0, now_ms=t0)

    assert changed == {waiting.origin}
    assert [entry.due_at_ms for entry in after.pending] == [t0, t0 - 10, elsewhere.due_at_ms]
    assert after.attempts == 3  # nothing else of the key changes
    assert retry_now(after, partition=0, now_ms=t0) == (after, frozenset())


def test_dead_letter_removes_the_messages_sent_at_the_attempt_they_were_sent_at(
    make_pending: Callable[..., PendingMessage],
) -> None:
    sent = make_pending(offset=1, attempt=2)
    parked_again = make_pending(offset=2, attempt=3)  # a newer attempt than the one the operator dead-lettered
    untouched = make_pending(offset=3, attempt=1)
    state = KeyState(pending=(sent, parked_again, untouched), blocked_by=sent.origin)

    after = dead_lettered(state, [(sent.origin, 2), (parked_again.origin, 2)])

    assert after.pending == (parked_again, untouched)
    assert after.blocked_by == sent.origin  # the block is key-ordered mode's to lift (after_outcome), not this
    assert dead_lettered(state, []) == state
