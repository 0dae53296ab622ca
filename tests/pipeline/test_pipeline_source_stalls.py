"""A read that gets no record: outage (timeout), lagging leader (no false data loss) or real loss, decided like Spark.

Spark's KafkaDataConsumer checks ListOffsets when a poll comes back empty: a position Kafka still has means the
broker is slow (a timeout, whatever failOnDataLoss says), one outside the log is data loss. These tests drive
:meth:`KafkaReader.read_range` with a fake consumer that answers the way aiokafka does in those situations (an
empty ``getmany`` and a stale or missing ``highwater`` during an outage, ``OffsetOutOfRangeError({tp: offset})``
with ``auto_offset_reset="none"``, ``KafkaTimeoutError`` from ListOffsets when no broker answers), because an
embedded broker cannot be made to lag a leader change or drop fetches on demand.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, OffsetOutOfRangeError

from pipeline.kafka_source import client
from pipeline.kafka_source.client import KafkaReader, KafkaReadTimeoutError, _Loop
from pipeline.kafka_source.planning import DataLossError


@dataclass
class Record:
    offset: int
    timestamp: int = 0


@dataclass
class Log:
    """What the broker says at a moment: records readable in [start, readable_end), fetch HW, ListOffsets bounds."""

    start: int = 0
    readable_end: int = 100
    high_watermark: int | None = 100
    listed_end: int = 100
    out_of_range: bool = False
    list_offsets_down: bool = False


class FakeConsumer:
    """The parts of AIOKafkaConsumer the reader uses; ``state(elapsed_s)`` says what the broker answers when."""

    def __init__(self, state: Callable[[float], Log], max_calls: int = 400) -> None:
        self.state = state
        self.began = time.monotonic()
        self.position_ = 0
        self.calls = 0
        self.max_calls = max_calls
        self.hw: int | None = None

    def now(self) -> Log:
        return self.state(time.monotonic() - self.began)

    def assign(self, tps: Any) -> None:
        pass

    def unsubscribe(self) -> None:
        pass

    def seek(self, tp: Any, offset: int) -> None:
        self.position_ = offset

    async def getmany(self, tp: Any, timeout_ms: int = 0, max_records: int | None = None) -> dict[Any, list[Record]]:
        self.calls += 1
        if self.calls > self.max_calls:  # the reader spins without backing off: fail instead of hanging
            raise AssertionError(f"still fetching after {self.calls} calls at position {self.position_}")
        log = self.now()
        if log.out_of_range or self.position_ < log.start:  # Kafka: OFFSET_OUT_OF_RANGE below the log start
            raise OffsetOutOfRangeError({tp: self.position_})
        self.hw = log.high_watermark
        if log.start <= self.position_ < log.readable_end:
            records = [Record(o) for o in range(self.position_, min(log.readable_end, self.position_ + 10))]
            self.position_ = records[-1].offset + 1
            return {tp: records}
        await asyncio.sleep(0.01)
        return {}

    async def position(self, tp: Any) -> int:
        return self.position_

    def highwater(self, tp: Any) -> int | None:
        return self.hw

    async def beginning_offsets(self, tps: list[Any]) -> dict[Any, int]:
        log = self.now()
        if log.list_offsets_down:
            raise KafkaTimeoutError()
        return dict.fromkeys(tps, log.start)

    async def end_offsets(self, tps: list[Any]) -> dict[Any, int]:
        log = self.now()
        if log.list_offsets_down:
            raise KafkaTimeoutError()
        return dict.fromkeys(tps, log.listed_end)

    async def stop(self) -> None:
        pass


def reader_over(consumer: FakeConsumer) -> KafkaReader:
    reader = object.__new__(KafkaReader)
    reader._loop = _Loop()
    reader._consumer = consumer
    reader.read_committed = False
    return reader


def read_offsets(consumer: FakeConsumer, *, fail: bool, poll_timeout_ms: int = 1500, end: int = 100) -> list[int]:
    reader = reader_over(consumer)
    try:
        chunks = reader.read_range("t", 0, 0, end, poll_timeout_ms=poll_timeout_ms, fail_on_data_loss=fail)
        return [r.offset for chunk in chunks for r in chunk]
    finally:
        reader._loop.close()


# --- 1: an outage is a timeout, never data loss ---------------------------------------------------------------


def outage_after_50(list_offsets_down: bool) -> Callable[[float], Log]:
    """Records 0..49 arrive, then the leader stops answering fetches; ListOffsets still says [0, 100) (or fails)."""

    def state(_elapsed: float) -> Log:
        return Log(readable_end=50, high_watermark=None, list_offsets_down=list_offsets_down)

    return state


@pytest.mark.parametrize("fail", [True, False])
@pytest.mark.parametrize("list_offsets_down", [False, True])
def test_an_unreachable_broker_times_out_instead_of_skipping(fail: bool, list_offsets_down: bool) -> None:
    consumer = FakeConsumer(outage_after_50(list_offsets_down))
    began = time.monotonic()
    with pytest.raises(KafkaReadTimeoutError, match=r"t-0: no record between offset 50 and 100.*pollTimeoutMs=1500"):
        read_offsets(consumer, fail=fail)
    assert 1.5 <= time.monotonic() - began < 10
    assert not issubclass(KafkaReadTimeoutError, DataLossError)


def test_a_slow_broker_that_recovers_within_the_poll_timeout_loses_nothing() -> None:
    consumer = FakeConsumer(lambda t: Log(readable_end=50 if t < 0.8 else 100, high_watermark=None if t < 0.8 else 100))
    assert read_offsets(consumer, fail=True, poll_timeout_ms=3000) == list(range(100))


def test_a_timeout_after_retention_moved_the_log_start_is_data_loss(caplog: pytest.LogCaptureFixture) -> None:
    # Outside the log (the start moved past the position) the stall goes through the data-loss decision.
    consumer = FakeConsumer(lambda t: Log(start=0 if t < 0.3 else 70, readable_end=50 if t < 0.3 else 100))
    with pytest.raises(DataLossError, match=r"offsets 50\.\.69 are no longer in Kafka"):
        read_offsets(consumer, fail=True)
    consumer = FakeConsumer(lambda t: Log(start=0 if t < 0.3 else 70, readable_end=50 if t < 0.3 else 100))
    with caplog.at_level(logging.WARNING, logger="pipeline.kafka_source"):
        assert read_offsets(consumer, fail=False) == list(range(50)) + list(range(70, 100))
    assert "Skipping offsets 50..69" in caplog.text


# --- 3: a high watermark that lags after a leader change is not truncation -------------------------------------


def lagging_leader(until_s: float, listed_lags: bool) -> Callable[[float], Log]:
    """Records 0..49 read from the old leader; the new one reports a high watermark of 40 for ``until_s``."""

    def state(elapsed: float) -> Log:
        if elapsed < 0.2:
            return Log(readable_end=50)
        if elapsed < until_s:
            return Log(readable_end=40, high_watermark=40, listed_end=40 if listed_lags else 100)
        return Log()

    return state


@pytest.mark.parametrize("listed_lags", [True, False])
@pytest.mark.parametrize("fail", [True, False])
def test_a_briefly_lagging_new_leader_is_not_data_loss(fail: bool, listed_lags: bool) -> None:
    consumer = FakeConsumer(lagging_leader(1.2, listed_lags))
    assert read_offsets(consumer, fail=fail, poll_timeout_ms=10000) == list(range(100))


def test_a_truncation_that_persists_is_data_loss(caplog: pytest.LogCaptureFixture) -> None:
    began = time.monotonic()
    with pytest.raises(DataLossError, match=r"offset 50 is past the end of the log \(40\)"):
        read_offsets(FakeConsumer(lagging_leader(1e9, True)), fail=True, poll_timeout_ms=20000)
    assert time.monotonic() - began < client.TRUNCATION_CONFIRM_S + 5
    with caplog.at_level(logging.WARNING, logger="pipeline.kafka_source"):
        got = read_offsets(FakeConsumer(lagging_leader(1e9, True)), fail=False, poll_timeout_ms=20000)
    assert got == list(range(50))
    assert "Skipping offsets 50..99" in caplog.text


# --- 5: out of range while ListOffsets says the position is inside the log: back off, then time out ------------


def test_a_passing_out_of_range_answer_is_retried_with_a_backoff() -> None:
    consumer = FakeConsumer(lambda t: Log(out_of_range=0.1 < t < 0.8, readable_end=50 if t < 0.1 else 100), 60)
    assert read_offsets(consumer, fail=True, poll_timeout_ms=5000) == list(range(100))


@pytest.mark.parametrize("fail", [True, False])
def test_an_out_of_range_answer_inside_the_log_ends_at_the_poll_timeout(fail: bool) -> None:
    consumer = FakeConsumer(lambda _t: Log(out_of_range=True), max_calls=60)
    began = time.monotonic()
    with pytest.raises(KafkaReadTimeoutError, match=r"Kafka still has offsets 0\.\.99"):
        read_offsets(consumer, fail=fail, poll_timeout_ms=1500)
    assert time.monotonic() - began >= 1.5
    assert consumer.calls <= 2 + 1.5 / client.STALL_BACKOFF_S


# --- 8: no leaked loop or consumer ----------------------------------------------------------------------------


def test_a_reader_that_cannot_start_stops_its_consumer_and_closes_its_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokafka import AIOKafkaConsumer

    loops: list[_Loop] = []
    stopped: list[bool] = []

    class TrackedLoop(_Loop):
        def __init__(self) -> None:
            super().__init__()
            loops.append(self)

    async def failing_start(self: Any) -> None:
        raise KafkaTimeoutError("no broker")

    real_stop = AIOKafkaConsumer.stop

    async def tracked_stop(self: Any) -> None:
        stopped.append(True)
        await real_stop(self)

    monkeypatch.setattr(client, "_Loop", TrackedLoop)
    monkeypatch.setattr(AIOKafkaConsumer, "start", failing_start)
    monkeypatch.setattr(AIOKafkaConsumer, "stop", tracked_stop)
    with pytest.raises(KafkaTimeoutError):
        KafkaReader("127.0.0.1:1")
    assert stopped == [True]
    assert len(loops) == 1 and loops[0].loop.is_closed()


def test_close_tolerates_the_cancelled_error_of_a_pending_fetch() -> None:
    class CancelledOnStop(FakeConsumer):
        async def stop(self) -> None:
            raise asyncio.CancelledError()

    reader = reader_over(CancelledOnStop(lambda _t: Log()))
    reader.close()
    assert reader._loop.loop.is_closed()


# --- 1 on a real broker: the broker goes away under a read ------------------------------------------------------


@pytest.mark.broker
@pytest.mark.parametrize("fail", [True, False])
def test_a_broker_that_goes_away_under_a_read_times_out(fail: bool) -> None:
    """A private Tansu broker (the session's must stay up) is stopped after the reader connected: the read fails
    with the timeout, where it used to skip the records (failOnDataLoss=false) or call the outage data loss."""
    from demo.embedded_broker import start_broker
    from tests.pipeline.conftest import create_topics, produce, unique

    private = start_broker()
    try:
        topic = unique("stall-outage")
        create_topics(private.bootstrap, {topic: 1})
        produce(private.bootstrap, topic, [{"value": f"v{i}".encode()} for i in range(10)])
        reader = KafkaReader(private.bootstrap)
        try:
            assert reader.latest([(topic, 0)]) == {(topic, 0): 10}
            private.stop()
            began = time.monotonic()
            with pytest.raises(KafkaReadTimeoutError, match=rf"{topic}-0: no record between offset 0 and 10"):
                list(reader.read_range(topic, 0, 0, 10, poll_timeout_ms=3000, fail_on_data_loss=fail))
            assert time.monotonic() - began < 30
        finally:
            reader.close()
    finally:
        private.stop()
