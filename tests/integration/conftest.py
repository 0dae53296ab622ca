"""Integration fixtures: real workers (``faust -A app worker`` subprocesses) on the session's embedded broker."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from demo.harness import Record, Tail, Worker, create_topics, worker_env
from rebound.embedded_broker import EmbeddedBroker

pytestmark = pytest.mark.broker


@dataclass
class Deployment:
    """One app id and main topic of its own, so tests share the broker without sharing state."""

    broker: EmbeddedBroker
    root: Path
    app_id: str
    topic: str
    settings: dict[str, str]
    workers: list[Worker] = field(default_factory=list)

    @property
    def calls_path(self) -> Path:
        return self.root / "calls.jsonl"

    def start_worker(self, name: str = "w1") -> Worker:
        env = worker_env(
            self.broker.url,
            self.root / f"data-{name}-{len(self.workers)}",
            REBOUND_APP_ID=self.app_id,
            REBOUND_MAIN_TOPICS=self.topic,
            REBOUND_HANDLER="tests.scripted_handler:handle",
            SCRIPTED_CALLS=str(self.calls_path),
            **self.settings,
        )
        worker = Worker(env, self.root / f"{name}.log").start()
        self.workers.append(worker)
        return worker

    def calls(self) -> list[dict[str, Any]]:
        if not self.calls_path.exists():
            return []
        return [json.loads(line) for line in self.calls_path.read_text().splitlines() if line.strip()]

    def collect(self, until: Callable[[list[Record]], bool], timeout: float = 60.0) -> list[Record]:
        """Read the attempts and failed topics from the start until ``until`` holds."""

        async def run() -> list[Record]:
            def check(seen: list[Record]) -> bool:
                for worker in self.workers:
                    if worker.crashed:
                        assert worker.process is not None
                        raise AssertionError(
                            f"worker exited with {worker.process.returncode}:\n{worker.log_text()[-4000:]}"
                        )
                return until(seen)

            async with Tail(self.broker.bootstrap, [f"{self.app_id}.attempts", f"{self.topic}.failed"]) as tail:
                if not await tail.until(check, timeout):
                    logs = "\n".join(worker.log_text()[-4000:] for worker in self.workers)
                    raise AssertionError(f"condition not met in {timeout}s; {len(tail.records)} records\n{logs}")
                return tail.records

        return asyncio.run(run())


@pytest.fixture(scope="module")
def deploy(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Deployment]]:
    deployments: list[Deployment] = []

    def factory(partitions: int = 2, **settings: str) -> Deployment:
        suffix = uuid.uuid4().hex[:8]
        deployment = Deployment(
            broker=broker,
            root=tmp_path_factory.mktemp(f"deploy-{suffix}"),
            app_id=f"it-{suffix}",
            topic=f"orders-{suffix}",
            settings=settings,
        )
        asyncio.run(create_topics(broker.bootstrap, [deployment.topic], partitions))
        deployments.append(deployment)
        return deployment

    yield factory
    for deployment in deployments:
        for worker in deployment.workers:
            worker.stop(timeout=10)


def attempts_by_key(records: list[Record]) -> dict[str | None, list[dict[str, Any]]]:
    grouped: dict[str | None, list[dict[str, Any]]] = {}
    for record in records:
        if record.topic.endswith(".attempts"):
            event = record.json()
            grouped.setdefault(event["key"], []).append(event)
    for events in grouped.values():
        events.sort(key=lambda event: (event["attempt"], event["event_time"]))
    return grouped


def failed_records(records: list[Record]) -> list[Record]:
    return [record for record in records if record.topic.endswith(".failed")]
