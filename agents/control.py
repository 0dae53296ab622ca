"""Pause and resume of the main topics, cluster-wide: every worker, including workers started later.

An operator's ``POST /retry/admin/pause`` (or ``resume``) writes one control record (:mod:`rebound.pause`, one fixed
key) to ``<app id>.control``: one partition, ``cleanup.policy=compact``, no time-based deletion, so Kafka always keeps
the latest record and a pause outlasts any stop of the whole cluster (on a broker without compaction, such as the
embedded one of the tests, the reader simply keeps the last record it reads). Every worker reads that partition from
the beginning with a group-less consumer (like the status reader: independent of the group's assignment), so the
latest control record is the cluster's state: it survives restarts and reaches a worker that starts after the pause.

Applying it is a hold on the main topics in Rebound's consumer (``ReboundConsumer.hold_topics``, reason ``pause``):
their partitions are paused between fetched batches, also those a rebalance assigns later, and resumed only when no
reason holds them any more: the circuit breaker's own hold and the dispatcher's back-pressure pauses are separate,
and ending one never ends another. Only first tries stop: tier topics and the release path are not held, so parked
retries keep being released while the main topics are paused. With ``REBOUND_RELEASE_MODE=republish`` a released
retry travels back through the main topic, so a pause holds those retries too, until the resume.

A worker holds its main topics from the moment it starts until it has read the control partition to its end: it
never fetches a first try before it knows whether it may (fail-closed). Until then :func:`pause_state_known` is
False: ``/ready`` answers 503, the backlog views say so, and a reader that keeps failing logs once a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from agents.livelock import restart_stream_clocks
from agents.readers import groupless_consumer, topic_partitions
from agents.runtime import Runtime
from agents.services import Restarting, start_with
from agents.topics import raw_topic
from rebound.display import utc_time
from rebound.pause import CONTROL_KEY, CONTROL_PARTITION, NOT_PAUSED, PauseState
from rebound.topics import CONTROL_PARTITIONS, control_topic

log = logging.getLogger(__name__)

PAUSE_REASON = "pause"
"""The consumer's hold reason for the operator's pause (the circuit breaker's is ``breaker``)."""
CONFIRM_TIMEOUT_S = 10.0
WARN_EVERY_S = 60.0
"""A control reader that keeps failing logs its first failure with the traceback, then one line this often."""


@dataclass
class ControlBoard:
    """This worker's view of the pause state, as read from the control partition."""

    runtime: Runtime
    state: PauseState = NOT_PAUSED
    known: bool = False
    """The control partition was read to its end once: ``state`` is the cluster's."""
    read_to: int = -1
    """Offset of the last record read on the control partition."""
    topic: Any = None
    """The control topic (Faust), which pause and resume write to."""
    position: int | None = None
    end: int | None = None
    """The reader's position and the partition's end offset it must reach before the state is known."""
    failures: int = 0
    """Consecutive failures of the control reader (0 once it reads again)."""
    last_error: str = ""
    _warned_at: float = float("-inf")
    _progress: asyncio.Event = field(default_factory=asyncio.Event)

    def reader_failed(self, error: BaseException, now: float | None = None) -> None:
        """Log a failure of the control reader: the first with its traceback, then one line a minute."""
        now = time.monotonic() if now is None else now
        self.failures += 1
        self.last_error = repr(error)
        holding = (
            "the main topics stay held until it is read (first tries wait)"
            if not self.known
            else f"the main topics stay as last read ({'paused' if self.state.paused else 'fetched'})"
        )
        if self.failures == 1:
            log.error("control reader failed (%s); retrying every second", holding, exc_info=error)
        elif now - self._warned_at >= WARN_EVERY_S:
            log.warning(
                "control reader still failing (%d failures): %s; position %s of end %s; %s",
                self.failures,
                self.last_error,
                "?" if self.position is None else self.position,
                "?" if self.end is None else self.end,
                holding,
            )
        else:
            return
        self._warned_at = now

    def reader_caught_up(self) -> None:
        if self.failures:
            log.warning("control reader reads again after %d failure(s)", self.failures)
        self.failures, self.last_error, self._warned_at = 0, "", float("-inf")

    @property
    def main_topics(self) -> frozenset[str]:
        return frozenset(self.runtime.settings.topics)

    def apply(self, state: PauseState) -> None:
        """Make ``state`` this worker's and hold or release the main topics accordingly."""
        previous, self.state = self.state, state
        first = not self.known
        self.known = True
        if first or not previous.same_action(state):
            if state.paused:
                log.warning(
                    "main topics %s are paused (by %s from %s at %s): first tries wait; retries are still released",
                    ",".join(sorted(self.main_topics)),
                    state.by or "?",
                    state.source or "?",
                    _when(state.at_ms),
                )
            elif first and not state.at_ms:
                log.info("main topics %s were never paused: fetching them", ",".join(sorted(self.main_topics)))
            else:
                log.warning(
                    "main topics %s are fetched (resumed by %s from %s at %s)",
                    ",".join(sorted(self.main_topics)),
                    state.by or "?",
                    state.source or "?",
                    _when(state.at_ms),
                )
        self.enforce()
        self._notify()

    def enforce(self) -> None:
        consumer = _consumer(self.runtime)
        if consumer is None:
            return
        if self.state.paused:
            consumer.hold_topics(self.main_topics, reason=PAUSE_REASON)
        else:
            held = consumer.holds.get(PAUSE_REASON, frozenset())
            consumer.release_topics(reason=PAUSE_REASON, still_paused=frozenset(self.runtime.dispatcher.core.paused))
            restart_stream_clocks(self.runtime.app, consumer, held)  # (the pause is not a stream standing still)

    def read(self, offset: int) -> None:
        self.read_to = max(self.read_to, offset)
        self._notify()

    def _notify(self) -> None:
        progress, self._progress = self._progress, asyncio.Event()
        progress.set()

    async def wait_until(self, done: Any, timeout: float) -> bool:
        """Until ``done()`` holds (checked after every record read, and every 0.1 s); False on timeout."""
        deadline = time.monotonic() + timeout
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), min(remaining, 0.1))
        return True

    def applied_here(self) -> bool:
        """Whether this worker's consumer does what the state says: with the pause, every fetch from now on leaves
        the main topics out; without it, no pause holds them."""
        consumer = _consumer(self.runtime)
        if consumer is None or not hasattr(consumer, "holds"):
            return False
        if self.state.paused:
            return PAUSE_REASON in consumer.effective_holds
        return PAUSE_REASON not in consumer.holds

    def view(self) -> dict[str, Any]:
        """The ``paused`` field of the backlog views."""
        return {
            **self.state.to_view(),
            "topics": sorted(self.main_topics),
            "known": self.known,
            "applied_here": self.applied_here(),
            "reader_failures": self.failures,
        }


