"""redrive after review: whatever stops a run, every record the broker acknowledged ends up in the ledger (or the
lock stays, marked); records that cannot or must not be sent are skipped; garbled headers, plans and ledger objects
fail clearly. Fakes stand in for the producer only where a fault has to be injected, and fail the way
:class:`pipeline.kafka_source.client.KafkaWriter` does; the rest runs on Spark and the embedded broker."""

from __future__ import annotations

import json
import os
import signal
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import create_topics, produce, unique
from test_pipeline_redrive_safety import arrived, dead_letter
from test_pipeline_redrive_units import _dead_letter, _decide

from pipeline.__main__ import main
from pipeline.common import failed_columns
from pipeline.jobs import redrive
from pipeline.ledger import (
    LedgerCorrupt,
    LockHeld,
    acquire_lock,
    read_audit,
    read_ledger,
    read_lock,
    write_ledger_chunk,
)
from pipeline.storage import Location


class FakeWriter:
    """KafkaWriter's contract without a broker: ``send`` queues (and refuses a record with neither key nor value, as
    aiokafka asserts), ``flush`` waits for all and raises if any failed, ``settle`` returns each result, ``close``
    flushes. ``failing`` are the indexes (in send order) the broker rejects; ``delivered`` what it accepted."""

    def __init__(self, failing: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.failing = failing
        self.pending: list[tuple[int, bytes | None]] = []
        self.count = 0
        self.delivered: list[bytes | None] = []

    def __enter__(self) -> FakeWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, topic: str, value: bytes | None, key: bytes | None = None, **_: Any) -> None:
        assert not (value is None and key is None), "Need at least one: key or value"
        self.pending.append((self.count, key))
        self.count += 1

    def settle(self) -> list[Any]:
        pending, self.pending = self.pending, []
        results: list[Any] = []
        for index, key in pending:
            if index in self.failing:
                results.append(OSError(f"send {index} rejected"))
            else:
                self.delivered.append(key)
                results.append(types.SimpleNamespace(partition=0, offset=len(self.delivered) - 1))
        return results

    def flush(self) -> list[Any]:
        results = self.settle()
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise RuntimeError(f"{len(errors)} of {len(results)} Kafka sends failed; first: {errors[0]!r}")
        return results

    def close(self) -> None:
        self.flush()


def _row(n: int) -> dict[str, Any]:
    return {
        "topic": "items.failed",
        "partition": 0,
        "offset": n,
        "timestamp": None,
        "action": redrive.SEND,
        "key": b"k%d" % n,
        "value": b"v",
        "headers": [],
        "key_text": f"k{n}",
        "reason": "exhausted",
        "error_class": "E",
        "original_topic": "items",
        "original_partition": 0,
        "original_offset": n,
        "group": "g",
        "redrive_count": 0,
        "message": f'["original","items","0","{n}"]',
        "digest": "d",
    }


def _cfg(out: Location) -> Any:
    return types.SimpleNamespace(out=out, failed_topics=["items.failed"], main_topics=["items"])


def _rows_then(count: int, error: BaseException) -> Iterator[dict[str, Any]]:
    for n in range(count):
        yield _row(n)
    raise error


def _ledgered(out: Location) -> list[int]:
    return sorted(int(r["failed_offset"]) for r in read_ledger(out))


@pytest.fixture
def out(tmp_path: Path) -> Location:
    return Location(tmp_path / "out")


# --- 1, 2: every acknowledged record is recorded ----------------------------------------------------------------


@pytest.mark.parametrize("error", [RuntimeError("Spark: toLocalIterator failed"), KeyboardInterrupt()])
def test_an_error_mid_chunk_still_records_what_the_broker_accepted(out: Location, error: BaseException) -> None:
    with pytest.raises(type(error)), FakeWriter() as producer:
        sender = redrive.Sender(producer, _cfg(out), "run-1", rate=0)  # type: ignore[arg-type]
        redrive.carry_out(_rows_then(150, error), out / "plan.jsonl", sender)  # type: ignore[arg-type]
    assert len(producer.delivered) == 150
    assert _ledgered(out) == list(range(150))


