"""The faults: a seeded, bounded schedule, and the injector that carries it out against a :class:`Cluster`.

Faults run one at a time and each ends with the cluster whole again (the killed worker restarted, the stopped one
continued, the broker resumed, as many members as before), so the run always finishes by itself. Stops and broker
pauses last longer than the session timeout, so they really cost the victim its group membership; shorter ones
would only test a slow process.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from chaos.cluster import Cluster

log = logging.getLogger(__name__)


class FaultKind(StrEnum):
    KILL = "kill"
    """SIGKILL a worker, restart it on its own data directory."""
    STOP = "stop"
    """SIGSTOP a worker past its session timeout (it is evicted), then SIGCONT."""
    REBALANCE = "rebalance"
    """A new worker joins, then another leaves gracefully: two rebalances, a hand-over of partitions."""
    BROKER_PAUSE = "broker-pause"
    """SIGSTOP the broker past the session timeout, then SIGCONT: every member loses its session at once."""


@dataclass(frozen=True, slots=True)
class FaultTimings:
    stop_s: float
    broker_pause_s: float
    restart_delay_s: float = 2.0
    rebalance_dwell_s: float = 8.0
    settle_s: float = 4.0
    """Quiet time after each fault before the next one starts."""

    @classmethod
    def for_session_timeout(cls, session_timeout_s: float) -> FaultTimings:
        # Well past the session timeout: the coordinator must notice and evict before the process comes back.
        return cls(stop_s=session_timeout_s + 5.0, broker_pause_s=session_timeout_s + 5.0)


@dataclass(frozen=True, slots=True)
class PlannedFault:
    at_s: float
    """Earliest start, in seconds from the start of the fault window."""
    kind: FaultKind


@dataclass
class FaultRecord:
    kind: str
    target: str
    started_ms: int
    ended_ms: int = 0
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.target}"


def plan_faults(counts: dict[FaultKind, int], *, window_s: float, seed: int) -> list[PlannedFault]:
    """Spread the faults over the window in a seeded order, each at a jittered slot of its own."""
    rng = random.Random(seed)
    kinds = [kind for kind, count in counts.items() for _ in range(count)]
    rng.shuffle(kinds)
    if not kinds:
        return []
    slot = window_s / len(kinds)
    return [PlannedFault(round(index * slot + rng.uniform(0, slot * 0.3), 1), kind) for index, kind in enumerate(kinds)]


class Injector:
    def __init__(self, cluster: Cluster, timings: FaultTimings, *, seed: int) -> None:
        self.cluster = cluster
        self.timings = timings
        self.rng = random.Random(seed + 1)
        self.records: list[FaultRecord] = []
        self._next_member = 0

    def counts(self) -> dict[str, int]:
        return dict(Counter(record.kind for record in self.records))

    async def run(self, plan: list[PlannedFault]) -> None:
        start = time.monotonic()
        for planned in plan:
            await asyncio.sleep(max(0.0, start + planned.at_s - time.monotonic()))
            await self.inject(planned.kind)
            await asyncio.sleep(self.timings.settle_s)

    async def inject(self, kind: FaultKind) -> FaultRecord | None:
        victims = self.cluster.running()
        if kind is not FaultKind.BROKER_PAUSE and not victims:
            log.warning("no running worker for fault %s; skipped", kind)
            return None
        record = FaultRecord(kind=kind.value, target="broker", started_ms=_now_ms())
        self.records.append(record)
        try:
            if kind is FaultKind.KILL:
                await self._kill(record, self.rng.choice(victims))
            elif kind is FaultKind.STOP:
                await self._stop(record, self.rng.choice(victims))
            elif kind is FaultKind.REBALANCE:
                await self._rebalance(record, victims)
            else:
                await self._pause_broker(record)
        finally:
            record.ended_ms = _now_ms()
        log.info("fault %s on %s done in %.1fs", kind, record.target, (record.ended_ms - record.started_ms) / 1000)
        return record

    async def _kill(self, record: FaultRecord, name: str) -> None:
        record.target = f"{name}.{self.cluster.members[name].incarnation}"
        record.detail["pid"] = await asyncio.to_thread(self.cluster.kill, name)
        await asyncio.sleep(self.timings.restart_delay_s)
        member = self.cluster.restart(name)
        record.detail["restarted_as"] = f"{name}.{member.incarnation}"

    async def _stop(self, record: FaultRecord, name: str) -> None:
        record.target = f"{name}.{self.cluster.members[name].incarnation}"
        try:
            record.detail["pid"] = self.cluster.sigstop(name)
            record.detail["stopped_s"] = self.timings.stop_s
            await asyncio.sleep(self.timings.stop_s)
        finally:
            self.cluster.sigcont(name)

    async def _rebalance(self, record: FaultRecord, victims: list[str]) -> None:
        self._next_member += 1
        joiner = f"j{self._next_member}"
        self.cluster.start_worker(joiner)
        record.detail["joined"] = f"{joiner}.0"
        await asyncio.sleep(self.timings.rebalance_dwell_s)
        leaver = self.rng.choice(victims)
        record.target = f"{leaver}.{self.cluster.members[leaver].incarnation}"
        record.detail["left"] = record.target
        record.detail["leave_returncode"] = await asyncio.to_thread(self.cluster.leave, leaver)

    async def _pause_broker(self, record: FaultRecord) -> None:
        try:
            record.detail["pid"] = self.cluster.pause_broker()
            record.detail["paused_s"] = self.timings.broker_pause_s
            await asyncio.sleep(self.timings.broker_pause_s)
        finally:
            self.cluster.resume_broker()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
