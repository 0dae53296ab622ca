"""``GET /retry/failed``: what is on each main topic's failed topic, read incrementally and bounded.

Depth is not taken from ``ListOffsets(latest)``: the embedded broker answers it with the base offset of the last
batch plus one, which undercounts multi-record batches. Instead the reader keeps one group-less consumer per worker
whose position only moves forward: it reads what arrived since the last request (at most ``limit`` records per
request) and folds each record's headers into running counts. Once caught up, its position is the true end, so
``depth = position - start`` (``start`` from ``ListOffsets(earliest)``, which is reliable). Results are cached for a
few seconds, so a dashboard polling every worker does not turn into a read storm.

The counts by reason/class/topic cover the records read since this worker started; after retention deleted old
records they may exceed ``depth`` (which is always exact once caught up).

Browsing (``?reason=&error_class=&key=&key_encoding=&topic=&before=&limit=``): a page of records, newest first, filtered on the
server. It reads backwards from a cursor (``before``: per partition, the offset below which the next page starts;
opaque to clients) in windows, round-robin over the partitions, and never more than ``SCAN_CAP`` records or
``READ_BUDGET_S`` per request: a rare filter over a deep topic answers with fewer records (``scan_capped: true``) and
a cursor to go on from, instead of reading the whole topic. No record is skipped or shown twice while paging: a
partition's cursor only moves past records that were either shown or did not match, and a window the broker did not
deliver whole in time is dropped (the partition's cursor stays, the answer says ``scan_capped``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import heapq
import json
import logging
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agents.readers import groupless_consumer, topic_partitions
from rebound import headers as h
from rebound.key_names import KEY_ENCODING_PARAM, KEY_ENCODINGS, key_names, key_of_name

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 5_000
MAX_LIMIT = 100_000
LATEST = 20
CACHE_TTL_S = 3.0
READ_BUDGET_S = 3.0
MAX_SHOWN_VALUE_BYTES = 4096
DEFAULT_PAGE = 20
MAX_PAGE = 200
SCAN_CAP = 5_000
"""Records one browse request reads at most, over every partition (plus ``READ_BUDGET_S`` of time)."""
BROWSE_WINDOW = 500
"""Records read from one partition in one go while browsing backwards."""
BROWSE_PARAMS = ("reason", "error_class", "key", "topic", "before")
"""Any of these makes ``GET /retry/failed`` a browse request (a page of records) instead of the summary."""


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", errors="backslashreplace")


def _names(key: bytes | None) -> dict[str, str | None]:
    """A record's key as the key view names it: its text, and ``key_base64`` when the text does not name it
    (``rebound/key_names.py``); ``key: null`` for a null key."""
    return {"key": None} if key is None else dict(key_names(key))


@dataclass
class FailedTopicSummary:
    """Running counts over the records of one failed topic (pure: fed record by record)."""

    topic: str
    latest_size: int = LATEST
    counted: int = 0
    by_reason: Counter[str] = field(default_factory=Counter)
    by_error_class: Counter[str] = field(default_factory=Counter)
    by_original_topic: Counter[str] = field(default_factory=Counter)
    oldest_ms: int | None = None
    newest_ms: int | None = None
    latest: deque[dict[str, Any]] = field(default_factory=deque)

    def add(
        self,
        *,
        partition: int,
        offset: int,
        timestamp_ms: int,
        key: bytes | None,
        value: bytes | None,
        headers: Iterable[h.Header],
    ) -> None:
        pairs = list(headers)
        named = dict(pairs)
        reason = _text(named.get(h.REASON)) or "unknown"
        error_class = _text(named.get(h.ERROR_CLASS)) or "unknown"
        original = _text(named.get(h.ORIGINAL_TOPIC)) or "unknown"
        self.counted += 1
        self.by_reason[reason] += 1
        self.by_error_class[error_class] += 1
        self.by_original_topic[original] += 1
        if timestamp_ms:
            self.oldest_ms = timestamp_ms if self.oldest_ms is None else min(self.oldest_ms, timestamp_ms)
            self.newest_ms = timestamp_ms if self.newest_ms is None else max(self.newest_ms, timestamp_ms)
        self.latest.append(
            {
                "partition": partition,
                "offset": offset,
                "timestamp": timestamp_ms,
                **_names(key),
                "value_bytes": None if value is None else len(value),
                "headers": {name: _text(raw) for name, raw in pairs},
                "_value": value,
            }
        )
        while len(self.latest) > self.latest_size:
            self.latest.popleft()

    def to_dict(self, *, show_payloads: bool = False) -> dict[str, Any]:
        latest = []
        for item in reversed(self.latest):  # newest first
            shown = {name: value for name, value in item.items() if name != "_value"}
            if show_payloads:
                value = item["_value"]
                shown["value"] = None if value is None else _text(value[:MAX_SHOWN_VALUE_BYTES])
            latest.append(shown)
        return {
            "counted": self.counted,
            "by_reason": dict(self.by_reason.most_common()),
            "by_error_class": dict(self.by_error_class.most_common()),
            "by_original_topic": dict(self.by_original_topic.most_common()),
            "oldest_record": self.oldest_ms,
            "newest_record": self.newest_ms,
            "latest": latest,
        }


def depth(start: Mapping[int, int], position: Mapping[int, int]) -> int:
    """Records currently on the topic: per partition, the read position (the end, once caught up) minus the start."""
    return sum(max(0, position.get(partition, begin) - begin) for partition, begin in start.items())


def _header_texts(pairs: Iterable[h.Header]) -> dict[str, str | None]:
    return {name: _text(raw) for name, raw in pairs}


@dataclass(frozen=True)
class FailedFilter:
    """What a browse request keeps: exact reason, error class (qualified, or its bare name) and key (its bytes)."""

    reason: str | None = None
    error_class: str | None = None
    key: bytes | None = None

    def matches(self, key: bytes | None, headers: Mapping[str, str | None]) -> bool:
        if self.reason is not None and (headers.get(h.REASON) or "unknown") != self.reason:
            return False
        if self.error_class is not None:
            found = headers.get(h.ERROR_CLASS) or "unknown"
            if found != self.error_class and not found.endswith("." + self.error_class):
                return False
        return self.key is None or key == self.key

    def to_dict(self) -> dict[str, str | None]:
        """The filter as the answer echoes it: the key named as the key view names it (``key_base64`` too when its
        text does not name it)."""
        return {"reason": self.reason, "error_class": self.error_class, **_names(self.key)}


def browse_filter(query: Mapping[str, str]) -> FailedFilter:
    """The filter of a browse request's parameters: ``key`` is the key's text (its UTF-8 bytes) or, with
    ``key_encoding=base64``, the base64 of its bytes, as in the key view (``rebound/key_names.py``); an empty parameter
    filters nothing. :class:`rebound.key_names.KeyNameError` for a key name that names no key or an unknown
    ``key_encoding`` (the view answers 400)."""
    name = query.get("key") or None
    encoding = query.get(KEY_ENCODING_PARAM)
    if encoding not in (None, *KEY_ENCODINGS):  # refused without a key too, as key_of_name refuses it
        key_of_name("", encoding)
    return FailedFilter(
        reason=query.get("reason") or None,
        error_class=query.get("error_class") or None,
        key=None if name is None else key_of_name(name, encoding),
    )


Positions = dict[str, dict[int, int]]
"""Failed topic -> partition -> offset: where the next (older) page starts, exclusive."""


def encode_cursor(positions: Mapping[str, Mapping[int, int]]) -> str:
    data = {topic: {str(p): int(o) for p, o in sorted(parts.items())} for topic, parts in sorted(positions.items())}
    raw = json.dumps(data, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(text: str) -> Positions:
    """The positions of an ``encode_cursor`` string; ``ValueError`` for anything else."""
    try:
        data = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError) as exc:
        raise ValueError("not a cursor of /retry/failed") from exc
    if not isinstance(data, dict):
        raise ValueError("not a cursor of /retry/failed")
    positions: Positions = {}
    for topic, parts in data.items():
        if not isinstance(parts, dict):
            raise ValueError("not a cursor of /retry/failed")
        for partition, offset in parts.items():
            if not (isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0):
                raise ValueError("not a cursor of /retry/failed")
            try:
                positions.setdefault(str(topic), {})[int(partition)] = offset
            except ValueError as exc:
                raise ValueError("not a cursor of /retry/failed") from exc
    return positions


def describe_record(
    *,
    topic: str,
    partition: int,
    offset: int,
    timestamp_ms: int,
    key: bytes | None,
    value: bytes | None,
    headers: Mapping[str, str | None],
    show_payloads: bool,
) -> dict[str, Any]:
    """One failed record as a browse page shows it: key (named as the key view names it) and headers as text, the
    value only if switched on."""
    described: dict[str, Any] = {
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "timestamp": timestamp_ms,
        **_names(key),
        "value_bytes": None if value is None else len(value),
        "headers": dict(headers),
    }
    if show_payloads:
        described["value"] = None if value is None else _text(value[:MAX_SHOWN_VALUE_BYTES])
    return described


@dataclass
class PartitionScan:
    """One partition of a browse request, read backwards from ``upper`` (exclusive) in windows.

    Invariant: every record in ``[lo, upper)`` has been read, and the ones that match are in ``matches`` (newest,
    i.e. highest offset, first). At most ``limit`` matches are kept: when a window brings more, ``lo`` moves up to
    the oldest kept one, so the records below it are read again by the next page rather than skipped."""

    topic: str
    partition: int
    start: int
    upper: int
    lo: int
    matches: list[dict[str, Any]] = field(default_factory=list)
    frontier_ms: int | None = None
    """Timestamp of the record at ``lo`` (the oldest read): older unread records are taken to be older than it."""

    @property
    def exhausted(self) -> bool:
        return self.lo <= self.start

    def add_window(self, low: int, matches: list[dict[str, Any]], first_ms: int | None, limit: int) -> None:
        """Matches (ascending offsets) of the window ``[low, lo)`` just read, and the timestamp of its first record."""
        self.matches.extend(reversed(matches))
        self.lo = low
        if first_ms is not None:
            self.frontier_ms = first_ms
        if len(self.matches) > limit:
            del self.matches[limit:]
            self.lo = self.matches[-1]["offset"]
            self.frontier_ms = self.matches[-1]["timestamp"]


def merge_page(scans: list[PartitionScan], limit: int) -> tuple[list[dict[str, Any]], Positions, bool, bool]:
    """The page (newest first over every partition), the positions the next page starts from, whether there is
    anything older, and whether the page is in exact time order.

    A partition whose reading stopped early (the cap) may hold unread records newer than another partition's
    matches, so only matches at least as new as its last read record are taken; if that leaves the page empty the
    matches are taken anyway (progress before order) and ``ordered`` is false. Whatever is not taken stays behind
    the partition's position: the next page shows it.

    A partition with unread records and no record read yet (the cap or the time ran out before it, or the broker
    answered nothing in time) bounds nothing: its unread records may be newer than any match, so the page is not
    known to be in order (``ordered`` false); the other partitions' frontiers still bound what is taken."""
    unbounded = False
    bounded = []
    for scan in scans:
        if scan.exhausted or len(scan.matches) >= limit:
            continue
        if scan.frontier_ms is None:
            unbounded = True
        else:
            bounded.append(scan.frontier_ms)
    frontier = max(bounded, default=None)
    taken = [0] * len(scans)
    heap: list[tuple[int, int, int]] = []
    for index, scan in enumerate(scans):
        if scan.matches:
            heapq.heappush(heap, (-scan.matches[0]["timestamp"], -scan.matches[0]["offset"], index))
    page: list[dict[str, Any]] = []

    def fill(bound: int | None) -> None:
        while heap and len(page) < limit:
            negative_ts, _, index = heap[0]
            if bound is not None and -negative_ts < bound:
                return
            heapq.heappop(heap)
            scan = scans[index]
            page.append(scan.matches[taken[index]])
            taken[index] += 1
            if taken[index] < len(scan.matches):
                following = scan.matches[taken[index]]
                heapq.heappush(heap, (-following["timestamp"], -following["offset"], index))

    fill(frontier)
    ordered = not unbounded
    if not page and heap:
        fill(None)
        ordered = False
    positions: Positions = {}
    more = False
    for index, scan in enumerate(scans):
        if taken[index] == len(scan.matches):
            before = scan.lo
        elif taken[index]:
            before = scan.matches[taken[index] - 1]["offset"]
        else:
            before = scan.upper
        positions.setdefault(scan.topic, {})[scan.partition] = before
        more = more or before > scan.start
    return page, positions, more, ordered


