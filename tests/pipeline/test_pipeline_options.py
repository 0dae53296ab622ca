"""Option parsing of the pykafka source: same names and rules as Spark's Kafka connector (no JVM, no broker)."""

from __future__ import annotations

import pytest

from pipeline.kafka_source.options import (
    EARLIEST,
    LATEST,
    KafkaOptionError,
    offsets_from_json,
    offsets_to_json,
    parse_sink_options,
    parse_source_options,
)

BASE = {"kafka.bootstrap.servers": "h:9092"}


def test_subscribe_defaults_for_batch_and_stream() -> None:
    batch = parse_source_options({**BASE, "subscribe": "a, b,,"}, streaming=False)
    assert batch.strategy.topics == ("a", "b")
    assert (batch.starting.kind, batch.ending.kind) == ("earliest", "latest")
    assert batch.fail_on_data_loss is True and batch.include_headers is False
    stream = parse_source_options({**BASE, "subscribe": "a"}, streaming=True)
    assert stream.starting.kind == "latest"


def test_option_names_are_case_insensitive() -> None:
    opts = parse_source_options(
        {
            **BASE,
            "SUBSCRIBE": "a",
            "StartingOffsets": "earliest",
            "includeheaders": "TRUE",
            "MINPARTITIONS": "7",
            "maxOffsetsPerTrigger": "50",
        },
        streaming=True,
    )
    assert opts.include_headers is True
    assert (opts.min_partitions, opts.max_offsets_per_trigger, opts.starting.kind) == (7, 50, "earliest")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "One of the following options must be specified"),
        ({"subscribe": "a", "assign": '{"a":[0]}'}, "Only one of the following options"),
        ({"subscribe": " , "}, "No topics to subscribe to"),
        ({"subscribePattern": "  "}, "Pattern to subscribe is empty"),
        ({"subscribePattern": "a("}, "not a valid regular expression"),
        ({"assign": "a"}, "No topicpartitions to assign"),
    ],
)
def test_strategy_errors(extra: dict[str, str], message: str) -> None:
    with pytest.raises(KafkaOptionError, match=message):
        parse_source_options({**BASE, **extra}, streaming=False)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("kafka.group.id", "'group.id' is not supported"),
        ("kafka.auto.offset.reset", "set the source option 'startingOffsets'"),
        ("kafka.enable.auto.commit", "'enable.auto.commit' is not supported"),
        ("kafka.key.deserializer", "keys are deserialized as byte arrays"),
        ("kafka.value.deserializer", "values are deserialized as byte arrays"),
        ("kafka.interceptor.classes", "'interceptor.classes' is not supported"),
    ],
)
def test_consumer_options_the_source_owns_are_refused(name: str, message: str) -> None:
    with pytest.raises(KafkaOptionError, match=message):
        parse_source_options({**BASE, "subscribe": "a", name: "x"}, streaming=False)


def test_bootstrap_servers_is_required() -> None:
    with pytest.raises(KafkaOptionError, match=r"'kafka\.bootstrap\.servers' must be specified"):
        parse_source_options({"subscribe": "a"}, streaming=False)


def test_batch_offset_rules() -> None:
    with pytest.raises(KafkaOptionError, match="starting offset can't be latest"):
        parse_source_options({**BASE, "subscribe": "a", "startingOffsets": "latest"}, streaming=False)
    with pytest.raises(KafkaOptionError, match="ending offset can't be earliest"):
        parse_source_options({**BASE, "subscribe": "a", "endingOffsets": "earliest"}, streaming=False)
    with pytest.raises(KafkaOptionError, match="can't be latest"):
        parse_source_options({**BASE, "subscribe": "a", "startingOffsets": '{"a":{"0":-1}}'}, streaming=False)
    with pytest.raises(KafkaOptionError, match="greater than endingOffsets"):
        parse_source_options(
            {**BASE, "subscribe": "a", "startingOffsets": '{"a":{"0":9}}', "endingOffsets": '{"a":{"0":3}}'},
            streaming=False,
        )
    with pytest.raises(KafkaOptionError, match="same topic-partitions"):
        parse_source_options(
            {**BASE, "subscribe": "a", "startingOffsets": '{"a":{"0":1}}', "endingOffsets": '{"a":{"1":3}}'},
            streaming=False,
        )
    with pytest.raises(KafkaOptionError, match="ending offset not valid in streaming"):
        parse_source_options({**BASE, "subscribe": "a", "endingOffsets": "latest"}, streaming=True)


def test_specific_offsets_and_assign() -> None:
    opts = parse_source_options(
        {
            **BASE,
            "assign": '{"a":[0,1],"b":[2]}',
            "startingOffsets": '{"a":{"0":23,"1":-2},"b":{"2":-2}}',
            "endingOffsets": '{"a":{"0":30,"1":-1},"b":{"2":5}}',
        },
        streaming=False,
    )
    assert opts.strategy.partitions == (("a", 0), ("a", 1), ("b", 2))
    assert opts.starting.for_partition(("a", 0), EARLIEST) == 23
    assert opts.starting.for_partition(("a", 1), 0) == EARLIEST
    assert opts.ending.for_partition(("a", 1), 0) == LATEST
    with pytest.raises(KafkaOptionError, match="not assigned"):
        parse_source_options({**BASE, "assign": '{"a":[0]}', "startingOffsets": '{"a":{"1":0}}'}, streaming=True)


