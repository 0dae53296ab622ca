"""The per-worker Kafka client pool: its rules on fakes, and reuse across Spark tasks on the embedded broker."""

from __future__ import annotations

import os
from typing import Any

import pytest
from conftest import create_topics, produce, unique

from pipeline.kafka_source.pool import ReaderPool


class FakeReader:
    def __init__(self, bootstrap: str, config: Any) -> None:
        self.bootstrap, self.config = bootstrap, dict(config)
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _pool(**kwargs: Any) -> tuple[ReaderPool, list[FakeReader]]:
    made: list[FakeReader] = []

    def factory(bootstrap: str, config: Any) -> FakeReader:
        made.append(FakeReader(bootstrap, config))
        return made[-1]

    return ReaderPool(factory, **kwargs), made


def test_a_returned_reader_serves_the_next_checkout_with_the_same_settings() -> None:
    pool, made = _pool()
    with pool.checkout("b:9092", {"client.id": "x"}) as first:
        pass
    with pool.checkout("b:9092", {"client.id": "x"}) as second:
        assert second is first
    assert (pool.stats.created, pool.stats.reused, first.closed) == (1, 1, 0)
    assert len(made) == 1


def test_other_bootstrap_or_settings_get_their_own_reader() -> None:
    pool, made = _pool()
    for bootstrap, config in (("b:9092", {}), ("c:9092", {}), ("b:9092", {"security.protocol": "SSL"})):
        with pool.checkout(bootstrap, config):
            pass
    assert pool.stats.created == 3
    assert [(r.bootstrap, r.config) for r in made] == [
        ("b:9092", {}),
        ("c:9092", {}),
        ("b:9092", {"security.protocol": "SSL"}),
    ]


def test_a_reader_is_used_by_one_task_at_a_time() -> None:
    pool, _ = _pool()
    with pool.checkout("b", {}) as outer, pool.checkout("b", {}) as inner:
        assert inner is not outer
    assert pool.stats.created == 2
    assert pool.idle_count() == 2


def test_a_reader_whose_task_failed_is_closed_not_returned() -> None:
    pool, made = _pool()
    with pytest.raises(RuntimeError, match="fetch broke"), pool.checkout("b", {}):
        raise RuntimeError("fetch broke")
    assert made[0].closed == 1
    assert pool.idle_count() == 0
    with pool.checkout("b", {}) as again:
        assert again is not made[0]
    assert (pool.stats.created, pool.stats.discarded) == (2, 1)


def test_a_generator_closed_mid_read_discards_its_reader() -> None:
    """Spark closes a partition's generator early (a ``limit``): the reader's fetch state is unknown then."""
    pool, made = _pool()

    def read() -> Any:
        with pool.checkout("b", {}):
            yield 1
            yield 2

    rows = read()
    assert next(rows) == 1
    rows.close()
    assert made[0].closed == 1
    assert pool.idle_count() == 0


def test_idle_readers_expire_and_the_oldest_go_beyond_capacity() -> None:
    clock = Clock()
    pool, made = _pool(idle_timeout_s=60, max_idle=2, clock=clock)
    with pool.checkout("old", {}):
        pass
    clock.now += 61
    with pool.checkout("new", {}):
        pass  # taking a reader sweeps the expired ones first
    assert made[0].closed == 1
    assert pool.stats.expired == 1
    with pool.checkout("a", {}), pool.checkout("b", {}):
        pass
    assert [r.closed for r in made] == [1, 1, 0, 0]  # "new" was the oldest idle one beyond max_idle=2
    pool.close_all()
    assert [r.closed for r in made] == [1, 1, 1, 1]
    assert pool.idle_count() == 0


def test_a_failing_close_does_not_fail_the_task() -> None:
    pool, _ = _pool()

    def broken_close() -> None:
        raise OSError("socket already gone")

    with pytest.raises(ValueError), pool.checkout("b", {}) as reader:
        reader.close = broken_close  # type: ignore[method-assign]
        raise ValueError("the task's own error wins")
    assert pool.stats.discarded == 1


def _worker_stats(bootstrap: str, client_id: str) -> Any:
    """A ``mapInArrow`` function run by Spark Python workers: that worker's pool counters for the test's key."""

    def probe(batches: Any) -> Any:
        import pyarrow as pa

        from pipeline.kafka_source.datasource import reader_fetch_config
        from pipeline.kafka_source.options import DEFAULT_MAX_BATCH_BYTES
        from pipeline.kafka_source.pool import READERS, ReaderPool

        for _ in batches:
            pass
        key = ReaderPool.key(bootstrap, reader_fetch_config({"client.id": client_id}, DEFAULT_MAX_BATCH_BYTES))
        s = READERS.stats
        yield pa.RecordBatch.from_pydict(
            {"pid": [os.getpid()], "created": [s.created_by_key[key]], "reused": [s.reused_by_key[key]]},
            schema=pa.schema([("pid", pa.int64()), ("created", pa.int64()), ("reused", pa.int64())]),
        )

    return probe


@pytest.mark.broker
@pytest.mark.spark
def test_spark_tasks_on_one_worker_share_one_kafka_client(spark, broker) -> None:
    """Eight tasks (one per partition), twice, on local[2]: Spark runs them on reused Python workers, which take
    the client their previous task returned instead of opening one each (the old reader opened 16)."""
    partitions = 8
    topic = unique("pool")
    client_id = unique("pool-test")  # a pool key of this test's own, whatever other tests left in the workers
    create_topics(broker.bootstrap, {topic: partitions})
    produce(broker.bootstrap, topic, [{"value": b"v%d" % i, "partition": i % partitions} for i in range(80)])

    def read() -> int:
        df = spark.read.format("pykafka").option("kafka.bootstrap.servers", broker.bootstrap)
        return int(df.option("subscribe", topic).option("kafka.client.id", client_id).load().count())

    assert read() == 80
    assert read() == 80
    # A Python job right after runs on the same idle workers (Spark keeps them for reuse): ask their pools.
    probe = _worker_stats(broker.bootstrap, client_id)
    rows = spark.range(0, 4, 1, 4).mapInArrow(probe, "pid long, created long, reused long").collect()
    by_pid = {r["pid"]: (r["created"], r["reused"]) for r in rows}
    assert sum(c for c, _ in by_pid.values()) >= 1, f"the probe ran on workers that never read: {by_pid}"
    for pid, (created, _) in by_pid.items():
        assert created <= 1, f"worker {pid} opened {created} Kafka clients for 16 tasks: {by_pid}"
    assert sum(r for _, r in by_pid.values()) >= 1, by_pid
