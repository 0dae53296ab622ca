"""The pykafka source and sink against the embedded broker, through a real local[2] SparkSession."""

from __future__ import annotations

import pytest
from conftest import create_topics, produce, unique
from pyspark.errors import PySparkException
from pyspark.testing import assertDataFrameEqual, assertSchemaEqual

from pipeline.kafka_source.arrow import kafka_spark_schema

pytestmark = [pytest.mark.broker, pytest.mark.spark]

N = 30
WRITE_SCHEMA = "key string, value binary, partition int, headers array<struct<key:string,value:binary>>"


def _rows(n: int, first: int = 0) -> list[tuple]:
    return [(f"k{i}", f"v{i}".encode(), i % 3, [("h", b"%d" % i)] if i % 2 else None) for i in range(first, first + n)]


def _read(spark, broker, topic: str, **options: str):
    reader = spark.read.format("pykafka").option("kafka.bootstrap.servers", broker.bootstrap)
    reader = reader.option("subscribe", topic)
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load()


def test_write_then_read_back_equal(spark, broker) -> None:
    topic = unique("roundtrip")
    create_topics(broker.bootstrap, {topic: 3})
    written = spark.createDataFrame(_rows(N), WRITE_SCHEMA)
    written.write.format("pykafka").option("kafka.bootstrap.servers", broker.bootstrap).option("topic", topic).mode(
        "append"
    ).save()

    read = _read(spark, broker, topic, includeHeaders="true")
    assertSchemaEqual(read.schema, kafka_spark_schema(include_headers=True))
    assertSchemaEqual(_read(spark, broker, topic).schema, kafka_spark_schema(include_headers=False))
    expected = spark.createDataFrame(
        [(k.encode(), v, topic, p, h) for k, v, p, h in _rows(N)],
        "key binary, value binary, topic string, partition int, headers array<struct<key:string,value:binary>>",
    )
    assertDataFrameEqual(read.select("key", "value", "topic", "partition", "headers"), expected)
    # offsets are dense per partition, timestamps are set, CreateTime
    per_partition = {
        r["partition"]: (r["n"], r["lo"], r["hi"])
        for r in read.groupBy("partition")
        .agg({"offset": "min", "*": "count"})
        .selectExpr("partition", "`count(1)` as n", "`min(offset)` as lo", "`min(offset)` + `count(1)` - 1 as hi")
        .collect()
    }
    assert per_partition == {0: (10, 0, 9), 1: (10, 0, 9), 2: (10, 0, 9)}
    assert read.where("timestamp is null or timestampType != 0").count() == 0


def test_offsets_min_partitions_and_pattern(spark, broker) -> None:
    topic = unique("ranges")
    create_topics(broker.bootstrap, {topic: 2})
    produce(broker.bootstrap, topic, [{"value": b"%d" % i, "partition": i % 2} for i in range(40)])

    df = _read(spark, broker, topic, minPartitions="6")
    assert df.rdd.getNumPartitions() == 6
    assert df.count() == 40

    ranged = _read(
        spark,
        broker,
        topic,
        startingOffsets=f'{{"{topic}":{{"0":5,"1":-2}}}}',
        endingOffsets=f'{{"{topic}":{{"0":8,"1":2}}}}',
    )
    assert sorted((r.partition, r.offset) for r in ranged.collect()) == [(0, 5), (0, 6), (0, 7), (1, 0), (1, 1)]

    by_pattern = (
        spark.read.format("pykafka")
        .option("kafka.bootstrap.servers", broker.bootstrap)
        .option("subscribePattern", topic.replace("ranges", "r.nges"))
        .load()
    )
    assert by_pattern.count() == 40
    empty = _read(spark, broker, unique("missing"))
    assert empty.count() == 0


def test_streaming_available_now_reads_only_new_records(spark, broker, tmp_path) -> None:
    topic = unique("stream")
    create_topics(broker.bootstrap, {topic: 2})
    produce(broker.bootstrap, topic, [{"value": b"a%d" % i, "partition": i % 2} for i in range(25)])
    sink, checkpoint = tmp_path / "sink", tmp_path / "checkpoint"

    def run() -> int:
        query = (
            spark.readStream.format("pykafka")
            .option("kafka.bootstrap.servers", broker.bootstrap)
            .option("subscribe", topic)
            .option("startingOffsets", "earliest")
            .option("maxOffsetsPerTrigger", "10")
            .load()
            .selectExpr("partition", "offset", "cast(value as string) as value")
            .writeStream.format("parquet")
            .option("path", str(sink))
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        assert query.exception() is None
        return sum(p["numInputRows"] for p in query.recentProgress)

    assert run() == 25
    produce(broker.bootstrap, topic, [{"value": b"b%d" % i, "partition": i % 2} for i in range(7)])
    assert run() == 7
    stored = spark.read.parquet(str(sink))
    assert stored.count() == 32
    assert stored.select("partition", "offset").distinct().count() == 32
    assert stored.where("value like 'b%'").count() == 7


def test_refused_options_fail_with_sparks_wording(spark, broker) -> None:
    with pytest.raises(PySparkException, match=r"'auto\.offset\.reset' is not supported"):
        _read(spark, broker, "x", **{"kafka.auto.offset.reset": "earliest"}).count()
    with pytest.raises(PySparkException, match="topic option required"):
        spark.createDataFrame([(b"v",)], "value binary").write.format("pykafka").option(
            "kafka.bootstrap.servers", broker.bootstrap
        ).mode("append").save()


def test_write_timestamp_column_and_ignore_other_columns(spark, broker) -> None:
    topic = unique("stamped")
    create_topics(broker.bootstrap, {topic: 1})
    rows = spark.createDataFrame(
        [("v1", 7, "2024-05-01 10:00:00"), ("v2", 8, None)], "value string, id int, ts string"
    ).selectExpr("value", "id", "cast(ts as timestamp) as timestamp")  # `id` is not a Kafka column: ignored
    rows.write.format("pykafka").option("kafka.bootstrap.servers", broker.bootstrap).option("topic", topic).mode(
        "append"
    ).save()
    got = {
        r.v: (r.ts, r.year)
        for r in _read(spark, broker, topic)
        .selectExpr("cast(value as string) as v", "cast(timestamp as string) as ts", "year(timestamp) as year")
        .collect()
    }
    assert got["v1"] == ("2024-05-01 10:00:00", 2024)  # the session time zone is UTC
    assert got["v2"][1] >= 2025  # null timestamp: the producer's time
