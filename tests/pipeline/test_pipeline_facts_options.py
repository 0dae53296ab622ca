"""Pure parts of the facts job: which partitions the de-duplication reads, and the flags' parsing."""

from __future__ import annotations

import argparse
import datetime as dt

import pytest

from pipeline.common import parse_time
from pipeline.jobs.facts import lookup_dates, parse_trigger

D = dt.date(2024, 5, 10)


def _days(*offsets: int) -> set[dt.date]:
    return {D + dt.timedelta(days=n) for n in offsets}


def test_lookup_covers_first_receipt_to_event_date() -> None:
    assert lookup_dates([(D - dt.timedelta(days=2), D)], lookback_days=30) == _days(-2, -1, 0)
    assert lookup_dates([(D, D)], lookback_days=30) == _days(0)


def test_lookup_is_capped_by_the_lookback() -> None:
    assert lookup_dates([(dt.date(1970, 1, 1), D)], lookback_days=3) == _days(-3, -2, -1, 0)
    assert lookup_dates([(None, D)], lookback_days=2) == _days(-2, -1, 0)
    assert lookup_dates([(None, D)], lookback_days=0) == _days(0)


def test_lookup_ignores_a_first_receipt_after_the_event() -> None:
    # Clocks disagree: the first receipt claims to be later than the event; only the event's own date is read.
    assert lookup_dates([(D + dt.timedelta(days=1), D)], lookback_days=30) == _days(0)


def test_lookup_unions_the_ranges_of_a_batch() -> None:
    ranges = [(D - dt.timedelta(days=1), D), (D + dt.timedelta(days=5), D + dt.timedelta(days=5))]
    assert lookup_dates(ranges, lookback_days=30) == _days(-1, 0, 5)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1 minute", "1 minutes"),
        ("2 seconds", "2 seconds"),
        ("30s", "30 seconds"),
        ("5m", "5 minutes"),
        ("1 HOUR", "1 hours"),
        ("500ms", "500 milliseconds"),
    ],
)
def test_trigger_intervals(text: str, expected: str) -> None:
    assert parse_trigger(text) == expected


@pytest.mark.parametrize("text", ["", "minute", "0 seconds", "5 fortnights", "-1 s", "1.5 minutes"])
def test_bad_trigger_names_the_flag(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--trigger"):
        parse_trigger(text)


def test_times_are_utc() -> None:
    assert parse_time("2024-05-01") == dt.datetime(2024, 5, 1, tzinfo=dt.UTC)
    assert parse_time("2024-05-01T10:30") == dt.datetime(2024, 5, 1, 10, 30, tzinfo=dt.UTC)
    assert parse_time("2024-05-01T12:30+02:00") == dt.datetime(2024, 5, 1, 10, 30, tzinfo=dt.UTC)
    assert parse_time("1714521600000") == dt.datetime(2024, 5, 1, tzinfo=dt.UTC)
    with pytest.raises(argparse.ArgumentTypeError, match="ISO date"):
        parse_time("yesterday")
