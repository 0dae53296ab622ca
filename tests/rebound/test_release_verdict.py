"""The release verdict (``rebound/release.py``): what a release request does with the message it names, in order."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rebound.release import STALE, Verdict, check_release, how_to_run
from rebound.state import PendingMessage


def never(entry: PendingMessage) -> bool:
    raise AssertionError("asked whether a failure would retry, which only the breaker's verdict needs")


def test_a_message_no_longer_parked_is_settled_already(t0: int) -> None:
    assert check_release(None, 1, t0, breaker_open=True, would_retry=never) is Verdict.SETTLED


def test_a_request_for_an_older_attempt_is_superseded(make_pending: Callable[..., PendingMessage], t0: int) -> None:
    entry = make_pending(attempt=2)
    assert check_release(entry, 1, entry.due_at_ms, breaker_open=True, would_retry=never) is Verdict.SUPERSEDED
    assert {Verdict.SETTLED, Verdict.SUPERSEDED} == STALE


def test_never_before_due_even_with_the_breaker_open(make_pending: Callable[..., PendingMessage]) -> None:
    entry = make_pending(attempt=1)
    early = check_release(entry, 1, entry.due_at_ms - 1, breaker_open=True, would_retry=never)
    assert early is Verdict.EARLY
    assert check_release(entry, 1, entry.due_at_ms, breaker_open=False, would_retry=never) is Verdict.DUE


@pytest.mark.parametrize(("would_retry", "expected"), [(False, Verdict.BREAKER_DEFERRED), (True, Verdict.DUE)])
def test_the_open_breaker_defers_only_a_release_whose_failure_would_end_it(
    make_pending: Callable[..., PendingMessage], would_retry: bool, expected: Verdict
) -> None:
    entry = make_pending(attempt=3)
    asked: list[PendingMessage] = []

    def answer(asked_about: PendingMessage) -> bool:
        asked.append(asked_about)
        return would_retry

    assert check_release(entry, 3, entry.due_at_ms + 5, breaker_open=True, would_retry=answer) is expected
    assert asked == [entry]


def test_a_due_message_without_its_payload_is_dead_lettered_whatever_the_mode(
    make_pending: Callable[..., PendingMessage],
) -> None:
    missing = make_pending(value=None, has_payload=False)
    assert how_to_run(missing, republish=False) is Verdict.PAYLOAD_MISSING
    assert how_to_run(missing, republish=True) is Verdict.PAYLOAD_MISSING


def test_a_due_message_with_its_payload_runs_in_place_or_is_republished(
    make_pending: Callable[..., PendingMessage],
) -> None:
    entry = make_pending()
    assert how_to_run(entry, republish=False) is Verdict.RUN
    assert how_to_run(entry, republish=True) is Verdict.REPUBLISH
