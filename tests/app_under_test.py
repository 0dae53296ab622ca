"""A Rebound app built but not started: real Faust, mode and aiokafka objects, no broker.

The fixtures (``runtime``, ``consumer``, ``handed_over``) reach tests/app and tests/contract through their
conftest.py, and ``runtime`` and ``rocksdb_runtime`` reach tests/tables through its conftest.py; a module that needs
other settings overrides ``runtime`` with :func:`build_runtime`. The helpers stand in for what a running worker would
do: the fetcher handing records over, the producer connecting, a busy event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, cast

import pytest
from faust.types import TP

from agents.runtime import Runtime
from app.consumer import ReboundConsumer
from app.factory import build
from rebound.settings import load_settings

ITEMS_1 = TP("items", 1)


def build_runtime(tmp_path: Path, **settings: object) -> Runtime:
    """The scripted handler, the memory store, no topic provisioning, two partitions; ``settings`` add or change.

    Call it inside the test's event loop (an async fixture or test): Faust's services take the loop running when they
    are made."""
    defaults: dict[str, object] = {
        "handler": "tests.scripted_handler:handle",
        "data_dir": str(tmp_path),
        "provision_topics": False,
        "store": "memory://",
    }
    return build(load_settings(**(defaults | settings)), partitions=2)


@pytest.fixture
async def runtime(tmp_path: Path) -> Runtime:
    return build_runtime(tmp_path)


@pytest.fixture
async def rocksdb_runtime(tmp_path: Path) -> AsyncIterator[Runtime]:
    """On RocksDB, as workers run (the tables' reads, the replay point and the emptying of a partition live in its
    per-partition databases); the databases closed after the test."""
    runtime = build_runtime(tmp_path, store="rocksdb://")
    yield runtime
    for table in (runtime.store.states, runtime.store.payloads):
        for db in table.data._dbs.values():
            db.close()


@pytest.fixture
async def consumer(runtime: Runtime) -> ReboundConsumer:
    """The app's consumer with the main topic subscribed, as a starting worker subscribes it: main topics are
    acknowledged."""
    app = runtime.app
    app.topics.add(runtime.main_topics["items"])
    await cast(Any, app.topics)._update_indices()
    made = app.consumer
    assert isinstance(made, ReboundConsumer)
    return made


class FetchedMessage:
    """A record of items partition 1 as the fetcher hands it to the consumer's ``_drain_one``."""

    def __init__(self, offset: int) -> None:
        self.topic, self.partition, self.tp, self.offset = "items", 1, ITEMS_1, offset


@pytest.fixture
def handed_over(consumer: ReboundConsumer, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """The conductor's callback and the fetcher's seek, recorded instead of reaching streams and aiokafka."""
    seen: dict[str, list[int]] = {"delivered": [], "seeks": []}

    async def callback(message: Any) -> None:
        seen["delivered"].append(message.offset)

    async def seek(tp: TP, offset: int) -> None:
        seen["seeks"].append(offset)

    monkeypatch.setattr(consumer, "callback", callback)
    monkeypatch.setattr(consumer, "_seek", seek)
    return seen


def started_producer(app: Any) -> Any:
    """The app's own producer, marked started as ``Service.start()`` marks it (nothing is produced here)."""
    producer = app.producer
    producer._started.set()
    return producer


def slow_starting_producer(app: Any, starts: list[str], seconds: float = 0.05) -> Any:
    """The app's own producer, whose start (mode's real ``start()``) connects for ``seconds`` instead of to Kafka."""
    producer = app.producer

    async def on_start() -> None:
        starts.append("connecting")
        await asyncio.sleep(seconds)
        starts.append("connected")

    producer.on_start = on_start
    return producer


async def turns_taken(awaitable: Awaitable[Any]) -> tuple[Any, int]:
    """What ``awaitable`` returns, and how many turns of the event loop passed while it ran."""
    turns = 0
    stop = False

    def tick() -> None:
        nonlocal turns
        if not stop:
            turns += 1
            asyncio.get_running_loop().call_soon(tick)

    asyncio.get_running_loop().call_soon(tick)
    try:
        return await awaitable, turns
    finally:
        stop = True
