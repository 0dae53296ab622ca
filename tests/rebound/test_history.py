"""The dashboard history's arithmetic: counter deltas per source, rates, mean lateness, the bounded ring."""

from __future__ import annotations

import pytest

from rebound.history import (
    CounterTracker,
    History,
    bucket_deltas,
    counter_deltas,
    histogram_quantile,
    make_sample,
    mean_lag_ms,
    outcome_counts,
    per_minute,
    window_summary,
)


def test_counter_deltas_take_growth_and_treat_a_drop_as_a_restart() -> None:
    assert counter_deltas(None, {"a": 5}) == {"a": 5}
    assert counter_deltas({"a": 5, "b": 1}, {"a": 8, "b": 1, "c": 2}) == {"a": 3, "b": 0, "c": 2}
    assert counter_deltas({"a": 50}, {"a": 7}) == {"a": 7}  # restarted at 0, grew by 7


def test_tracker_baselines_new_sources_unless_known_to_start_at_zero() -> None:
    tracker = CounterTracker()
    # An old worker seen for the first time: its hour of history is not this interval's.
    assert tracker.step({"old": {"outcome.succeeded": 1000}, "me": {"outcome.succeeded": 3}}, from_zero={"me"}) == {
        "outcome.succeeded": 3
    }
    assert tracker.step({"old": {"outcome.succeeded": 1010}, "me": {"outcome.succeeded": 4}}) == {
        "outcome.succeeded": 11
    }
    # "old" leaves: nothing negative; it is forgotten, and baselined again if it comes back.
    assert tracker.step({"me": {"outcome.succeeded": 6}}) == {"outcome.succeeded": 2}
    assert "old" not in tracker.previous
    assert tracker.step({"me": {"outcome.succeeded": 6}, "old": {"outcome.succeeded": 2000}}) == {
        "outcome.succeeded": 0
    }


def test_outcomes_rates_and_mean_lag() -> None:
    deltas = {
        "outcome.succeeded": 6,
        "outcome.scheduled": 3,
        "outcome.dead": 2,
        "outcome.expired": 1,
        "released": 4,
        "release.lag_ms_total": 100,
        "parked": 3,
    }
    assert outcome_counts(deltas) == {"succeeded": 6, "retried": 3, "dead": 3, "held": 0}
    assert per_minute(6, 10_000) == 36.0
    assert per_minute(6, 0) == 0.0
    assert mean_lag_ms(deltas) == 25.0
    assert mean_lag_ms({"release.lag_ms_total": 5}) is None


def test_sample_keeps_the_charted_tier_fields() -> None:
    sample = make_sample(
        at_ms=20_000,
        interval_ms=10_000,
        tiers={"items.retry.5m": {"waiting": 3, "overdue": 1, "max_overdue_ms": 1500, "oldest_due": 1, "x": 9}},
        deltas={"outcome.succeeded": 1},
    )
    out = sample.to_dict()
    assert out["tiers"] == {"items.retry.5m": {"waiting": 3, "overdue": 1, "max_overdue_ms": 1500}}
    assert out["per_minute"]["succeeded"] == 6.0 and out["lag_mean_ms"] is None


def test_history_is_a_bounded_ring_over_the_window() -> None:
    history = History(interval_ms=10_000, window_ms=60_000)
    assert history.samples.maxlen == 7
    counters = {"me": {"outcome.succeeded": 0}}
    first = history.record(at_ms=12_000, tiers={}, counters=counters, from_zero={"me"}, started_at_ms=2_000)
    assert first.interval_ms == 10_000
    for step in range(1, 20):
        history.record(at_ms=12_000 + step * 10_000, tiers={}, counters={"me": {"outcome.succeeded": step * 5}})
    assert len(history.samples) == 7
    now = 12_000 + 19 * 10_000
    view = history.to_dict(now_ms=now)
    assert [s["at"] for s in view["samples"]] == [now - 10_000 * i for i in range(6, -1, -1)]
    assert all(s["outcomes"]["succeeded"] == 5 and s["per_minute"]["succeeded"] == 30.0 for s in view["samples"])
    assert [s["at"] for s in history.to_dict(now_ms=now, since_ms=now - 15_000)["samples"]] == [now - 10_000, now]
    # Samples older than the window are left out even while the ring still holds them (the timer was held up).
    assert all(s["at"] >= now + 55_000 - 60_000 for s in history.to_dict(now_ms=now + 55_000)["samples"])


