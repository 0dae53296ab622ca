"""The failed-topic browser: filters, cursors, merging partitions in time order, and the read cap (on a real broker)."""

from __future__ import annotations

import asyncio
import base64
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from app.web.failed import (
    FailedFilter,
    FailedTopicReader,
    PartitionScan,
    browse_filter,
    decode_cursor,
    describe_record,
    encode_cursor,
    merge_page,
)
from demo.embedded_broker import EmbeddedBroker
from demo.harness import create_topics
from rebound import headers as h
from rebound.key_names import KeyNameError


def record(partition: int, offset: int, timestamp: int, key: str = "k") -> dict[str, Any]:
    return {"topic": "t.failed", "partition": partition, "offset": offset, "timestamp": timestamp, "key": key}


@pytest.mark.parametrize(
    ("key", "names"),
    [
        (b"retry-\xff\xfe", {"key": "retry-\\xff\\xfe", "key_base64": "cmV0cnkt__4="}),
        (b"\x00\x00\x00\x00\x07item", {"key": "\x00\x00\x00\x00\x07item", "key_base64": "AAAAAAdpdGVt"}),
        (b"k", {"key": "k"}),
        (None, {"key": None}),
    ],
)
def test_a_browsed_record_names_its_key_as_the_key_view_does(key: bytes | None, names: dict[str, Any]) -> None:
    described = describe_record(
        topic="t.failed", partition=0, offset=1, timestamp_ms=1, key=key, value=b"v", headers={}, show_payloads=False
    )
    assert {name: described[name] for name in described if name.startswith("key")} == names


def test_filter_matches_reason_class_by_bare_or_qualified_name_and_key() -> None:
    headers = {h.REASON: "exhausted", h.ERROR_CLASS: "app.errors.RetryableError"}
    assert FailedFilter().matches(None, {})
    assert FailedFilter(reason="exhausted", error_class="RetryableError", key=b"a").matches(b"a", headers)
    assert FailedFilter(error_class="app.errors.RetryableError").matches(b"a", headers)
    assert not FailedFilter(error_class="Error").matches(b"a", headers)
    assert not FailedFilter(reason="permanent").matches(b"a", headers)
    assert not FailedFilter(key=b"b").matches(b"a", headers)
    assert not FailedFilter(key=b"a").matches(None, headers)
    assert FailedFilter(reason="unknown").matches(b"a", {})


@pytest.mark.parametrize(
    ("query", "key", "echo"),
    [
        ({"key": "retry-é"}, "retry-é".encode(), {"key": "retry-é"}),
        ({"key": "a", "key_encoding": "text"}, b"a", {"key": "a"}),
        (
            {"key": "cmV0cnkt__4=", "key_encoding": "base64"},
            b"retry-\xff\xfe",
            {"key": "retry-\\xff\\xfe", "key_base64": "cmV0cnkt__4="},
        ),
        ({"key": "cmV0cnkt//4", "key_encoding": "base64"}, b"retry-\xff\xfe", {"key": "retry-\\xff\\xfe"}),
        ({"key": "", "key_encoding": "base64", "reason": "exhausted"}, None, {"key": None}),
        ({"key_encoding": "base64", "reason": "exhausted"}, None, {"key": None}),
    ],
)
def test_the_browse_key_is_named_by_its_text_or_by_the_base64_of_its_bytes(
    query: dict[str, str], key: bytes | None, echo: dict[str, str | None]
) -> None:
    wanted = browse_filter(query)
    assert wanted.key == key
    assert echo.items() <= wanted.to_dict().items()  # the answer echoes the key as the key view names it


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ({"key": "abc", "key_encoding": "hex"}, "key_encoding must be one of text, base64, not 'hex'"),
        ({"reason": "exhausted", "key_encoding": "hex"}, "key_encoding must be one of text, base64"),
        ({"key": "not$base64", "key_encoding": "base64"}, "not a base64 character"),
        ({"key": "QR==", "key_encoding": "base64"}, "stray trailing bits"),
    ],
)
def test_a_browse_key_that_names_no_key_or_an_unknown_encoding_is_refused(query: dict[str, str], says: str) -> None:
    with pytest.raises(KeyNameError, match=says):
        browse_filter(query)


