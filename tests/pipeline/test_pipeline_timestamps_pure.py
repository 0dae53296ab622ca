"""Fast tests of the time options: parsing and precedence, resolving, and the check/search of offsets-for-times."""

from __future__ import annotations

import math
import random

import pytest

from pipeline.kafka_source.options import KafkaOptionError, OffsetSpec, parse_source_options
from pipeline.kafka_source.planning import check_time_window, resolve
from pipeline.kafka_source.timestamps import (
    BACKWARD_PROBES,
    Lookup,
    Stamp,
    answer_holds,
    offset_for_time,
    record_before,
    search,
)

BASE = {"kafka.bootstrap.servers": "b:9092", "subscribe": "t"}


class FakeLog:
    """A partition as a list of (offset, timestamp) with gaps; counts the single-record fetches."""

    def __init__(self, records: list[tuple[int, int]], first: int, end: int) -> None:
        self.records = records
        self.first, self.end = first, end
        self.fetches = 0

    def fetch(self, offset: int) -> Stamp | None:
        self.fetches += 1
        for off, ts in self.records:
            if offset <= off < self.end:
                return Stamp(off, ts)
        return None

    def truth(self, target: int) -> int | None:
        return next((off for off, ts in self.records if ts >= target), None)


def make_log(rng: random.Random, size: int, *, first: int = 0, gaps: bool = True) -> FakeLog:
    records, offset, ts = [], first, 1_700_000_000_000
    for _ in range(size):
        records.append((offset, ts))
        offset += 1 + (rng.choice([0, 0, 0, 1, 3]) if gaps else 0)  # skipped offsets: markers, compaction
        ts += rng.choice([0, 1, 5, 1000])  # equal timestamps too
    return FakeLog(records, first, offset)


@pytest.mark.parametrize("seed", range(6))
def test_search_finds_the_first_record_at_or_after_the_time_in_log2_fetches(seed: int) -> None:
    rng = random.Random(seed)
    log = make_log(rng, rng.randint(1, 300), first=rng.choice([0, 17]))
    times = sorted({ts for _, ts in log.records})
    targets = [times[0] - 1, times[-1] + 1, *times, *(t + 1 for t in times[:20])]
    for target in targets:
        log.fetches = 0
        assert search(target, log.first, log.end, log.fetch) == log.truth(target), target
        assert log.fetches <= math.ceil(math.log2(log.end - log.first + 1)) + 1


def test_search_on_an_empty_range_needs_no_fetch() -> None:
    log = FakeLog([], 5, 5)
    assert search(123, 5, 5, log.fetch) is None
    assert log.fetches == 0


@pytest.mark.parametrize("seed", range(4))
def test_a_right_broker_answer_is_kept_after_at_most_two_fetches(seed: int) -> None:
    rng = random.Random(seed)
    log = make_log(rng, 200, gaps=False)
    for target in (log.records[0][1], log.records[57][1] + 1, log.records[-1][1] + 1):
        log.fetches = 0
        right = log.truth(target)
        assert answer_holds(target, right, log.first, log.end, log.fetch)
        log.fetches = 0
        lookup = offset_for_time(target, right, log.first, log.end, log.fetch)
        assert (lookup.offset, lookup.corrected) == (right, False)
        assert log.fetches <= 2  # the record at the answer and the one before it: no search


@pytest.mark.parametrize("seed", range(4))
def test_a_wrong_broker_answer_is_corrected_by_the_search(seed: int) -> None:
    rng = random.Random(seed)
    log = make_log(rng, 150)
    target = log.records[100][1] + 1
    right = log.truth(target)
    # Tansu's answer (offset 0 for every time), a late answer, an offset past the end and a wrong "no record".
    wrong_answers = [0, log.records[-1][0], log.end + 10, None, log.first - 1]
    for wrong in wrong_answers:
        assert wrong != right
        assert not answer_holds(target, wrong, log.first, log.end, log.fetch)
        lookup = offset_for_time(target, wrong, log.first, log.end, log.fetch)
        assert (lookup.offset, lookup.corrected) == (right, True)