def test_one_rejected_send_does_not_drop_the_chunks_acknowledged_records(out: Location) -> None:
    with pytest.raises(RuntimeError, match="1 of 100 Kafka sends failed"), FakeWriter(failing={5}) as producer:
        sender = redrive.Sender(producer, _cfg(out), "run-1", rate=0)  # type: ignore[arg-type]
        redrive.carry_out(iter([_row(n) for n in range(120)]), out / "plan.jsonl", sender)  # type: ignore[arg-type]
    assert _ledgered(out) == [n for n in range(100) if n != 5]
    assert len(producer.delivered) == 99


def test_kafka_writer_settle_returns_each_result_and_counts_the_successes() -> None:
    from pipeline.kafka_source import client

    async def ok() -> str:
        return "meta"

    async def bad() -> str:
        raise OSError("rejected")

    writer = client.KafkaWriter.__new__(client.KafkaWriter)
    writer._loop = client._Loop()
    try:
        writer._pending = [writer._loop.run(_task(ok())), writer._loop.run(_task(bad())), writer._loop.run(_task(ok()))]
        writer.sent = 0
        results = writer.settle()
    finally:
        writer._loop.close()
    assert results[0] == "meta" and isinstance(results[1], OSError) and results[2] == "meta"
    assert writer.sent == 2 and writer._pending == []


async def _task(coro: Any) -> Any:
    import asyncio

    return asyncio.ensure_future(coro)


# --- 4: a ledger write that fails ----------------------------------------------------------------------------------


def test_a_failing_ledger_write_is_retried(out: Location, monkeypatch: pytest.MonkeyPatch) -> None:
    failures = iter([OSError("503 Slow Down"), OSError("503 Slow Down")])

    def flaky(*args: Any) -> Any:
        for exc in failures:
            raise exc
        return write_ledger_chunk(*args)

    monkeypatch.setattr(redrive, "write_ledger_chunk", flaky)
    pauses: list[float] = []
    with FakeWriter() as producer:
        sender = redrive.Sender(producer, _cfg(out), "run-1", rate=0, sleep=pauses.append)  # type: ignore[arg-type]
        redrive.carry_out(iter([_row(n) for n in range(3)]), out / "plan.jsonl", sender)  # type: ignore[arg-type]
    assert _ledgered(out) == [0, 1, 2] and pauses == [0.5, 1.0] and sender.sent == 3


