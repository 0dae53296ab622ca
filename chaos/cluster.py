"""The processes under test: the embedded broker (or an existing one) and named, restartable worker subprocesses.

Every process the run starts is registered here and ended by :meth:`Cluster.close`, which the run calls on every exit
path (normal end, exception, SIGTERM, Ctrl-C) and ``atexit`` calls as a last resort. A stopped process is continued
before it is asked to terminate, otherwise it could never act on the request.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from chaos.handler import CALL_LOG_ENV, EFFECTS_ENV, WORKER_ENV
from demo.embedded_broker import EmbeddedBroker, start_broker
from demo.harness import Worker, worker_env
from demo.mock_cluster import MockCluster, start_mock_cluster

log = logging.getLogger(__name__)

TANSU = "tansu"
MOCK = "mock"
MOCK_WORKER_SETTINGS = {
    # librdkafka's mock cluster has no CreateTopics: the run creates every topic beforehand, Rebound only checks.
    "REBOUND_PROVISION_TOPICS": "false",
    # Its ListOffsets(latest) is exact, so the producer batches as in production.
    "REBOUND_PRODUCER_MAX_BATCH_BYTES": "16384",
}
"""Settings for workers on the mock cluster instead of the embedded broker's work-arounds (as in the tests)."""


@dataclass
class Member:
    """One worker name across its incarnations (a restart is a new process under the same name)."""

    name: str
    data_dir: Path
    worker: Worker
    incarnation: int = 0
    stopped: bool = False
    """SIGSTOPped by a fault and not yet continued."""
    left: bool = False
    """Stopped gracefully for good (a rebalance's leave)."""