def test_cursor_round_trips_and_refuses_anything_else() -> None:
    positions = {"items.failed": {0: 12, 3: 0}, "pay.failed": {1: 7}}
    assert decode_cursor(encode_cursor(positions)) == positions

    def raw(text: str) -> str:
        return base64.urlsafe_b64encode(text.encode()).decode()

    bad = ["", "!!", raw("null"), raw("[1]"), raw('{"t": 3}'), raw('{"t": {"0": -1}}'), raw('{"t": {"x": 1}}')]
    for text in [*bad, raw('{"t": {"0": true}}'), raw('{"t": {"0": 1.5}}')]:
        with pytest.raises(ValueError):
            decode_cursor(text)


def test_merge_takes_the_newest_across_partitions_and_keeps_the_rest_behind_the_cursor() -> None:
    a = PartitionScan("t.failed", 0, start=0, upper=10, lo=0, matches=[record(0, 9, 90), record(0, 5, 50)])
    b = PartitionScan("t.failed", 1, start=0, upper=8, lo=0, matches=[record(1, 7, 70), record(1, 2, 20)])
    page, positions, more, ordered = merge_page([a, b], limit=3)
    assert [(r["partition"], r["offset"]) for r in page] == [(0, 9), (1, 7), (0, 5)]
    assert positions == {"t.failed": {0: 0, 1: 7}} and more and ordered
    page, positions, more, _ = merge_page([a, b], limit=10)
    assert len(page) == 4 and positions == {"t.failed": {0: 0, 1: 0}} and not more


def test_a_partition_cut_short_holds_back_older_matches_of_the_others() -> None:
    # Partition 0 was read only down to offset 40 (ts 50) without a match: its unread part may be newer than 40.
    cut = PartitionScan("t.failed", 0, start=0, upper=100, lo=40, frontier_ms=50)
    done = PartitionScan("t.failed", 1, start=0, upper=5, lo=0, matches=[record(1, 4, 60), record(1, 3, 30)])
    page, positions, more, ordered = merge_page([cut, done], limit=5)
    assert [r["offset"] for r in page] == [4] and ordered
    assert positions == {"t.failed": {0: 40, 1: 4}} and more
    # When that leaves nothing, the page takes them anyway: every request makes progress.
    only_old = PartitionScan("t.failed", 1, start=0, upper=5, lo=0, matches=[record(1, 3, 30)])
    page, positions, _, ordered = merge_page([cut, only_old], limit=5)
    assert [r["offset"] for r in page] == [3] and not ordered and positions["t.failed"] == {0: 40, 1: 0}


def test_a_window_with_more_matches_than_a_page_moves_lo_up_to_the_oldest_kept() -> None:
    scan = PartitionScan("t.failed", 0, start=0, upper=10, lo=10)
    scan.add_window(0, [record(0, o, o) for o in range(10)], first_ms=0, limit=4)
    assert [r["offset"] for r in scan.matches] == [9, 8, 7, 6] and scan.lo == 6 and scan.frontier_ms == 6
    assert not scan.exhausted


def test_a_partition_not_read_at_all_makes_the_page_unordered() -> None:
    # Partition 0 has unread records and none read (the cap came first): they may be newer than anything shown.
    unread = PartitionScan("t.failed", 0, start=0, upper=100, lo=100)
    done = PartitionScan("t.failed", 1, start=0, upper=5, lo=0, matches=[record(1, 4, 60), record(1, 3, 30)])
    page, positions, more, ordered = merge_page([unread, done], limit=5)
    assert [r["offset"] for r in page] == [4, 3] and not ordered
    assert positions == {"t.failed": {0: 100, 1: 0}} and more


