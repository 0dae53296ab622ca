"""Pure parts of the jobs: the tune model, redrive header rewriting (no Spark; redrive planning and the ledger: test_pipeline_redrive_units.py)."""

from __future__ import annotations

import argparse

import pytest

from pipeline.jobs.redrive import outgoing_headers
from pipeline.jobs.tune import evaluate, label, nice_ceil, parse_duration, quantile, recommend


def test_quantile_interpolates_like_spark() -> None:
    assert quantile([10, 20, 30, 40, 50], 0.5) == 30
    assert quantile([10, 20, 30, 40, 50], 0.9) == pytest.approx(46)  # rank 3.6
    assert quantile([7], 0.99) == 7


def test_durations() -> None:
    assert (parse_duration("90s"), parse_duration("2h"), parse_duration("250ms")) == (90_000, 7_200_000, 250)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration("soon")
    assert (label(300_000), label(1500), nice_ceil(24_750), nice_ceil(49_500)) == ("5m", "1500ms", 30_000, 60_000)


def test_evaluate_counts_writes_and_recovery() -> None:
    # T = 5 s recovers on retry 1; 25 s on retry 2 (cumulative 10 s, 40 s); 100 s never within 40 s; 1 never at all.
    c = evaluate([10_000, 30_000], [5_000, 25_000, 100_000], never_recovered=1)
    assert c.sequence == "10s,30s" and c.total_ms == 40_000
    assert c.recovery_rate == pytest.approx(2 / 4)
    assert c.writes_per_message == pytest.approx((1 + 2 + 3 + 3) / 4)
    assert c.mean_time_to_success_ms == pytest.approx((10_000 + 40_000) / 2)


def test_recommend_respects_max_duration() -> None:
    result = recommend([60_000.0] * 50 + [7_200_000.0], 0, max_duration_ms=600_000)
    assert result["p99_within_max_duration"] is False
    assert all(c["total_ms"] <= 600_000 for c in result["candidates"])
    assert recommend([], 3, max_duration_ms=1)["recommendation"] is None


def test_outgoing_headers_strip_ours_keep_users_and_count() -> None:
    headers = [("trace", b"1"), ("rebound.reason", b"exhausted"), ("rebound.redrive-count", b"1"), ("x", b"")]
    assert outgoing_headers(headers, 1) == [("trace", b"1"), ("x", b""), ("rebound.redrive-count", b"2")]
    assert outgoing_headers(None, 0) == [("rebound.redrive-count", b"1")]