def _when(at_ms: int) -> str:
    if not at_ms:
        return "?"
    return utc_time(at_ms)


def _consumer(runtime: Runtime) -> Any:
    consumer = getattr(runtime.app, "_consumer", None)
    return consumer if consumer is not None and hasattr(consumer, "hold_topics") else None


def control_board(runtime: Runtime) -> ControlBoard:
    board = runtime.control_board
    if board is None:
        board = runtime.control_board = ControlBoard(runtime)
    return board


def pause_state_known(runtime: Runtime) -> bool:
    """True once this worker has read the control partition to its end: it knows whether the main topics are paused.
    Until then it holds them (first tries wait) and ``/ready`` answers 503. For a gauge."""
    board = runtime.control_board
    return bool(board is not None and board.known)


def main_paused(runtime: Runtime) -> bool:
    """True while an operator's pause of the main topics is in effect, as this worker last read it (False until it
    has read the control partition once). For the ``rebound_main_paused`` gauge."""
    board = runtime.control_board
    return bool(board is not None and board.known and board.state.paused)


def pause_view(runtime: Runtime) -> dict[str, Any]:
    return control_board(runtime).view()


@dataclass(frozen=True)
class Written:
    """What ``set_paused`` wrote and what became of it on this worker."""

    state: PauseState
    confirmed: bool
    """This worker read the record back and applies it."""
    overtaken: bool = False
    """Another action was written after it before it was confirmed: the current state is that one's."""


