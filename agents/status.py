"""Cluster-wide backlog: every worker publishes a summary of its partitions, every worker reads all summaries.

Publishing: a timer on each worker sends, every ``STATUS_INTERVAL_S``, one JSON record to ``<app id>.status`` (key =
worker id) with per-partition, per-tier numbers: waiting, overdue, oldest due, next release, oldest first receipt,
plus the worker's id, web URL, owned partitions and a timestamp.

No number comes from a scan: how many wait per tier is counted by the store as entries are written and deleted
(``RetryStore.parked_per_tier``), and the time figures come from the release schedule's per-tier heaps
(``ReleaseSchedule.tier_stats``: kept per tier as slots are sent, confirmed and come due; a call costs in proportion to
the slots come due since the last, not to how many are overdue). A scan reads and decodes
every parked message, which at a million parked would take longer than the 2 s tick, on the event loop. Only first
receipt times have neither: a paced survey reads them, sooner when a walk would say something new (a tier with parked
messages and no figure, a partition taken over: docs/operating.md gives how soon) and otherwise every
``FIRST_RECEIPT_SURVEY_S``, so they are up to that much older.

Reading: every worker must see every worker's record, but a Faust agent shares the app's consumer group and would
see only the status partitions assigned to it (and a worker with no partitions would see nothing). Sending each
record to every partition would work only while every worker owns a status partition. So the reader is a plain
aiokafka consumer with no group, assigned all partitions of the status topic and starting a few records before the
end: it is independent of the group's assignment and rebalances, never commits, and never delays the group. The
latest summary per worker is kept in memory (not in a table: it is ephemeral, rebuilt within one interval).

Agreement: each summary carries the settings the group must agree on (:mod:`rebound.agreement`). A fresh summary of
another worker with other values, published since this worker started, is logged at WARNING once per worker and
fingerprint, counted in the gauge ``rebound_settings_mismatch`` and listed under ``settings_mismatch`` in
``/retry/backlog``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agents.control import pause_state_known
from agents.ownership import owned_partitions
from agents.readers import groupless_consumer, topic_partitions
from agents.runtime import Runtime
from agents.services import Restarting, start_with
from agents.topics import raw_topic
from rebound.agreement import GroupSettings, describe_differences, group_settings
from rebound.summary import (
    PartitionTiers,
    WorkerSummary,
    aggregate,
    fill_first_received,
    settings_mismatches,
    tiers_from_counts,
)
from rebound.topics import status_topic

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 2.0
STALE_AFTER_INTERVALS = 3
FIRST_RECEIPT_SURVEY_S = 60.0
SURVEY_BATCH = 1000
SURVEY_PAUSE_S = 0.005
"""Between two chunks of the survey. A chunk reads two fields of each record without decoding it (about 2 µs of CPU
per parked message, 8 µs decoded, measured on 200,000 records of a real RocksDB), so about 2 ms, then this pause:
the survey takes at most about a quarter of the event loop and never holds it for long while releases are due. A
million parked take about 2 s of CPU, spread over 7 s, once a minute (and once more after a takeover or a first park:
see ``SURVEY_CHECK_S``)."""
SURVEY_PAUSE_PER_BUSY = 3.0
"""A chunk that took longer (a busy worker: releases due, RocksDB compacting) is followed by a pause three times as
long, so the survey never takes more than a quarter of the event loop: at 1,000 releases a second a fixed pause let a
survey of 100,000 parked take half of it for a second, and the releases due meanwhile queued behind it."""
SURVEY_CHECK_S = 2.0
"""How often the survey asks whether a walk would say something new: a partition scheduled here that no walk has read
since it was last adopted (a takeover, the first assignment, a replay into it), or a tier of one with parked messages
and no first receipt that had none when the last walk began (a first park; a tier emptied and filled again, once
between two walks of every partition: ``SurveyState.asked``). Then a walk starts (after ``SURVEY_EARLY_GAP``), else one comes every
``FIRST_RECEIPT_SURVEY_S``; a burst of parks between two looks is one walk. One status interval. How long OLDEST can
stay `-` (about this plus four walk lengths) is told in docs/operating.md."""
SURVEY_EARLY_GAP = 3.0
"""An early walk (not the minute's) waits, after the last walk ended, three times as long as that walk took: walks
then take at most a quarter of the time, each at most a quarter of the event loop, whatever keeps asking for one (a
tier of one partition after another filling after a walk, a partition lost and taken back in every walk)."""
RECENT_RECORDS_PER_PARTITION = 32


@dataclass
class SurveyState:
    """What the first-receipt survey needs to decide when to walk (:func:`survey_due`)."""

    running: bool = False
    """A walk is under way: no other starts (:func:`survey_first_received`)."""
    surveyed: dict[int, int] = field(default_factory=dict)
    """Partitions a walk read whole while they were scheduled here, and have been kept since (scheduled or
    suspended): the schedule's :meth:`~rebound.schedule.ReleaseSchedule.adoption` number of each when it was read. A
    partition adopted again since (taken over again, a replay into it), even between two looks or during a walk of
    others, has another number: not read yet."""
    counted: frozenset[tuple[int, str]] = frozenset()
    """``(partition, tier)`` that had parked messages when the last walk began, and have had some at every look since:
    such a tier without a figure (the walk found none: it emptied and filled again during the walk, or its count is
    wrong) waits for the minute's walk instead of asking for a walk every few seconds."""
    asked: frozenset[tuple[int, str]] = frozenset()
    """``(partition, tier)`` that asked for an early walk (no figure) since the last walk of every partition: each
    asks at most once between two, then waits for the minute's walk. A tier that keeps emptying and filling again (a
    1 s tier) would otherwise ask at every other look, and each early walk reads the whole partition (docs/design.md,
    Scale)."""
    cadence_from_s: float | None = None
    """Monotonic time the last walk began (the first look, before any walk): the next is due ``FIRST_RECEIPT_SURVEY_S``
    after it."""
    ended_s: float = 0.0
    took_s: float = 0.0


@dataclass
class StatusBoard:
    """The latest summary of every worker, as read from the status topic (plus this worker's own, at once)."""

    worker_id: str
    url: str
    interval_s: float = STATUS_INTERVAL_S
    latest: dict[str, WorkerSummary] = field(default_factory=dict)
    first_received: dict[int, dict[str, int]] = field(default_factory=dict)
    """Per partition scheduled (or suspended) here, per tier with parked messages: the oldest first receipt the last
    walk read (:func:`survey_first_received`)."""
    survey: SurveyState = field(default_factory=SurveyState)
    settings: GroupSettings | None = None
    """This worker's settings that the group must agree on, computed once at start."""
    warned: dict[str, str] = field(default_factory=dict)
    """Worker -> the fingerprint of its that was last logged as differing from ours."""
    started_ms: int = 0
    """When this worker's board was made (as it starts): only summaries published since are compared with its
    settings (``settings_mismatches``)."""

    @property
    def stale_after_ms(self) -> int:
        return int(self.interval_s * STALE_AFTER_INTERVALS * 1000)

    def record(self, summary: WorkerSummary) -> None:
        current = self.latest.get(summary.worker)
        if current is None or summary.at_ms >= current.at_ms:
            self.latest[summary.worker] = summary

    def cluster(self, runtime: Runtime) -> dict[str, Any]:
        now = runtime.clock()
        # Forget workers gone for long (ten stale windows): they were reported as stale long enough.
        for worker, summary in list(self.latest.items()):
            if now - summary.at_ms > 10 * self.stale_after_ms:
                del self.latest[worker]
        result = aggregate(
            self.latest.values(),
            now_ms=now,
            stale_after_ms=self.stale_after_ms,
            tier_names=runtime.tier_topics,
            partition_count=runtime.partitions,
        )
        result["this_worker"] = self.worker_id
        result["settings_mismatch"] = self.settings_mismatch(now)
        return result

    def settings_mismatch(self, now_ms: int) -> list[dict[str, Any]]:
        """The fresh workers whose group settings differ from this one's; each new difference (a worker, or a worker
        with other values than last logged) is logged once at WARNING, a worker agreeing again at INFO."""
        if self.settings is None:
            return []
        mine = self.settings
        found = settings_mismatches(
            self.latest.values(),
            mine=mine,
            me=self.worker_id,
            now_ms=now_ms,
            stale_after_ms=self.stale_after_ms,
            since_ms=self.started_ms,
        )
        for other in found:
            if self.warned.get(other["worker"]) != other["fingerprint"]:
                self.warned[other["worker"]] = other["fingerprint"]
                log.warning(
                    "settings differ between workers %s (this one, %s) and %s (%s) of one group: %s. Each worker "
                    "decides retries with its own settings, so a message's fate depends on which worker holds its "
                    "partition: give every worker of the group the same values",
                    self.worker_id,
                    mine.fingerprint,
                    other["worker"],
                    other["fingerprint"],
                    describe_differences(other["differs"]),
                )
        differing = {other["worker"] for other in found}
        for worker in [worker for worker in self.warned if worker not in differing]:
            del self.warned[worker]
            summary = self.latest.get(worker)
            if summary is not None and summary.settings is not None and now_ms - summary.at_ms <= self.stale_after_ms:
                log.info("worker %s now has the same group settings as this one (%s)", worker, mine.fingerprint)
        return found


def worker_identity(runtime: Runtime) -> tuple[str, str]:
    url = str(runtime.app.conf.canonical_url)
    return f"{url.split('://', 1)[-1]}/{os.getpid()}", url


def status_board(runtime: Runtime) -> StatusBoard:
    board = runtime.status_board
    if board is None:
        worker, url = worker_identity(runtime)
        board = runtime.status_board = StatusBoard(
            worker_id=worker, url=url, settings=group_settings(runtime.settings), started_ms=runtime.clock()
        )
    return board


def local_partition_tiers(runtime: Runtime) -> PartitionTiers:
    """This worker's per-partition tier numbers: counts kept by the store, time figures from the schedule's heaps,
    first receipts from the last survey. No scan: this runs per status tick and per request."""
    board = status_board(runtime)
    tiers = tiers_from_counts(
        runtime.store.parked_per_tier,
        runtime.schedule.tier_stats(runtime.clock()),
        partitions=runtime.schedule.partitions,
    )
    fill_first_received(tiers, board.first_received)
    return tiers


def not_read(runtime: Runtime, partitions: frozenset[int]) -> frozenset[int]:
    """Of ``partitions``, those no walk has read since their last adoption."""
    surveyed = status_board(runtime).survey.surveyed
    adoption = runtime.schedule.adoption
    return frozenset(p for p in partitions if p not in surveyed or surveyed[p] != adoption(p))


def surveyed_here(runtime: Runtime) -> frozenset[int]:
    """The partitions a walk reads and whose figures the views show: scheduled here and owned."""
    return runtime.schedule.partitions & owned_partitions(runtime)


def parked_tiers(runtime: Runtime, partitions: frozenset[int]) -> frozenset[tuple[int, str]]:
    """``(partition, tier)`` with parked messages, from the store's counts (no scan)."""
    counts = runtime.store.parked_per_tier
    return frozenset((p, tier) for p in partitions for tier, count in counts.get(p, {}).items() if count)


def forget_gone(runtime: Runtime, board: StatusBoard) -> frozenset[int]:
    """Drop the figures of partitions neither scheduled here nor suspended (kept across a rebalance: they resume as
    they were if nothing was replayed into them) and of tiers with nothing parked (a figure would be older than the
    next message parked); returns the partitions scheduled here."""
    here = surveyed_here(runtime)
    kept = here | runtime.schedule.suspended
    parked = parked_tiers(runtime, here)
    state = board.survey
    figures: dict[int, dict[str, int]] = {}
    for partition, tiers in board.first_received.items():
        left = {tier: first for tier, first in tiers.items() if partition not in here or (partition, tier) in parked}
        if left and partition in kept:
            figures[partition] = left
    board.first_received = figures
    state.surveyed = {p: adopted for p, adopted in state.surveyed.items() if p in kept}
    state.counted &= parked
    return here


@dataclass(frozen=True)
class Walk:
    """A walk :func:`survey_due` asks for: why, and which partitions (None: all scheduled here, the minute's)."""

    reason: str
    partitions: frozenset[int] | None = None


def survey_due(runtime: Runtime, now_s: float) -> Walk | None:
    """The walk to start now (``now_s``: monotonic seconds), or None: one is running; the minute since the last full
    walk began is up (all partitions); or, unless the last walk ended less than ``SURVEY_EARLY_GAP`` times its length
    ago, the partitions here that no walk has read and those with a tier with parked messages and no figure (see
    ``SURVEY_CHECK_S``): only them, so that a takeover reads only the partitions taken over. Reads only the store's
    counts (no scan): it runs every ``SURVEY_CHECK_S``."""
    board = status_board(runtime)
    state = board.survey
    if state.running:
        return None
    here = forget_gone(runtime, board)
    if state.cadence_from_s is None:
        state.cadence_from_s = now_s
    if now_s - state.cadence_from_s >= FIRST_RECEIPT_SURVEY_S:
        return Walk("the minute's walk")
    if now_s - state.ended_s < SURVEY_EARLY_GAP * state.took_s:
        return None
    reasons: list[str] = []
    unread = not_read(runtime, here)
    if unread:
        reasons.append(f"partitions {sorted(unread)} not read yet")
    unfigured = sorted(
        (partition, tier)
        for partition, tier in parked_tiers(runtime, here - unread) - state.counted - state.asked
        if tier not in board.first_received.get(partition, {})
    )
    reasons.extend(
        f"{tier} has parked messages of partition {partition} and no first receipt" for partition, tier in unfigured
    )
    if not reasons:
        return None
    state.asked |= frozenset(unfigured)
    return Walk("; ".join(reasons), unread | {partition for partition, _tier in unfigured})


async def survey_step(runtime: Runtime, now: Callable[[], float] = time.monotonic) -> str | None:
    """One look of the survey (every ``SURVEY_CHECK_S``): a walk if :func:`survey_due` says so; returns why, or None.
    A walk that fails is logged, and its partitions and tiers count as read: the next try is the minute's walk."""
    walk = survey_due(runtime, now())
    if walk is None:
        return None
    log.debug("first-receipt survey: %s", walk.reason)
    try:
        await survey_first_received(runtime, now, walk.partitions)
    except Exception:  # a figure of the views: never worth a worker
        log.exception("first-receipt survey failed")
        state = status_board(runtime).survey
        here = surveyed_here(runtime)
        state.surveyed.update({p: adopted for p in here if (adopted := runtime.schedule.adoption(p)) is not None})
        state.counted = parked_tiers(runtime, here)
    return walk.reason


async def survey_first_receipts(runtime: Runtime) -> None:
    """The survey's loop: a look every ``SURVEY_CHECK_S``, one walk at a time (each look awaits its walk)."""
    while True:
        await asyncio.sleep(SURVEY_CHECK_S)
        await survey_step(runtime)


async def survey_first_received(
    runtime: Runtime, now: Callable[[], float] = time.monotonic, partitions: frozenset[int] | None = None
) -> bool:
    """The oldest first receipt per partition and tier: the one figure no counter keeps (it would take a second
    ordered index of every parked message). Read by a walk of ``partitions`` (default: all) scheduled here that pauses
    every ``SURVEY_BATCH`` entries (``SURVEY_PAUSE_S``), so it never holds up a release; when and which,
    :func:`survey_due` decides. The other partitions keep their figures.

    Never two at once: while one runs, another call returns False at once. A partition seen gone from this worker
    after any chunk of the walk (revoked, even if given back before the walk ends) gets no figure from it: its read may
    have stopped short (a revoked partition's database is closed) or missed another worker's writes; it keeps the
    figure it had, if it is kept here (:func:`forget_gone`), and the next look asks for a walk of it.
    """
    board = status_board(runtime)
    state = board.survey
    if state.running:
        return False
    state.running = True
    began = now()
    try:
        start = surveyed_here(runtime)
        if partitions is not None:
            start &= partitions
        counted = parked_tiers(runtime, start)
        oldest: dict[int, dict[str, int]] = {}
        adopted: dict[int, int | None] = {}  # (None: never, as the partition is scheduled here)
        lost: set[int] = set()

        def gone() -> set[int]:  # (scheduled here no more, or adopted again since its read began)
            here = surveyed_here(runtime)
            return {p for p in oldest if p not in here or runtime.schedule.adoption(p) != adopted[p]}

        for partition in sorted(start):
            if partition not in surveyed_here(runtime):
                lost.add(partition)
                continue
            adopted[partition] = runtime.schedule.adoption(partition)
            tiers = oldest.setdefault(partition, {})
            for listed in (False, True):  # records of their own, then version 2 states' lists
                after: bytes | None = None
                while partition not in lost:
                    started = time.perf_counter()
                    if listed:
                        entries, after = runtime.store.parked_chunk(partition, after, SURVEY_BATCH, listed=True)
                        found = [(entry.tier_topic, entry.provenance.first_received_at_ms) for entry in entries]
                    else:
                        found, after = runtime.store.first_received_chunk(partition, after, SURVEY_BATCH)
                    for tier, first in found:  # folded as it goes: never a list of a million entries
                        tiers[tier] = min(tiers.get(tier, first), first)
                    # (no database handle or iterator is held across this pause)
                    await asyncio.sleep(max(SURVEY_PAUSE_S, SURVEY_PAUSE_PER_BUSY * (time.perf_counter() - started)))
                    lost |= gone()  # (a partition read earlier in the walk too)
                    if after is None:
                        break
        read = frozenset(oldest) - lost
        kept = surveyed_here(runtime) | runtime.schedule.suspended
        figures = {p: tiers for p, tiers in board.first_received.items() if p in kept and p not in read}
        figures.update({partition: oldest[partition] for partition in read if oldest[partition]})
        board.first_received = figures
        for partition in lost:
            state.surveyed.pop(partition, None)
        state.surveyed.update({p: number for p in read if (number := adopted[p]) is not None})
        state.counted = frozenset((p, tier) for p, tier in state.counted if p not in start) | frozenset(
            (p, tier) for p, tier in counted if p in read
        )
        return True
    finally:
        state.running = False
        if partitions is None:
            state.cadence_from_s = began
            state.asked = frozenset()
        state.ended_s = now()
        state.took_s = state.ended_s - began


def local_ordering(runtime: Runtime) -> dict[int, dict[str, int]]:
    """Key-ordered mode: blocked keys and held messages per partition this worker schedules (counts, no scan)."""
    if not runtime.settings.key_ordered:
        return {}
    counts: dict[int, dict[str, int]] = runtime.store.ordering_counts(runtime.schedule.partitions)
    return counts


def breaker_snapshot(runtime: Runtime) -> dict[str, Any] | None:
    gate = runtime.breaker_gate
    if gate is None:
        return None
    snapshot = gate.breaker.snapshot(runtime.clock())
    snapshot["waiting_calls"] = gate.waiting
    snapshot["transitions"] = [
        {"at": t.at_ms, "from": str(t.from_state), "to": str(t.to_state), "reason": t.reason}
        for t in gate.breaker.transitions[-20:]
    ]
    return snapshot


def build_summary(runtime: Runtime) -> WorkerSummary:
    board = status_board(runtime)
    return WorkerSummary(
        worker=board.worker_id,
        url=board.url,
        at_ms=runtime.clock(),
        partitions=local_partition_tiers(runtime),
        owned=tuple(sorted(owned_partitions(runtime))),
        counters={name: int(value) for name, value in runtime.counters.items()},
        ordering=local_ordering(runtime),
        breaker=breaker_snapshot(runtime),
        pause_state_known=pause_state_known(runtime),
        concurrency=runtime.dispatcher.concurrency(),
        settings=board.settings,
    )


def register_status(runtime: Runtime) -> StatusBoard:
    """The publishing timer and the group-less reader task; returns the board the web views read."""
    board = status_board(runtime)
    app = runtime.app
    name = status_topic(runtime.settings.app_id)
    topic = raw_topic(app, name, partitions=runtime.partitions)
    runtime.status_topic = topic

    @app.timer(board.interval_s, name="rebound.status_publish")  # type: ignore[untyped-decorator]
    async def publish_status() -> None:
        try:
            summary = build_summary(runtime)
            board.record(summary)
            payload = json.dumps(summary.to_dict(), separators=(",", ":")).encode()
            await runtime.status_topic.send(key=board.worker_id.encode(), value=payload)
            board.settings_mismatch(summary.at_ms)  # logs a new difference even if no one asks the views
        except Exception:  # the status view must never take the worker down
            log.exception("could not publish the status summary")

    def survey_failed(exc: Exception) -> None:  # (survey_step catches a failed walk itself: this is a bug)
        log.error("first-receipt survey failed; restarting it", exc_info=exc)

    start_with(app, Restarting("first-receipt survey", lambda: survey_first_receipts(runtime), survey_failed))

    def reader_failed(exc: Exception) -> None:
        log.error("status reader failed; restarting it", exc_info=exc)

    start_with(app, Restarting("status reader", lambda: follow_status(runtime, name, board), reader_failed))

    return board


async def follow_status(runtime: Runtime, name: str, board: StatusBoard) -> None:
    from aiokafka import TopicPartition

    consumer = groupless_consumer(
        runtime.settings.bootstrap_servers,
        auto_offset_reset="latest",
        fetch_max_wait_ms=min(runtime.settings.fetch_max_wait_ms, 500),
    )
    try:
        await consumer.start()  # (inside: a start that fails is stopped too, or each retry leaks a client)
        found = await topic_partitions(consumer, name, tries=None, every_s=0.5)
        partitions = [TopicPartition(name, p) for p in sorted(found)]
        consumer.assign(partitions)
        # Start a little before the end, so the view is complete at once instead of after one interval. (An end
        # answered too low, as the embedded broker does, only means reading a few more old records.)
        starts = await consumer.beginning_offsets(partitions)
        ends = await consumer.end_offsets(partitions)
        for tp in partitions:
            consumer.seek(tp, max(starts[tp], ends[tp] - RECENT_RECORDS_PER_PARTITION))
        while True:
            batch = await consumer.getmany(timeout_ms=1000)
            for messages in batch.values():
                for message in messages:
                    try:
                        board.record(WorkerSummary.from_dict(json.loads(message.value)))
                    except (ValueError, KeyError, TypeError):
                        log.warning("ignoring malformed status record at %d", message.offset)
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()