@dataclass
class Cluster:
    root: Path
    settings: dict[str, str]
    """Worker environment shared by every member (app id, topics, retry sequence...)."""
    external_bootstrap: str | None = None
    kafka: str = TANSU
    """Which Kafka implementation the run starts: the embedded Tansu broker, or librdkafka's mock cluster (3 brokers,
    a second implementation, to tell a broker's quirk from a defect of Rebound's)."""
    broker: EmbeddedBroker | MockCluster | None = None
    members: dict[str, Member] = field(default_factory=dict)
    crashes: list[dict[str, object]] = field(default_factory=list)
    broker_paused: bool = False
    _closed: bool = False

    def __post_init__(self) -> None:
        atexit.register(self.close)

    # broker ---------------------------------------------------------------------------------------------------------

    def start_broker(self) -> None:
        if self.external_bootstrap is not None:
            return
        log_path = self.root / "logs" / "broker.log"
        if self.kafka == MOCK:
            self.broker = start_mock_cluster(brokers=3, log_path=log_path)
        else:
            self.broker = start_broker(log_path=log_path)

    @property
    def bootstrap(self) -> str:
        if self.external_bootstrap is not None:
            return self.external_bootstrap
        assert self.broker is not None, "start_broker() first"
        return self.broker.bootstrap

    @property
    def broker_url(self) -> str:
        if self.broker is not None:
            return self.broker.url
        return ",".join(f"kafka://{server}" for server in self.bootstrap.split(","))

    async def create_topics(self, topics: list[str], partitions: int, *, everything: list[str]) -> None:
        """The main topic; on the mock cluster, which cannot create topics on request, ``everything`` a worker uses."""
        if isinstance(self.broker, MockCluster):
            self.broker.create_topics(everything, partitions, replication=3)
            return
        from demo.harness import create_topics

        await create_topics(self.bootstrap, topics, partitions)

    @property
    def owns_broker(self) -> bool:
        return self.broker is not None

    def pause_broker(self) -> int:
        """SIGSTOP the broker process itself (Tansu, or the process holding the whole mock cluster)."""
        if self.broker is None:
            raise RuntimeError("pausing the broker needs the run's own broker, not an external one")
        self.broker.process.send_signal(signal.SIGSTOP)
        self.broker_paused = True
        return self.broker.process.pid

    def resume_broker(self) -> None:
        if self.broker is not None and self.broker_paused:
            self.broker.process.send_signal(signal.SIGCONT)
            self.broker_paused = False

    # workers --------------------------------------------------------------------------------------------------------

    def _env(self, name: str, incarnation: int, data_dir: Path) -> dict[str, str]:
        return worker_env(
            self.broker_url,
            data_dir,
            **(MOCK_WORKER_SETTINGS if isinstance(self.broker, MockCluster) else {}),
            **self.settings,
            **{
                CALL_LOG_ENV: str(self.root / "calls" / f"{name}.{incarnation}.sqlite"),
                WORKER_ENV: f"{name}.{incarnation}",
                EFFECTS_ENV: str(self.root / "effects"),
            },
        )

    def start_worker(self, name: str) -> Member:
        """Start a new member with a fresh data directory: it knows only what the changelogs give it."""
        data_dir = self.root / "data" / name
        worker = Worker(self._env(name, 0, data_dir), self.root / "logs" / f"{name}.0.log").start()
        member = Member(name=name, data_dir=data_dir, worker=worker)
        self.members[name] = member
        return member

    def restart(self, name: str) -> Member:
        """Start the next incarnation of a member on its own data directory, as a supervisor restarting it would."""
        member = self.members[name]
        member.incarnation += 1
        member.stopped = member.left = False
        member.worker = Worker(
            self._env(name, member.incarnation, member.data_dir),
            self.root / "logs" / f"{name}.{member.incarnation}.log",
        ).start()
        return member

    def running(self) -> list[str]:
        """Members that are up and neither stopped nor leaving: the candidates for the next fault."""
        return [
            name
            for name, member in self.members.items()
            if not member.left
            and not member.stopped
            and member.worker.process is not None
            and member.worker.process.poll() is None
        ]

    def pid(self, name: str) -> int:
        process = self.members[name].worker.process
        assert process is not None
        return process.pid

    def kill(self, name: str) -> int:
        member = self.members[name]
        pid = self.pid(name)
        member.worker.kill()
        return pid

    def sigstop(self, name: str) -> int:
        member = self.members[name]
        pid = self.pid(name)
        os.kill(pid, signal.SIGSTOP)
        member.stopped = True
        return pid

    def sigcont(self, name: str) -> None:
        member = self.members[name]
        if member.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid(name), signal.SIGCONT)
            member.stopped = False

    def leave(self, name: str, timeout: float = 30.0) -> int | None:
        """A graceful hand-over: SIGTERM and wait, as an orchestrator scaling down would."""
        member = self.members[name]
        member.left = True
        return member.worker.stop(timeout=timeout)

    def ready(self, name: str) -> bool:
        """The worker's ``/ready`` view: it owns partitions and is not rebalancing."""
        try:
            url = f"http://127.0.0.1:{self.members[name].worker.web_port}/ready"
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(json.loads(response.read()).get("ready"))
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def wait_ready(self, names: list[str], timeout: float) -> list[str]:
        """Wait until every named worker is ready; returns those that were not in time."""
        deadline = time.monotonic() + timeout
        waiting = list(names)
        while waiting and time.monotonic() < deadline:
            waiting = [name for name in waiting if not self.ready(name)]
            if waiting:
                time.sleep(0.5)
        return waiting

    def reap_crashes(self) -> list[str]:
        """Members that exited without being asked to: recorded with their log tail as evidence."""
        crashed = []
        for name, member in self.members.items():
            process = member.worker.process
            if member.worker.crashed and process is not None:
                crashed.append(name)
                self.crashes.append(
                    {
                        "worker": f"{name}.{member.incarnation}",
                        "pid": process.pid,
                        "returncode": process.returncode,
                        "log_tail": member.worker.log_text()[-3000:],
                    }
                )
                member.worker.stopping = True  # reported once
        return crashed

    # teardown -------------------------------------------------------------------------------------------------------

    def close(self, timeout: float = 15.0) -> None:
        """End every process this run started: continue the stopped, terminate all at once, then kill stragglers."""
        if self._closed:
            return
        self._closed = True
        self.resume_broker()
        processes: list[subprocess.Popen[bytes]] = []
        for member in self.members.values():
            process = member.worker.process
            if process is None or process.poll() is not None:
                continue
            member.worker.stopping = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
                process.send_signal(signal.SIGTERM)
            processes.append(process)
        deadline = time.monotonic() + timeout
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.1, deadline - time.monotonic()))
        for process in processes:
            if process.poll() is None:
                # Each worker runs in its own session: its group id is its pid, so this reaches only its own tree.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(10)
        if self.broker is not None:
            self.broker.stop()
        atexit.unregister(self.close)