async def set_paused(
    runtime: Runtime, *, paused: bool, by: str, source: str, timeout: float = CONFIRM_TIMEOUT_S, topic: Any = None
) -> Written:
    """Write the control record and wait until this worker has read it back and applied it; the state written and
    whether that happened within ``timeout`` (the other workers apply it as they read it), or whether another action
    overtook it (read after it before it was confirmed: the record is superseded, not confirmed)."""
    now = runtime.clock()
    state = PauseState(paused=paused, by=by, source=source, at_ms=now, action_id=uuid.uuid4().hex, written_at_ms=now)
    board = control_board(runtime)
    topic = topic if topic is not None else board.topic
    pending = await topic.send(key=CONTROL_KEY, value=state.to_json(), partition=CONTROL_PARTITION)
    metadata = await pending
    offset = int(getattr(metadata, "offset", -1))

    def overtaken() -> bool:
        return board.read_to >= offset and not board.state.same_action(state)

    def settled() -> bool:
        applied = board.read_to >= offset and board.state.same_action(state) and board.applied_here()
        return applied or overtaken()

    await board.wait_until(settled, timeout)
    if overtaken():
        return Written(state, confirmed=False, overtaken=True)
    return Written(state, confirmed=settled())


def register_control(runtime: Runtime) -> ControlBoard:
    """Hold the main topics from the start and read the control partition on every worker."""
    board = control_board(runtime)
    app = runtime.app
    holds = getattr(app, "holds_at_start", None)
    if holds is not None:
        holds[PAUSE_REASON] = board.main_topics
    name = control_topic(runtime.settings.app_id)
    board.topic = raw_topic(app, name, partitions=CONTROL_PARTITIONS)

    start_with(app, Restarting("control reader", lambda: follow_control(runtime, name, board), board.reader_failed))

    return board


async def follow_control(runtime: Runtime, name: str, board: ControlBoard) -> None:
    """Read the control partition from its start; apply the last state once at its end, then each new one."""
    from aiokafka import TopicPartition

    consumer = groupless_consumer(
        runtime.settings.bootstrap_servers,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=min(runtime.settings.fetch_max_wait_ms, 500),
    )
    try:
        await consumer.start()
        tp = TopicPartition(name, CONTROL_PARTITION)

        def not_found_yet(waited: int) -> None:
            if waited % 120 == 0:
                log.error("control topic %s not found yet: the main topics stay held", name)

        await topic_partitions(consumer, name, tries=None, every_s=0.5, on_wait=not_found_yet)
        consumer.assign([tp])
        start = (await consumer.beginning_offsets([tp]))[tp]
        end = (await consumer.end_offsets([tp]))[tp]
        board.position, board.end = start, end
        consumer.seek(tp, start)
        latest: PauseState | None = None
        caught_up = end <= start  # nothing on it: never paused (and nothing to wait for)
        if caught_up:
            board.reader_caught_up()
            board.apply(board.state if board.known else NOT_PAUSED)
        while True:
            # Short waits until the end is reached once: the main topics are held until then.
            batch = await consumer.getmany(tp, timeout_ms=1000 if caught_up else 100)
            for message in batch.get(tp, []):
                if message.key == CONTROL_KEY:
                    try:
                        state = PauseState.from_json(message.value)
                    except ValueError as exc:
                        log.warning("ignoring malformed control record at offset %d: %s", message.offset, exc)
                    else:
                        if caught_up:
                            board.apply(state)
                        else:
                            latest = state
                board.read(message.offset)
            if not caught_up:
                board.position = await consumer.position(tp)
                if board.position >= end:
                    # Read to the end once: the last state is the cluster's (none at all: never paused).
                    caught_up = True
                    board.reader_caught_up()
                    board.apply(latest if latest is not None else board.state if board.known else NOT_PAUSED)
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()
