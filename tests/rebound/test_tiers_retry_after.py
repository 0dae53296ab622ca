"""A tier accepts a due time as late as ``REBOUND_RETRY_AFTER_MAX`` after its record, not only its own delay: a
``Retry-After`` longer than the tier's delay is parked, and a forged due time is still bounded."""

from __future__ import annotations

import pytest

from rebound.errors import InvalidRetryHeadersError
from rebound.headers import RetryHeaders
from rebound.tiers import CLOCK_SKEW_TOLERANCE_MS, Tier

NOW = 1_700_000_000_000
TIER = Tier("items", "1s", 1_000)
HOUR = 3_600_000


def headers(make_provenance, due_at_ms: int) -> RetryHeaders:
    return RetryHeaders(
        provenance=make_provenance(topic="items", partition=1, first_received_at_ms=NOW - 1000),
        attempt=1,
        due_at_ms=due_at_ms,
        group="rebound",
        error_class="rebound.http_errors.HttpOverloaded",
        error_message="HTTP 503",
    )


def validate(parsed: RetryHeaders, *, longest_wait_ms: int) -> None:
    TIER.validate(
        parsed,
        group="rebound",
        partition=1,
        partitions=4,
        record_timestamp_ms=NOW,
        now_ms=NOW,
        longest_wait_ms=longest_wait_ms,
    )


def test_a_due_time_later_than_the_tier_delay_is_accepted_up_to_the_longest_wait(make_provenance) -> None:
    validate(headers(make_provenance, NOW + HOUR + CLOCK_SKEW_TOLERANCE_MS), longest_wait_ms=HOUR)


def test_a_due_time_beyond_the_longest_wait_is_refused(make_provenance) -> None:
    with pytest.raises(InvalidRetryHeadersError, match="due time"):
        validate(headers(make_provenance, NOW + HOUR + CLOCK_SKEW_TOLERANCE_MS + 1), longest_wait_ms=HOUR)


def test_a_longest_wait_shorter_than_the_delay_keeps_the_delay_as_the_bound(make_provenance) -> None:
    validate(headers(make_provenance, NOW + 1_000 + CLOCK_SKEW_TOLERANCE_MS), longest_wait_ms=10)
    with pytest.raises(InvalidRetryHeadersError, match="due time"):
        validate(headers(make_provenance, NOW + 1_001 + CLOCK_SKEW_TOLERANCE_MS), longest_wait_ms=10)
