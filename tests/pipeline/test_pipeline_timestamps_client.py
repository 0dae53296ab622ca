"""The client's offsets-for-times against logs that change during the lookup, with a fake aiokafka consumer.

Neither test broker can show these: Tansu answers ListOffsets by timestamp with offset 0 for every time and
librdkafka's mock cluster answers "no record", so a broker answer past the end offsets never occurs there, and
neither implements DeleteRecords to move the log start mid-search. The fake answers as aiokafka does:
``OffsetOutOfRangeError({tp: offset})`` for a fetch below the log start (``auto_offset_reset="none"``), an empty
``getmany`` for a fetch at the high watermark, ``OffsetAndTimestamp`` from ``offsets_for_times``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import OffsetOutOfRangeError
from aiokafka.structs import OffsetAndTimestamp

from pipeline.kafka_source.client import KafkaReader, _Loop


@dataclass
class Record:
    offset: int
    timestamp: int


class TimedLog:
    """Records ``offset -> offset * 10`` ms; ``start`` moves to ``moved_start`` once ``offsets_for_times`` answered."""

    def __init__(self, high_watermark: int, answer: int | None, moved_start: int = 0) -> None:
        self.start = 0
        self.high_watermark = high_watermark
        self.answer = answer
        self.moved_start = moved_start
        self.position_ = 0

    async def offsets_for_times(self, times: dict[Any, int]) -> dict[Any, OffsetAndTimestamp | None]:
        self.start = self.moved_start  # retention runs right after the broker answered
        return {tp: None if self.answer is None else OffsetAndTimestamp(self.answer, self.answer * 10) for tp in times}

    def assign(self, tps: Any) -> None:
        pass

    def unsubscribe(self) -> None:
        pass

    def seek(self, tp: Any, offset: int) -> None:
        self.position_ = offset

    async def getmany(self, tp: Any, timeout_ms: int = 0, max_records: int | None = None) -> dict[Any, list[Record]]:
        if self.position_ < self.start:
            raise OffsetOutOfRangeError({tp: self.position_})
        if self.position_ >= self.high_watermark:
            await asyncio.sleep(timeout_ms / 1000)
            return {}
        record = Record(self.position_, self.position_ * 10)
        self.position_ += 1
        return {tp: [record]}

    async def position(self, tp: Any) -> int:
        return self.position_

    async def beginning_offsets(self, tps: list[Any]) -> dict[Any, int]:
        return dict.fromkeys(tps, self.start)


def lookup(log: TimedLog, target: int, end: int) -> int | None:
    reader = object.__new__(KafkaReader)
    reader._loop = _Loop()
    reader._consumer = log
    reader.read_committed = False
    try:
        return reader.offsets_for_times({("t", 0): target}, {("t", 0): 0}, {("t", 0): end}, timeout_s=3)[("t", 0)]
    finally:
        reader._loop.close()


def test_retention_moving_the_log_start_during_the_search_is_clamped_to_the_new_start() -> None:
    # The broker answers 30 (time 300); then offsets 0..59 age out. The first record at or after 300 is now 60.
    assert lookup(TimedLog(100, answer=30, moved_start=60), target=300, end=100) == 60


def test_a_broker_answer_past_the_end_offsets_is_a_record_that_arrived_since() -> None:
    # End offsets were taken at 100; records 100..104 arrived since, and the broker answers 102 for time 1020.
    # No record below 100 is at or after the time, so the offset is the end: the next batch reads from there.
    assert lookup(TimedLog(105, answer=102), target=1020, end=100) == 100


def test_a_broker_answer_past_the_end_is_rejected_when_a_snapshot_record_matches() -> None:
    # The answer 102 is wrong: record 50 (time 500) is in the snapshot and at or after 450.
    assert lookup(TimedLog(105, answer=102), target=450, end=100) == 45


def test_a_broker_answer_past_the_log_end_is_not_waited_for() -> None:
    # A wrong answer past everything: the probe past the end gives up after a short wait, the search decides.
    assert lookup(TimedLog(100, answer=500), target=5000, end=100) is None