def test_an_unwritable_ledger_keeps_the_lock_marked_and_the_rows_in_the_audit(
    out: Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> Any:
        raise OSError("disk full")

    monkeypatch.setattr(redrive, "write_ledger_chunk", broken)
    acquire_lock(out, {"run_id": "run-1", "user": "ann", "host": "box", "pid": 1})
    with pytest.raises(redrive.LedgerIncomplete, match="could not be written") as raised, FakeWriter() as producer:
        sender = redrive.Sender(producer, _cfg(out), "run-1", rate=0, sleep=lambda _: None)  # type: ignore[arg-type]
        redrive.carry_out(iter([_row(n) for n in range(3)]), out / "plan.jsonl", sender)  # type: ignore[arg-type]
    assert len(producer.delivered) == 3 and sender.unrecorded and len(sender.unrecorded) == 3
    keep = redrive._record_failure(raised.value, _cfg(out), {"run_id": "run-1", "status": "started"}, sender)
    assert keep is True
    failed = [a for a in read_audit(out) if a["status"] == "failed"]
    assert [r["failed_offset"] for r in failed[0]["unrecorded"]] == [0, 1, 2]
    assert read_lock(out)["ledger_incomplete"]["records"] == 3
    with pytest.raises(LockHeld, match=r"ledger is incomplete: 3 record\(s\).*--break-lock"):
        acquire_lock(out, {"run_id": "run-2"})
    acquire_lock(out, {"run_id": "run-2"}, break_lock=True)
    assert read_lock(out)["run_id"] == "run-2"


@pytest.mark.broker
@pytest.mark.spark
def test_execute_with_an_unwritable_ledger_leaves_the_lock_for_the_operator(
    spark, broker, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = unique("items")
    create_topics(broker.bootstrap, {items: 1, f"{items}.failed": 1})
    produce(broker.bootstrap, f"{items}.failed", [dead_letter(b"k", b"v", original_offset=1, original_topic=items)])
    monkeypatch.setattr(redrive, "write_ledger_chunk", lambda *a: (_ for _ in ()).throw(OSError("503")))
    monkeypatch.setattr(redrive.Sender, "WRITE_ATTEMPTS", 2)
    common = ["redrive", "--bootstrap", broker.bootstrap, "--main-topics", items, "--out", str(tmp_path)]
    with pytest.raises(redrive.LedgerIncomplete):
        main([*common, "--execute"], spark=spark)
    assert len(arrived(spark, broker, items)) == 1
    assert read_lock(Location(tmp_path))["ledger_incomplete"]["records"] == 1
    with pytest.raises(LockHeld, match="ledger is incomplete"):
        main([*common, "--execute"], spark=spark)


# --- 3, 5, 8, 9: what is never sent, and headers that cannot fail the job --------------------------------------------


@pytest.mark.spark
def test_payload_missing_is_never_sent_and_neither_is_a_record_without_key_and_value(spark) -> None:
    rows = [
        _dead_letter(0, original_offset=100, value=None, reason="payload-missing"),
        _dead_letter(1, original_offset=101, value=None),
        (None, *_dead_letter(2, original_offset=102, value=None)[1:]),
        (None, *_dead_letter(3, original_offset=103, value=b"")[1:]),  # an empty value and no key: still a value
    ]
    opted_in = _decide(spark, rows, include_empty_values=True)
    assert opted_in == {
        0: redrive.SKIP_VALUE_LEFT_OUT,
        1: redrive.SEND,
        2: redrive.SKIP_NO_KEY_NO_VALUE,
        3: redrive.SEND,
    }
    reviewed = _decide(spark, rows, reviewed=True)
    assert reviewed[0] == redrive.SKIP_VALUE_LEFT_OUT and reviewed[2] == redrive.SKIP_NO_KEY_NO_VALUE


@pytest.mark.spark
def test_a_dead_letter_goes_only_to_the_main_topic_of_its_failed_topic(spark) -> None:
    rows = [_dead_letter(0, original_offset=1, original_topic="payments"), _dead_letter(1, original_offset=2)]
    actions = _decide(spark, rows, main_topics=("items", "payments"))
    assert actions == {0: redrive.SKIP_OTHER_FAILED_TOPIC, 1: redrive.SEND}


@pytest.mark.spark
def test_garbled_numeric_headers_read_as_null_instead_of_failing_the_job(spark) -> None:
    assert spark.conf.get("spark.sql.ansi.enabled") == "true"

    def with_headers(*headers: tuple[str, bytes]) -> tuple[object, ...]:
        base = _dead_letter(0, original_offset=None)
        return (*base[:7], [*base[7], *headers])  # type: ignore[misc]

    schema = (
        "key binary, value binary, topic string, partition int, offset long, timestamp timestamp, "
        "timestampType int, headers array<struct<key:string,value:binary>>"
    )
    cases = {
        b"abc": 0,
        b"-5": 0,
        b"99999999999": 2**31 - 1,  # more than an int: at least any cap, as rebound.replay reads it
        b" 2 ": 2,
        b"7": 7,
    }
    rows = [
        with_headers(
            ("rebound.redrive-count", raw),
            ("rebound.original-offset", raw),
            ("rebound.attempt", raw),
            ("rebound.first-received-at", raw),
        )
        for raw in cases
    ]
    got = failed_columns(spark.createDataFrame(rows, schema)).collect()
    assert [r["redrive_count"] for r in got] == list(cases.values())
    assert [r["original_offset"] for r in got] == [None, None, 99999999999, None, 7]
    assert [r["attempt"] for r in got] == [None, None, None, None, 7]
    assert [r["first_received_at"] for r in got] == [None, None, 99999999999, None, 7]

    from rebound.replay import redrive_count

    assert [redrive_count([("rebound.redrive-count", raw)]) for raw in cases if raw != b"99999999999"] == [
        v for raw, v in cases.items() if raw != b"99999999999"
    ]
    assert redrive_count([("rebound.redrive-count", b"99999999999")]) >= 2**31 - 1


def _produce_without_key_and_value(bootstrap: str, topic: str, headers: list[tuple[str, bytes]]) -> None:
    """aiokafka refuses such a record; Kafka and librdkafka (another app's producer) do not."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    errors: list[Any] = []
    producer.produce(topic, value=None, key=None, headers=headers, on_delivery=lambda err, _msg: errors.append(err))
    assert producer.flush(30) == 0 and errors == [None]


@pytest.mark.broker
@pytest.mark.spark
def test_execute_sends_only_what_may_be_sent_and_survives_garbled_headers(spark, broker, tmp_path) -> None:
    items, payments = unique("items"), unique("payments")
    create_topics(broker.bootstrap, {items: 1, f"{items}.failed": 1, payments: 1, f"{payments}.failed": 1})
    letters = [
        dead_letter(b"ok", b"v", original_offset=1, original_topic=items),
        dead_letter(b"lost", None, original_offset=2, original_topic=items, reason="payload-missing"),
        dead_letter(None, None, original_offset=3, original_topic=items),
        dead_letter(b"elsewhere", b"v", original_offset=4, original_topic=payments),
        dead_letter(b"garbled", b"v", original_offset=5, original_topic=items),
    ]
    letters[4]["headers"].append(("rebound.redrive-count", b"abc"))
    produce(broker.bootstrap, f"{items}.failed", letters[:2])
    _produce_without_key_and_value(broker.bootstrap, f"{items}.failed", letters[2]["headers"])
    produce(broker.bootstrap, f"{items}.failed", letters[3:])
    done = main(
        [
            "redrive",
            "--bootstrap",
            broker.bootstrap,
            "--main-topics",
            f"{items},{payments}",
            "--out",
            str(tmp_path),
            "--execute",
            "--include-empty-values",
        ],
        spark=spark,
    )
    assert done["counts"] == {
        redrive.SEND: 2,
        redrive.SKIP_VALUE_LEFT_OUT: 1,
        redrive.SKIP_NO_KEY_NO_VALUE: 1,
        redrive.SKIP_OTHER_FAILED_TOPIC: 1,
    }
    assert sorted(bytes(r["key"]) for r in arrived(spark, broker, items)) == [b"garbled", b"ok"]
    assert arrived(spark, broker, payments) == []


# --- 6: the ledger lives under --out ---------------------------------------------------------------------------------


def test_execute_needs_an_explicit_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="needs an explicit --out"):
        main(["redrive", "--bootstrap", "localhost:1", "--execute"], spark=object())  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


# --- 7, 10: the lock broken meanwhile, SIGTERM --------------------------------------------------------------------


def test_a_run_that_took_the_lock_by_breaking_it_stops_when_it_is_broken_again(out: Location) -> None:
    acquire_lock(out, {"run_id": "run-1"})

    def rows() -> Iterator[dict[str, Any]]:
        for n in range(250):
            if n == 150:
                acquire_lock(out, {"run_id": "run-2"}, break_lock=True)
            yield _row(n)

    with pytest.raises(redrive.LockLost, match="no longer held by this run"), FakeWriter() as producer:
        sender = redrive.Sender(producer, _cfg(out), "run-1", rate=0, fenced=True)  # type: ignore[arg-type]
        redrive.carry_out(rows(), out / "plan.jsonl", sender)  # type: ignore[arg-type]
    assert _ledgered(out) == list(range(200)) and len(producer.delivered) == 200


def test_sigterm_while_executing_settles_records_and_restores_the_handler(out: Location) -> None:
    before = signal.getsignal(signal.SIGTERM)

    def rows() -> Iterator[dict[str, Any]]:
        for n in range(150):
            yield _row(n)
        os.kill(os.getpid(), signal.SIGTERM)
        yield _row(150)

    with pytest.raises(redrive.Terminated), redrive._sigterm_raises(), FakeWriter() as producer:
        sender = redrive.Sender(producer, _cfg(out), "run-1", rate=0)  # type: ignore[arg-type]
        redrive.carry_out(rows(), out / "plan.jsonl", sender)  # type: ignore[arg-type]
    assert _ledgered(out) == list(range(150))
    assert signal.getsignal(signal.SIGTERM) == before


# --- 11, 12: plans and ledger objects that cannot be read ------------------------------------------------------------


def test_malformed_plan_lines_are_refused_with_their_line_number(tmp_path: Path) -> None:
    plan = Location(tmp_path / "plan.jsonl")
    good = {"failed_topic": "items.failed", "failed_partition": 0, "failed_offset": 1, "action": "send", "digest": "d"}
    bad_lines = {
        "[1, 2]": "line 2 is not a plan line",
        json.dumps({**good, "failed_offset": "x"}): "line 2: failed_topic, failed_partition and failed_offset",
        json.dumps({k: v for k, v in good.items() if k != "failed_partition"}): "line 2: failed_topic",
        json.dumps({**good, "failed_topic": "payments.failed"}): "line 2 names 'payments.failed'",
    }
    for bad, message in bad_lines.items():
        plan.write_text(json.dumps(good) + "\n" + bad + "\n")
        with pytest.raises(SystemExit, match=message):
            redrive.read_plan(plan, ["items.failed"])
    plan.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    assert redrive.read_plan(plan, ["items.failed"]) == [("items.failed", 0, 1, "d")]


def test_a_torn_ledger_object_fails_loudly(out: Location) -> None:
    write_ledger_chunk(out, "run-1", 0, [{"failed_topic": "items.failed", "failed_partition": 0, "failed_offset": 1}])
    torn = out / "redrive" / "ledger" / f"run-2-{uuid.uuid4().hex[:4]}.jsonl"
    torn.write_text('{"failed_topic": "items.failed", "failed_partition": 0, "failed_offset": 2}\n{"failed_to')
    with pytest.raises(LedgerCorrupt, match=r"line 2 is not a JSON object"):
        read_ledger(out)


@pytest.mark.broker
@pytest.mark.spark
def test_a_planned_record_gone_after_the_check_is_counted_as_gone(
    spark, broker, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = unique("items")
    create_topics(broker.bootstrap, {items: 1, f"{items}.failed": 1})
    produce(
        broker.bootstrap,
        f"{items}.failed",
        [dead_letter(b"k%d" % n, b"v", original_offset=n, original_topic=items) for n in range(3)],
    )
    common = ["redrive", "--bootstrap", broker.bootstrap, "--main-topics", items, "--out", str(tmp_path)]
    dry = main(common, spark=spark)
    checked = redrive.reviewed_candidates

    def retention_after_the_check(*args: Any) -> Any:
        current, planned = checked(*args)
        return current.where("offset != 1"), planned  # as if retention removed it between the check and the send

    monkeypatch.setattr(redrive, "reviewed_candidates", retention_after_the_check)
    done = main([*common, "--execute", "--plan", dry["plan"]], spark=spark)
    assert done["counts"] == {redrive.SEND: 2, redrive.GONE: 1} and done["sent"] == 2 and done["matched"] == 2
