"""The fetch guard (``app/fetch_guard.py``) on aiokafka's own fetch objects (``PartitionRecords`` over real record
batches, ``FetchResult``, the subscription state), and the consumer thread's handling of what it reports.

The broker cannot hold every kind of undecodable batch (the embedded broker refuses an unknown codec on produce), so
the kinds are built here as bytes and decoded exactly as a fetch response's partition data is; the corrupt CRC on
a real broker, through a real worker, is in ``tests/integration/test_undecodable_batches.py``."""

from __future__ import annotations

import collections
import gzip
import struct
from types import SimpleNamespace
from typing import Any

import aiokafka.codec
import cramjam
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.consumer.fetcher import (
    READ_COMMITTED,
    READ_UNCOMMITTED,
    Fetcher,
    FetchError,
    FetchResult,
    PartitionRecords,
)
from aiokafka.consumer.subscription_state import SubscriptionState
from aiokafka.errors import CorruptRecordException, KafkaError, UnsupportedCodecError
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.structs import TopicPartition

from app.consumer import ReboundConsumerThread
from app.fetch_guard import GuardedFetchResults, GuardedPartitionRecords, guard_fetcher
from rebound.undecodable import UndecodableBatches
from tests.raw_batches import (
    ATTRIBUTES_OFFSET,
    at,
    batch,
    control_batch,
    with_bad_crc,
    with_codec,
    with_crc_fixed,
    with_header_name_not_utf8,
)

TP0 = TopicPartition("items", 0)


def snappy_batch(keys: list[bytes]) -> bytearray:
    return batch([(key, b"v") for key in keys], compression_type=2)


def partition_data(bad: bytes) -> bytes:
    """What a fetch answers for partition 0: records a, b (offsets 0-1), the bad batch (2-3), then e (4)."""
    return at(0, batch([(b"a", b"1"), (b"b", b"2")])) + at(2, bad) + at(4, batch([(b"e", b"5")]))


def fetched(data: bytes, isolation_level: str = READ_UNCOMMITTED) -> tuple[FetchResult, Any, PartitionRecords]:
    subscriptions = SubscriptionState()
    subscriptions.assign_from_user({TP0})
    assignment = subscriptions.subscription.assignment
    assignment.state_value(TP0).seek(0)
    records = PartitionRecords(TP0, MemoryRecords(data), [], 0, None, None, True, isolation_level)
    return FetchResult(TP0, assignment=assignment, partition_records=records, backoff=0), assignment, records


def with_empty_control_batch() -> bytes:
    """A transaction's control batch (offsets 2-3 here) that holds no control record: under read_committed aiokafka
    reads its first record to tell an abort marker from a commit marker."""
    data = control_batch()
    struct.pack_into(">i", data, ATTRIBUTES_OFFSET + 2, 1)  # last offset delta: the batch spans two offsets
    return with_crc_fixed(data)


def corrupt_payload(codec: int) -> Any:
    """An uncompressed batch labelled with a codec Kafka defines, CRC made right: the payload does not decompress."""
    return lambda: with_codec(batch([(b"c", b"3"), (b"d", b"4")]), codec)


BAD_BATCHES: dict[str, tuple[Any, Any, str, str]] = {
    "corrupt CRC": (
        lambda: with_bad_crc(batch([(b"c", b"3"), (b"d", b"4")])),
        CorruptRecordException,
        "Invalid CRC",
        READ_UNCOMMITTED,
    ),
    "unknown codec": (
        lambda: with_codec(batch([(b"c", b"3"), (b"d", b"4")]), 5),
        UnsupportedCodecError,
        "Unknown compression codec 0x05",
        READ_UNCOMMITTED,
    ),
    "corrupt gzip payload": (corrupt_payload(1), gzip.BadGzipFile, "Not a gzipped file", READ_UNCOMMITTED),
    "corrupt snappy payload": (corrupt_payload(2), cramjam.DecompressionError, "snappy", READ_UNCOMMITTED),
    "corrupt lz4 payload": (corrupt_payload(3), cramjam.DecompressionError, "lz4", READ_UNCOMMITTED),
    "corrupt zstd payload": (corrupt_payload(4), cramjam.DecompressionError, "frame descriptor", READ_UNCOMMITTED),
    "header name not UTF-8": (
        lambda: with_header_name_not_utf8([(b"c", b"3"), (b"d", b"4")]),
        UnicodeDecodeError,
        "utf-8",
        READ_UNCOMMITTED,
    ),
    "control batch without records": (
        with_empty_control_batch,
        KafkaError,
        "Control batch did not contain any records",
        READ_COMMITTED,
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD_BATCHES))
async def test_aiokafka_alone_raises_loses_the_records_before_and_never_moves(kind: str) -> None:
    make, error, text, isolation_level = BAD_BATCHES[kind]
    result, assignment, _ = fetched(partition_data(make()), isolation_level)
    with pytest.raises(error, match=text):
        result.getall()
    assert assignment.state_value(TP0).position == 0  # a and b were decoded, then dropped with the error


