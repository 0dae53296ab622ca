"""Offsets the broker's own answer shows empty, so the read cursors accept a jump over them without reading again.

A partition's offsets are not all records a consumer gets: a transaction's commit or abort marker (a control batch)
takes an offset of its own, and under ``read_committed`` a transaction's aborted batches are skipped too. aiokafka
steps over both while it decodes a fetched partition (``PartitionRecords._unpack_records`` moves its
``next_fetch_offset`` past them), so the records handed over jump. The read cursors (``rebound/read_cursors.py``)
take every jump for records Faust dropped until a fetch after a seek back shows the same jump: one extra read per
transaction marker, and per aborted transaction.

The offsets skipped while one fetched partition is decoded are the broker's answer itself: no record of that answer
was dropped there, because none was yielded. Here each fetched partition's records are wrapped as the fetcher stores
them (the same seam as ``app/fetch_guard.py``, whose results class this one extends); while they are iterated, every
offset range stepped over (from where the previous record ended to the next record, or to where decoding stopped)
is reported, before any record after it reaches Faust. Offsets Faust drops later are never in such a range: they
were yielded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiokafka.consumer.fetcher import FetchResult
from aiokafka.structs import TopicPartition

from app.fetch_guard import GuardedFetchResults, OnUndecodable

OnHole = Callable[[TopicPartition, int, int], None]
"""Called with the partition and the first and last offset (inclusive) of a range that holds no record to hand over."""


class HoleReportingRecords:
    """One fetched partition's records (aiokafka's ``PartitionRecords``, or a wrapper with its surface: an iterator
    and ``next_fetch_offset``), reporting the offsets they step over."""

    __slots__ = ("_on_hole", "_records", "_tp")

    def __init__(self, tp: TopicPartition, records: Any, on_hole: OnHole) -> None:
        self._tp = tp
        self._records = records
        self._on_hole = on_hole

    @property
    def next_fetch_offset(self) -> int:
        return int(self._records.next_fetch_offset)

    def __iter__(self) -> HoleReportingRecords:
        return self

    def __next__(self) -> Any:
        before = self.next_fetch_offset
        try:
            record = next(self._records)
        except StopIteration:
            after = self.next_fetch_offset
            if after > before:  # control or aborted batches at the end of what was fetched
                self._on_hole(self._tp, before, after - 1)
            raise
        if record.offset > before:
            self._on_hole(self._tp, before, record.offset - 1)
        return record


class HoleReportingResults(GuardedFetchResults):
    """The fetcher's ``_records`` with the fetch guard, and each stored ``FetchResult``'s records reporting holes:
    ``HoleReportingRecords(GuardedPartitionRecords(PartitionRecords))``. The other way round, a decode error passed
    through the hole reporting as an exception, and a range stepped over just before the bad batch went unreported
    while the position still moved past it."""

    def __init__(self, on_undecodable: OnUndecodable, on_hole: OnHole, *args: Any) -> None:
        self.on_hole = on_hole  # first: the results already fetched pass through __setitem__ below
        super().__init__(on_undecodable, *args)

    def __setitem__(self, tp: Any, result: Any) -> None:
        # Guarded first, then wrapped here: the guard ends the records quietly at a batch that cannot be decoded,
        # so the offsets stepped over just before it (a transaction marker, an aborted range) are still reported.
        super().__setitem__(tp, result)
        report_holes_of(tp, result, self.on_hole)


def report_holes_of(tp: TopicPartition, result: Any, on_hole: OnHole) -> None:
    if type(result) is not FetchResult:
        return
    records = result._partition_records
    if records is not None and not isinstance(records, HoleReportingRecords):
        result._partition_records = HoleReportingRecords(tp, records, on_hole)


def report_fetch_holes(fetcher: Any, on_undecodable: OnUndecodable, on_hole: OnHole) -> None:
    """Install on an aiokafka ``Fetcher`` (once; it replaces a plain fetch guard, keeping what it holds)."""
    if not isinstance(fetcher._records, HoleReportingResults):
        fetcher._records = HoleReportingResults(on_undecodable, on_hole, fetcher._records)
