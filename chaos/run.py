"""One chaos run, start to verdict: broker, workers, paced production, faults, the wait for terminal states, checks.

The wait ends when every produced message has a terminal state and nothing new has happened for a settle period
(so late duplicates and second dead letters are still caught), or when no message has become terminal for the stall
timeout (a wedge), or at the hard deadline (a cluster too slow to finish); either way the checker then reports what it
found, including every message still missing. Judging a wedge by progress rather than by a fixed deadline keeps a
slow but moving cluster (a shared 2-core machine) from being reported as losing messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from chaos import evidence
from chaos.calllog import Call, CallLogReader
from chaos.checker import CheckInputs, DeadLetter, Origin, Produced, check
from chaos.cluster import TANSU, Cluster
from chaos.faults import FaultKind, FaultTimings, Injector, plan_faults
from chaos.observe import Observer, committed_offsets
from chaos.produce import produce_paced
from chaos.report import scan_logs, write_result, write_summary
from chaos.scenario import CallOutcome, plan_messages
from demo.harness import FAST_GROUP_TIMEOUTS
from rebound.policy import RetryPolicy
from rebound.topics import attempts_topic, failed_topic, tier_topic

log = logging.getLogger("chaos")
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class RunConfig:
    out: Path
    messages: int = 20_000
    workers: int = 3
    partitions: int = 6
    duration_s: float = 240.0
    """The fault window; production is spread over most of it."""
    faults: dict[FaultKind, int] = field(
        default_factory=lambda: {
            FaultKind.KILL: 2,
            FaultKind.STOP: 2,
            FaultKind.REBALANCE: 2,
            FaultKind.BROKER_PAUSE: 1,
        }
    )
    seed: int = 1
    retry_sequence: str = "1s,2s,3s"
    ordering: str = "none"
    """``REBOUND_ORDERING`` of the workers; ``key`` also checks each key's order."""
    outcome: str = "scripted"
    """``scripted``: the handler decides by the attempt number; ``random``: at random per call, so two lifecycles of
    one message can end differently and the checker sees forks (``chaos.scenario``)."""
    deadline_s: float = 900.0
    """Longest wait for terminal states after the fault window, however much progress is still being made."""
    stall_s: float = 90.0
    """The wait gives up once no message has become terminal for this long: longer than any retry delay, than a
    rebalance, and than the longest fault."""
    settle_s: float = 8.0
    bootstrap: str | None = None
    """An existing broker to use instead of starting one (then the broker cannot be paused)."""
    log_level: str = "info"
    max_crash_restarts: int = 5
    kafka: str = TANSU
    """``tansu`` (the embedded broker) or ``mock`` (librdkafka's mock cluster)."""


SOURCE_COMMIT_ENV = "CHAOS_SOURCE_COMMIT"
"""Names the source when the run is made from an exported snapshot, which has no ``.git`` to ask."""


def _git_commit() -> str:
    if os.environ.get(SOURCE_COMMIT_ENV):
        return os.environ[SOURCE_COMMIT_ENV]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}{'-dirty' if dirty else ''}"