def test_malformed_values_name_the_option() -> None:
    with pytest.raises(KafkaOptionError, match="startingOffsets"):
        parse_source_options({**BASE, "subscribe": "a", "startingOffsets": "{nope"}, streaming=True)
    with pytest.raises(KafkaOptionError, match="minPartitions must be positive"):
        parse_source_options({**BASE, "subscribe": "a", "minPartitions": "0"}, streaming=False)
    with pytest.raises(KafkaOptionError, match="'failOnDataLoss' must be 'true' or 'false'"):
        parse_source_options({**BASE, "subscribe": "a", "failOnDataLoss": "yes"}, streaming=False)


def test_offsets_json_round_trip_uses_sparks_layout() -> None:
    offsets = {("t", 1): -1, ("t", 0): 23, ("u", 0): 5}
    as_json = offsets_to_json(offsets)
    assert as_json == {"t": {"0": 23, "1": -1}, "u": {"0": 5}}
    assert offsets_from_json(as_json) == offsets
    assert offsets_from_json('{"t":{"0":23}}') == {("t", 0): 23}


def test_pattern_must_match_whole_topic_name() -> None:
    opts = parse_source_options({**BASE, "subscribePattern": r"items\.failed|orders.*"}, streaming=False)
    assert opts.strategy.select_topics({"items.failed", "items.failed.x", "orders.failed", "x"}) == [
        "items.failed",
        "orders.failed",
    ]


def test_sink_options() -> None:
    sink = parse_sink_options({**BASE, "topic": " out ", "kafka.acks": "all", "kafka.linger.ms": "5"})
    assert (sink.topic, sink.client_config) == ("out", {"linger.ms": "5"})
    with pytest.raises(KafkaOptionError, match="'acks' is not supported"):
        parse_sink_options({**BASE, "kafka.acks": "1"})
    with pytest.raises(KafkaOptionError, match="keys are serialized as byte arrays"):
        parse_sink_options({**BASE, "kafka.key.serializer": "x"})
    with pytest.raises(KafkaOptionError, match="configuring Kafka producer"):
        parse_sink_options({"topic": "x"})


def test_client_kwargs_translate_java_names() -> None:
    from aiokafka import AIOKafkaConsumer

    from pipeline.kafka_source.client import client_kwargs

    kwargs = client_kwargs(
        {
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "PLAIN",
            "sasl.plain.username": "u",
            "request.timeout.ms": "5000",
        },
        AIOKafkaConsumer,
    )
    assert kwargs == {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": "u",
        "request_timeout_ms": 5000,
    }
    with pytest.raises(KafkaOptionError, match=r"'no\.such\.setting' is not supported"):
        client_kwargs({"no.such.setting": "1"}, AIOKafkaConsumer)


@pytest.mark.parametrize(
    "name",
    [
        "minOffsetsPerTrigger",
        "maxTriggerDelay",
        "maxRecordsPerPartition",
    ],
)
def test_connector_options_not_implemented_are_refused_not_ignored(name: str) -> None:
    opts = {"kafka.bootstrap.servers": "b:9092", "subscribe": "t", name: "1"}
    with pytest.raises(KafkaOptionError, match=f"option '{name}' is not supported by the pykafka source"):
        parse_source_options(opts, streaming=True)


def test_writer_schema_rules_follow_sparks_kafka_writer() -> None:
    from pyspark.sql import types as T

    from pipeline.kafka_source.datasource import check_writer_schema

    header = T.ArrayType(
        T.StructType([T.StructField("key", T.StringType(), False), T.StructField("value", T.BinaryType())])
    )
    string, binary = T.StringType(), T.BinaryType()

    def check(option: str | None = "t", **columns: T.DataType) -> None:
        check_writer_schema(T.StructType([T.StructField(n, t) for n, t in columns.items()]), option)

    check(key=string, value=binary, id=T.LongType(), note=string)  # other columns are ignored, as in Spark
    check(None, value=string, topic=string, partition=T.IntegerType(), timestamp=T.TimestampType())
    check(value=binary, headers=header)  # nullability does not matter
    with pytest.raises(KafkaOptionError, match="Required attribute 'value' not found"):
        check(key=string)
    with pytest.raises(KafkaOptionError, match="topic option required when no 'topic' attribute is present"):
        check(None, value=string)
    with pytest.raises(
        KafkaOptionError, match=r"value attribute unsupported type int\. value must be a\(n\) string or"
    ):
        check(value=T.IntegerType())
    with pytest.raises(
        KafkaOptionError, match=r"partition attribute unsupported type bigint\. partition must be a\(n\) int"
    ):
        check(value=string, partition=T.LongType())
    with pytest.raises(KafkaOptionError, match="headers attribute unsupported type map<string,binary>"):
        check(value=string, headers=T.MapType(string, binary))
    with pytest.raises(KafkaOptionError, match="a double timestamp is not supported"):
        check(value=string, timestamp=T.DoubleType())