def test_a_time_after_the_last_record_has_no_offset_and_a_broker_saying_so_is_believed() -> None:
    log = make_log(random.Random(9), 40)
    after = log.records[-1][1] + 1
    assert answer_holds(after, None, log.first, log.end, log.fetch)
    assert offset_for_time(after, None, log.first, log.end, log.fetch).offset is None
    assert offset_for_time(after, 0, log.first, log.end, log.fetch).corrected


def test_a_gap_before_the_answer_is_looked_past_and_the_answer_kept() -> None:
    # offsets 0..2, then a transaction marker at 3, then records from 4 on
    log = FakeLog([(0, 10), (1, 20), (2, 30), (4, 40), (5, 50)], 0, 6)
    assert answer_holds(40, 4, 0, 6, log.fetch)
    assert not answer_holds(30, 4, 0, 6, log.fetch)  # the record before the gap is already at the time
    lookup = offset_for_time(40, 4, 0, 6, log.fetch)
    assert (lookup.offset, lookup.corrected) == (4, False)


def test_a_right_answer_after_a_marker_wins_over_a_later_crossing_of_out_of_order_times() -> None:
    # A marker at 1 before the right answer 2; out-of-order times after it make the search find 6 instead, which
    # would leave records 2..5 of a window starting at time 40 unread.
    log = FakeLog([(0, 10), (2, 50), (3, 20), (4, 25), (5, 30), (6, 60), (7, 70)], 0, 8)
    assert search(40, 0, 8, log.fetch) == 6
    assert answer_holds(40, 2, 0, 8, log.fetch)
    assert offset_for_time(40, 2, 0, 8, log.fetch) == Lookup(2, corrected=False)


