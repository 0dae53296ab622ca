"""Save modes of the pykafka sink, through real Spark writes to the embedded broker.

Spark's Kafka sink allows Append and ErrorIfExists and refuses Overwrite and Ignore. A Python data source only
ever sees Append and Overwrite (Spark refuses ErrorIfExists and Ignore for it), so the sink accepts Append and
refuses Overwrite, which it used to turn silently into an append.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.pipeline.conftest import create_topics, unique


def topic_values(spark: Any, bootstrap: str, topic: str) -> list[str]:
    rows = (
        spark.read.format("pykafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .load()
        .selectExpr("CAST(value AS STRING) AS value")
        .collect()
    )
    return sorted(r.value for r in rows)


def write(spark: Any, bootstrap: str, topic: str, values: list[str], mode: str | None) -> None:
    writer = spark.createDataFrame([(v,) for v in values], "value string").write.format("pykafka")
    writer = writer.option("kafka.bootstrap.servers", bootstrap).option("topic", topic)
    if mode is not None:
        writer = writer.mode(mode)
    writer.save()


def test_append_adds_records(spark: Any, broker: Any) -> None:
    topic = unique("sink-append")
    create_topics(broker.bootstrap, {topic: 1})
    write(spark, broker.bootstrap, topic, ["a", "b"], "append")
    write(spark, broker.bootstrap, topic, ["c"], "append")
    assert topic_values(spark, broker.bootstrap, topic) == ["a", "b", "c"]


def test_overwrite_is_refused_and_writes_nothing(spark: Any, broker: Any) -> None:
    from pyspark.errors import PySparkException

    topic = unique("sink-overwrite")
    create_topics(broker.bootstrap, {topic: 1})
    write(spark, broker.bootstrap, topic, ["kept"], "append")
    with pytest.raises(PySparkException, match=r"Save mode Overwrite not allowed for Kafka\. Allowed save modes"):
        write(spark, broker.bootstrap, topic, ["replacement"], "overwrite")
    assert topic_values(spark, broker.bootstrap, topic) == ["kept"]


@pytest.mark.parametrize(
    ("mode", "spark_name"), [(None, "ErrorIfExists"), ("error", "ErrorIfExists"), ("ignore", "Ignore")]
)
def test_error_if_exists_and_ignore_are_refused_by_spark(
    spark: Any, broker: Any, mode: str | None, spark_name: str
) -> None:
    """Spark itself refuses these for a Python data source, before the sink runs: nothing is written."""
    from pyspark.errors import PySparkException

    topic = unique("sink-mode")
    create_topics(broker.bootstrap, {topic: 1})
    with pytest.raises(PySparkException, match=rf'UNSUPPORTED_DATA_SOURCE_SAVE_MODE.*"{spark_name}" mode'):
        write(spark, broker.bootstrap, topic, ["x"], mode)
    assert topic_values(spark, broker.bootstrap, topic) == []
