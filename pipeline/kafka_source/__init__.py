"""``pykafka``: a PySpark Python Data Source for Kafka (batch read, micro-batch read, batch write).

Use it where the JVM ``spark-sql-kafka`` connector is unavailable::

    from pipeline.kafka_source import register
    fmt = register(spark)                      # "pykafka"
    df = (spark.read.format(fmt)
          .option("kafka.bootstrap.servers", "host:9092")
          .option("subscribe", "items.failed")
          .option("includeHeaders", "true")
          .load())

The pure modules (``options``, ``planning``, ``arrow``) import neither Spark's JVM nor a Kafka client.
"""

from __future__ import annotations

from typing import Any

SHORT_NAME = "pykafka"


def register(spark: Any) -> str:
    from pipeline.kafka_source.datasource import register as _register

    return _register(spark)


__all__ = ["SHORT_NAME", "register"]