@pytest.mark.parametrize("gap", [1, 2, 7, 100, 1000])
def test_the_record_before_a_gap_is_found_in_few_fetches(gap: int) -> None:
    answer = 5 + gap
    log = FakeLog([(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (answer, 99)], 0, answer + 1)
    assert record_before(answer, 0, log.fetch) == (True, Stamp(4, 5))
    assert log.fetches <= 2 * math.ceil(math.log2(gap + 1)) + 2
    log.fetches = 0
    # No record before the answer at all (a compacted head): the answer is the first record.
    head = FakeLog([(answer, 99)], 0, answer + 1)
    assert answer_holds(50, answer, 0, answer + 1, head.fetch)


def test_a_gap_too_long_for_the_probes_is_inconclusive_and_the_search_decides() -> None:
    log = FakeLog([(0, 1), (10**9, 99)], 0, 10**9 + 1)
    assert record_before(10**9, 0, log.fetch) == (False, None)
    assert log.fetches <= BACKWARD_PROBES
    assert offset_for_time(50, 10**9, 0, 10**9 + 1, log.fetch).offset == 10**9


# --- options: names, precedence and validation follow Spark's KafkaSourceProvider ---


def test_global_timestamp_wins_over_by_partition_which_wins_over_offsets() -> None:
    both = {
        **BASE,
        "startingTimestamp": "1000",
        "startingOffsetsByTimestamp": '{"t":{"0":5}}',
        "startingOffsets": "earliest",
        "endingOffsetsByTimestamp": '{"t":{"0":2000}}',
        "endingOffsets": "latest",
    }
    opts = parse_source_options(both, streaming=False)
    assert (opts.starting.kind, opts.starting.timestamp, opts.starting.option) == (
        "timestamp",
        1000,
        "startingTimestamp",
    )
    assert (opts.ending.timestamps, opts.ending.option) == ({("t", 0): 2000}, "endingOffsetsByTimestamp")
    assert opts.starting.no_match == "error" and opts.ending.no_match == "latest"
    lower = parse_source_options(
        {**BASE, "startingoffsetsbytimestampstrategy": "LATEST", "STARTINGTIMESTAMP": "7"}, streaming=True
    )
    assert (lower.starting.timestamp, lower.starting.no_match) == (7, "latest")


@pytest.mark.parametrize(
    ("options", "streaming", "message"),
    [
        ({"startingTimestamp": "yesterday"}, False, "'startingTimestamp' must be a single epoch-milliseconds"),
        ({"endingTimestamp": "-5"}, False, "'endingTimestamp' must not be negative"),
        ({"startingOffsetsByTimestamp": "{bad"}, False, "'startingOffsetsByTimestamp' must be JSON like"),
        ({"startingOffsetsByTimestamp": '{"t":{"0":-1}}'}, False, "timestamp -1 for t-0 is negative"),
        ({"startingOffsetsByTimestamp": "{}"}, False, "names no topic-partition"),
        ({"startingOffsetsByTimestampStrategy": "earliest"}, False, "must be 'error' or 'latest'"),
        ({"endingTimestamp": "5"}, True, "ending timestamp not valid in streaming queries"),
        ({"endingOffsetsByTimestamp": '{"t":{"0":5}}'}, True, "ending timestamp not valid in streaming queries"),
        (
            {"startingTimestamp": "9", "endingTimestamp": "5"},
            False,
            r"startingTimestamp \(9\) is after endingTimestamp",
        ),
        (
            {"startingTimestamp": "9", "endingOffsetsByTimestamp": '{"t":{"0":5}}'},
            False,
            r"startingTimestamp for t-0 \(9\) is after endingOffsetsByTimestamp \(5\)",
        ),
    ],
)
def test_time_options_are_validated_with_the_option_name(
    options: dict[str, str], streaming: bool, message: str
) -> None:
    with pytest.raises(KafkaOptionError, match=message):
        parse_source_options({**BASE, **options}, streaming=streaming)


def test_by_timestamp_with_assign_must_name_assigned_partitions() -> None:
    opts = {"kafka.bootstrap.servers": "b", "assign": '{"t":[0]}', "startingOffsetsByTimestamp": '{"t":{"1":5}}'}
    with pytest.raises(KafkaOptionError, match="startingOffsetsByTimestamp names partitions that are not assigned"):
        parse_source_options(opts, streaming=False)


def test_a_by_partition_map_must_name_exactly_the_partitions_read() -> None:
    spec = OffsetSpec("timestamp", timestamps={("t", 0): 5}, option="startingOffsetsByTimestamp")
    assert spec.times_for([("t", 0)]) == {("t", 0): 5}
    with pytest.raises(KafkaOptionError, match=r"must name every topic-partition read.*read: t-0, t-1"):
        spec.times_for([("t", 0), ("t", 1)])
    assert OffsetSpec("timestamp", timestamp=3).times_for([("t", 0), ("t", 1)]) == {("t", 0): 3, ("t", 1): 3}
    assert OffsetSpec("earliest").times_for([("t", 0)]) == {}


def test_resolve_maps_no_match_to_the_end_or_to_spark_s_error() -> None:
    tps = [("t", 0), ("t", 1)]
    earliest, latest = {("t", 0): 0, ("t", 1): 0}, {("t", 0): 10, ("t", 1): 20}
    found = {("t", 0): 4, ("t", 1): None}
    lenient = OffsetSpec("timestamp", timestamp=99, option="startingTimestamp", no_match="latest")
    assert resolve(lenient, tps, earliest, latest, default=-2, found_by_time=found) == {("t", 0): 4, ("t", 1): 20}
    strict = OffsetSpec("timestamp", timestamp=99, option="startingTimestamp", no_match="error")
    with pytest.raises(
        KafkaOptionError, match="No offset matched from request of topic-partition t-1 and timestamp 99"
    ):
        resolve(strict, tps, earliest, latest, default=-2, found_by_time=found)


def test_a_start_after_the_end_because_of_a_time_option_is_an_error_not_data_loss() -> None:
    start_spec = OffsetSpec("timestamp", timestamp=5, option="startingTimestamp")
    end_spec = OffsetSpec("specific", {("t", 0): 3}, option="endingOffsets")
    with pytest.raises(KafkaOptionError, match="startingTimestamp resolves to offset 7 of t-0, which is after"):
        check_time_window({("t", 0): 7}, {("t", 0): 3}, start_spec, end_spec)
    check_time_window({("t", 0): 3}, {("t", 0): 3}, start_spec, end_spec)
    check_time_window({("t", 0): 7}, {("t", 0): 3}, OffsetSpec("earliest"), end_spec)  # check_ranges' business
