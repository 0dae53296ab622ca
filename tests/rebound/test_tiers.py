"""Tiers come from the configuration, and tier records are validated against the tier they arrived on."""

from __future__ import annotations

import pytest

from rebound.errors import ConfigurationError, InvalidRetryHeadersError
from rebound.headers import RetryHeaders
from rebound.policy import RetryPolicy
from rebound.settings import load_settings
from rebound.tiers import CLOCK_SKEW_TOLERANCE_MS, Tier, Tiers, check_topic_names

NOW = 1_700_000_000_000
TIER = Tier("items", "5m", 300_000)


def parsed(make_provenance, *, due_at_ms: int, topic="items", partition=1, group="rebound") -> RetryHeaders:
    return RetryHeaders(
        provenance=make_provenance(topic=topic, partition=partition, first_received_at_ms=NOW - 1000),
        attempt=1,
        due_at_ms=due_at_ms,
        group=group,
        error_class="x",
        error_message="y",
    )


def validate(headers: RetryHeaders, *, timestamp: int, partition: int = 1, now: int = NOW) -> None:
    TIER.validate(
        headers, group="rebound", partition=partition, partitions=4, record_timestamp_ms=timestamp, now_ms=now
    )


def test_a_due_time_within_the_tier_delay_is_accepted(make_provenance) -> None:
    validate(parsed(make_provenance, due_at_ms=NOW + 300_000), timestamp=NOW)


@pytest.mark.parametrize("timestamp", [0, -1, NOW, NOW + 10 * 86_400_000])
def test_the_due_time_is_bounded_by_the_workers_clock_whatever_the_record_timestamp(make_provenance, timestamp) -> None:
    """Timestamp 0 or -1 used to skip the bound; a timestamp in the future must not widen it either."""
    too_late = NOW + 300_000 + CLOCK_SKEW_TOLERANCE_MS + 1
    with pytest.raises(InvalidRetryHeadersError, match="due time"):
        validate(parsed(make_provenance, due_at_ms=too_late), timestamp=timestamp)


def test_a_worker_whose_clock_lags_the_forwarding_one_still_accepts_a_genuine_record(make_provenance) -> None:
    forwarded_at = NOW + 30_000  # the forwarding worker's clock is 30 s ahead of this one
    validate(parsed(make_provenance, due_at_ms=forwarded_at + 300_000), timestamp=forwarded_at)


def test_a_main_topic_is_never_taken_for_an_old_tier() -> None:
    tiers = Tiers.build(("pay", "pay.retry.10m"), RetryPolicy.parse("5m"), ["pay.retry.10m", "pay.retry.30m"])
    assert "pay.retry.10m" not in tiers
    assert tiers["pay.retry.30m"].draining


def test_an_old_record_timestamp_tightens_the_bound(make_provenance) -> None:
    with pytest.raises(InvalidRetryHeadersError, match="due time"):
        validate(parsed(make_provenance, due_at_ms=NOW + 300_000), timestamp=NOW - 3_600_000)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"topic": "orders"}, "does not own tier"),
        ({"group": "other"}, "group"),
        ({"partition": 2}, "does not map"),
    ],
)
def test_foreign_records_are_refused(make_provenance, overrides, message) -> None:
    with pytest.raises(InvalidRetryHeadersError, match=message):
        validate(parsed(make_provenance, due_at_ms=NOW + 1000, **overrides), timestamp=NOW)


def test_tiers_are_built_from_the_configuration() -> None:
    tiers = Tiers.build(("items",), RetryPolicy.parse("5m,5m,30m,1h"))
    assert list(tiers) == ["items.retry.5m", "items.retry.30m", "items.retry.1h"]
    assert tiers["items.retry.30m"] == Tier("items", "30m", 1_800_000)
    assert tiers.tier_for("items", "1h").topic == "items.retry.1h"
    assert tiers.draining == ()


def test_a_main_topic_named_like_another_topics_failed_topic_is_refused_at_start_up() -> None:
    with pytest.raises(ConfigurationError, match=r"'items\.failed'"):
        load_settings(main_topics="items,items.failed")
    with pytest.raises(ConfigurationError, match=r"'rebound\.attempts'"):
        check_topic_names(("rebound.attempts",), RetryPolicy.parse("1s"), "rebound")


def test_pay_and_pay_retry_as_main_topics_are_accepted_and_kept_apart() -> None:
    settings = load_settings(main_topics="pay,pay.retry", retry_sequence="1s")
    tiers = Tiers.build(settings.topics, settings.policy)
    assert {name: (tier.main_topic, tier.label) for name, tier in tiers.items()} == {
        "pay.retry.1s": ("pay", "1s"),
        "pay.retry.retry.1s": ("pay.retry", "1s"),
    }
