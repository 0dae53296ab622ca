"""Offset planning and Arrow batch building, without Spark's JVM or a broker."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.kafka_source.arrow import BatchBuilder, batches, kafka_arrow_schema, kafka_spark_schema
from pipeline.kafka_source.options import EARLIEST, LATEST, OffsetSpec
from pipeline.kafka_source.planning import (
    DataLossError,
    OffsetRange,
    cap,
    check_ranges,
    rate_limit,
    resolve,
    split_ranges,
)

A0, A1, B0 = ("a", 0), ("a", 1), ("b", 0)


def test_resolve_markers_against_the_log() -> None:
    earliest = {A0: 5, A1: 0, B0: 2}
    latest = {A0: 50, A1: 10, B0: 2}
    spec = OffsetSpec("specific", {A0: 7, A1: LATEST})
    assert resolve(spec, [A0, A1, B0], earliest, latest, default=EARLIEST) == {A0: 7, A1: 10, B0: 2}
    assert resolve(OffsetSpec("latest"), [A0], earliest, latest, default=EARLIEST) == {A0: 50}
    assert resolve(OffsetSpec("earliest"), [A0], earliest, latest, default=LATEST) == {A0: 5}


def test_check_ranges_data_loss_and_new_partitions() -> None:
    earliest = {A0: 10, A1: 0, B0: 0}
    with pytest.raises(DataLossError, match=r"offsets 3\.\.9 are no longer in Kafka"):
        check_ranges({A0: 3}, {A0: 20}, earliest, fail_on_data_loss=True)
    assert check_ranges({A0: 3}, {A0: 20}, earliest, fail_on_data_loss=False) == [OffsetRange("a", 0, 10, 20)]
    with pytest.raises(DataLossError, match="recreated"):
        check_ranges({A1: 9}, {A1: 4}, earliest, fail_on_data_loss=True)
    # B0 is missing from the start: a new partition, read from its beginning; empty ranges are dropped.
    ranges = check_ranges({A0: 12, A1: 4}, {A0: 12, A1: 6, B0: 3}, earliest, fail_on_data_loss=True)
    assert ranges == [OffsetRange("a", 1, 4, 6), OffsetRange("b", 0, 0, 3)]


def test_split_ranges_in_proportion_to_size() -> None:
    ranges = [OffsetRange("a", 0, 0, 90), OffsetRange("a", 1, 100, 110)]
    assert split_ranges(ranges, None) == ranges
    assert split_ranges(ranges, 2) == ranges
    split = split_ranges(ranges, 4)
    # 90/100*4 = 3.6 -> 4 pieces for a-0, 10/100*4 = 0.4 -> 1 piece for a-1; contiguous and covering.
    assert [(r.partition, r.start, r.end) for r in split] == [
        (0, 0, 22),
        (0, 22, 45),
        (0, 45, 67),
        (0, 67, 90),
        (1, 100, 110),
    ]
    assert split_ranges([OffsetRange("a", 0, 0, 2)], 5) == [OffsetRange("a", 0, 0, 1), OffsetRange("a", 0, 1, 2)]


def test_rate_limit_shares_backlog_proportionally() -> None:
    start = {A0: 0, A1: 0, B0: 10}
    latest = {A0: 80, A1: 19, B0: 11}
    # total lag 100 > 10: a-0 gets floor(8.0)=8, a-1 floor(1.9)=1, b-0 ceil(0.1)=1
    assert rate_limit(start, latest, 10) == {A0: 8, A1: 1, B0: 11}
    assert rate_limit(start, latest, 1000) == latest


def test_cap_for_available_now() -> None:
    assert cap({A0: 50, A1: 10, B0: 3}, {A0: 40, A1: 12}) == {A0: 40, A1: 10}


def test_arrow_schema_is_what_spark_derives() -> None:
    from pyspark.sql.pandas.types import to_arrow_schema

    for headers in (False, True):
        assert kafka_arrow_schema(headers).equals(to_arrow_schema(kafka_spark_schema(headers), timezone="UTC"))


def test_batch_builder_columns_and_null_headers() -> None:
    builder = BatchBuilder(include_headers=True)
    builder.append(
        key=None,
        value=b"v0",
        topic="t",
        partition=1,
        offset=7,
        timestamp_ms=1_700_000_000_123,
        timestamp_type=0,
        headers=[("h", b"x"), ("n", None)],
    )
    builder.append(
        key=b"k", value=None, topic="t", partition=1, offset=8, timestamp_ms=-1, timestamp_type=1, headers=[]
    )
    batch = builder.flush()
    assert len(builder) == 0
    assert batch.schema.equals(kafka_arrow_schema(True))
    rows = batch.to_pylist()
    assert rows[0]["headers"] == [{"key": "h", "value": b"x"}, {"key": "n", "value": None}]
    assert rows[1]["headers"] is None
    assert batch.column("timestamp")[0].value == 1_700_000_000_123_000
    assert rows[1]["timestamp"] is None
    assert (rows[0]["key"], rows[1]["value"], rows[1]["timestampType"]) == (None, None, 1)


def test_batches_are_cut_at_the_row_limit() -> None:
    records = [
        {
            "key": None,
            "value": b"%d" % i,
            "topic": "t",
            "partition": 0,
            "offset": i,
            "timestamp_ms": i,
            "timestamp_type": 0,
        }
        for i in range(10)
    ]
    out = list(batches(records, include_headers=False, rows=4))
    assert [b.num_rows for b in out] == [4, 4, 2]
    assert pa.Table.from_batches(out).column("offset").to_pylist() == list(range(10))
