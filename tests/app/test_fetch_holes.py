"""The offsets aiokafka steps over while decoding one fetched partition are reported before the records after them
are handed over; records it yields never count as such (they may still be dropped by Faust later)."""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import Any

from aiokafka.consumer.fetcher import READ_COMMITTED, FetchResult, PartitionRecords
from aiokafka.consumer.subscription_state import SubscriptionState
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.structs import TopicPartition

from app.fetch_guard import GuardedFetchResults, GuardedPartitionRecords, guard_fetcher
from app.fetch_holes import HoleReportingRecords, HoleReportingResults, report_fetch_holes
from tests.raw_batches import at, control_batch, with_crc_fixed
from tests.raw_batches import batch as raw_batch

TP = TopicPartition("items", 0)


def batch(base: int, count: int) -> bytes:
    return at(base, raw_batch([(b"k", b"v")] * count, timestamp=1))


def partition_records(data: bytes, fetch_offset: int) -> PartitionRecords:
    return PartitionRecords(TP, MemoryRecords(data), [], fetch_offset, None, None, True, READ_COMMITTED)


def test_offsets_between_and_after_the_records_yielded_are_reported_in_order() -> None:
    holes: list[tuple[int, int]] = []
    records = HoleReportingRecords(
        TP, partition_records(batch(0, 3) + batch(5, 2), 0), lambda _, a, b: holes.append((a, b))
    )
    offsets = []
    for record in records:
        offsets.append(record.offset)
        seen_holes = list(holes)
        if record.offset == 5:
            assert seen_holes == [(3, 4)]  # reported before the record after it is handed over
    assert offsets == [0, 1, 2, 5, 6]
    assert holes == [(3, 4)]
    assert records.next_fetch_offset == 7


def test_a_fetch_starting_inside_a_batch_reports_nothing_for_the_records_before_its_offset() -> None:
    holes: list[tuple[int, int]] = []
    records = HoleReportingRecords(TP, partition_records(batch(0, 3), 1), lambda _, a, b: holes.append((a, b)))
    assert [record.offset for record in records] == [1, 2]
    assert holes == []


def installed(holes: list[tuple[int, int]], undecodable: list[Any]) -> tuple[SimpleNamespace, Any]:
    """A fetcher's ``_records`` with the guard and the hole reporting installed as the consumer thread installs them,
    and a subscription state with ``TP`` assigned at offset 0 (aiokafka's own: it moves as records are taken)."""
    fetcher = SimpleNamespace(_records=collections.OrderedDict())
    guard_fetcher(fetcher, lambda *args: undecodable.append(args[:3]))
    report_fetch_holes(fetcher, lambda *args: undecodable.append(args[:3]), lambda _, a, b: holes.append((a, b)))
    assert isinstance(fetcher._records, HoleReportingResults) and isinstance(fetcher._records, GuardedFetchResults)
    subscriptions = SubscriptionState()
    subscriptions.assign_from_user({TP})
    assignment = subscriptions.subscription.assignment
    assignment.state_value(TP).seek(0)
    return fetcher, assignment


def corrupt(data: bytes) -> bytes:
    changed = bytearray(data)
    changed[-1] ^= 0xFF  # a record byte: the CRC no longer matches
    return bytes(changed)


def commit_marker(offset: int) -> bytes:
    """A transaction's commit marker (a control batch of producer 7: key = version 0, type 1) at ``offset``."""
    data = control_batch([(b"\x00\x00\x00\x01", b"\x00\x00\x00\x00\x00\x00")])
    data[0:8] = offset.to_bytes(8, "big")
    return with_crc_fixed(data)


async def test_installed_with_the_fetch_guard_and_a_batch_that_cannot_be_decoded_reports_no_hole() -> None:
    holes: list[tuple[int, int]] = []
    undecodable: list[Any] = []
    fetcher, assignment = installed(holes, undecodable)
    fetcher._records[TP] = FetchResult(
        TP, assignment=assignment, partition_records=partition_records(batch(0, 3) + corrupt(batch(3, 2)), 0), backoff=0
    )
    assert isinstance(fetcher._records[TP]._partition_records, HoleReportingRecords)
    assert [record.offset for record in fetcher._records[TP].getall()] == [0, 1, 2]
    assert holes == []  # the records from 3 on were not read: nothing says they are empty
    assert undecodable == [(TP, 3, 5)]
    assert assignment.state_value(TP).position == 3


async def test_a_marker_just_before_a_batch_that_cannot_be_decoded_is_still_reported() -> None:
    """Records 0-2, a commit marker at 3, a corrupt batch at 4-5: the position moves to 4, and 3 is reported empty
    (wrapped the other way round, the decode error passed through the hole reporting and 3 went unreported)."""
    holes: list[tuple[int, int]] = []
    undecodable: list[Any] = []
    fetcher, assignment = installed(holes, undecodable)
    data = batch(0, 3) + commit_marker(3) + corrupt(batch(4, 2))
    fetcher._records[TP] = FetchResult(
        TP, assignment=assignment, partition_records=partition_records(data, 0), backoff=0
    )
    assert [record.offset for record in fetcher._records[TP].getall()] == [0, 1, 2]
    assert holes == [(3, 3)]
    assert undecodable == [(TP, 4, 6)]
    assert assignment.state_value(TP).position == 4


async def test_results_stored_again_are_wrapped_once() -> None:
    fetcher, assignment = installed([], [])
    result = FetchResult(TP, assignment=assignment, partition_records=partition_records(batch(0, 1), 0), backoff=0)
    fetcher._records[TP] = result
    outer = result._partition_records
    fetcher._records[TP] = result
    report_fetch_holes(fetcher, lambda *args: None, lambda *args: None)
    assert result._partition_records is outer
    assert isinstance(outer._records, GuardedPartitionRecords)
    assert isinstance(outer._records._records, PartitionRecords)
