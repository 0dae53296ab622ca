"""redrive's safety rules through the real job (``python -m pipeline redrive``) on the embedded broker: no accidental
tombstones, one send per original message, one executing run per --out, audit records for runs that fail, and
executing a reviewed plan exactly."""

from __future__ import annotations

import datetime as dt
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import create_topics, produce, unique

from pipeline.__main__ import main
from pipeline.ledger import acquire_lock, read_audit, read_ledger, read_lock
from pipeline.storage import Location

pytestmark = [pytest.mark.broker, pytest.mark.spark]


def dead_letter(
    key: bytes | None,
    value: bytes | None,
    *,
    original_offset: int,
    reason: str = "exhausted",
    group: str = "g",
    redrives: int | None = None,
    ts: int | None = None,
    original_topic: str,
) -> dict[str, Any]:
    headers = [
        ("rebound.original-topic", original_topic.encode()),
        ("rebound.original-partition", b"0"),
        ("rebound.original-offset", b"%d" % original_offset),
        ("rebound.group", group.encode()),
        ("rebound.attempt", b"3"),
        ("rebound.reason", reason.encode()),
        ("rebound.error-class", b"ValueError"),
        ("rebound.error-message", b"boom"),
    ]
    if redrives is not None:
        headers.append(("rebound.redrive-count", b"%d" % redrives))
    record: dict[str, Any] = {"key": key, "value": value, "headers": headers}
    if ts is not None:
        record["timestamp_ms"] = ts
    return record


def topics(broker) -> tuple[str, str]:
    items = unique("items")
    create_topics(broker.bootstrap, {items: 1, f"{items}.failed": 1})
    return items, f"{items}.failed"


def args(broker, items: str, out: Path | str, *more: str) -> list[str]:
    return ["redrive", "--bootstrap", broker.bootstrap, "--main-topics", items, "--out", str(out), *more]


def arrived(spark, broker, topic: str) -> list[Any]:
    return (
        spark.read.format("pykafka")
        .option("kafka.bootstrap.servers", broker.bootstrap)
        .option("subscribe", topic)
        .option("includeHeaders", "true")
        .load()
        .orderBy("offset")
        .collect()
    )


def plan_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Location(result["plan"]).read_text().splitlines()]


def test_too_large_and_empty_values_are_never_sent_as_tombstones_unless_asked(spark, broker, tmp_path) -> None:
    items, failed = topics(broker)
    ok = dead_letter(b"ok", b"v", original_offset=4, original_topic=items)
    ok["headers"][:0] = [("trace", None), ("empty", b"")]  # user headers: a null value (Java producers) and b""
    produce(
        broker.bootstrap,
        failed,
        [
            dead_letter(b"big", None, original_offset=1, reason="too-large", original_topic=items),
            dead_letter(b"gone", None, original_offset=2, original_topic=items),  # the original was a tombstone
            dead_letter(b"bytes", b"\xff\xfe", original_offset=3, reason="undecodable", original_topic=items),
            ok,
        ],
    )
    first = main(args(broker, items, tmp_path, "--execute"), spark=spark)
    assert first["counts"] == {
        "send": 1,
        "skipped_value_left_out": 1,
        "skipped_empty_value": 1,
        "skipped_undecodable": 1,
    }
    (sent,) = arrived(spark, broker, items)
    assert (sent.key, sent.value) == (b"ok", b"v")
    assert [(h.key, h.value) for h in sent.headers] == [
        ("trace", None),  # byte-exact: null stays null, never b""
        ("empty", b""),
        ("rebound.redrive-count", b"1"),
    ]
    assert {p["key"]: p["action"] for p in plan_of(first)}["big"] == "skipped_value_left_out"

    opted = main(
        args(broker, items, tmp_path, "--execute", "--include-empty-values", "--include-undecodable"), spark=spark
    )
    assert opted["sent"] == 2 and opted["counts"]["skipped_value_left_out"] == 1
    got = [(r.key, r.value) for r in arrived(spark, broker, items)]
    assert got == [(b"ok", b"v"), (b"gone", None), (b"bytes", b"\xff\xfe")]  # never (b"big", None)


