"""The record of partitions stopped at a batch that cannot be decoded (``rebound/undecodable.py``)."""

from __future__ import annotations

from rebound.undecodable import UndecodableBatches


def test_a_first_failure_is_logged_and_its_retries_at_most_once_per_interval() -> None:
    batches = UndecodableBatches(retry_interval_s=30)
    first = batches.failed("items", 0, 100, 102, "CorruptRecordException()", now=10.0, now_ms=5)
    assert first.log and first.stuck.failures == 1 and first.stuck.retry_at == 40.0
    again = batches.failed("items", 0, 100, None, "CorruptRecordException()", now=12.0, now_ms=6)
    assert not again.log  # resumed by something else two seconds later: counted, not logged
    assert again.stuck.failures == 2 and again.stuck.next_offset == 102 and again.stuck.since_ms == 5
    assert batches.failed("items", 0, 100, 102, "x", now=41.0, now_ms=7).log
    moved = batches.failed("items", 0, 103, 104, "y", now=42.0, now_ms=8)
    assert moved.log and moved.stuck.failures == 1 and moved.stuck.offset == 103  # another batch: a new stop
    assert batches.failures() == {("items", 0): 4}


def test_each_partition_is_due_once_per_interval() -> None:
    batches = UndecodableBatches(retry_interval_s=30)
    batches.failed("items", 0, 1, 2, "e", now=0.0, now_ms=0)
    batches.failed("items", 1, 5, 6, "e", now=20.0, now_ms=0)
    assert batches.due(29.0) == []
    assert [(s.topic, s.partition) for s in batches.due(30.0)] == [("items", 0)]
    assert batches.due(31.0) == []  # pushed back by the try
    assert [(s.partition) for s in batches.due(60.0)] == [0, 1]


def test_a_partition_is_freed_only_once_records_reach_its_stopping_offset() -> None:
    batches = UndecodableBatches()
    batches.failed("items", 0, 100, 102, "e", now=0.0, now_ms=0)
    assert batches.decoded("items", 0, 99) is None  # the records before the batch, returned with the failure
    assert batches.is_stuck("items", 0)
    freed = batches.decoded("items", 0, 100)
    assert freed is not None and freed.offset == 100
    assert not batches.any_stuck() and batches.snapshot() == ()
    assert batches.failures() == {("items", 0): 1}  # the counter never goes down


def test_partitions_no_longer_assigned_are_forgotten_and_the_snapshot_is_sorted() -> None:
    batches = UndecodableBatches()
    for topic, partition in (("b", 0), ("a", 2), ("a", 1)):
        batches.failed(topic, partition, 7, None, "UnsupportedCodecError()", now=0.0, now_ms=3)
    gone = batches.keep_only([("a", 1), ("a", 2)])
    assert [(s.topic, s.partition) for s in gone] == [("b", 0)]
    assert [s.as_dict() for s in batches.snapshot()] == [
        {
            "topic": "a",
            "partition": partition,
            "offset": 7,
            "next_offset": None,
            "error": "UnsupportedCodecError()",
            "since_ms": 3,
            "failures": 1,
        }
        for partition in (1, 2)
    ]