def _prepare(out: Path) -> None:
    """Only what a previous run wrote here is removed: the directory may be shared with other files."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("calls", "logs", "data", "effects"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("result.json", "summary.md", evidence.PRODUCED_FILE, evidence.OBSERVED_FILE):
        (out / name).unlink(missing_ok=True)
    for name in ("calls", "logs", "data"):
        (out / name).mkdir()


class Progress:
    """Terminal states known so far, kept incrementally: recomputing from scratch every poll would cost O(calls)."""

    def __init__(self) -> None:
        self.terminal: set[Origin] = set()
        self.calls = 0
        self.dead_letters = 0

    def feed_calls(self, calls: list[Call]) -> None:
        self.calls += len(calls)
        self.terminal.update(call.origin for call in calls if call.outcome == CallOutcome.OK)

    def feed_dead_letters(self, letters: list[DeadLetter]) -> None:
        self.dead_letters += len(letters)
        self.terminal.update(letter.origin for letter in letters if letter.origin is not None)

    def pending(self, produced: list[Produced]) -> list[str]:
        return [message.mid for message in produced if message.origin not in self.terminal]


async def run(config: RunConfig) -> dict[str, Any]:
    """One complete run; every process it started is ended before this returns or raises."""
    if config.faults.get(FaultKind.BROKER_PAUSE) and config.bootstrap is not None:
        raise SystemExit("broker-pause needs the run's own broker: drop --bootstrap or the broker-pause fault")
    return await ChaosRun(config).execute()


class ChaosRun:
    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.started = datetime.now(UTC)
        self.wall_start = time.monotonic()
        self.out = config.out.resolve()
        self.run_id = f"{config.seed}-{uuid.uuid4().hex[:6]}"
        self.topic = f"chaos-{self.run_id}"
        self.app_id = f"chaos-{self.run_id}"
        self.policy = RetryPolicy.parse(config.retry_sequence)
        self.cluster = Cluster(
            root=self.out,
            settings={
                "REBOUND_APP_ID": self.app_id,
                "REBOUND_MAIN_TOPICS": self.topic,
                "REBOUND_RETRY_SEQUENCE": config.retry_sequence,
                "REBOUND_ORDERING": config.ordering,
                "REBOUND_HANDLER": "chaos.handler:handle",
                # The chaos handler never sleeps; a tight timeout leaves a revocation time to drain (REVOKE_DRAIN).
                "REBOUND_HANDLER_TIMEOUT": "1s",
                "REBOUND_LOG_LEVEL": config.log_level,
            },
            external_bootstrap=config.bootstrap,
            kafka=config.kafka,
        )
        self.plan = plan_messages(
            config.messages, seed=config.seed, max_retries=self.policy.max_retries, outcome=config.outcome
        )
        self.fault_plan = plan_faults(config.faults, window_s=config.duration_s * 0.85, seed=config.seed)
        timings = FaultTimings.for_session_timeout(float(FAST_GROUP_TIMEOUTS["REBOUND_SESSION_TIMEOUT"]))
        self.injector = Injector(self.cluster, timings, seed=config.seed)
        self.produced: list[Produced] = []
        self.unacknowledged: list[str] = []
        self.calls: list[Call] = []
        self.progress = Progress()
        self.reader = CallLogReader(self.out / "calls")
        self.notes: list[str] = []
        self.crash_restarts = 0
        self.all_terminal_after: float | None = None
        self.committed: dict[int, int] | None = None
        self.observer: Observer | None = None
        self._seen_letters = 0
        self._last_report = 0.0
        self._last_call_read = 0.0

    def every_topic(self) -> list[str]:
        """Every partitioned topic a worker uses, for a broker on which workers cannot create topics."""
        from app.provisioning import derived_topics
        from rebound.settings import load_settings
        from tables.retry_state import PAYLOAD_TABLE, STATE_TABLE

        settings = load_settings(app_id=self.app_id, main_topics=self.topic, retry_sequence=self.config.retry_sequence)
        changelogs = [f"{self.app_id}-{table}-changelog" for table in (STATE_TABLE, PAYLOAD_TABLE)]
        return [self.topic, *derived_topics(settings), *changelogs]

    def stamp(self) -> str:
        return f"[{time.monotonic() - self.wall_start:7.1f}s]"

    async def execute(self) -> dict[str, Any]:
        _prepare(self.out)
        try:
            await self.start()
            await self.drive()
            await self.wait_for_terminal_states()
        finally:
            if self.observer is not None:
                with contextlib.suppress(Exception):
                    await self.observer.__aexit__(None, None, None)
            await asyncio.to_thread(self.cluster.close)
        self.calls += self.reader.read_new()  # the workers are gone: the call logs are complete now
        return self.verdict()

    async def start(self) -> None:
        await asyncio.to_thread(self.cluster.start_broker)
        bootstrap = self.cluster.bootstrap
        log.info("%s broker %s; topic %s, %d partitions", self.stamp(), bootstrap, self.topic, self.config.partitions)
        mock = self.config.kafka != TANSU and self.config.bootstrap is None
        everything = self.every_topic() if mock else []
        await self.cluster.create_topics([self.topic], self.config.partitions, everything=everything)
        if mock:
            from rebound.topics import control_topic

            one = [f"{self.app_id}-__assignor-__leader", control_topic(self.app_id)]  # one partition each
            await self.cluster.create_topics([], 1, everything=one)
        names = [f"w{index + 1}" for index in range(self.config.workers)]
        for name in names:
            self.cluster.start_worker(name)
        late = await asyncio.to_thread(self.cluster.wait_ready, names, 120.0)
        if late:
            self.notes.append(f"workers not ready after 120 s: {late}")
        log.info("%s %d workers started (not ready: %s)", self.stamp(), len(names), late or "none")
        self.observer = Observer(
            bootstrap,
            main_topic=self.topic,
            failed_topic=failed_topic(self.topic),
            attempts_topic=attempts_topic(self.app_id),
            tier_topics=[tier_topic(self.topic, label) for label in self.policy.tier_labels],
        )
        await self.observer.__aenter__()

    async def observe_once(self) -> int:
        """One poll of the topics and the call logs; also notices (and restarts) workers that died by themselves."""
        assert self.observer is not None
        new = await self.observer.poll(200)
        letters = self.observer.observed.dead_letters
        self.progress.feed_dead_letters(letters[self._seen_letters :])
        self._seen_letters = len(letters)
        fresh: list[Call] = []
        if time.monotonic() - self._last_call_read >= 1.0:  # the harness shares the machine with what it tests
            self._last_call_read = time.monotonic()
            fresh = self.reader.read_new()
            self.calls += fresh
            self.progress.feed_calls(fresh)
        for name in self.cluster.reap_crashes():
            log.error("%s worker %s exited without being asked to (see result.json crashes)", self.stamp(), name)
            if self.crash_restarts < self.config.max_crash_restarts:
                self.crash_restarts += 1
                self.cluster.restart(name)
        return new + len(fresh)

    def report_progress(self, every_s: float = 10.0) -> None:
        if time.monotonic() - self._last_report < every_s:
            return
        self._last_report = time.monotonic()
        missing = self.progress.pending(self.produced)
        log.info(
            "%s produced %d/%d, not terminal %d %s, calls %d, faults %s",
            self.stamp(),
            len(self.produced),
            self.config.messages,
            len(missing),
            missing[:3],
            self.progress.calls,
            self.injector.counts(),
        )

    async def drive(self) -> None:
        """Produce and inject faults concurrently, observing all the while."""
        producer = asyncio.create_task(
            produce_paced(
                self.cluster.bootstrap,
                self.topic,
                self.plan,
                duration_s=self.config.duration_s * 0.7,
                produced=self.produced,
                unacknowledged=self.unacknowledged,
            )
        )
        faults = asyncio.create_task(self.injector.run(self.fault_plan))
        try:
            while not (producer.done() and faults.done()):
                await self.observe_once()
                self.report_progress()
            for task in (producer, faults):
                task.result()  # a harness error surfaces here, not as a silent partial run
        finally:
            for task in (producer, faults):
                task.cancel()
            await asyncio.gather(producer, faults, return_exceptions=True)
        log.info("%s production and faults over; waiting for terminal states", self.stamp())

    async def wait_for_terminal_states(self) -> None:
        """Until all are terminal and nothing new arrived for the settle period, or a stall, or the deadline."""
        deadline = time.monotonic() + self.config.deadline_s
        quiet_since = last_progress = time.monotonic()
        terminal = len(self.progress.terminal)
        while time.monotonic() < deadline:
            if await self.observe_once():
                quiet_since = time.monotonic()
            if len(self.progress.terminal) != terminal:
                terminal, last_progress = len(self.progress.terminal), time.monotonic()
            if self.all_terminal_after is None and time.monotonic() - last_progress > self.config.stall_s:
                missing = len(self.progress.pending(self.produced))
                self.notes.append(f"stalled: no message became terminal for {self.config.stall_s:.0f} s, {missing} not")
                log.error("%s %s", self.stamp(), self.notes[-1])
                break
            if self.all_terminal_after is None and not self.progress.pending(self.produced):
                self.all_terminal_after = round(time.monotonic() - self.wall_start, 1)
                log.info("%s all %d messages terminal; settling", self.stamp(), len(self.produced))
            if self.all_terminal_after is not None and time.monotonic() - quiet_since >= self.config.settle_s:
                break
            if self.all_terminal_after is None:
                self.report_progress()
        else:
            missing = len(self.progress.pending(self.produced))
            self.notes.append(f"deadline of {self.config.deadline_s:.0f} s passed with {missing} not terminal")
            log.error("%s %s", self.stamp(), self.notes[-1])
        for _ in range(5):  # whatever is still in flight on the broker
            await self.observe_once()
        try:
            self.committed = await asyncio.wait_for(
                committed_offsets(self.cluster.bootstrap, self.app_id, self.topic), 30
            )
        except Exception as exc:  # evidence only: the verdict does not depend on it
            self.notes.append(f"committed offsets unavailable: {exc!r}")

    def verdict(self) -> dict[str, Any]:
        assert self.observer is not None
        observed = self.observer.observed
        committed = self.committed
        inputs = CheckInputs(
            produced=self.produced,
            calls=self.calls,
            dead_letters=observed.dead_letters,
            due_times=observed.due_times,
            succeeded_events=observed.succeeded_events,
            main_log=observed.main_log,
            committed=None if committed is None else {(self.topic, p): offset for p, offset in committed.items()},
            faults=[(record.started_ms, record.label) for record in self.injector.records],
            fault_windows=[(r.started_ms, r.ended_ms or r.started_ms, r.label) for r in self.injector.records],
            key_ordered=self.config.ordering == "key",
        )
        evidence.save_produced(self.out, self.produced)
        evidence.save_observed(self.out, inputs)
        config = self.config
        result: dict[str, Any] = {
            "run": {
                "run_id": self.run_id,
                "started": self.started.isoformat(timespec="seconds"),
                "commit": _git_commit(),
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "seed": config.seed,
                "messages_planned": config.messages,
                "messages_unacknowledged": self.unacknowledged,
                "workers": config.workers,
                "partitions": config.partitions,
                "kafka": config.kafka if config.bootstrap is None else f"external {config.bootstrap}",
                "retry_sequence": config.retry_sequence,
                "ordering": config.ordering,
                "outcome": config.outcome,
                "duration_s": config.duration_s,
                "faults_planned": [{"at_s": fault.at_s, "kind": fault.kind.value} for fault in self.fault_plan],
                "faults_injected": self.injector.counts(),
                "faults": [record.to_json() for record in self.injector.records],
                "crashes": self.cluster.crashes,
                "all_terminal_after_s": self.all_terminal_after,
                "wall_s": round(time.monotonic() - self.wall_start, 1),
                "notes": self.notes,
                "observed": {
                    "attempt_events": observed.attempt_events,
                    "tier_records": observed.tier_records,
                    "dead_letters": len(observed.dead_letters),
                    "main_records": len(observed.main_log),
                    "unreadable": observed.unreadable,
                },
                "committed_offsets": committed,
                "app_id": self.app_id,
                "topic": self.topic,
            },
            "check": check(inputs).to_json(),
            "log_evidence": scan_logs(self.out / "logs"),
        }
        write_result(self.out, result)
        write_summary(self.out, result)
        return result
