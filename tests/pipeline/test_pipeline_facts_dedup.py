"""facts de-duplication across dates: an attempt event re-emitted after a crash keeps its event id but gets a new
event time, which can fall on the next UTC date (another partition) than the first copy."""

from __future__ import annotations

import datetime as dt

import pytest
from conftest import create_topics, produce, unique

from pipeline.__main__ import main
from pipeline.jobs.facts import parse_attempts, read_facts
from rebound.attempts import AttemptEvent, event_id

pytestmark = [pytest.mark.broker, pytest.mark.spark]

DAY = dt.datetime(2024, 5, 1, tzinfo=dt.UTC)
S = 1000


def _ms(value: dt.datetime) -> int:
    return int(value.timestamp() * 1000)


def _event(offset: int, outcome: str, first: dt.datetime, at: dt.datetime) -> AttemptEvent:
    return AttemptEvent(
        event_id=event_id("g", "items", 0, offset, 1, outcome),
        group="g",
        key=f"k{offset}",
        original_topic="items",
        original_partition=0,
        original_offset=offset,
        attempt=1,
        tier="30s",
        outcome=outcome,
        reason=None,
        error_class=None,
        error_message=None,
        first_received_at=_ms(first),
        due_at=None,
        event_time=_ms(at),
        next_tier=None,
    )


def _publish(bootstrap: str, topic: str, events: list[AttemptEvent]) -> None:
    produce(bootstrap, topic, [{"value": e.to_json(), "key": e.event_id.encode()} for e in events])


def _stored(spark, out) -> dict[str, list[str]]:
    rows = read_facts(spark, out / "facts").select("event_id", "event_ts", "date").collect()
    found: dict[str, list[str]] = {}
    for r in rows:
        found.setdefault(r["event_id"], []).append(str(r["date"]))
    return {event: sorted(dates) for event, dates in found.items()}


def test_reemission_on_the_next_date_is_not_written_twice(spark, broker, tmp_path) -> None:
    app = unique("app")
    attempts = f"{app}.attempts"
    create_topics(broker.bootstrap, {attempts: 1})
    common = ["--bootstrap", broker.bootstrap, "--app-id", app, "--out", str(tmp_path)]
    first_received = DAY + dt.timedelta(hours=23, minutes=59)
    original = _event(1, "succeeded", first_received, DAY + dt.timedelta(hours=23, minutes=59, seconds=50))
    other = _event(2, "succeeded", first_received, DAY + dt.timedelta(hours=23, minutes=59, seconds=55))
    _publish(broker.bootstrap, attempts, [original, other])
    assert main(["facts", *common], spark=spark)["facts_total"] == 2

    # The worker crashed after emitting the outcome but before committing; the re-emission happens 30 s later,
    # on the next UTC date, with the same event id. A genuinely new event comes with it.
    reemitted = _event(1, "succeeded", first_received, DAY + dt.timedelta(days=1, seconds=20))
    assert reemitted.event_id == original.event_id
    new = _event(3, "succeeded", first_received, DAY + dt.timedelta(days=1, seconds=25))
    _publish(broker.bootstrap, attempts, [reemitted, new])
    second = main(["facts", *common], spark=spark)
    assert second["facts_total"] == 3
    assert second["records_read"] == 2
    assert second["facts_written"] == 1
    assert _stored(spark, tmp_path) == {
        original.event_id: ["2024-05-01"],
        other.event_id: ["2024-05-01"],
        new.event_id: ["2024-05-02"],
    }


def test_copies_in_one_batch_keep_the_earliest(spark, broker, tmp_path) -> None:
    app = unique("app")
    attempts = f"{app}.attempts"
    create_topics(broker.bootstrap, {attempts: 2})
    first_received = DAY + dt.timedelta(hours=23, minutes=58)
    original = _event(1, "dead", first_received, DAY + dt.timedelta(hours=23, minutes=59, seconds=59))
    copies = [_event(1, "dead", first_received, DAY + dt.timedelta(days=1, minutes=m)) for m in (1, 2)]
    # The later copies are produced first, so Kafka order alone would pick a copy on the wrong date.
    _publish(broker.bootstrap, attempts, [*copies, original])
    result = main(["facts", "--bootstrap", broker.bootstrap, "--app-id", app, "--out", str(tmp_path)], spark=spark)
    assert result["records_read"] == 3
    assert result["facts_total"] == 1
    assert _stored(spark, tmp_path) == {original.event_id: ["2024-05-01"]}


def test_only_partitions_from_the_first_receipt_on_are_read(spark, broker, tmp_path) -> None:
    # The documented bound: a copy older than the message's first receipt cannot be a first copy, so its partition
    # is not read. Planted here with the same event id in January, it does not stop the May event.
    app = unique("app")
    attempts = f"{app}.attempts"
    create_topics(broker.bootstrap, {attempts: 1})
    january = dt.datetime(2024, 1, 5, tzinfo=dt.UTC)
    planted = _event(7, "succeeded", january, january)
    rows = spark.createDataFrame([(planted.to_json(), 0, 0)], "value binary, partition int, offset long")
    parse_attempts(rows).write.partitionBy("date").parquet(str(tmp_path / "facts"))
    may = _event(7, "succeeded", DAY, DAY + dt.timedelta(minutes=1))
    _publish(broker.bootstrap, attempts, [may])
    result = main(["facts", "--bootstrap", broker.bootstrap, "--app-id", app, "--out", str(tmp_path)], spark=spark)
    assert result["facts_written"] == 1
    assert _stored(spark, tmp_path) == {may.event_id: ["2024-01-05", "2024-05-01"]}
