"""The back-off of sends waiting for an acknowledgement (``rebound/backoff.py``)."""

from __future__ import annotations

import pytest

from rebound.backoff import backoff_s


def test_the_backoff_starts_at_a_tenth_of_a_second_doubles_and_stays_at_five_seconds() -> None:
    """The rule the four resend loops each wrote out before (``backoff = min(backoff * 2, 5.0)`` from 0.1): the same
    floats, failure after failure."""
    written_out, expected = 0.1, []
    for _ in range(12):
        expected.append(written_out)
        written_out = min(written_out * 2, 5.0)
    assert [backoff_s(failures) for failures in range(1, 13)] == expected
    assert expected[:7] == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0]
    assert backoff_s(10**6) == 5.0


@pytest.mark.parametrize("failures", [0, -1])
def test_a_count_below_one_is_refused(failures: int) -> None:
    with pytest.raises(ValueError, match="counts from 1"):
        backoff_s(failures)