class FakeBrowser:
    """aiokafka's consumer as the browser uses it, over one partition of ``count`` records; while ``slow``, a fetch
    delivers at most ``slow`` records from where the window was sought, then nothing (a broker too slow to answer)."""

    def __init__(
        self, tp: Any, count: int, *, slow: int | None = None, known: bool = True, keys: dict[int, bytes] | None = None
    ) -> None:
        self.tp, self.count, self.slow, self.known = tp, count, slow, known
        self.keys = keys or {}  # offset -> key (else b"k")
        self.position_at = 0
        self.sought = 0
        self._client = SimpleNamespace(force_metadata_update=self.metadata_update)

    async def metadata_update(self) -> None:
        self.known = True

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return {0} if self.known and topic == self.tp.topic else None

    def assign(self, partitions: list[Any]) -> None:
        assert partitions == [self.tp]

    def seek(self, tp: Any, offset: int) -> None:
        self.position_at = self.sought = offset

    async def getmany(self, tp: Any, timeout_ms: int, max_records: int) -> dict[Any, list[Any]]:
        stop = self.count if self.slow is None else min(self.count, self.sought + self.slow)
        offsets = range(self.position_at, min(stop, self.position_at + max_records))
        self.position_at = max(self.position_at, offsets.stop)
        return (
            {
                tp: [
                    SimpleNamespace(
                        offset=o,
                        timestamp=1_000 + o,
                        key=self.keys.get(o, b"k"),
                        value=b"v",
                        headers=[(h.REASON, b"exhausted")],
                    )
                    for o in offsets
                ]
            }
            if offsets
            else {}
        )

    async def position(self, tp: Any) -> int:
        return self.position_at

    async def beginning_offsets(self, parts: list[Any]) -> dict[Any, int]:
        return dict.fromkeys(parts, 0)

    async def end_offsets(self, parts: list[Any]) -> dict[Any, int]:
        return dict.fromkeys(parts, self.count)


def fake_reader(browser: FakeBrowser, *, discovered: bool = True) -> FailedTopicReader:
    reader = FailedTopicReader("unused:9092", [browser.tp.topic])
    reader._browser = browser
    reader._browse_partitions = [browser.tp] if discovered else []
    return reader


async def test_a_window_the_broker_does_not_deliver_whole_is_dropped_not_skipped() -> None:
    from aiokafka import TopicPartition

    tp = TopicPartition("t.failed", 0)
    browser = FakeBrowser(tp, 10, slow=3)  # offsets 0..2 of the window [0, 10) arrive, then nothing
    reader = fake_reader(browser)
    page = await reader.browse(wanted=FailedFilter(), limit=20)
    assert page["records"] == [] and page["scan_capped"] and not page["ordered"]
    assert page["next_before"] is not None and decode_cursor(page["next_before"]) == {"t.failed": {0: 10}}
    browser.slow = None  # the broker catches up: the next page reads the whole window
    page = await reader.browse(wanted=FailedFilter(), before=decode_cursor(page["next_before"]), limit=20)
    assert [r["offset"] for r in page["records"]] == list(range(9, -1, -1))
    assert not page["scan_capped"] and page["ordered"] and page["next_before"] is None


async def test_a_failed_topic_unknown_at_first_open_is_browsed_once_its_metadata_arrives() -> None:
    from aiokafka import TopicPartition

    tp = TopicPartition("t.failed", 0)
    browser = FakeBrowser(tp, 2, known=False)
    reader = fake_reader(browser, discovered=False)  # the first open found no partitions
    page = await reader.browse(wanted=FailedFilter(), limit=5)
    assert [r["offset"] for r in page["records"]] == [1, 0] and reader._browse_partitions == [tp]


async def test_a_key_that_is_not_utf8_is_browsed_by_its_bytes_not_by_the_text_shown_for_it() -> None:
    """Reported: ``?key=...&key_encoding=base64`` searched for the base64 text, and the text a view shows for a key
    that is not UTF-8 (``retry-\\xff\\xfe``) matched that key as well as the key holding those backslashes."""
    from aiokafka import TopicPartition

    tp = TopicPartition("t.failed", 0)
    reader = fake_reader(FakeBrowser(tp, 8, keys={2: b"retry-\xff\xfe", 5: b"retry-\\xff\\xfe", 6: b"cmV0cnkt__4="}))
    page = await reader.browse(wanted=browse_filter({"key": "cmV0cnkt__4=", "key_encoding": "base64"}), limit=5)
    assert [(r["offset"], r["key_base64"]) for r in page["records"]] == [(2, "cmV0cnkt__4=")]
    assert page["filters"]["key_base64"] == "cmV0cnkt__4="
    page = await reader.browse(wanted=browse_filter({"key": "retry-\\xff\\xfe"}), limit=5)
    assert [r["offset"] for r in page["records"]] == [5]  # its text names the key holding the backslashes only


