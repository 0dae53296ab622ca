"""Integration fixtures: real workers (``faust -A app worker`` subprocesses) on each Kafka implementation.

``deploy`` takes the session's ``kafka`` fixture: the embedded Tansu broker, or, in modules marked ``every_kafka``, each
implementation ``REBOUND_TEST_KAFKA`` selects in turn (Tansu and librdkafka's mock cluster by default). Tests create
topics with ``tests.kafka_under_test.create_topics``, which works on both (``demo.harness.create_topics`` needs the
CreateTopics request, which the mock cluster does not implement).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from demo.embedded_broker import EmbeddedBroker
from demo.harness import Record, Tail, Worker, worker_env
from demo.mock_cluster import MockCluster
from tests.kafka_under_test import Kafka


@dataclass
class Deployment:
    """One app id and main topic of its own, so tests share the broker without sharing state."""

    broker: EmbeddedBroker | MockCluster
    root: Path
    app_id: str
    topic: str
    settings: dict[str, str]
    workers: list[Worker] = field(default_factory=list)

    @property
    def calls_path(self) -> Path:
        return self.root / "calls.jsonl"

    def worker_env(self, data_dir: Path) -> dict[str, str]:
        return worker_env(
            self.broker.url,
            data_dir,
            REBOUND_APP_ID=self.app_id,
            REBOUND_MAIN_TOPICS=self.topic,
            REBOUND_HANDLER="tests.scripted_handler:handle",
            SCRIPTED_CALLS=str(self.calls_path),
            **self.settings,
        )

    def start_worker(self, name: str = "w1", **extra_env: str) -> Worker:
        """A worker of this deployment, its data directory its own; ``extra_env`` over the deployment's settings
        (another handler, say)."""
        env = {**self.worker_env(self.root / f"data-{name}-{len(self.workers)}"), **extra_env}
        worker = Worker(env, self.root / f"{name}.log").start()
        self.workers.append(worker)
        return worker

    def start_gated_worker(self, name: str, gate: Path) -> Worker:
        """A worker whose handler is ``tests.gated_handler`` (calls held while ``gate`` holds them)."""
        return self.start_worker(name, REBOUND_HANDLER="tests.gated_handler:handle", GATE_DIR=str(gate))

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
def deploy(kafka: Kafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Deployment]]:
    deployments: list[Deployment] = []

    def factory(partitions: int = 2, **settings: str) -> Deployment:
        suffix = uuid.uuid4().hex[:8]
        deployment = Deployment(
            broker=kafka.server,
            root=tmp_path_factory.mktemp(f"deploy-{suffix}"),
            app_id=f"it-{suffix}",
            topic=f"orders-{suffix}",
            settings={**kafka.worker_settings, **settings},
        )
        asyncio.run(kafka.create_topics([deployment.topic], partitions))
        asyncio.run(kafka.provision(deployment.worker_env(deployment.root / "unused"), partitions))
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


def has_outcomes(records: list[Record], wanted: Mapping[str | None, Iterable[str]]) -> bool:
    """Whether each key of ``wanted`` has attempt events of the outcomes listed for it, each as many times as listed.

    For a ``collect`` predicate whose snapshot is then asserted on: an attempt event is only buffered, after the record
    it reports is acknowledged (a dead letter, a tier record, a held message's changelog write; ``emit_attempt`` in
    ``agents/delivery.py``), so it may reach the attempts topic after that record, and waiting for the record does not
    wait for its event."""
    by_key = attempts_by_key(records)
    for key, outcomes in wanted.items():
        if Counter(outcomes) - Counter(event["outcome"] for event in by_key.get(key, [])):
            return False
    return True


def outcome_offsets(records: list[Record], outcome: str) -> set[tuple[int, int]]:
    """The messages (original partition and offset) with an attempt event of ``outcome``: each once, however often a
    redelivery repeated its event, so that their number counts messages, not events."""
    return {
        (event["original_partition"], event["original_offset"])
        for events in attempts_by_key(records).values()
        for event in events
        if event["outcome"] == outcome
    }


T = TypeVar("T")


def wait_for(
    condition: Callable[[], T],
    timeout: float,
    what: str,
    workers: Sequence[Worker] = (),
    *,
    ignore: tuple[type[Exception], ...] = (),
    interval: float = 0.2,
) -> T:
    """Call ``condition`` every ``interval`` seconds until it returns something true, and return that.

    A worker of ``workers`` that exited without being asked to fails at once (``workers`` is read on every look, so
    ``deployment.workers`` sees the workers started meanwhile); ``timeout`` running out fails with ``what`` and the
    workers' log tails. An error of ``ignore`` counts as not yet (a web server that is not listening yet).
    """
    deadline = time.monotonic() + timeout
    while True:
        for worker in workers:
            assert not worker.crashed, f"worker crashed:\n{worker.log_text()[-4000:]}"
        try:
            found = condition()
        except ignore:
            pass
        else:
            if found:
                return found
        if time.monotonic() >= deadline:
            logs = "\n".join(worker.log_text()[-4000:] for worker in workers)
            raise AssertionError(f"{what}: not within {timeout}s\n{logs}")
        time.sleep(interval)
