"""Redrive's parts on their own: the immutable ledger and audit objects, the run lock, plan files (no Spark), and
the Spark decision (:func:`pipeline.jobs.redrive.decide`) on in-memory failed-topic rows (Spark, no broker)."""

from __future__ import annotations

import datetime as dt
import json
import threading
import uuid
from pathlib import Path

import pytest

from pipeline.common import failed_columns
from pipeline.jobs import redrive
from pipeline.ledger import (
    LockHeld,
    acquire_lock,
    ledger_keys,
    lock_path,
    read_audit,
    read_ledger,
    read_lock,
    release_lock,
    write_audit,
    write_ledger_chunk,
)
from pipeline.storage import Location


@pytest.fixture(params=["local", "memory"])
def out(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    if request.param == "local":
        return Location(tmp_path / "out")
    return Location(f"memory://redrive-{uuid.uuid4().hex[:8]}/out")


def _ledger_row(offset: int, **extra: object) -> dict[str, object]:
    return {"failed_topic": "items.failed", "failed_partition": 0, "failed_offset": offset, **extra}


def test_the_ledger_is_the_union_of_immutable_chunks_and_the_old_appended_file(out: Location) -> None:
    assert read_ledger(out) == [] and ledger_keys(out) == set()
    first = write_ledger_chunk(out, "run-a", 0, [_ledger_row(1), _ledger_row(2)])
    write_ledger_chunk(out, "run-b", 0, [_ledger_row(3)])
    assert write_ledger_chunk(out, "run-b", 1, []) is None  # an empty chunk leaves no object
    (out / "redrive" / "ledger.jsonl").write_text(json.dumps(_ledger_row(7)) + '\n{"torn line')
    assert ledger_keys(out) == {("items.failed", 0, o) for o in (1, 2, 3, 7)}
    assert first is not None and first.name == "run-a-000000.jsonl"
    with pytest.raises(FileExistsError, match="written once"):
        write_ledger_chunk(out, "run-a", 0, [_ledger_row(9)])
    assert ("items.failed", 0, 9) not in ledger_keys(out)


def test_audit_objects_are_read_back_in_order(out: Location) -> None:
    write_audit(out, "20240501T100000Z-aa", 0, {"status": "started", "dry_run": True})
    write_audit(out, "20240501T100000Z-aa", 1, {"status": "failed", "error": "boom"})
    write_audit(out, "20240501T100001Z-bb", 0, {"status": "started", "dry_run": False})
    got = [(a["run_id"], a["status"]) for a in read_audit(out)]
    assert got == [
        ("20240501T100000Z-aa", "started"),
        ("20240501T100000Z-aa", "failed"),
        ("20240501T100001Z-bb", "started"),
    ]
    with pytest.raises(FileExistsError):
        write_audit(out, "20240501T100000Z-aa", 1, {"status": "failed"})


def test_the_lock_names_its_holder_and_only_breaks_on_request(out: Location) -> None:
    holder = {"run_id": "r1", "user": "ann", "host": "box-1", "pid": 42}
    acquire_lock(out, holder)
    assert read_lock(out)["run_id"] == "r1" and read_lock(out)["acquired_at"]
    with pytest.raises(LockHeld, match=r"run r1 by ann@box-1 \(pid 42\).*--break-lock"):
        acquire_lock(out, {"run_id": "r2", "user": "bob", "host": "box-2", "pid": 7})
    release_lock(out, "r2")  # not the holder: nothing happens
    assert read_lock(out)["run_id"] == "r1"
    acquire_lock(out, {"run_id": "r2", "user": "bob", "host": "box-2", "pid": 7}, break_lock=True)
    assert read_lock(out)["run_id"] == "r2"
    release_lock(out, "r2")
    assert not lock_path(out).exists() and read_lock(out) == {}


def test_of_many_threads_taking_the_lock_exactly_one_wins(tmp_path: Path) -> None:
    out = Location(tmp_path)
    winners: list[int] = []
    barrier = threading.Barrier(8)

    def contend(n: int) -> None:
        barrier.wait()
        try:
            acquire_lock(out, {"run_id": f"r{n}"})
            winners.append(n)
        except LockHeld:
            pass

    threads = [threading.Thread(target=contend, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and read_lock(out)["run_id"] == f"r{winners[0]}"


def test_read_plan_takes_the_send_lines_and_refuses_plans_without_digests(tmp_path: Path) -> None:
    plan = Location(tmp_path / "plan.jsonl")
    lines = [
        {"failed_topic": "items.failed", "failed_partition": 0, "failed_offset": 4, "action": "send", "digest": "ab"},
        {"failed_topic": "items.failed", "failed_partition": 1, "failed_offset": 5, "action": redrive.SKIP_CAP},
    ]
    plan.write_text("".join(json.dumps(line) + "\n" for line in lines) + "\n")
    assert redrive.read_plan(plan, ["items.failed"]) == [("items.failed", 0, 4, "ab")]
    del lines[0]["digest"]
    plan.write_text(json.dumps(lines[0]) + "\n")
    with pytest.raises(SystemExit, match="line 1 has no digest"):
        redrive.read_plan(plan, ["items.failed"])
    with pytest.raises(SystemExit, match="--plan: no such file"):
        redrive.read_plan(Location(tmp_path / "missing.jsonl"), ["items.failed"])


# --- the decision, in Spark -----------------------------------------------------------------------------------------

T0 = dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.UTC)


def _dead_letter(
    offset: int,
    *,
    original_offset: int | None,
    value: bytes | None = b"v",
    reason: str = "exhausted",
    redrives: int = 0,
    original_topic: str = "items",
    group: str = "g",
    extra_headers: tuple[tuple[str, bytes], ...] = (),
) -> tuple[object, ...]:
    headers = [("rebound.original-topic", original_topic.encode()), ("rebound.original-partition", b"0")]
    if original_offset is not None:
        headers.append(("rebound.original-offset", b"%d" % original_offset))
    headers += [("rebound.reason", reason.encode()), ("rebound.group", group.encode()), *extra_headers]
    if redrives:
        headers.append(("rebound.redrive-count", b"%d" % redrives))
    ts = T0 + dt.timedelta(seconds=offset)
    return (b"k%d" % offset, value, "items.failed", 0, offset, ts, 0, [(k, v) for k, v in headers])


def _candidates(spark, rows):
    schema = (
        "key binary, value binary, topic string, partition int, offset long, timestamp timestamp, "
        "timestampType int, headers array<struct<key:string,value:binary>>"
    )
    return redrive.identify(failed_columns(spark.createDataFrame(rows, schema)))


def _decide(spark, rows, ledger=(), **options):
    settings = {"main_topics": ("items",), "max_redrives": 3, "max_records": None, **options}
    decided = redrive.decide(_candidates(spark, rows), list(ledger), spark, **settings)
    return {r["offset"]: r["action"] for r in decided.toLocalIterator()}


@pytest.mark.spark
def test_each_rule_in_order(spark) -> None:
    rows = [
        _dead_letter(0, original_offset=100),
        _dead_letter(1, original_offset=101, original_topic="payments"),
        _dead_letter(2, original_offset=102, value=None, reason="too-large"),
        _dead_letter(3, original_offset=103, value=None),
        _dead_letter(4, original_offset=104, value=b"", extra_headers=(("rebound.null-value", b"1"),)),
        _dead_letter(5, original_offset=105, value=b""),  # an empty value is a value
        _dead_letter(6, original_offset=106, reason="undecodable"),
        _dead_letter(7, original_offset=107, redrives=3),
        _dead_letter(8, original_offset=108),
    ]
    ledger = [_ledger_row(8)]
    assert _decide(spark, rows, ledger) == {
        0: redrive.SEND,
        1: redrive.SKIP_NOT_MAIN,
        2: redrive.SKIP_VALUE_LEFT_OUT,
        3: redrive.SKIP_EMPTY,
        4: redrive.SKIP_EMPTY,
        5: redrive.SEND,
        6: redrive.SKIP_UNDECODABLE,
        7: redrive.SKIP_CAP,
        8: redrive.SKIP_DONE,
    }
    opted_in = _decide(spark, rows, ledger, include_empty_values=True, include_undecodable=True)
    assert [o for o, action in sorted(opted_in.items()) if action == redrive.SEND] == [0, 3, 4, 5, 6]


@pytest.mark.spark
def test_one_send_per_original_message_newest_first_and_max_records_oldest_first(spark) -> None:
    rows = [
        _dead_letter(0, original_offset=100, group="g1"),
        _dead_letter(1, original_offset=100, group="g2"),  # the same message, failed in another group
        _dead_letter(2, original_offset=200, value=None),
        _dead_letter(3, original_offset=200),  # the only sendable one of message 200
        _dead_letter(4, original_offset=None),  # no provenance: only itself
        _dead_letter(5, original_offset=None),
        _dead_letter(6, original_offset=300),
    ]
    actions = _decide(spark, rows)
    assert actions == {
        0: redrive.SKIP_DUPLICATE,
        1: redrive.SEND,
        2: redrive.SKIP_EMPTY,
        3: redrive.SEND,
        4: redrive.SEND,
        5: redrive.SEND,
        6: redrive.SEND,
    }
    capped = _decide(spark, rows, max_records=2)
    assert [o for o, a in sorted(capped.items()) if a == redrive.SEND] == [1, 3]
    assert [o for o, a in sorted(capped.items()) if a == redrive.SKIP_MAX_RECORDS] == [4, 5, 6]


@pytest.mark.spark
def test_a_message_already_redriven_is_skipped_unless_its_copy_came_back(spark) -> None:
    message = '["original","items","0","100"]'
    ledger = [_ledger_row(0, message=message, redrive_count=1)]
    rows = [
        _dead_letter(1, original_offset=100),  # a late duplicate of the message that was sent (count 0)
        _dead_letter(2, original_offset=100, redrives=1),  # the sent copy failed again (count 1)
    ]
    assert _decide(spark, rows, ledger) == {1: redrive.SKIP_DONE, 2: redrive.SEND}


@pytest.mark.spark
def test_the_digest_covers_key_value_and_headers(spark) -> None:
    base = _dead_letter(0, original_offset=1)
    variants = [
        base,
        (b"other", *base[1:]),
        (base[0], b"other", *base[2:]),
        (*base[:7], [*base[7], ("trace", b"1")]),  # type: ignore[misc]
        (None, *base[1:]),
        (base[0], None, *base[2:]),
    ]
    digests = [_candidates(spark, [v]).first()["digest"] for v in variants]
    assert len(set(digests)) == len(variants)
    assert _candidates(spark, [base]).first()["digest"] == digests[0]