def test_two_dead_letters_of_one_message_send_it_once_and_a_later_run_skips_it(spark, broker, tmp_path) -> None:
    items, failed = topics(broker)
    now = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    produce(
        broker.bootstrap,
        failed,
        [
            dead_letter(b"a", b"a-1", original_offset=10, group="g1", ts=now - 3000, original_topic=items),
            dead_letter(b"a", b"a-2", original_offset=10, group="g2", ts=now - 2000, original_topic=items),
            dead_letter(b"b", b"b", original_offset=11, ts=now - 1000, original_topic=items),
        ],
    )
    first = main(args(broker, items, tmp_path, "--execute"), spark=spark)
    assert first["sent"] == 2 and first["counts"]["skipped_duplicate_of_message"] == 1
    assert [(r.key, r.value) for r in arrived(spark, broker, items)] == [(b"a", b"a-2"), (b"b", b"b")]
    copy_offset = next(r["target_offset"] for r in read_ledger(Location(tmp_path)) if r["original_offset"] == 10)

    produce(
        broker.bootstrap,
        failed,
        [
            # written late (a group that was behind): the same message, already sent back
            dead_letter(b"a", b"a-3", original_offset=10, group="g3", original_topic=items),
            # the copy that was sent back failed again: a new message (its own offset), one redrive further
            dead_letter(b"a", b"a-2", original_offset=copy_offset, redrives=1, original_topic=items),
        ],
    )
    second = main(args(broker, items, tmp_path, "--execute"), spark=spark)
    assert second["counts"] == {"skipped_already_redriven": 4, "send": 1}
    sent_back = arrived(spark, broker, items)
    assert [(r.key, r.value) for r in sent_back] == [(b"a", b"a-2"), (b"b", b"b"), (b"a", b"a-2")]
    assert [(h.key, h.value) for h in sent_back[-1].headers] == [("rebound.redrive-count", b"2")]


def test_two_runs_at_once_against_one_out_send_once(spark, broker, tmp_path) -> None:
    items, failed = topics(broker)
    produce(
        broker.bootstrap,
        failed,
        [dead_letter(b"k%d" % n, b"v%d" % n, original_offset=n, original_topic=items) for n in range(20)],
    )
    outcomes: list[Any] = []
    barrier = threading.Barrier(2)
    # at 10/s the sending takes 2 s, so the two runs overlap whatever Spark's scheduling

    def run() -> None:
        barrier.wait()
        try:
            outcomes.append(main(args(broker, items, tmp_path, "--execute", "--rate", "10"), spark=spark))
        except BaseException as exc:  # kept, so that a crash counts as neither sending nor refusing
            outcomes.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(arrived(spark, broker, items)) == 20
    assert len(outcomes) == 2 and all(isinstance(o, dict | SystemExit) for o in outcomes), outcomes
    sent = sorted(o["sent"] for o in outcomes if isinstance(o, dict))
    refused = [str(o) for o in outcomes if isinstance(o, SystemExit)]
    # the loser is refused by the lock, or (if the winner was already done) finds everything in the ledger
    assert sent in ([20], [0, 20])
    assert all("is held by run" in text and "--break-lock" in text for text in refused)
    assert not read_lock(Location(tmp_path))  # released


def test_a_held_lock_refuses_naming_its_holder_and_break_lock_takes_it(spark, broker, tmp_path) -> None:
    items, failed = topics(broker)
    produce(broker.bootstrap, failed, [dead_letter(b"k", b"v", original_offset=1, original_topic=items)])
    out = Location(tmp_path)
    acquire_lock(out, {"run_id": "crashed-run", "user": "ann", "host": "box-9", "pid": 4242})
    with pytest.raises(SystemExit, match=r"held by run crashed-run by ann@box-9 \(pid 4242\)"):
        main(args(broker, items, tmp_path, "--execute"), spark=spark)
    assert arrived(spark, broker, items) == []
    assert main(args(broker, items, tmp_path), spark=spark)["dry_run"]  # a dry run needs no lock
    done = main(args(broker, items, tmp_path, "--execute", "--break-lock"), spark=spark)
    assert done["sent"] == 1 and not read_lock(out)
    refused = [a for a in read_audit(out) if a["status"] == "failed"]
    assert len(refused) == 1 and "crashed-run" in refused[0]["error"]


