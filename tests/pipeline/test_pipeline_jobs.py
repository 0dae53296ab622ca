"""facts, report, tune, inventory and redrive on generated data in the embedded broker; expectations by hand."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
from conftest import create_topics, produce, unique

from pipeline.__main__ import main
from pipeline.jobs.facts import parse_attempts, read_facts
from pipeline.ledger import read_audit
from pipeline.storage import Location
from rebound.attempts import AttemptEvent, event_id

pytestmark = [pytest.mark.broker, pytest.mark.spark]

BASE = int(dt.datetime(2024, 5, 1, 23, 59, 30, tzinfo=dt.UTC).timestamp() * 1000)  # events cross midnight UTC
S = 1000
TIMEOUT = "TimeoutError"


def _event(group, topic, offset, attempt, tier, outcome, first, at, *, key, error=None, reason=None, next_tier=None):
    return AttemptEvent(
        event_id=event_id(group, topic, 0, offset, attempt, outcome),
        group=group,
        key=key,
        original_topic=topic,
        original_partition=0,
        original_offset=offset,
        attempt=attempt,
        tier=tier,
        outcome=outcome,
        reason=reason,
        error_class=error,
        error_message=error and f"{error}: boom",
        first_received_at=first,
        due_at=None,
        event_time=at,
        next_tier=next_tier,
    )


def scenario(items: str, orders: str) -> list[AttemptEvent]:
    """12 messages of group g:
    * offsets 0-3 on items succeed on the first try;
    * offsets 4-6 on items fail with TimeoutError and recover on retry 1 (tier 5s) after 10, 20, 30 s;
    * offsets 7-8 on items fail twice with TimeoutError, recover on retry 2 (tier 30s) after 40, 50 s;
    * offsets 9-10 on items fail with ValueError three times and go dead after tier 30s (key "poison");
    * offset 0 on orders fails with ConnectionError and recovers on retry 1 after 8 s.
    Every ``scheduled`` event names its ``next_tier``: 5s after the first try, 30s after tier 5s.
    """
    g = "g"
    events = []
    for off in range(4):
        first = BASE + off * S
        events.append(_event(g, items, off, 0, None, "succeeded", first, first + 1, key=f"ok{off}"))
    for off, secs in ((4, 10), (5, 20), (6, 30)):
        first = BASE + off * S
        events.append(
            _event(g, items, off, 0, None, "scheduled", first, first, key=f"slow{off}", error=TIMEOUT, next_tier="5s")
        )
        events.append(_event(g, items, off, 1, "5s", "succeeded", first, first + secs * S, key=f"slow{off}"))
    for off, secs in ((7, 40), (8, 50)):
        first = BASE + off * S
        events.append(
            _event(g, items, off, 0, None, "scheduled", first, first, key=f"slow{off}", error=TIMEOUT, next_tier="5s")
        )
        events.append(
            _event(
                g,
                items,
                off,
                1,
                "5s",
                "scheduled",
                first,
                first + 6 * S,
                key=f"slow{off}",
                error=TIMEOUT,
                next_tier="30s",
            )
        )
        events.append(_event(g, items, off, 2, "30s", "succeeded", first, first + secs * S, key=f"slow{off}"))
    for off in (9, 10):
        first = BASE + off * S
        events.append(
            _event(g, items, off, 0, None, "scheduled", first, first, key="poison", error="ValueError", next_tier="5s")
        )
        events.append(
            _event(
                g,
                items,
                off,
                1,
                "5s",
                "scheduled",
                first,
                first + 5 * S,
                key="poison",
                error="ValueError",
                next_tier="30s",
            )
        )
        events.append(
            _event(
                g,
                items,
                off,
                2,
                "30s",
                "dead",
                first,
                first + 40 * S,
                key="poison",
                error="ValueError",
                reason="exhausted",
            )
        )
    first = BASE + 20 * S
    events.append(
        _event(g, orders, 0, 0, None, "scheduled", first, first, key="o1", error="ConnectionError", next_tier="5s")
    )
    events.append(_event(g, orders, 0, 1, "5s", "succeeded", first, first + 8 * S, key="o1"))
    return events


def seed_facts_without_next_tier(spark, path: Path, events: list[AttemptEvent]) -> None:
    """Facts as the job wrote them before attempt events carried ``next_tier``: files without that column."""
    kafka_rows = spark.createDataFrame(
        [(e.to_json(), 0, -1) for e in events], "value binary, partition int, offset long"
    )
    parse_attempts(kafka_rows).drop("next_tier").write.partitionBy("date").parquet(str(path))


def _publish(broker, topic: str, events: list[AttemptEvent]) -> None:
    produce(broker.bootstrap, topic, [{"value": e.to_json(), "key": e.event_id.encode()} for e in events])


def _failed_record(original_topic, key, value, *, reason, error, ts, redrives=None, user_headers=(), original_offset=9):
    headers = [
        *user_headers,
        ("rebound.original-topic", original_topic.encode()),
        ("rebound.original-partition", b"0"),
        ("rebound.original-offset", b"%d" % original_offset),
        ("rebound.first-received-at", b"%d" % BASE),
        ("rebound.group", b"g"),
        ("rebound.attempt", b"3"),
        ("rebound.reason", reason.encode()),
        ("rebound.error-class", error.encode()),
        ("rebound.error-message", b"boom"),
    ]
    if redrives is not None:
        headers.append(("rebound.redrive-count", b"%d" % redrives))
    return {"key": key, "value": value, "headers": headers, "timestamp_ms": ts}


def test_facts_then_report_then_tune(spark, broker, tmp_path) -> None:
    app, items, orders = unique("app"), unique("items"), unique("orders")
    attempts = f"{app}.attempts"
    create_topics(broker.bootstrap, {attempts: 2, f"{items}.failed": 1, f"{orders}.failed": 1})
    events = scenario(items, orders)
    duplicates = events[4:6]  # re-emitted after a "crash": same event ids
    _publish(broker, attempts, events + duplicates)
    hour = BASE // 3_600_000 * 3_600_000
    produce(
        broker.bootstrap,
        f"{items}.failed",
        [
            _failed_record(items, b"poison", b"x", reason="exhausted", error="ValueError", ts=hour + 60 * S),
            _failed_record(items, b"poison", b"y", reason="exhausted", error="ValueError", ts=hour + 120 * S),
            _failed_record(items, b"late", b"z", reason="expired", error="TimeoutError", ts=hour + 3_600_000 + S),
        ],
    )
    common = [
        "--bootstrap",
        broker.bootstrap,
        "--app-id",
        app,
        "--main-topics",
        f"{items},{orders}",
        "--out",
        str(tmp_path),
    ]

    # Offsets 7 and 8 (both dates) are already in the facts, written before next_tier existed; the run must
    # de-duplicate against them and the dataset must read with the new column (null for those rows).
    old = [e for e in events if e.original_topic == items and e.original_offset in (7, 8)]
    seed_facts_without_next_tier(spark, tmp_path / "facts", old)
    assert "next_tier" not in spark.read.parquet(str(tmp_path / "facts")).columns

    first = main(["facts", *common], spark=spark)
    assert first["records_read"] == len(events) + len(duplicates)
    assert first["facts_total"] == len({e.event_id for e in events}) == len(events)
    stored = {
        (r["original_topic"], r["original_offset"], r["attempt"]): r["next_tier"]
        for r in read_facts(spark, tmp_path / "facts").where("outcome = 'scheduled'").collect()
    }
    assert stored == {
        **{(items, off, 0): "5s" for off in (4, 5, 6, 9, 10)},
        **{(items, off, 1): "30s" for off in (9, 10)},
        **{(items, off, attempt): None for off in (7, 8) for attempt in (0, 1)},
        (orders, 0, 0): "5s",
    }
    facts = spark.read.parquet(str(tmp_path / "facts"))
    by_date = {str(r["date"]): r["count"] for r in facts.groupBy("date").count().collect()}
    expected_dates = Counter(
        dt.datetime.fromtimestamp(e.event_time / 1000, tz=dt.UTC).date().isoformat() for e in events
    )
    assert by_date == dict(expected_dates)
    assert set(expected_dates) == {"2024-05-01", "2024-05-02"}

    # Second run: only the new records are read; re-emitted old events do not create duplicates.
    late = _event("g", orders, 1, 0, None, "succeeded", BASE + 90 * S, BASE + 91 * S, key="o2")
    _publish(broker, attempts, [late, events[0], events[-1]])
    second = main(["facts", *common], spark=spark)
    assert second["records_read"] == 3
    assert second["facts_total"] == len(events) + 1
    events.append(late)

    _check_report(main(["report", *common], spark=spark), events, items, orders, tmp_path)
    _check_tune(main(["tune", *common, "--max-duration", "1h"], spark=spark), tmp_path)


def _check_report(result, events, items, orders, tmp_path) -> None:
    tables = result["tables"]
    hour = BASE // 3_600_000 * 3_600_000
    # outcomes per tier, counted straight from the generated events
    expected_tiers = Counter((e.tier or "first try", e.outcome) for e in events)
    got_tiers = {
        (row["tier"], outcome): row[outcome]
        for row in tables["outcomes_per_tier"].to_dict("records")
        for outcome in ("succeeded", "scheduled", "dead", "expired")
        if row[outcome]
    }
    assert got_tiers == dict(expected_tiers)
    assert got_tiers[("first try", "succeeded")] == 5 and got_tiers[("30s", "dead")] == 2
    # where scheduled messages went: 8 first tries (items 4-10, orders 0) to 5s, 4 retries (items 7-10) from 5s to
    # 30s. Items 7-8 are old facts without next_tier: their route comes from the tier of their next attempt.
    routes = {
        (r["tier"], r["next_tier"]): (r["scheduled"], r["messages"])
        for r in tables["scheduled_routes"].to_dict("records")
    }
    assert routes == {("first try", "5s"): (8, 8), ("5s", "30s"): (4, 4)}
    went = dict(zip(tables["outcomes_per_tier"]["tier"], tables["outcomes_per_tier"]["scheduled_to"], strict=True))
    assert went == {"first try": "5s (8)", "5s": "30s (4)", "30s": ""}
    # attempts before success: 5 on the first try (4 + the late orders one), 4 on retry 1, 2 on retry 2
    hist = dict(
        zip(
            tables["attempts_to_success"]["attempts_before_success"],
            tables["attempts_to_success"]["count"],
            strict=True,
        )
    )
    assert hist == {0: 5, 1: 4, 2: 2}
    # TimeoutError on items recovered after 10, 20, 30, 40, 50 s: p50 = 30; p90 at rank 0.9*4 = 3.6 -> 40 + 0.6*10
    # = 46; p99 at rank 3.96 -> 40 + 0.96*10 = 49.6. ConnectionError on orders: a single value, 8 s.
    pct = {
        (r["error_class"], r["original_topic"]): (r["recovered"], r["p50_s"], r["p90_s"], r["p99_s"])
        for r in tables["recovery_percentiles"].to_dict("records")
    }
    assert pct == {
        ("TimeoutError", items): (5, 30.0, 46.0, pytest.approx(49.6)),
        ("ConnectionError", orders): (1, 8.0, 8.0, 8.0),
    }
    assert tables["never_recovered"].to_dict("records") == [{"original_topic": items, "never_recovered": 2}]
    top = tables["top_failing_keys"].to_dict("records")[0]
    assert (top["key"], top["failures"], top["messages"]) == ("poison", 6, 2)
    growth = {
        (r["reason"], r["hour"].isoformat()): (r["count"], r["cumulative"])
        for r in tables["failed_growth"].to_dict("records")
    }
    h0 = dt.datetime.fromtimestamp(hour / 1000, tz=dt.UTC).replace(tzinfo=None).isoformat()
    h1 = dt.datetime.fromtimestamp(hour / 1000 + 3600, tz=dt.UTC).replace(tzinfo=None).isoformat()
    assert growth == {("exhausted", h0): (2, 2), ("expired", h1): (1, 1)}
    assert result["summary"]["recovered"] == 6 and result["summary"]["failed_topic_records"] == 3
    report_dir = tmp_path / "report"
    assert (report_dir / "index.html").read_text().count("<img") == 4
    for name in ("outcomes_per_tier", "attempts_to_success", "recovery_percentiles", "failed_growth"):
        assert (report_dir / f"{name}.png").stat().st_size > 1000
    assert json.loads((report_dir / "tables" / "never_recovered.json").read_text())[0]["never_recovered"] == 2
    sample = os.environ.get("REBOUND_REPORT_SAMPLE")  # regenerate docs/img/report-sample.png from this scenario
    if sample:
        shutil.copyfile(report_dir / "overview.png", sample)


def _check_tune(tuned, tmp_path) -> None:
    # recovery times 8,10,20,30,40,50 s and 2 never recovered.
    assert tuned["observed"]["recovered"] == 6 and tuned["observed"]["never_recovered"] == 2
    best = tuned["recommendation"]
    assert best["total_ms"] >= 50 * S  # covers the p99 (49.5 s)
    assert best["recovery_rate"] == pytest.approx(6 / 8)  # everything that can recover does
    # a single 1m delay would recover all 6 at 60 s each with 1 write; the rule must weigh that against latency
    one = next(c for c in tuned["candidates"] if len(c["delays_ms"]) == 1)
    assert one["sequence"] == "1m" and one["writes_per_message"] == pytest.approx((6 * 1 + 2 * 2) / 8)
    # Two tiers: cumulative delays at the p49.5 (24.75 s -> 30s) and the p99 (49.5 s -> 1m) give 30s,30s. Mean wait
    # (4 x 30 s + 2 x 60 s) / 6 = 40 s <= 2 x mean T (26.3 s); the single 1m tier waits 60 s on average (too slow).
    assert best["sequence"] == "30s,30s"
    # writes: 4 recover on retry 1 (1 write each), 2 on retry 2 (2 each), 2 never (2 retries + failed topic = 3 each)
    assert best["writes_per_message"] == pytest.approx((4 * 1 + 2 * 2 + 2 * 3) / 8)
    saved = json.loads((tmp_path / "tune" / "recommendation.json").read_text())["recommendation"]
    assert saved == json.loads(json.dumps(best))


def test_redrive_dry_run_execute_and_ledger(spark, broker, tmp_path) -> None:
    items = unique("items")
    failed = f"{items}.failed"
    create_topics(broker.bootstrap, {items: 1, failed: 1})
    now = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    produce(
        broker.bootstrap,
        failed,
        [
            _failed_record(
                items,
                b"k1",
                b"v1",
                reason="exhausted",
                error="ValueError",
                ts=now - 5000,
                user_headers=[("trace-id", b"abc")],
                original_offset=1,
            ),
            _failed_record(
                items,
                b"k2",
                b"v2",
                reason="exhausted",
                error="ValueError",
                ts=now - 4000,
                redrives=3,
                original_offset=2,
            ),
            _failed_record(
                "payments", b"k3", b"v3", reason="exhausted", error="ValueError", ts=now - 3000, original_offset=3
            ),
            _failed_record(
                items,
                b"k4",
                b"\x00\xff",
                reason="expired",
                error="TimeoutError",
                ts=now - 2000,
                redrives=1,
                original_offset=4,
            ),
            _failed_record(
                items, b"other", b"v5", reason="expired", error="TimeoutError", ts=now - 1000, original_offset=5
            ),
        ],
    )
    common = ["--bootstrap", broker.bootstrap, "--app-id", "x", "--main-topics", items, "--out", str(tmp_path)]

    def main_topic_records():
        return (
            spark.read.format("pykafka")
            .option("kafka.bootstrap.servers", broker.bootstrap)
            .option("subscribe", items)
            .option("includeHeaders", "true")
            .load()
            .orderBy("offset")
            .collect()
        )

    dry = main(["redrive", *common, "--key-pattern", "^k"], spark=spark)
    assert dry["dry_run"] is True and dry["sent"] == 0
    assert dry["counts"] == {"send": 2, "skipped_max_redrives": 1, "skipped_not_a_main_topic": 1}
    assert main_topic_records() == []
    plan = [json.loads(line) for line in Path(dry["plan"]).read_text().splitlines()]
    assert [(p["key"], p["action"]) for p in plan] == [
        ("k1", "send"),
        ("k2", "skipped_max_redrives"),
        ("k3", "skipped_not_a_main_topic"),
        ("k4", "send"),
    ]

    done = main(["redrive", *common, "--key-pattern", "^k", "--execute", "--rate", "50"], spark=spark)
    assert done["sent"] == 2
    arrived = main_topic_records()
    assert [(r.key, r.value) for r in arrived] == [(b"k1", b"v1"), (b"k4", b"\x00\xff")]
    assert [[(h.key, h.value) for h in r.headers] for r in arrived] == [
        [("trace-id", b"abc"), ("rebound.redrive-count", b"1")],
        [("rebound.redrive-count", b"2")],
    ]

    again = main(["redrive", *common, "--key-pattern", "^k", "--execute"], spark=spark)
    assert again["sent"] == 0 and again["counts"]["skipped_already_redriven"] == 2
    assert len(main_topic_records()) == 2
    audit = [a for a in read_audit(Location(tmp_path)) if a["status"] == "finished"]
    assert [(a["dry_run"], a["sent"]) for a in audit] == [(True, 0), (False, 2), (False, 0)]
    assert audit[0]["filters"]["key_pattern"] == "^k" and audit[0]["user"]

    inv = main(["inventory", *common], spark=spark)
    assert inv["summary"]["topics"][failed]["depth"] == 5
    assert inv["summary"]["topics"][failed]["redriven"] == 2
    reasons = {r["reason"]: (r["records"], r["redriven"]) for r in inv["tables"]["by_reason"].to_dict("records")}
    assert reasons == {"exhausted": (3, 1), "expired": (2, 1)}
    assert sorted(inv["tables"]["redriven"]["key_text"]) == ["k1", "k4"]
