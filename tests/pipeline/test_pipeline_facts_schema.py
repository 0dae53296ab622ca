"""The facts schema grows (``next_tier``): old Parquet files still read, and the report fills in their routes."""

from __future__ import annotations

import pytest

from pipeline.jobs.facts import parse_attempts, read_facts
from pipeline.jobs.report import outcomes_per_tier, scheduled_routes
from rebound.attempts import AttemptEvent, event_id

pytestmark = pytest.mark.spark

T0 = 1_714_608_000_000  # 2024-05-02T00:00:00Z


def _event(offset: int, attempt: int, tier: str | None, outcome: str, next_tier: str | None = None) -> AttemptEvent:
    return AttemptEvent(
        event_id=event_id("g", "items", 0, offset, attempt, outcome),
        group="g",
        key=f"k{offset}",
        original_topic="items",
        original_partition=0,
        original_offset=offset,
        attempt=attempt,
        tier=tier,
        outcome=outcome,
        reason=None,
        error_class="TimeoutError" if outcome == "scheduled" else None,
        error_message=None,
        first_received_at=T0,
        due_at=None,
        event_time=T0 + attempt * 60_000,
        next_tier=next_tier,
    )


def _write(spark, path, events, *, without_next_tier: bool) -> None:
    kafka_rows = spark.createDataFrame(
        [(e.to_json(), 0, i) for i, e in enumerate(events)], "value binary, partition int, offset long"
    )
    facts = parse_attempts(kafka_rows)
    if without_next_tier:
        facts = facts.drop("next_tier")
    facts.write.mode("append").partitionBy("date").parquet(str(path))


def test_old_facts_read_with_null_next_tier_and_inferred_routes(spark, tmp_path) -> None:
    # Old files only: message 0 was scheduled and then succeeded on tier 1m; message 1 was scheduled and has not
    # been retried yet, so where it went is unknown.
    _write(
        spark,
        tmp_path,
        [_event(0, 0, None, "scheduled"), _event(0, 1, "1m", "succeeded"), _event(1, 0, None, "scheduled")],
        without_next_tier=True,
    )
    facts = read_facts(spark, tmp_path)
    assert dict(facts.dtypes)["next_tier"] == "string"
    assert facts.where("next_tier IS NOT NULL").count() == 0
    routes = scheduled_routes(facts)
    assert routes.to_dict("records") == [
        {"tier": "first try", "next_tier": "(unknown)", "scheduled": 1, "messages": 1},
        {"tier": "first try", "next_tier": "1m", "scheduled": 1, "messages": 1},
    ]

    # A newer file with the column: merged with the old ones, and its next_tier wins over any inference.
    _write(spark, tmp_path, [_event(2, 0, None, "scheduled", next_tier="5m")], without_next_tier=False)
    facts = read_facts(spark, tmp_path)
    assert {r["original_offset"]: r["next_tier"] for r in facts.where("outcome = 'scheduled'").collect()} == {
        0: None,
        1: None,
        2: "5m",
    }
    tiers = outcomes_per_tier(facts).to_dict("records")
    assert tiers == [
        {
            "tier": "first try",
            "succeeded": 0,
            "scheduled": 3,
            "dead": 0,
            "expired": 0,
            "scheduled_to": "(unknown) (1), 1m (1), 5m (1)",
        },
        {"tier": "1m", "succeeded": 1, "scheduled": 0, "dead": 0, "expired": 0, "scheduled_to": ""},
    ]
