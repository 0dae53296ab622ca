"""``report --since/--until`` and ``tune --since/--until``: only the attempt events of the window, read from its date
partitions alone, and only the failed-topic records of the window."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json

import pytest
from conftest import create_topics, produce, unique

from pipeline.__main__ import main
from pipeline.jobs.facts import facts_in_window, parse_attempts
from rebound.attempts import AttemptEvent, event_id

pytestmark = pytest.mark.spark

S = 1000


def _at(day: int, hour: int, minute: int = 0, second: int = 0) -> dt.datetime:
    return dt.datetime(2024, 5, day, hour, minute, second, tzinfo=dt.UTC)


def _ms(value: dt.datetime) -> int:
    return int(value.timestamp() * 1000)


def _event(offset: int, attempt: int, outcome: str, first: dt.datetime, after_s: int) -> AttemptEvent:
    failing = outcome != "succeeded"
    return AttemptEvent(
        event_id=event_id("g", "items", 0, offset, attempt, outcome),
        group="g",
        key=f"k{offset}",
        original_topic="items",
        original_partition=0,
        original_offset=offset,
        attempt=attempt,
        tier=None if attempt == 0 else "30s",
        outcome=outcome,
        reason="exhausted" if outcome == "dead" else None,
        error_class="TimeoutError" if failing else None,
        error_message=None,
        first_received_at=_ms(first),
        due_at=None,
        event_time=_ms(first) + after_s * S,
        next_tier="30s" if outcome == "scheduled" else None,
    )


def _recovering(offset: int, first: dt.datetime, after_s: int) -> list[AttemptEvent]:
    return [_event(offset, 0, "scheduled", first, 0), _event(offset, 1, "succeeded", first, after_s)]


DAY1_A = _recovering(0, _at(1, 10), 20)  # recovers after 20 s
DAY1_B = [_event(1, 0, "succeeded", _at(1, 9), 0)]  # first try, before 10:00
DAY2_C = _recovering(2, _at(2, 12), 60)  # recovers after 60 s
DAY2_D = [_event(3, 0, "scheduled", _at(2, 13), 0), _event(3, 1, "dead", _at(2, 13), 30)]  # never recovers
DAY3_E = _recovering(4, _at(3, 8), 5)
EVENTS = [*DAY1_A, *DAY1_B, *DAY2_C, *DAY2_D, *DAY3_E]


def _seed(spark, out) -> None:
    rows = spark.createDataFrame(
        [(e.to_json(), 0, i) for i, e in enumerate(EVENTS)], "value binary, partition int, offset long"
    )
    parse_attempts(rows).write.partitionBy("date").parquet(str(out / "facts"))


@pytest.fixture
def seeded(spark, tmp_path):
    _seed(spark, tmp_path)
    return tmp_path


def test_window_is_a_partition_filter(spark, seeded) -> None:
    df = facts_in_window(spark, seeded / "facts", _at(2, 0), _at(3, 0))
    plan = io.StringIO()
    with contextlib.redirect_stdout(plan):
        df.explain()
    scan = next(line for line in plan.getvalue().splitlines() if "FileScan parquet" in line)
    partition_filters = scan.split("PartitionFilters: [", 1)[1].split("]", 1)[0]
    assert "date" in partition_filters and "2024-05-02" in partition_filters
    assert sorted({str(r["date"]) for r in df.select("date").collect()}) == ["2024-05-02"]
    assert df.count() == len(DAY2_C) + len(DAY2_D)


def test_report_of_one_day(spark, seeded) -> None:
    result = main(
        ["report", "--out", str(seeded), "--skip-failed-topics", "--since", "2024-05-02", "--until", "2024-05-03"],
        spark=spark,
    )
    summary = result["summary"]
    assert summary["since"] == "2024-05-02T00:00:00+00:00" and summary["until"] == "2024-05-03T00:00:00+00:00"
    assert summary["events"] == len(DAY2_C) + len(DAY2_D)
    assert summary["messages"] == 2 and summary["recovered"] == 1 and summary["never_recovered"] == 1
    pct = result["tables"]["recovery_percentiles"].to_dict("records")
    assert [(r["recovered"], r["p50_s"]) for r in pct] == [(1, 60.0)]
    saved = json.loads((seeded / "report" / "summary.json").read_text())
    assert saved["events"] == summary["events"]


def test_report_window_inside_a_day_is_exact(spark, seeded) -> None:
    # From 10:00:10 on May 1 to 12:00:30 on May 2: A's success (not its first failure, at 10:00:00), not B (09:00),
    # and C's first failure (12:00:00) but not its success (12:01:00).
    result = main(
        [
            "report",
            "--out",
            str(seeded),
            "--skip-failed-topics",
            "--since",
            "2024-05-01T10:00:10",
            "--until",
            "2024-05-02T12:00:30Z",
        ],
        spark=spark,
    )
    summary = result["summary"]
    assert summary["events"] == 2
    assert summary["recovered"] == 1 and summary["succeeded_first_try"] == 0
    assert [r["p50_s"] for r in result["tables"]["recovery_percentiles"].to_dict("records")] == [20.0]


def test_report_open_ended_windows(spark, seeded) -> None:
    since = main(["report", "--out", str(seeded), "--skip-failed-topics", "--since", "2024-05-03"], spark=spark)
    assert since["summary"]["events"] == len(DAY3_E)
    until = main(["report", "--out", str(seeded), "--skip-failed-topics", "--until", "2024-05-02"], spark=spark)
    assert until["summary"]["events"] == len(DAY1_A) + len(DAY1_B)


def test_tune_learns_from_the_window_only(spark, seeded) -> None:
    everything = main(["tune", "--out", str(seeded)], spark=spark)
    assert everything["observed"]["recovered"] == 3 and everything["observed"]["never_recovered"] == 1
    day2 = main(["tune", "--out", str(seeded), "--since", "2024-05-02", "--until", "2024-05-03"], spark=spark)
    assert day2["observed"]["recovered"] == 1 and day2["observed"]["never_recovered"] == 1
    assert day2["observed"]["p50_ms"] == 60 * S
    assert day2["since"] == "2024-05-02T00:00:00+00:00"
    saved = json.loads((seeded / "tune" / "recommendation.json").read_text())
    assert saved["observed"] == day2["observed"]


def test_reversed_window_names_both_flags(spark, seeded) -> None:
    with pytest.raises(SystemExit, match=r"--since .* must be before --until"):
        main(["tune", "--out", str(seeded), "--since", "2024-05-03", "--until", "2024-05-02"], spark=spark)


@pytest.mark.broker
def test_report_window_on_the_failed_topics(spark, broker, seeded) -> None:
    items = unique("items")
    create_topics(broker.bootstrap, {f"{items}.failed": 1})

    def failed(ts: dt.datetime, reason: str) -> dict:
        headers = [("rebound.reason", reason.encode()), ("rebound.original-topic", items.encode())]
        return {"key": b"k", "value": b"v", "headers": headers, "timestamp_ms": _ms(ts)}

    produce(
        broker.bootstrap,
        f"{items}.failed",
        [failed(_at(1, 23, 30), "exhausted"), failed(_at(2, 13, 0, 30), "exhausted"), failed(_at(3, 1), "expired")],
    )
    common = ["--bootstrap", broker.bootstrap, "--main-topics", items, "--out", str(seeded)]
    result = main(["report", *common, "--since", "2024-05-02", "--until", "2024-05-03"], spark=spark)
    assert result["summary"]["failed_topic_records"] == 1
    growth = result["tables"]["failed_growth"].to_dict("records")
    assert [(r["hour"].isoformat(), r["reason"], r["count"]) for r in growth] == [
        ("2024-05-02T13:00:00", "exhausted", 1)
    ]


def test_empty_window_gives_an_empty_report(spark, seeded) -> None:
    result = main(["report", "--out", str(seeded), "--skip-failed-topics", "--since", "2024-06-01"], spark=spark)
    assert result["summary"]["events"] == 0 and result["summary"]["messages"] == 0
    assert result["charts"] == {}
    assert (seeded / "report" / "index.html").read_text().count("(no data)") == len(result["tables"])
