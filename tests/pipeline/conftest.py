"""Fixtures for the pipeline tests: one local[2] SparkSession for the whole session, and Kafka helpers."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def _allow_assert_dataframe_equal_with_pandas_3() -> None:
    """Guarded fallback, normally inactive: the ``pipeline`` extra pins ``pandas>=2.2,<3``, with which
    ``pyspark.pandas`` imports and this does nothing. pyspark 4.3's ``assertDataFrameEqual`` imports
    ``pyspark.pandas`` unconditionally, which fails on pandas 3 (``DateOffset`` moved); the pipeline never uses
    pandas-on-Spark, so if someone runs the tests with pandas 3 anyway, the assertion gets inert stand-ins."""
    import types

    try:
        import pyspark.pandas  # noqa: F401
    except ImportError:
        stub = types.ModuleType("pyspark.pandas")
        stub.DataFrame = type("DataFrame", (), {})  # type: ignore[attr-defined]
        utils = types.ModuleType("pyspark.testing.pandasutils")
        utils.PandasOnSparkTestUtils = type("PandasOnSparkTestUtils", (), {})  # type: ignore[attr-defined]
        sys.modules["pyspark.pandas"] = stub
        sys.modules["pyspark.testing.pandasutils"] = utils


_allow_assert_dataframe_equal_with_pandas_3()


SELECT_HEADROOM = 600
"""Descriptors open in the test process above which Spark is not started (select() handles numbers below 1,024)."""


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from pyspark.sql import SparkSession

    from pipeline.kafka_source import register
    from tests.loop_hygiene import open_descriptors

    # py4j's callback server and PySpark's accumulator server use select(), which fails on a descriptor numbered
    # 1,024 or more: a Spark test would then hang until its timeout (tests/loop_hygiene.py). Fail at once instead.
    assert open_descriptors() < SELECT_HEADROOM, (
        f"{open_descriptors()} descriptors open before Spark starts: something earlier in this process leaks them"
    )
    session = (
        SparkSession.builder.master("local[2]")
        .appName("rebound-pipeline-tests")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def create_topics(bootstrap: str, topics: dict[str, int]) -> None:
    from pipeline.kafka_source.client import create_topics as create

    create(bootstrap, topics)


def produce(bootstrap: str, topic: str, records: Iterable[dict[str, Any]]) -> list[Any]:
    """Send records (dicts with value, key, headers, partition, timestamp_ms) and wait for every ack."""
    from aiokafka import AIOKafkaProducer

    async def run() -> list[Any]:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
        await producer.start()
        try:
            futures = [await producer.send(topic, **r) for r in records]
            return list(await asyncio.gather(*futures))
        finally:
            await producer.stop()

    return asyncio.run(run())


class S3Server:
    """A local S3 (moto) for ``--out s3a://...``; ``bucket()`` makes a fresh bucket and returns its name."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def bucket(self, prefix: str = "rebound") -> str:
        import boto3

        name = unique(prefix)
        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on a free port, with the AWS variables s3fs (and boto3) read pointing at it; they are put
    back as they were afterwards. Spark's JVM sees them too, which is harmless: it has no S3 driver here."""
    import shutil
    import subprocess
    import time
    import urllib.request
    from pathlib import Path

    exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    if not Path(exe).exists():
        pytest.skip("moto_server is not installed (pip install 'moto[server]' s3fs)")
    from demo.embedded_broker import free_port

    port = free_port()  # outside the ephemeral range: an outgoing connection cannot take it before moto binds
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    settings = {
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {name: os.environ.get(name) for name in settings}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on port {port}") from None
                time.sleep(0.2)
        os.environ.update(settings)
        yield S3Server(endpoint)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
