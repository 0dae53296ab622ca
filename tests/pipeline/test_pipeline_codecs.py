"""The ``pykafka`` source reads batches compressed with every codec Kafka defines (decoded in Spark's Python workers,
which need ``cramjam`` for snappy, lz4 and zstd), and a batch it cannot decode fails the read, naming it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import create_topics, unique

from demo.embedded_broker import EmbeddedBroker
from tests.raw_batches import batch, produce_raw, stored_codecs, with_bad_crc

pytestmark = [pytest.mark.broker, pytest.mark.spark]

CODECS = ("gzip", "snappy", "lz4", "zstd")


async def produce_each_codec(bootstrap: str, topic: str) -> list[tuple[bytes, bytes, int]]:
    """5 records per codec and 5 uncompressed, spread over both partitions; answers (key, value, partition)."""
    from aiokafka import AIOKafkaProducer

    sent: list[tuple[bytes, bytes, int]] = []
    for codec in (*CODECS, None):
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, compression_type=codec, linger_ms=200, acks="all")
        await producer.start()
        try:
            rows = [(f"{codec}-{n}".encode(), bytes([n]) * 50 + b"\x00\xff", n % 2) for n in range(5)]
            futures = [await producer.send(topic, key=k, value=v, partition=p) for k, v, p in rows]
            await producer.flush()
            await asyncio.gather(*futures)
        finally:
            await producer.stop()
        sent += rows
    return sent


def read(spark: Any, broker: EmbeddedBroker, topic: str) -> Any:
    return (
        spark.read.format("pykafka")
        .option("kafka.bootstrap.servers", broker.bootstrap)
        .option("subscribe", topic)
        .option("minPartitions", "2")
        .load()
    )


def test_every_codec_is_read_by_the_spark_source(spark: Any, broker: EmbeddedBroker) -> None:
    topic = unique("codecs")
    create_topics(broker.bootstrap, {topic: 2})
    sent = asyncio.run(produce_each_codec(broker.bootstrap, topic))
    stored = {codec for p in (0, 1) for _, codec in asyncio.run(stored_codecs(broker.bootstrap, topic, p))}
    assert stored == {*CODECS, "none"}
    rows = read(spark, broker, topic).select("key", "value", "partition").collect()
    assert sorted((bytes(r.key), bytes(r.value), r.partition) for r in rows) == sorted(sent)


def test_a_batch_that_cannot_be_decoded_fails_the_read_naming_its_partition(spark: Any, broker: EmbeddedBroker) -> None:
    """Never a silent gap in the facts: the job fails with aiokafka's error; the operator moves the job's start past
    the batch (``startingOffsets``), as docs/pipeline.md says."""
    topic = unique("corrupt")
    create_topics(broker.bootstrap, {topic: 1})
    asyncio.run(produce_raw(broker.bootstrap, topic, 0, bytes(batch([(b"a", b"1")]))))
    bad = asyncio.run(produce_raw(broker.bootstrap, topic, 0, with_bad_crc(batch([(b"b", b"2"), (b"c", b"3")]))))
    asyncio.run(produce_raw(broker.bootstrap, topic, 0, bytes(batch([(b"d", b"4")]))))
    with pytest.raises(Exception, match="Invalid CRC") as failure:
        read(spark, broker, topic).collect()
    assert topic in str(failure.value)
    after = (
        spark.read.format("pykafka")
        .option("kafka.bootstrap.servers", broker.bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", f'{{"{topic}":{{"0":{bad + 2}}}}}')
        .load()
        .collect()
    )
    assert [bytes(r.key) for r in after] == [b"d"]