@pytest.mark.parametrize("kind", sorted(BAD_BATCHES))
async def test_the_guard_returns_the_records_before_and_stops_at_the_batch(kind: str) -> None:
    make, error, text, isolation_level = BAD_BATCHES[kind]
    result, assignment, records = fetched(partition_data(make()), isolation_level)
    calls: list[tuple[TopicPartition, int, int | None, Exception]] = []
    result._partition_records = GuardedPartitionRecords(TP0, records, lambda *call: calls.append(call))
    assert [m.key for m in result.getall()] == [b"a", b"b"]
    assert assignment.state_value(TP0).position == 2  # at the batch's first offset: never past it
    ((tp, offset, next_offset, exc),) = calls
    assert (tp, offset, next_offset) == (TP0, 2, 4)
    assert isinstance(exc, error) and text in str(exc)
    assert not result.has_more()  # the fetcher fetches the partition again (unless paused) from offset 2


async def test_a_missing_codec_library_is_reported_as_aiokafka_words_it(monkeypatch: pytest.MonkeyPatch) -> None:
    result, _, records = fetched(partition_data(bytes(snappy_batch([b"c", b"d"]))))
    monkeypatch.setattr(aiokafka.codec, "cramjam", None)  # as installed without it: the import failed
    calls: list[tuple[TopicPartition, int, int | None, Exception]] = []
    result._partition_records = GuardedPartitionRecords(TP0, records, lambda *call: calls.append(call))
    assert [m.key for m in result.getall()] == [b"a", b"b"]
    ((_, offset, next_offset, exc),) = calls
    assert (offset, next_offset) == (2, 4)
    assert isinstance(exc, UnsupportedCodecError) and "Libraries for snappy compression codec not found" in str(exc)


async def test_the_fetchers_results_are_guarded_as_they_are_stored() -> None:
    result, _, records = fetched(partition_data(bytes(batch([(b"c", b"3")]))))
    earlier, _, _ = fetched(partition_data(bytes(batch([(b"c", b"3")]))))
    fetcher = SimpleNamespace(_records={TopicPartition("items", 1): earlier})
    guard_fetcher(fetcher, lambda *call: None)
    stored = fetcher._records
    assert isinstance(stored, GuardedFetchResults)
    assert isinstance(earlier._partition_records, GuardedPartitionRecords)  # fetched before the guard came
    stored[TP0] = result
    assert isinstance(result._partition_records, GuardedPartitionRecords)
    error = FetchError(error=KafkaError("kept as it is"), backoff=0)
    stored[TopicPartition("items", 2)] = error
    assert stored[TopicPartition("items", 2)] is error
    guard_fetcher(fetcher, lambda *call: None)
    assert fetcher._records is stored  # installed once
    stored[TP0] = result
    assert result._partition_records._records is records  # never wrapped twice


def consumer_thread() -> tuple[ReboundConsumerThread, AIOKafkaConsumer]:
    """The consumer thread's undecodable handling on a real (unstarted) aiokafka consumer with TP0 assigned."""
    thread = ReboundConsumerThread.__new__(ReboundConsumerThread)
    thread.undecodable = UndecodableBatches(retry_interval_s=30)
    kafka = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1")
    kafka.assign([TP0])
    thread._consumer = kafka
    return thread, kafka


