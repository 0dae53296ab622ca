"""One partition's undecodable record batch stops that partition only, never the whole fetch.

aiokafka (0.14) decodes fetched batches lazily, while ``Fetcher.fetched_records`` drains partition after partition
into one answer. Decoding bytes already in memory raises many things: ``CorruptRecordException("Invalid CRC -
<tp>")`` when the CRC check fails (``PartitionRecords._unpack_records``, before decompressing),
``UnsupportedCodecError`` when the codec is unknown (attribute bits 5 to 7) or its library is missing (snappy, lz4
and zstd need ``cramjam``), ``gzip.BadGzipFile`` or ``cramjam.DecompressionError`` for a corrupt compressed payload
under a valid CRC, ``UnicodeDecodeError`` for a header name that is not UTF-8 (librdkafka, sarama and franz-go let
a producer write raw bytes there), ``KafkaError("Control batch did not contain any records")`` under
``read_committed``, ``CorruptRecordException`` for a record that does not parse. What that loses:

- the records of the partitions drained before it in the same call (their positions have already moved past them),
  and those of its own partition decoded before the bad batch (the position does not move: they come back, and so
  does the error);
- every later fetch of the partition answers the same batch, so the error comes back once per fetch for ever: a
  ``KafkaError`` stalls every partition of the worker, anything else crashes it (and every worker that takes the
  partition over).

Here every fetched partition's records are wrapped as the fetcher stores them (``fetcher._records``, replaced by a
dict that wraps on insertion): any error while decoding ends that partition's records where the bad batch starts,
the records before it are returned with every other partition's, the fetcher's position stops at the batch's first
offset (never past it), and the consumer thread is told (``on_undecodable``), which pauses the partition in
aiokafka at once, before the fetcher could fetch it again. The batch's own offsets (for the operator who skips it)
come from the record set, wrapped to remember the last batch it handed to the decoder.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from aiokafka.consumer.fetcher import FetchResult, PartitionRecords
from aiokafka.structs import TopicPartition

OnUndecodable = Callable[[TopicPartition, int, "int | None", Exception], None]
"""Called with the partition, the first offset not read, the first offset after the bad batch (None when unknown)
and the error."""


class LastBatchRecords:
    """aiokafka's ``MemoryRecords`` of one fetched partition, remembering the last batch it handed out.

    ``PartitionRecords._unpack_records`` takes batch after batch with ``has_next()`` and ``next_batch()`` and decodes
    each; when decoding fails, the batch that failed is the last one handed out here, and its header (base offset,
    last offset delta) says where it ends. aiokafka's errors do not carry the batch."""

    __slots__ = ("_records", "last_batch")

    def __init__(self, records: Any) -> None:
        self._records = records
        self.last_batch: Any = None

    def has_next(self) -> bool:
        return bool(self._records.has_next())

    def next_batch(self) -> Any:
        self.last_batch = self._records.next_batch()
        return self.last_batch


class GuardedPartitionRecords:
    """aiokafka's ``PartitionRecords`` of one fetched partition, ending where a batch cannot be decoded.

    ``FetchResult`` reads ``next_fetch_offset`` (to check the position and to move it) and iterates: both pass
    through. At a decode error ``next_fetch_offset`` is the first offset not yielded (the bad batch's base offset,
    or the offset of the record that did not decode), which is where the position then stays.

    Wrapped before aiokafka iterates it: the records' generator reads ``PartitionRecords._records`` on its first
    step only, so the record set swapped in here is the one it decodes."""

    __slots__ = ("_batches", "_on_undecodable", "_records", "_tp")

    def __init__(self, tp: TopicPartition, records: Any, on_undecodable: OnUndecodable) -> None:
        self._tp = tp
        self._records = records
        self._on_undecodable = on_undecodable
        self._batches: LastBatchRecords | None = None
        if isinstance(records, PartitionRecords):  # aiokafka's own: anything else has no record set to wrap
            self._batches = LastBatchRecords(records._records)
            records._records = self._batches

    @property
    def next_fetch_offset(self) -> int:
        return int(self._records.next_fetch_offset)

    def __iter__(self) -> GuardedPartitionRecords:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._records)
        except StopIteration:
            raise
        except Exception as exc:  # whatever decoding raised: the bytes will not change by being fetched again
            offset = self.next_fetch_offset
            last_batch = self._batches.last_batch if self._batches is not None else None
            self._on_undecodable(self._tp, offset, batch_end(last_batch, offset), exc)
            raise StopIteration from None


class GuardedFetchResults(collections.OrderedDict[Any, Any]):
    """The fetcher's ``_records``: each ``FetchResult`` stored gets its records guarded (a ``FetchError`` is kept
    as it is: aiokafka raises it to the caller itself, for the partition it names)."""

    def __init__(self, on_undecodable: OnUndecodable, *args: Any) -> None:
        self.on_undecodable = on_undecodable  # first: the results already fetched pass through __setitem__ below
        super().__init__(*args)

    def __setitem__(self, tp: Any, result: Any) -> None:
        guard_result(tp, result, self.on_undecodable)
        super().__setitem__(tp, result)


def batch_end(batch: Any, offset: int) -> int | None:
    """The first offset after ``batch`` (the one that failed at ``offset``), from its header (base offset and last
    offset delta), for the operator who moves the group's offset past it. None when there is no batch or it does not
    hold ``offset`` (a batch too short to read fails before it is handed out: the last one is then the batch
    before). A corrupt header can give a wrong answer: the docs say how to check it."""
    if batch is None:
        return None
    try:
        base, end = int(batch.base_offset), int(batch.next_offset)
    except Exception:  # a header that does not parse either
        return None
    return end if base <= offset < end else None


def guard_result(tp: TopicPartition, result: Any, on_undecodable: OnUndecodable) -> None:
    """Guard the records of a stored ``FetchResult`` (aiokafka's own records only: never wrapped twice)."""
    if type(result) is not FetchResult:
        return
    records = result._partition_records
    if isinstance(records, PartitionRecords):
        result._partition_records = GuardedPartitionRecords(tp, records, on_undecodable)


def guard_fetcher(fetcher: Any, on_undecodable: OnUndecodable) -> None:
    """Install the guard on an aiokafka ``Fetcher`` (once; the fetch task looks ``_records`` up on every use)."""
    if not isinstance(fetcher._records, GuardedFetchResults):
        fetcher._records = GuardedFetchResults(on_undecodable, fetcher._records)
