"""The reference service (``demo/reference_service.py``) as a child process of a benchmark, and a worker's counters.

A process of its own, not a thread of the benchmark: the service's event loop must not wait on the benchmark's
Python (the GIL), or its latencies would measure the benchmark. Shared by ``http-adaptive`` and ``http-overhead``.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import REPO, FaustProcess, cpu_seconds
from bench.scenarios.parked_memory import metrics_text, samples
from demo.embedded_broker import free_port


@dataclass
class ServiceProcess:
    """``python -m demo.reference_service`` with the given arguments, on a port of its own."""

    args: list[str]
    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child process
        self.process = subprocess.Popen(
            [sys.executable, "-m", "demo.reference_service", "--port", str(self.port), *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the reference service exited:\n{self.log_path.read_text(errors='replace')}")
            with contextlib.suppress(OSError):
                self.stats()
                return self
            time.sleep(0.1)
        raise RuntimeError("the reference service did not answer within 30 s")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def _request(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST")
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=10) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer

    def stats(self) -> dict[str, Any]:
        """Counts since the last reset, without the idempotency keys (a long run sees hundreds of thousands)."""
        return self._request("/stats?keys=0")

    def reset(self) -> None:
        self._request("/admin/reset", {})

    def set_capacity(self, capacity: int) -> None:
        self._request("/admin/capacity", {"capacity": capacity})

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)


@contextlib.contextmanager
def serving(service: ServiceProcess) -> Iterator[ServiceProcess]:
    service.start()
    try:
        yield service
    finally:
        service.stop()


def counters(worker: FaustProcess) -> dict[str, float]:
    """The worker's call and attempt counters from ``/metrics``, summed over topics and tiers.

    ``calls``: handler calls ended (every result); ``timeouts``: those that ran past the handler timeout, and the
    calls whose error class is a timeout (the HTTP request's own timeout fires first, by design); ``scheduled``:
    retries generated; ``dead``: dead letters; ``succeeded``; ``le=<seconds>``: the call-duration histogram's
    cumulative buckets (see :func:`histogram_quantile`).
    """
    out = {"calls": 0.0, "timeouts": 0.0, "scheduled": 0.0, "dead": 0.0, "succeeded": 0.0}
    for name, labels, value in samples(metrics_text(worker)):
        if name == "rebound_handler_duration_seconds_bucket":
            bucket = f"le={labels['le']}"  # cumulative count of calls that took at most ``le`` seconds
            out[bucket] = out.get(bucket, 0.0) + value
        elif name == "rebound_handler_duration_seconds_count":
            out["calls"] += value
            if labels.get("result") == "timeout":
                out["timeouts"] += value
        elif name == "rebound_attempts_total":
            outcome = labels.get("outcome", "")
            if outcome in ("scheduled", "dead", "succeeded"):
                out[outcome] += value
            if labels.get("error_class", "").endswith("HttpTimeout"):
                out["timeouts"] += value
    return out


def gauges(worker: FaustProcess, names: tuple[str, ...]) -> dict[str, float]:
    """The summed value of each named gauge (absent ones are left out: a worker without ``auto`` has no limit)."""
    out: dict[str, float] = {}
    for name, _, value in samples(metrics_text(worker)):
        if name in names:
            out[name] = out.get(name, 0.0) + value
    return out


def histogram_quantile(before: dict[str, float], after: dict[str, float], q: float) -> float | None:
    """The upper bound (seconds) of the bucket holding the ``q`` quantile of the calls ended between two
    :func:`counters` readings: as coarse as the buckets (1, 2.5, 5, 10, 25, 50, 100, 250 ms, ...), and the
    latency the worker saw (its own queueing for a core included), where the service's figures are the service's."""
    buckets = sorted((float(name[3:]), after[name] - before.get(name, 0.0)) for name in after if name.startswith("le="))
    if not buckets or buckets[-1][1] <= 0:
        return None
    wanted = q * buckets[-1][1]
    return next(bound for bound, count in buckets if count >= wanted)