async def test_the_thread_pauses_a_stopped_partition_and_fetches_it_again_after_the_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    thread, kafka = consumer_thread()
    try:
        thread._on_undecodable(TP0, 2, 4, CorruptRecordException("Invalid CRC - items[0]"))
        assert kafka.paused() == {TP0}
        (stuck,) = thread.undecodable.snapshot()
        assert (stuck.topic, stuck.partition, stuck.offset, stuck.next_offset) == ("items", 0, 2, 4)
        (line,) = [r for r in caplog.records if "cannot be decoded" in r.getMessage()]
        assert line.levelname == "ERROR" and "items[0] offset 2" in line.getMessage()
        thread.retry_undecodable(stuck.retry_at - 1)
        assert kafka.paused() == {TP0}
        thread.retry_undecodable(stuck.retry_at)
        assert kafka.paused() == set()  # fetched again; still stopped until records reach offset 2
        assert thread.undecodable.is_stuck("items", 0)
        thread._note_decoded({TP0: [SimpleNamespace(offset=2)]})
        assert not thread.undecodable.any_stuck()
    finally:
        await kafka.stop()


async def test_the_thread_resumes_a_due_partition_in_aiokafka_even_while_faust_pauses_it_and_forgets_revoked_ones() -> (
    None
):
    """Faust's pause of a partition (back-pressure, a hold) is kept in Faust's own sets and never reaches aiokafka;
    Faust's resume does not either. So the guard's aiokafka pause is undone here, when a try is due, whoever else
    paused the partition: left paused, it stayed unread for ever after Faust resumed it."""
    thread, kafka = consumer_thread()
    thread.consumer = SimpleNamespace(_paused_partitions={TP0}, _active_partitions=set())  # Faust paused it
    try:
        thread._on_undecodable(TP0, 2, None, CorruptRecordException("Invalid CRC - items[0]"))
        assert kafka.paused() == {TP0}
        (stuck,) = thread.undecodable.snapshot()
        thread.retry_undecodable(stuck.retry_at)
        assert kafka.paused() == set()
        kafka.assign([TopicPartition("items", 1)])
        thread.retry_undecodable(stuck.retry_at + 60)
        assert not thread.undecodable.any_stuck()
    finally:
        await kafka.stop()


async def test_a_partition_faust_pauses_is_fetched_but_neither_decoded_nor_handed_over() -> None:
    """What the resume above relies on, on aiokafka's own ``Fetcher.fetched_records``: Faust passes its active
    partitions only (``Consumer._get_active_partitions``: assigned minus paused), and a fetched result of any other
    assigned partition stays stored, not iterated, so the guard does not fire and nothing reaches Faust; it is
    decoded once Faust resumes the partition."""
    tp1 = TopicPartition("items", 1)
    subscriptions = SubscriptionState()
    subscriptions.assign_from_user({TP0, tp1})
    assignment = subscriptions.subscription.assignment
    assignment.state_value(TP0).seek(0)
    assignment.state_value(tp1).seek(0)
    calls: list[tuple[TopicPartition, int, int | None, Exception]] = []
    fetcher: Any = Fetcher.__new__(Fetcher)
    fetcher._subscriptions = subscriptions
    fetcher._records = collections.OrderedDict()
    fetcher._closed = False
    fetcher._wait_consume_future = None
    guard_fetcher(fetcher, lambda *call: calls.append(call))
    stuck = PartitionRecords(
        TP0, MemoryRecords(partition_data(with_bad_crc(batch([(b"c", b"3")])))), [], 0, None, None, True, 0
    )
    fetcher._records[TP0] = FetchResult(TP0, assignment=assignment, partition_records=stuck, backoff=0)
    other = PartitionRecords(tp1, MemoryRecords(at(0, batch([(b"x", b"1")]))), [], 0, None, None, True, 0)
    fetcher._records[tp1] = FetchResult(tp1, assignment=assignment, partition_records=other, backoff=0)
    drained = await fetcher.fetched_records({tp1}, timeout=0)  # TP0 paused in Faust only
    assert [m.key for m in drained[tp1]] == [b"x"]
    assert TP0 not in drained and TP0 in fetcher._records and calls == []
    assert assignment.state_value(TP0).position == 0
    drained = await fetcher.fetched_records({TP0}, timeout=0)  # Faust resumed it
    assert [m.key for m in drained[TP0]] == [b"a", b"b"]
    assert [(tp, offset) for tp, offset, *_ in calls] == [(TP0, 2)]
