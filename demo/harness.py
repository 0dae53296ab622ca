"""Running real workers against a real broker: shared by ``make demo``, the integration tests and benchmarks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo.embedded_broker import FAST_JOIN, TANSU_SETTINGS, free_port

FAST_GROUP_TIMEOUTS = {
    **FAST_JOIN,  # the embedded broker's first group join waits about half the rebalance timeout
    "REBOUND_COMMIT_INTERVAL": "0.5",
    **TANSU_SETTINGS,
}


@dataclass
class Worker:
    """A ``faust -A app worker`` subprocess with its own data directory and web port."""

    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    web_port: int = field(default_factory=free_port)
    stopping: bool = False

    def start(self) -> Worker:
        env = {**os.environ, **self.env, "REBOUND_WEB_PORT": str(self.web_port)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child process
        self.process = subprocess.Popen(
            [sys.executable, "-m", "faust", "-A", "app", "worker", "-l", env.get("REBOUND_LOG_LEVEL", "info")],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parent.parent,
            start_new_session=True,
        )
        return self

    @property
    def crashed(self) -> bool:
        """Exited without being asked to."""
        return self.process is not None and self.process.poll() is not None and not self.stopping

    def stop(self, timeout: float = 30.0) -> int | None:
        self.stopping = True
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout)

    def kill(self) -> None:
        self.stopping = True
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def worker_env(broker_url: str, data_dir: Path, **overrides: str) -> dict[str, str]:
    return {
        "REBOUND_BROKER": broker_url,
        "REBOUND_DATA_DIR": str(data_dir),
        **FAST_GROUP_TIMEOUTS,
        **overrides,
    }


async def create_topics(bootstrap: str, topics: Iterable[str], partitions: int) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, partitions, 1) for topic in topics])
    finally:
        await admin.close()


async def produce(
    bootstrap: str, topic: str, records: Iterable[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]]
) -> list[Any]:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        return [
            await producer.send_and_wait(topic, key=key, value=value, headers=headers or None)
            for key, value, headers in records
        ]
    finally:
        await producer.stop()


@dataclass
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]
    timestamp_ms: int
    raw_headers: list[tuple[str, bytes]] = field(default_factory=list)

    def json(self) -> dict[str, Any]:
        return json.loads(self.value or b"null")  # type: ignore[no-any-return]


class Tail:
    """Reads topics from the beginning, without a group, so it never disturbs the workers' assignment."""

    def __init__(self, bootstrap: str, topics: Iterable[str]) -> None:
        self.bootstrap = bootstrap
        self.topics = list(topics)
        self.records: list[Record] = []
        self._consumer: Any = None

    async def __aenter__(self) -> Tail:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        self._consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False)
        await self._consumer.start()
        partitions = []
        for topic in self.topics:
            for _ in range(300):  # the worker creates its topics when it starts
                found = self._consumer.partitions_for_topic(topic)
                if found:
                    break
                await self._consumer._client.force_metadata_update()
                await asyncio.sleep(0.1)
            partitions += [TopicPartition(topic, p) for p in sorted(found or ())]
        self._consumer.assign(partitions)
        await self._consumer.seek_to_beginning(*partitions)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._consumer.stop()

    async def poll(self, timeout_ms: int = 200) -> list[Record]:
        batch = await self._consumer.getmany(timeout_ms=timeout_ms)
        new = [
            Record(
                topic=message.topic,
                partition=message.partition,
                offset=message.offset,
                key=message.key,
                value=message.value,
                headers=dict(message.headers or ()),
                timestamp_ms=message.timestamp,
                raw_headers=list(message.headers or ()),
            )
            for messages in batch.values()
            for message in messages
        ]
        self.records += new
        return new

    async def until(self, predicate: Any, timeout: float, on_record: Any = None) -> bool:
        """Poll until ``predicate(records)`` holds; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for record in await self.poll():
                if on_record is not None:
                    await on_record(record)
            if predicate(self.records):
                return True
        return predicate(self.records)  # type: ignore[no-any-return]
