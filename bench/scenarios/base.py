"""What scenarios share: the run context, a paced producer and readiness by a warm-up record."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import FaustProcess, now_ms, read_calls, wait_until
from demo.embedded_broker import EmbeddedBroker
from demo.harness import create_topics

PARTITIONS = 4
# Every scenario runs without restarts, so the producer may batch as a real deployment does; the harness's
# one-record batches only matter when a table recovers its changelog from this broker.
PRODUCTION_BATCH = {"REBOUND_PRODUCER_MAX_BATCH_BYTES": "16384"}


@dataclass
class Context:
    root: Path
    quick: bool
    messages: int | None

    def size(self, default: int, quick: int) -> int:
        return self.messages if self.messages is not None else (quick if self.quick else default)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def new_topic(broker: EmbeddedBroker, prefix: str) -> str:
    topic = unique(prefix)
    asyncio.run(create_topics(broker.bootstrap, [topic], PARTITIONS))
    return topic


def script(fail_until: int = 0) -> bytes:
    return json.dumps({"t": now_ms(), "fail_until": fail_until}).encode()


async def _send(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for key, value in records:
            await producer.send_and_wait(topic, key=key, value=value)
    finally:
        await producer.stop()


def await_ready(
    broker: EmbeddedBroker, topic: str, calls: Path, worker: FaustProcess, timeout: float = 90, key_field: str = "k"
) -> float:
    """Ready = a warm-up record on every partition was handled: the group has formed and every partition flows.

    Works the same for Rebound and the baselines, which have no readiness view. Returns the seconds it took.
    """
    started = time.monotonic()
    keys = [f"warmup-{i}" for i in range(PARTITIONS * 4)]

    def seen() -> bool:
        return len({c[key_field] for c in read_calls(calls) if c[key_field].startswith("warmup-")}) >= len(keys)

    asyncio.run(_send(broker.bootstrap, topic, [(k.encode(), script()) for k in keys]))
    if not wait_until(seen, timeout, check=[worker]):
        raise RuntimeError(f"{worker.module} never handled the warm-up records:\n{worker.log_tail()}")
    return time.monotonic() - started


async def paced(
    bootstrap: str, topic: str, rate: float, count: int, make: Any, *, linger_ms: int = 0
) -> dict[str, int]:
    """Produce ``count`` records at ``rate`` per second on an absolute schedule; returns key -> produced at (ms).

    ``make(i)`` gives the key and the value's fields; the value also carries ``t``, the time it was produced.
    ``linger_ms`` > 0 lets the producer batch what comes due within it: without it every record is a batch of its
    own, and the embedded broker's fetch cost grows with the batches a partition holds (``docs/benchmarks.md``).
    """
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=linger_ms)
    await producer.start()
    produced: dict[str, int] = {}
    futures = []
    try:
        start = time.monotonic()
        for i in range(count):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            key, fields = make(i)
            produced_at = now_ms()
            value = json.dumps({"t": produced_at, **fields}).encode()
            futures.append(await producer.send(topic, key=key.encode(), value=value))
            produced[key] = produced_at
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return produced