class FailedTopicReader:
    """One group-less consumer per worker over every failed topic; never joins the app's consumer group."""

    def __init__(self, bootstrap: str, topics: Iterable[str], *, fetch_max_wait_ms: int = 100) -> None:
        self.bootstrap = bootstrap
        self.topics = list(topics)
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.summaries = {topic: FailedTopicSummary(topic) for topic in self.topics}
        self._consumer: Any = None
        self._partitions: list[Any] = []
        self._lock = asyncio.Lock()
        self._cached: tuple[float, dict[str, Any]] | None = None
        self._browser: Any = None
        self._browse_partitions: list[Any] = []
        self._browse_lock = asyncio.Lock()

    async def _open(self) -> tuple[Any, list[Any]]:
        """A started group-less consumer and every partition of the failed topics (none assigned yet)."""

        consumer = groupless_consumer(
            self.bootstrap, auto_offset_reset="earliest", fetch_max_wait_ms=self.fetch_max_wait_ms
        )
        try:
            await consumer.start()  # (inside: a start that fails is stopped too, or each retry leaks a client)
            partitions = await self._discover(consumer, self.topics, tries=20)
        except BaseException:
            await consumer.stop()
            raise
        return consumer, partitions

    @staticmethod
    async def _discover(consumer: Any, topics: Iterable[str], *, tries: int) -> list[Any]:
        """The partitions of ``topics`` the metadata knows, asking again (``tries`` times, 0.1 s apart) for a topic
        it does not know yet."""
        from aiokafka import TopicPartition

        partitions = []
        for topic in topics:
            found = await topic_partitions(consumer, topic, tries=tries, every_s=0.1)
            partitions += [TopicPartition(topic, p) for p in sorted(found)]
        return partitions

    async def _start(self) -> None:
        consumer, partitions = await self._open()
        try:
            consumer.assign(partitions)
            if partitions:
                await consumer.seek_to_beginning(*partitions)
        except BaseException:
            await consumer.stop()
            raise
        self._consumer, self._partitions = consumer, partitions

    async def close(self) -> None:
        for name in ("_consumer", "_browser"):
            consumer = getattr(self, name)
            if consumer is not None:
                with contextlib.suppress(Exception):
                    await consumer.stop()
                setattr(self, name, None)

    async def _read(self, limit: int) -> tuple[int, bool]:
        """Read up to ``limit`` new records; returns how many and whether the consumer is caught up."""
        read = 0
        deadline = time.monotonic() + READ_BUDGET_S
        while read < limit and time.monotonic() < deadline:
            batch = await self._consumer.getmany(
                timeout_ms=2 * self.fetch_max_wait_ms, max_records=min(500, limit - read)
            )
            if not batch:
                return read, True
            for tp, messages in batch.items():
                summary = self.summaries[tp.topic]
                for message in messages:
                    summary.add(
                        partition=tp.partition,
                        offset=message.offset,
                        timestamp_ms=message.timestamp or 0,
                        key=message.key,
                        value=message.value,
                        headers=message.headers or (),
                    )
                    read += 1
        return read, False

    async def summary(self, *, limit: int = DEFAULT_LIMIT, show_payloads: bool = False) -> dict[str, Any]:
        limit = max(1, min(limit, MAX_LIMIT))
        async with self._lock:
            if self._cached is not None and time.monotonic() - self._cached[0] < CACHE_TTL_S:
                return {**self._cached[1], "cached": True}
            if self._consumer is None:
                await self._start()
            read, caught_up = await self._read(limit)
            starts = await self._consumer.beginning_offsets(self._partitions) if self._partitions else {}
            topics: dict[str, Any] = {}
            for topic, summary in self.summaries.items():
                start = {tp.partition: offset for tp, offset in starts.items() if tp.topic == topic}
                position = {
                    tp.partition: await self._consumer.position(tp) for tp in self._partitions if tp.topic == topic
                }
                highwater = {tp.partition: self._consumer.highwater(tp) for tp in self._partitions if tp.topic == topic}
                topics[topic] = {
                    "depth": depth(start, position),
                    "partitions": {
                        str(p): {"start": start.get(p), "position": position.get(p), "highwater": highwater.get(p)}
                        for p in sorted(position)
                    },
                    **summary.to_dict(show_payloads=show_payloads),
                }
            result = {"read_this_request": read, "caught_up": caught_up, "limit": limit, "topics": topics}
            self._cached = (time.monotonic(), result)
            return {**result, "cached": False}

    async def _known_ends(self) -> dict[tuple[str, int], int]:
        """The summary consumer's positions: the true end once it is caught up (the embedded broker's
        ``ListOffsets(latest)`` can answer lower), else a lower bound that changes nothing."""
        known: dict[tuple[str, int], int] = {}
        if self._consumer is None:
            return known
        for tp in self._partitions:
            with contextlib.suppress(Exception):
                known[(tp.topic, tp.partition)] = await self._consumer.position(tp)
        return known

    async def _read_window(
        self, tp: Any, low: int, high: int, wanted: FailedFilter, show_payloads: bool
    ) -> tuple[list[dict[str, Any]], int | None, int, bool]:
        """Read ``[low, high)`` of one partition: its matches (ascending), the first record's timestamp, how many
        were read, and whether the window was read whole (the fetcher got to ``high``). A window not read whole (the
        broker answered nothing three polls running) must be dropped: taken, it would leave a hole below the
        partition's cursor."""
        consumer = self._browser
        consumer.assign([tp])
        consumer.seek(tp, low)
        matches: list[dict[str, Any]] = []
        first_ms: int | None = None
        read = empties = 0
        while True:
            batch = await consumer.getmany(
                tp, timeout_ms=2 * self.fetch_max_wait_ms, max_records=max(1, min(500, high - low))
            )
            messages = batch.get(tp, [])
            for message in messages:
                if message.offset >= high:
                    return matches, first_ms, read, True
                read += 1
                timestamp = message.timestamp or 0
                if first_ms is None:
                    first_ms = timestamp
                headers = _header_texts(message.headers or ())
                if wanted.matches(message.key, headers):
                    matches.append(
                        describe_record(
                            topic=tp.topic,
                            partition=tp.partition,
                            offset=message.offset,
                            timestamp_ms=timestamp,
                            key=message.key,
                            value=message.value,
                            headers=headers,
                            show_payloads=show_payloads,
                        )
                    )
            if messages and messages[-1].offset >= high - 1:
                return matches, first_ms, read, True
            if not messages:
                if await consumer.position(tp) >= high:  # the rest held no records (a gap): read whole
                    return matches, first_ms, read, True
                empties += 1
                if empties >= 3:  # a slow broker (or the end below what was reported): not read whole
                    return matches, first_ms, read, False

    async def browse(
        self,
        *,
        wanted: FailedFilter,
        topics: Iterable[str] | None = None,
        before: Mapping[str, Mapping[int, int]] | None = None,
        limit: int = DEFAULT_PAGE,
        show_payloads: bool = False,
        scan_cap: int = SCAN_CAP,
    ) -> dict[str, Any]:
        """A page of the failed records matching ``wanted``, newest first, older than ``before`` (a decoded cursor;
        None: from the end). Reads at most ``scan_cap`` records and about ``READ_BUDGET_S``."""
        limit = max(1, min(limit, MAX_PAGE))
        scan_cap = max(1, scan_cap)
        chosen = None if topics is None else set(topics)
        names = [topic for topic in self.topics if chosen is None or topic in chosen]
        async with self._browse_lock:
            if self._browser is None:
                self._browser, self._browse_partitions = await self._open()
            known_topics = {tp.topic for tp in self._browse_partitions}
            missing = [topic for topic in names if topic not in known_topics]
            if missing:  # its metadata had not arrived yet: asked again (briefly) on every request until it has
                self._browse_partitions += await self._discover(self._browser, missing, tries=1)
            parts = [tp for tp in self._browse_partitions if tp.topic in names]
            scans: list[PartitionScan] = []
            if parts:
                starts = await self._browser.beginning_offsets(parts)
                ends = await self._browser.end_offsets(parts)
                known = await self._known_ends()
                for tp in parts:
                    start = starts[tp]
                    end = max(ends[tp], known.get((tp.topic, tp.partition), 0))
                    cursor = None if before is None else before.get(tp.topic, {}).get(tp.partition)
                    upper = max(start, end if cursor is None else min(cursor, end))
                    scans.append(PartitionScan(tp.topic, tp.partition, start=start, upper=upper, lo=upper))
            by_scan = {(tp.topic, tp.partition): tp for tp in parts}
            deadline = time.monotonic() + READ_BUDGET_S
            scanned = 0
            capped = False
            stalled: set[tuple[str, int]] = set()  # a window not read whole: its partition waits for the next page
            while True:
                active = [
                    scan
                    for scan in scans
                    if not scan.exhausted and len(scan.matches) < limit and (scan.topic, scan.partition) not in stalled
                ]
                if not active:
                    capped = capped or bool(stalled)
                    break
                if scanned >= scan_cap or time.monotonic() >= deadline:
                    capped = True
                    break
                share = max(1, min(BROWSE_WINDOW, (scan_cap - scanned) // len(active)))
                for scan in active:
                    if scanned >= scan_cap or time.monotonic() >= deadline:
                        break
                    low = max(scan.start, scan.lo - share)
                    tp = by_scan[(scan.topic, scan.partition)]
                    matches, first_ms, read, whole = await self._read_window(tp, low, scan.lo, wanted, show_payloads)
                    scanned += read
                    if whole:
                        scan.add_window(low, matches, first_ms, limit)
                    else:
                        log.info(
                            "failed browser: %s[%d] offsets %d to %d not read in time; left for the next page",
                            scan.topic,
                            scan.partition,
                            low,
                            scan.lo - 1,
                        )
                        stalled.add((scan.topic, scan.partition))
        page, positions, more, ordered = merge_page(scans, limit)
        return {
            "topics": names,
            "filters": wanted.to_dict(),
            "limit": limit,
            "records": page,
            "next_before": encode_cursor(positions) if more else None,
            "scanned": scanned,
            "scan_limit": scan_cap,
            "scan_capped": capped,
            "ordered": ordered,
        }