REASONS = ("exhausted", "permanent", "undecodable")
CLASSES = ("app.errors.RetryableError", "ValueError")


async def produce_failed(bootstrap: str, topic: str, count: int, partitions: int) -> list[dict[str, Any]]:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    made = []
    try:
        for index in range(count):
            key = f"key-{index % 7}"
            headers = [
                (h.REASON, REASONS[index % 3].encode()),
                (h.ERROR_CLASS, CLASSES[index % 2].encode()),
                (h.ERROR_MESSAGE, f"failure {index}".encode()),
            ]
            meta = await producer.send_and_wait(
                topic,
                key=key.encode(),
                value=b"secret payload",
                headers=headers,
                partition=index % partitions,
                timestamp_ms=1_700_000_000_000 + index,
            )
            made.append({"index": index, "key": key, "partition": meta.partition, "offset": meta.offset})
    finally:
        await producer.stop()
    return made


async def page_through(reader: FailedTopicReader, wanted: FailedFilter, limit: int, **kwargs: Any) -> list[Any]:
    pages = []
    before = None
    for _ in range(500):
        page = await reader.browse(wanted=wanted, before=before, limit=limit, **kwargs)
        pages.append(page)
        if page["next_before"] is None:
            return pages
        before = decode_cursor(page["next_before"])
    raise AssertionError("paging never ended")


@pytest.mark.broker
def test_browse_pages_through_a_real_topic_newest_first_without_gaps_or_repeats(broker: EmbeddedBroker) -> None:
    topic = f"browse-{uuid.uuid4().hex[:8]}.failed"
    partitions, count = 3, 240

    async def run() -> None:
        await create_topics(broker.bootstrap, [topic], partitions)
        made = await produce_failed(broker.bootstrap, topic, count, partitions)
        reader = FailedTopicReader(broker.bootstrap, [topic], fetch_max_wait_ms=100)
        try:
            # No filter: every record once, newest first, across partitions.
            pages = await page_through(reader, FailedFilter(), limit=25)
            seen = [r["headers"][h.ERROR_MESSAGE] for page in pages for r in page["records"]]
            assert seen == [f"failure {i}" for i in range(count - 1, -1, -1)]
            assert all(len(page["records"]) <= 25 and not page["scan_capped"] for page in pages)
            assert "value" not in pages[0]["records"][0] and pages[0]["records"][0]["value_bytes"] == 14

            # Filters, server-side: reason and error class (bare name) and key.
            wanted = FailedFilter(reason="permanent", error_class="RetryableError", key=b"key-3")
            expected = [
                m["index"]
                for m in reversed(made)
                if m["index"] % 3 == 1 and m["index"] % 2 == 0 and m["key"] == "key-3"
            ]
            pages = await page_through(reader, wanted, limit=2)
            got = [int(r["headers"][h.ERROR_MESSAGE].split()[1]) for page in pages for r in page["records"]]
            assert got == expected and len(expected) >= 3

            # A rare match with a small read cap: pages say the cap was hit, and the cursor carries on to it.
            oldest = made[0]
            pages = await page_through(
                reader, FailedFilter(key=oldest["key"].encode(), reason="exhausted"), 1, scan_cap=40
            )
            assert any(page["scan_capped"] for page in pages)
            assert all(page["scanned"] <= 40 for page in pages)
            found = [r for page in pages for r in page["records"]]
            assert found[-1]["offset"] == oldest["offset"] and found[-1]["partition"] == oldest["partition"]

            # Payloads only when switched on; the summary reader still works next to the browser.
            page = await reader.browse(wanted=FailedFilter(), limit=1, show_payloads=True)
            assert page["records"][0]["value"] == "secret payload"
            summary = await reader.summary()
            assert summary["topics"][topic]["depth"] == count
        finally:
            await reader.close()

    asyncio.run(run())
