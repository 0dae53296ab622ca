"""Spark read throughput: the ``pykafka`` data source against a raw aiokafka consumer reading the same records.

A topic of ``N`` records of 1 KiB on 4 partitions is produced once; then Spark (``local[2]``, the data source's
default options) counts the records and sums the value lengths, so every value is fetched, converted to Arrow and
handed to the JVM; and one aiokafka consumer (no group, same fetch sizes as the data source uses) reads the same
offsets and sums the same lengths in one Python process. Each is timed after a warm-up read of the first part of the
topic (a warm JVM, loaded Python workers and pooled Kafka clients for Spark; a connected consumer for aiokafka).
The target is a Spark/raw time ratio of at most 1.5.

``--messages N`` (or ``BENCH_SPARK_READ_MESSAGES``) sets N; ``BENCH_PROFILE=1`` samples the Spark Python workers with
py-spy during the timed read (collapsed stacks in the scratch directory, printed as the top frames).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import produce_batch
from bench.scenarios.base import PARTITIONS, Context, new_topic
from demo.embedded_broker import EmbeddedBroker

RECORD_BYTES = 1024
TARGET_RATIO = 1.5
WARMUP_FRACTION = 0.05


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    env_count = os.environ.get("BENCH_SPARK_READ_MESSAGES")
    count = ctx.size(default=int(env_count) if env_count else 1_000_000, quick=20_000)
    topic = new_topic(broker, "spark-read")
    started = time.monotonic()
    produced = asyncio.run(produce_batch(broker.bootstrap, topic, _records(count)))
    produce_s = time.monotonic() - started
    print(f"  spark-read: produced {produced} records of {RECORD_BYTES} B in {produce_s:.1f} s", flush=True)
    ends = _end_offsets(broker.bootstrap, topic)
    warm_ends = {p: max(1, int(end * WARMUP_FRACTION)) for p, end in ends.items()}
    total_bytes = count * RECORD_BYTES

    broker_pid = broker.process.pid
    spark = _spark_session()
    try:
        spark_warm = _spark_read(spark, broker.bootstrap, topic, warm_ends)
        # what any read costs, whatever its size: planning in a Python process, scheduling, task start-up
        spark_tiny = _spark_read(spark, broker.bootstrap, topic, dict.fromkeys(ends, 1))
        profilers = _profile_workers(ctx.root / "spark-workers.collapsed")
        before = _cpu(broker_pid)
        spark_figures = _spark_read(spark, broker.bootstrap, topic, None)
        spark_figures["cpu_s"] = _cpu_delta(before, _cpu(broker_pid))
        for profiler in profilers:
            profiler.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        for profiler in profilers:
            profiler.wait(timeout=60)
    finally:
        spark.stop()
    raw_warm = asyncio.run(_raw_read(broker.bootstrap, topic, warm_ends))
    before = _cpu(broker_pid)
    raw_figures = asyncio.run(_raw_read(broker.bootstrap, topic, ends))
    raw_figures["cpu_s"] = _cpu_delta(before, _cpu(broker_pid))
    for name, figures in (("spark", spark_figures), ("raw", raw_figures)):
        if figures["records"] != count or figures["value_bytes"] != total_bytes:
            raise RuntimeError(f"{name} read {figures['records']} records / {figures['value_bytes']} B, not {count}")
    variants = {
        "spark": {
            "summary": _summary(spark_figures),
            "warmup": _summary(spark_warm),
            "one_record_per_partition_s": round(spark_tiny["seconds"], 2),
        },
        "raw-aiokafka": {"summary": _summary(raw_figures), "warmup": _summary(raw_warm)},
    }
    for name, result in variants.items():
        print(f"  spark-read {name}: {result['summary']}", flush=True)
    ratio = spark_figures["seconds"] / max(1e-9, raw_figures["seconds"])
    profiles = sorted(ctx.root.glob("spark-workers.collapsed.*"))
    return {
        "params": {
            "messages": count,
            "record_bytes": RECORD_BYTES,
            "partitions": PARTITIONS,
            "spark_master": "local[2]",
            "warmup_fraction": WARMUP_FRACTION,
            "produce_s": round(produce_s, 1),
        },
        "variants": variants,
        "summary": {"spark_vs_raw_time": round(ratio, 2), "target": TARGET_RATIO},
        "profile_top": _top_frames(profiles) if profiles else None,
        "verdict": "ok" if ratio <= TARGET_RATIO else f"spark/raw {ratio:.2f} > {TARGET_RATIO}",
    }


def _records(count: int) -> Any:
    filler = b"x" * (RECORD_BYTES - 16)
    for i in range(count):
        yield f"k{i}".encode(), f"{i:016d}".encode() + filler


def _summary(figures: dict[str, Any]) -> dict[str, Any]:
    seconds = figures["seconds"]
    summary = {
        "records": figures["records"],
        "seconds": round(seconds, 2),
        "records_per_s": round(figures["records"] / max(1e-9, seconds)),
        "mb_per_s": round(figures["value_bytes"] / 1e6 / max(1e-9, seconds), 1),
    }
    if "cpu_s" in figures:
        summary["cpu_s"] = figures["cpu_s"]
    return summary


def _processes() -> dict[int, tuple[int, float]]:
    """Every process's parent and CPU seconds: user+system, plus that of children already waited for."""
    table = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]) / tick)
    return table


