"""Everything the agents, timers and views share, built once per Faust app."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import faust

if TYPE_CHECKING:
    from agents.admin import AdminChannel
    from agents.breaker import BreakerGate
    from agents.control import ControlBoard
    from agents.status import StatusBoard

from agents.dispatcher import Dispatcher
from agents.failure_log import FailureLog
from agents.locks import KeyLocks
from agents.metrics import Metrics
from rebound.event import Handler
from rebound.pacing import ReleasePacer
from rebound.policy import RetryPolicy
from rebound.routing import Clock, ErrorClassifier
from rebound.schedule import ReleaseSchedule
from rebound.settings import Settings
from rebound.tiers import Tiers
from tables.retry_state import RetryStore


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class Runtime:
    app: faust.App
    settings: Settings
    handler: Handler
    partitions: int
    table: Any
    store: RetryStore
    """The state and payload tables behind one interface (``tables/retry_state.py``): every read and write of them."""
    main_topics: dict[str, Any]
    tiers: Tiers
    tier_topics: dict[str, Any]
    failed_topics: dict[str, Any]
    attempts_topic: Any
    release_topic: Any
    dispatcher: Dispatcher
    """Runs the main and release agents' work concurrently (``agents/dispatcher.py``); built with the app."""
    clock: Clock = wall_clock_ms
    schedule: ReleaseSchedule = field(default_factory=ReleaseSchedule)
    counters: Counter[str] = field(default_factory=Counter)
    agents: dict[str, Any] = field(default_factory=dict)
    """Faust's agents by name (``main``, ``release``, ``admin``, one per tier topic), for tests and the views."""
    admin_channel: AdminChannel | None = None
    """Hands admin commands to the admin agent and their results back to the waiting request (``agents/admin.py``)."""
    status_board: StatusBoard | None = None
    """Every worker's latest backlog summary (``agents/status.py``); made on first use."""
    status_topic: Any = None
    control_board: ControlBoard | None = None
    """The operator's pause as this worker last read it (``agents/control.py``); made on first use."""
    release_wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    release_failures: dict[tuple[bytes, str, int], int] = field(default_factory=dict)
    key_locks: KeyLocks = field(default_factory=KeyLocks)
    breaker_gate: BreakerGate | None = None
    """The circuit breaker's gate in front of every handler call (``agents/breaker.py``); None when it is off."""
    fences: tuple[Any, ...] = ()
    """The tables' writer-epoch fences (``tables/fencing.py``), state table's first."""
    failure_log: FailureLog = field(default_factory=FailureLog, repr=False, compare=False)
    """One INFO line per failed handler call, at most 10 a second (``agents/failure_log.py``)."""
    metrics: Metrics = field(init=False, repr=False, compare=False)
    """This runtime's Prometheus registry and the metrics the agents observe (``agents/metrics.py``)."""
    pacer: ReleasePacer = field(init=False, repr=False, compare=False)
    """How many due releases the timer may send now: ``REBOUND_RELEASE_RATE`` (``rebound/pacing.py``)."""

    def __post_init__(self) -> None:
        self.metrics = Metrics(self)
        self.pacer = ReleasePacer(self.settings.release_pacing)

    def failed_topic_named(self, name: str) -> Any:
        """The failed topic a routing decision named (``failed_topics`` is keyed by main topic)."""
        return next(topic for topic in self.failed_topics.values() if topic.get_topic_name() == name)

    @property
    def policy(self) -> RetryPolicy:
        return self.settings.policy

    @property
    def classifier(self) -> ErrorClassifier:
        return self.settings.classifier

    @property
    def group(self) -> str:
        return self.settings.app_id
