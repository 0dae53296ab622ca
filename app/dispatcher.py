"""Runs handler work concurrently across keys, one key at a time, acknowledging offsets only in order.

The decisions are :class:`rebound.dispatch.Dispatch`'s; this carries them out on Faust: each started work runs in a
task of its own with Faust's current event set to its event (table writes take their changelog partition from it),
acknowledgements go to Faust's consumer in offset order only (so Faust never sees a gap to misread, #606), dropped
and second deliveries are let go without an acknowledgement, and a partition with too much offered and unfinished
work is paused through Faust's consumer until it drains.

Agents that use it iterate their stream without Faust's automatic acknowledgements (``stream.noack()``) and hand
every event over; the agent itself never waits for a handler, so one slow key holds up neither its partition's other
keys nor the other partitions.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import weakref
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any

from faust.streams import _current_event

from rebound.dispatch import Dispatch, Step, Work

log = logging.getLogger(__name__)
RETRY_BACKOFF_S = (0.1, 0.5, 1.0, 5.0)

Run = Callable[[Any], Awaitable[None]]


@dataclass(frozen=True)
class Job:
    event: Any
    run: Run


class Dispatcher:
    """One per worker, shared by the main agent and the release agent: ``limit`` bounds their handler calls together."""

    def __init__(self, app: Any, *, limit: int, partition_buffer: int, revoke_drain_s: float = 0.0) -> None:
        self.app = app
        self.core: Dispatch[Job] = Dispatch(limit=limit, partition_buffer=partition_buffer)
        self.revoke_drain_s = revoke_drain_s
        self._tasks: dict[Work[Job], asyncio.Task[None]] = {}
        self._drain_timer: asyncio.TimerHandle | None = None

    @property
    def in_flight(self) -> int:
        return self.core.running

    def offer(self, event: Any, lane: Hashable, run: Run) -> None:
        """Hand one event over; ``run(event)`` is awaited when its lane and a slot are free, and must not raise."""
        message = event.message
        take_void = getattr(self.app.consumer, "take_void", None)
        if take_void is not None and take_void(message):
            # Its hand-over was interrupted when the flow resumed and it was read again: the copy read again runs.
            self._safely(self.app.consumer.abandon, message)
            return
        self._carry_out(self.core.offer(message.tp, message.offset, lane, Job(event, run)))

    def revoke(self) -> None:
        """Faust stopped the flow (a rebalance or a shutdown): running work finishes, and queued work runs on for up
        to ``revoke_drain_s`` before it is dropped.

        Faust waits for every message its streams took before it commits and lets the rebalance go on; what is done
        by then is committed with the revocation, and what was dropped is read again by the partition's next owner.
        Draining trades a longer revocation (bounded, and the group waits for it) for fewer handler calls made twice.
        """
        drain = self.revoke_drain_s > 0
        self._carry_out(self.core.revoke(drain=drain))
        if drain and self.core.draining and self._drain_timer is None:
            # A second stop while a drain runs (a shutdown during a rebalance) keeps the first deadline: the
            # revocation in progress is waiting for that work too.
            self._drain_timer = asyncio.get_running_loop().call_later(self.revoke_drain_s, self._drain_time_up)

    def _drain_time_up(self) -> None:
        self._drain_timer = None
        if self.core.draining:
            log.info("dispatcher: dropping %d queued records a revocation did not reach", self.core.queued)
            self._carry_out(self.core.drop_drained())

    async def wait_idle(self) -> None:
        """Until no work is running (tests, and a shutdown that wants to finish what it started)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks.values()))

    def _carry_out(self, step: Step[Job]) -> None:
        """Work is started whatever happens before it: a work the core counts as running without a task would hold
        its lane, its slot and Faust's ``wait_empty`` for ever."""
        consumer = self.app.consumer
        for work in step.abandon:
            self._safely(consumer.abandon, work.item.event.message)
        for work in step.ack:
            self._safely(self._acknowledge, work)
        if step.pause:
            # Between fetched batches: Faust's getmany filters a batch by the live set of active partitions, so a
            # pause now would drop the rest of the batch (read again later, but at the cost of a seek).
            self._safely(consumer.pause_between_batches, step.pause)
        if step.resume and consumer.flow_active:  # never undo the pause of a rebalance in progress
            self._safely(consumer.resume_after_pause, step.resume)
        for work in step.start:
            self._start(work)

    def _acknowledge(self, work: Work[Job]) -> None:
        """Acknowledge to Faust; an acknowledgement Faust does not take (its consumer refuses a message no stream
        tracked, or one below the committed offset) is logged and forgotten, so the record runs again if read again."""
        try:
            taken = work.item.event.ack()
        except Exception:
            log.exception("dispatcher: acknowledging %s@%d failed", work.partition, work.offset)
            taken = False
        message = work.item.event.message
        if taken is False and not (getattr(message, "refcount", 0) > 0 and not getattr(message, "acked", False)):
            # (Still held by another stream, the message is acknowledged to the consumer when that one lets go.)
            log.warning(
                "dispatcher: Faust did not take the acknowledgement of %s@%d (acked %s, tracked %s, refcount %s, "
                "committed %s); it runs again if read again",
                work.partition,
                work.offset,
                getattr(message, "acked", None),
                getattr(message, "tracked", None),
                getattr(message, "refcount", None),
                self._committed(message),
            )
            self.core.not_taken(work)

    def _committed(self, message: Any) -> object:
        committed = getattr(getattr(self.app, "consumer", None), "_committed_offset", None)
        return committed.get(message.tp) if isinstance(committed, dict) else None

    @staticmethod
    def _safely(action: Callable[..., object], *args: object) -> None:
        """One failing acknowledgement must not cost another partition its resume, or a work its start."""
        try:
            action(*args)
        except Exception:
            log.exception("dispatcher: %s failed", getattr(action, "__name__", action))

    def _start(self, work: Work[Job]) -> None:
        context = contextvars.copy_context()
        context.run(_current_event.set, weakref.ref(work.item.event))
        task = asyncio.get_running_loop().create_task(self._run(work), context=context)
        self._tasks[work] = task

    async def _run(self, work: Work[Job]) -> None:
        completed = False
        attempt = 0
        message = work.item.event.message
        try:
            while True:
                try:
                    await work.item.run(work.item.event)
                    completed = True
                    return
                except asyncio.CancelledError:
                    raise
                except Exception:
                    # The work routes every failure itself; reaching here means even that failed (the failed topic
                    # refused the record). Running it again is at-least-once; acknowledging it would lose it.
                    delay = RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)]
                    log.exception("work on %s@%d failed; running it again in %.1fs", message.tp, message.offset, delay)
                attempt += 1
                await asyncio.sleep(delay)
                if work.generation != self.core.generation:
                    # Revoked meanwhile: left to the partition's next reader (Faust waits for this task to end).
                    log.warning("leaving %s@%d, which kept failing, to the next reader", message.tp, message.offset)
                    return
        finally:
            del self._tasks[work]
            self._carry_out(self.core.finish(work, completed=completed))