def test_interval_follows_the_real_gap_between_samples() -> None:
    history = History(interval_ms=10_000, window_ms=60_000)
    history.record(at_ms=10_000, tiers={}, counters={"me": {"outcome.dead": 0}}, from_zero={"me"})
    late = history.record(at_ms=40_000, tiers={}, counters={"me": {"outcome.dead": 30}})
    assert late.interval_ms == 30_000 and late.to_dict()["per_minute"]["dead"] == 60.0


def test_window_summary_weights_lateness_by_releases() -> None:
    samples = [
        make_sample(at_ms=1, interval_ms=10_000, tiers={}, deltas={"released": 1, "release.lag_ms_total": 100}),
        make_sample(at_ms=2, interval_ms=10_000, tiers={}, deltas={"released": 9, "release.lag_ms_total": 90}),
        make_sample(at_ms=3, interval_ms=10_000, tiers={}, deltas={"outcome.succeeded": 4}),
    ]
    summary = window_summary(samples)
    assert summary["released"] == 10 and summary["lag_mean_ms"] == 19.0
    assert summary["lag_worst_interval_mean_ms"] == 100.0 and summary["outcomes"]["succeeded"] == 4


def test_history_refuses_a_window_shorter_than_its_interval() -> None:
    with pytest.raises(ValueError):
        History(interval_ms=10_000, window_ms=5_000)


INF = float("inf")


def test_bucket_deltas_take_growth_and_restart_on_a_reset() -> None:
    before = [(0.01, 2), (0.1, 5), (INF, 6)]
    assert bucket_deltas(None, before) == before
    assert bucket_deltas(before, [(0.01, 3), (0.1, 9), (INF, 12)]) == [(0.01, 1), (0.1, 4), (INF, 6)]
    assert bucket_deltas(before, [(0.01, 0), (0.1, 1), (INF, 1)]) == [(0.01, 0), (0.1, 1), (INF, 1)]
    assert bucket_deltas(before, [(0.5, 1), (INF, 1)]) == [(0.5, 1), (INF, 1)]


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.01, 50), (0.1, 90), (1.0, 100), (INF, 100)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.01)
    assert histogram_quantile(0.7, buckets) == pytest.approx(0.01 + 0.09 * 20 / 40)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.1 + 0.9 * 9 / 10)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.005)
    # Beyond the last finite bound: that bound, as Prometheus answers.
    assert histogram_quantile(0.99, [(0.01, 0), (1.0, 1), (INF, 10)]) == 1.0
    # Empty buckets in between are skipped.
    assert histogram_quantile(0.5, [(0.01, 0), (0.1, 0), (1.0, 4), (INF, 4)]) == pytest.approx(0.1 + 0.9 * 0.5)
    assert histogram_quantile(0.5, [(0.01, 0), (INF, 0)]) is None
    assert histogram_quantile(0.5, []) is None


def test_history_takes_lateness_percentiles_from_the_histogram_growth() -> None:
    history = History(interval_ms=10_000, window_ms=60_000)
    first = history.record(
        at_ms=10_000, tiers={}, counters={}, lateness=[(0.01, 10), (0.1, 10), (INF, 10)], started_at_ms=0
    )
    assert first.lag_p50_ms == 5.0 and first.lag_p99_ms == 9.9
    second = history.record(at_ms=20_000, tiers={}, counters={}, lateness=[(0.01, 10), (0.1, 20), (INF, 20)])
    assert second.lag_p50_ms == 55.0 and second.to_dict()["lag_p99_ms"] == 99.1
    quiet = history.record(at_ms=30_000, tiers={}, counters={}, lateness=[(0.01, 10), (0.1, 20), (INF, 20)])
    assert quiet.lag_p50_ms is None and quiet.lag_p99_ms is None
    assert history.record(at_ms=40_000, tiers={}, counters={}).lag_p50_ms is None  # no histogram at all