def test_a_run_that_fails_midway_leaves_an_audit_record_and_its_acknowledged_chunks(spark, broker, tmp_path) -> None:
    """The producer gets the common Kafka options: here a max.request.size that the last record exceeds."""
    items, failed = topics(broker)
    now = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    small = [
        dead_letter(b"k%d" % n, b"v", original_offset=n, ts=now - 10_000 + n, original_topic=items) for n in range(101)
    ]
    big = dead_letter(b"big", b"x" * 5000, original_offset=999, ts=now, original_topic=items)
    produce(broker.bootstrap, failed, [*small, big])
    with pytest.raises(Exception, match="MessageSizeTooLarge"):
        main(
            args(broker, items, tmp_path, "--execute", "--rate", "0", "--kafka-option", "max.request.size=2000"),
            spark=spark,
        )
    out = Location(tmp_path)
    audit = read_audit(out)
    assert [a["status"] for a in audit] == ["started", "failed"]
    # the first chunk of 100 was settled by the run, the 101st when the send after it failed
    assert "MessageSizeTooLarge" in audit[1]["error"] and audit[1]["sent"] == 101
    assert len(read_ledger(out)) == 101 == len(arrived(spark, broker, items))
    assert not read_lock(out)

    rest = main(args(broker, items, tmp_path, "--execute", "--rate", "0"), spark=spark)
    assert rest["sent"] == 1 and rest["counts"]["skipped_already_redriven"] == 101
    assert [r.key for r in arrived(spark, broker, items)][100:] == [b"k100", b"big"]


def test_a_reviewed_plan_is_sent_exactly_and_a_changed_one_is_refused(spark, broker, tmp_path) -> None:
    items, failed = topics(broker)
    produce(
        broker.bootstrap,
        failed,
        [
            dead_letter(b"k1", b"v1", original_offset=1, original_topic=items),
            dead_letter(b"k2", b"v2", original_offset=2, redrives=3, original_topic=items),
            dead_letter(b"k3", b"v3", original_offset=3, original_topic=items),
        ],
    )
    dry = main(args(broker, items, tmp_path, "--key-pattern", "^k[12]$"), spark=spark)
    assert [(p["key"], p["action"]) for p in plan_of(dry)] == [("k1", "send"), ("k2", "skipped_max_redrives")]
    # arrives after the review: matches the same filters, must not go with the reviewed plan
    produce(broker.bootstrap, failed, [dead_letter(b"k2", b"late", original_offset=4, original_topic=items)])

    with pytest.raises(SystemExit, match="--key-pattern belong to the dry run"):
        main(args(broker, items, tmp_path, "--execute", "--plan", dry["plan"], "--key-pattern", "x"), spark=spark)

    tampered = Location(tmp_path / "tampered.jsonl")
    lines = plan_of(dry)
    lines[0]["digest"] = "0" * 64
    lines.append({**lines[0], "failed_offset": 77, "digest": lines[0]["digest"]})
    tampered.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(SystemExit, match=r"2 planned record\(s\) no longer match.*@0 has changed.*@77 is gone"):
        main(args(broker, items, tmp_path, "--execute", "--plan", str(tampered)), spark=spark)
    assert arrived(spark, broker, items) == []

    done = main(args(broker, items, tmp_path, "--execute", "--plan", dry["plan"]), spark=spark)
    assert done["counts"] == {"send": 1} and done["sent"] == 1
    assert [(r.key, r.value) for r in arrived(spark, broker, items)] == [(b"k1", b"v1")]
    again = main(args(broker, items, tmp_path, "--execute", "--plan", dry["plan"]), spark=spark)
    assert again["counts"] == {"skipped_already_redriven": 1} and again["sent"] == 0


def test_selected_records_reach_the_driver_only_through_to_local_iterator(spark, broker, tmp_path, monkeypatch) -> None:
    """Filters, the ledger, de-duplication and --max-records run in Spark: the job never collects the candidates."""
    from pyspark.sql import DataFrame

    items, failed = topics(broker)
    produce(
        broker.bootstrap,
        failed,
        [dead_letter(b"k%d" % n, b"v%d" % n, original_offset=n, original_topic=items) for n in range(6)],
    )

    def refuse(self: DataFrame, *a: Any, **k: Any) -> Any:
        raise AssertionError("redrive collected a DataFrame on the driver")

    monkeypatch.setattr(DataFrame, "collect", refuse)
    monkeypatch.setattr(DataFrame, "toPandas", refuse)
    done = main(args(broker, items, tmp_path, "--execute", "--max-records", "4"), spark=spark)
    monkeypatch.undo()
    assert done["counts"] == {"send": 4, "skipped_max_records": 2}
    assert [r.key for r in arrived(spark, broker, items)] == [b"k0", b"k1", b"k2", b"k3"]