def _descendants(table: dict[int, tuple[int, float]], root: int) -> list[int]:
    found = []
    for pid in table:
        parent = table[pid][0]
        while parent > 1 and parent != root:
            parent = table.get(parent, (0, 0.0))[0]
        if parent == root:
            found.append(pid)
    return found


def _cpu(broker_pid: int) -> dict[str, float]:
    """CPU seconds so far of the broker, of this process (the raw consumer, the Spark driver's Python side) and of
    its descendants (Spark's JVM; the pyspark daemon and its Python workers): on a shared machine the wall-clock
    ratio moves with the load, the CPU each side spends much less."""
    table = _processes()
    me = os.getpid()
    python = set(_pyspark_pids(table))
    spark = [pid for pid in _descendants(table, me) if pid != broker_pid]
    return {
        "broker": table.get(broker_pid, (0, 0.0))[1],
        "bench_process": table.get(me, (0, 0.0))[1],
        "spark_jvm": sum(table[pid][1] for pid in spark if pid not in python),
        "spark_python_workers": sum(table[pid][1] for pid in spark if pid in python),
    }


def _cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before.get(name, 0.0), 2) for name in after}


def _end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    """End offsets confirmed by a fetch (the data source's own way): a listed end can lag on this broker."""
    from pipeline.kafka_source.client import KafkaReader

    with KafkaReader(bootstrap) as reader:
        ends = reader.latest([(topic, p) for p in range(PARTITIONS)])
    return {p: end for (_, p), end in ends.items()}


def _spark_session() -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from pipeline.kafka_source import register

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("rebound-bench-spark-read")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def _spark_read(spark: Any, bootstrap: str, topic: str, ends: dict[int, int] | None) -> dict[str, Any]:
    import json

    from pyspark.sql import functions as F

    reader = spark.read.format("pykafka").option("kafka.bootstrap.servers", bootstrap).option("subscribe", topic)
    if ends is not None:
        reader = reader.option("endingOffsets", json.dumps({topic: {str(p): e for p, e in ends.items()}}))
    started = time.monotonic()
    row = reader.load().select(F.count(F.lit(1)).alias("n"), F.sum(F.length("value")).alias("b")).collect()[0]
    return {"seconds": time.monotonic() - started, "records": int(row["n"]), "value_bytes": int(row["b"] or 0)}


async def _raw_read(bootstrap: str, topic: str, ends: dict[int, int]) -> dict[str, Any]:
    """One consumer over every partition, with the fetch sizes the data source's reader uses by default."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from pipeline.kafka_source.client import client_kwargs
    from pipeline.kafka_source.datasource import reader_fetch_config
    from pipeline.kafka_source.options import DEFAULT_MAX_BATCH_BYTES

    fetch = client_kwargs(reader_fetch_config({}, DEFAULT_MAX_BATCH_BYTES), AIOKafkaConsumer)
    started = time.monotonic()
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, **fetch)
    await consumer.start()
    records = value_bytes = 0
    try:
        tps = [TopicPartition(topic, p) for p in ends]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        pending = {tp for tp in tps if ends[tp.partition] > 0}
        while pending:
            got = await consumer.getmany(*pending, timeout_ms=500)
            for tp, batch in got.items():
                end = ends[tp.partition]
                for r in batch:
                    if r.offset < end:
                        records += 1
                        value_bytes += len(r.value) if r.value is not None else 0
                if batch and batch[-1].offset >= end - 1:
                    pending.discard(tp)
    finally:
        await consumer.stop()
    return {"seconds": time.monotonic() - started, "records": records, "value_bytes": value_bytes}


def _profile_workers(output: Path) -> list[subprocess.Popen[bytes]]:
    """With ``BENCH_PROFILE=1``, one py-spy per Spark Python process (the pyspark daemon and the workers it forked
    for the warm-up read, which Spark reuses), each writing ``<output>.<pid>``."""
    if os.environ.get("BENCH_PROFILE") != "1":
        return []
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if py_spy is None:
        raise RuntimeError("BENCH_PROFILE=1 needs py-spy (pip install py-spy)")
    pids = _pyspark_pids()
    if not pids:
        raise RuntimeError("BENCH_PROFILE=1: no pyspark.daemon process found after the warm-up read")
    command = [py_spy, "record", "--format", "raw", "--rate", "200", "--nonblocking"]
    return [
        subprocess.Popen(
            [*command, "--pid", str(pid), "--output", f"{output}.{pid}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid in pids
    ]


def _pyspark_pids(table: dict[int, tuple[int, float]] | None = None) -> list[int]:
    """This run's pyspark daemon and workers (other Spark sessions on the machine have their own)."""
    pids = []
    for pid in _descendants(table or _processes(), os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pyspark.daemon" in cmdline:
            pids.append(pid)
    return pids


def _top_frames(paths: list[Path], limit: int = 25) -> list[tuple[str, int]]:
    """Self time per frame (the last frame of each collapsed stack) over every profiled process, biggest first."""
    counts: Counter[str] = Counter()
    for path in paths:
        for line in path.read_text().splitlines():
            stack, _, samples = line.rpartition(" ")
            if stack and samples.isdigit():
                counts[stack.split(";")[-1]] += int(samples)
    total = sum(counts.values()) or 1
    top = counts.most_common(limit)
    for frame, samples in top:
        print(f"    {100 * samples / total:5.1f}%  {frame}", flush=True)
    return top
