"""Faust's aiokafka consumer, with reading and committing that never pass over a record Rebound has not handled.

Faust's ``Consumer._drain_messages`` treats any jump in offsets as a compacted-topic gap and ``_new_offset`` commits
across it, and also across a single missing offset at the head of the acknowledged ones (faust-streaming issue 606).
On Rebound's topics (never compacted) those jumps come from Faust itself around rebalances and seeks (see
``rebound/read_cursors.py``); committed across, they lost records in chaos runs. Here, on every topic whose messages
are acknowledged (not changelogs): a jump is read again from the expected offset, committing starts only at the
committed offset and runs over acknowledged offsets and confirmed gaps only, and a partition with nothing committed
starts from its earliest offset, where ``auto_offset_reset=earliest`` would also have started it.

Plugged in through Faust's own seams: ``App._new_transport`` picks the transport, whose ``Consumer`` class this is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from time import monotonic
from typing import Any, ClassVar, cast

import faust
from aiokafka.errors import (
    GroupAuthorizationFailedError,
    IllegalStateError,
    KafkaError,
    TopicAuthorizationFailedError,
)
from faust.exceptions import ConsumerNotStarted
from faust.transport.consumer import CONSUMER_FETCHING, ensure_TPset
from faust.transport.drivers import aiokafka as driver
from faust.types import TP, Message
from faust.utils.functional import consecutive_numbers
from mode import Service, ServiceT
from mode.utils.futures import notify

from app.log_levels import drop_unprinted_debug_level
from rebound.read_cursors import ReadCursors, Verdict

log = logging.getLogger(__name__)


class ReboundConsumerThread(driver.AIOKafkaConsumerThread):
    """faust-streaming hard-codes ``fetch_max_wait_ms=1500``; the app's ``fetch_max_wait_ms`` replaces it.

    Real Kafka answers a fetch as soon as any partition has data, so the value rarely matters there; the embedded
    broker answers a multi-partition fetch only when the wait is over, which puts up to 1.5 s between a due time and
    the release.
    """

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        wait_ms = getattr(self.app, "fetch_max_wait_ms", None)
        if wait_ms is not None:
            consumer._fetch_max_wait_ms = wait_ms  # read when the consumer starts its fetcher
        return consumer

    @Service.timer(1.0)
    async def _surface_coordinator_errors(self) -> None:
        self.surface_coordinator_errors()

    def surface_coordinator_errors(self) -> None:
        """Hand aiokafka's group coordinator the "error seen" it waits for, as its own ``getmany`` would.

        On an unexpected answer (the mock cluster's SyncGroup INVALID_REQUEST, for one) aiokafka's coordinator parks
        the error for the user and waits until ``check_errors`` is called before it joins again; Faust reads
        records from the fetcher directly and never calls it, so the worker sat in no group for ever. Logged, the
        coordinator goes on and rejoins; an authorization error needs an operator and ends the worker.
        """
        consumer = self._consumer
        coordinator = getattr(consumer, "_coordinator", None) if consumer is not None else None
        if coordinator is None:
            return
        task = getattr(coordinator, "_coordination_task", None)
        if task is not None and task.done():
            coordinator.check_errors()  # the coordinator itself died: raise (ends the worker), as aiokafka would
            return
        try:
            coordinator.check_errors()
        except (GroupAuthorizationFailedError, TopicAuthorizationFailedError):
            raise
        except KafkaError as exc:
            log.error("rebound: the group coordinator failed (%r); joining the group again", exc)

    async def committed(self, tp: TP) -> int | None:
        """The group's committed offset of ``tp`` as the broker has it (run in the thread: it asks the broker)."""
        return cast(int | None, await self._ensure_consumer().committed(tp))

    async def positions(self, partitions: list[TP]) -> dict[TP, int | None]:
        """The fetcher's position of each partition still assigned, None while it is being reset."""
        return cast(dict[TP, int | None], await self.call_thread(cast(Any, self._positions), partitions))

    def _positions(self, partitions: list[TP]) -> dict[TP, int | None]:
        # Read from the subscription state, as Faust's verify_event_path does: consumer.position() would consume a
        # pending coordinator error (check_errors) that the timer above must see.
        consumer = self._ensure_consumer()
        assignment = consumer._subscription.subscription.assignment if consumer._subscription.subscription else None
        positions: dict[TP, int | None] = {}
        if assignment is None:
            return positions
        for tp in partitions:
            state = assignment.state_value(tp)
            if state is not None:
                positions[tp] = state.position if state.has_valid_position else None
        return positions


class ReboundConsumer(driver.Consumer):
    """The worker's consumer: every record of an acknowledged topic is handed to its stream before it is committed."""

    _thread: ReboundConsumerThread
    positions_checked_at = 0.0
    positions_check_interval = 1.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.read_cursors = ReadCursors()
        self._positioned_at: dict[TP, int | None] = {}
        self._reposition: dict[TP, int] = {}
        self._batches_whole = True
        self._changelog_topic: dict[str, bool] = {}
        self._pause_requested: set[TP] = set()
        self._held_topics: frozenset[str] = frozenset()
        self._holds: dict[str, frozenset[str]] = {}
        self._effective_holds: frozenset[str] = frozenset()
        self._released_while_stopped: frozenset[str] = frozenset()
        self._stuck_seen: dict[TP, tuple[int, int, float]] = {}
        self._delivering: asyncio.Task[Any] | None = None
        self._delivering_tp: Any = None
        self._delivering_message: Message | None = None
        self._sought_this_generation = False
        self._flow_stops = 0
        self._drain_task: asyncio.Task[Any] | None = None
        self._voided: dict[int, Message] = {}
        self._delivery_interrupted = False
        self._kept_through_revocation: dict[TP, tuple[Any, Any, Any, Any]] = {}
        super().__init__(*args, **kwargs)
        # The app's part of a revocation (stop the flow, wait for the streams, commit), called by Faust's consumer
        # once it has forgotten the partitions' acknowledgements: they are put back first.
        self._app_revocation = self._on_partitions_revoked
        self._on_partitions_revoked = self._revoke_with_acknowledgements_kept

    def member_id(self) -> str | None:
        """This worker's member id in the group (None before it first joined): the group hands out a new one only
        to a member it evicted (or that left), which the tables' writer epochs need to know."""
        consumer = getattr(self._thread, "_consumer", None)
        coordinator = getattr(consumer, "_coordinator", None)
        member = getattr(coordinator, "member_id", None)
        return member or None

    def _new_consumer_thread(self) -> ReboundConsumerThread:
        return ReboundConsumerThread(self, loop=self.loop, beacon=self.beacon)

    def _must_see_every_offset(self, tp: TP) -> bool:
        """Per message: Faust's ``_is_changelog_tp`` builds a new set of changelog topics on every call, so the
        answer is kept per topic (tables are all declared before the worker consumes)."""
        if not self.app.topics.acks_enabled_for(tp.topic):
            return False
        changelog = self._changelog_topic.get(tp.topic)
        if changelog is None:
            changelog = self._changelog_topic[tp.topic] = self._is_changelog_tp(tp)
        return not changelog

    def abandon(self, message: Message) -> None:
        """Let go of a message that will never be acknowledged (its offset is read again after the next seek).

        Faust waits, at every rebalance and at shutdown, until each message its streams took is acknowledged
        (``wait_empty``); a message Rebound's dispatcher dropped must stop counting there without its offset ever
        becoming committable.
        """
        self._unacked_messages.discard(message)
        notify(self._waiting_for_ack)  # Faust's wait_empty polls once a second otherwise

    def pause_between_batches(self, tps: list[TP]) -> None:
        """Pause partitions (back-pressure) once the batch being handed over is done (see ``_before_each_fetch``)."""
        self._pause_requested.update(ensure_TPset(tps))

    def resume_after_pause(self, tps: list[TP]) -> None:
        # A message's tp is aiokafka's TopicPartition; Faust's resume_partitions adds what it is given to the active
        # set as it is, and the next fetch asserts that every member is Faust's own TP (a crash of the worker).
        resumed = {tp for tp in ensure_TPset(tps) if tp.topic not in self._held_topics}
        self._pause_requested.difference_update(resumed)
        self.resume_partitions(resumed)

    def resume_partitions(self, tps: Any) -> None:
        """Never resume a held topic's partition: Faust resumes every partition after a rebalance (its recovery's
        ``_resume_streams``), which would fetch a batch of the main topics while the circuit breaker is open."""
        held = self._held_topics
        super().resume_partitions({tp for tp in ensure_TPset(tps) if tp.topic not in held} if held else tps)

    def hold_topics(
        self, topics: frozenset[str], *, reason: str = "breaker", still_paused: frozenset[TP] = frozenset()
    ) -> None:
        """Stop fetching ``topics`` until :meth:`release_topics` with the same ``reason`` (``breaker``: the circuit
        breaker is open; ``pause``: an operator paused the main topics); partitions assigned later, after a
        rebalance, are held as well. Takes effect between fetched batches, like back-pressure.

        Each reason holds on its own: a topic is fetched again only once no reason holds it (and back-pressure does
        not pause its partition), so the breaker closing never undoes an operator's pause, nor the reverse.

        No topics at all ends ``reason``'s hold, as :meth:`release_topics` does (``still_paused`` is passed on)."""
        if not topics:
            self.release_topics(still_paused=still_paused, reason=reason)
            return
        self._holds[reason] = frozenset(topics)
        self._held_topics = frozenset().union(*self._holds.values())

    def release_topics(self, *, still_paused: frozenset[TP] = frozenset(), reason: str = "breaker") -> None:
        """End ``reason``'s hold; fetch again the topics no other reason holds, except partitions back-pressure
        still pauses."""
        before = self._held_topics
        self._holds.pop(reason, None)
        self._held_topics = frozenset().union(*self._holds.values())
        self._effective_holds = self._effective_holds & frozenset(self._holds)
        held = before - self._held_topics
        if not held:
            return
        if not self.flow_active or not self._sought_this_generation:
            # A rebalance in progress (the flow stopped, or the tables' recovery reading changelogs before the seek
            # to the committed offsets): Faust's own resume may already have passed these over (they were held), so
            # they are resumed with the flow after that seek (back-pressure is reset by then).
            self._released_while_stopped |= held
            return
        kept = {(tp.topic, tp.partition) for tp in still_paused}
        try:
            assigned = ensure_TPset(self.assignment())
        except ConsumerNotStarted:  # nothing assigned yet, nothing paused
            return
        resumed = {tp for tp in assigned if tp.topic in held and (tp.topic, tp.partition) not in kept}
        self._pause_requested.difference_update(resumed)
        self.resume_partitions(resumed)

    @property
    def held_topics(self) -> frozenset[str]:
        return self._held_topics

    @property
    def holds(self) -> dict[str, frozenset[str]]:
        """The topics each reason holds."""
        return dict(self._holds)

    @property
    def effective_holds(self) -> frozenset[str]:
        """The reasons whose hold a fetch has obeyed: every fetch since the last batch boundary leaves their topics
        out (records fetched before may still be running)."""
        return self._effective_holds & frozenset(self._holds)

    def verify_event_path(self, now: float, tp: TP) -> None:
        """Faust's livelock detector logs an error for a partition with records it has not fetched for
        ``stream_processing_timeout``: a held topic is not fetched on purpose (an operator's pause can last hours)."""
        if tp.topic in self._held_topics:
            return
        super().verify_event_path(now, tp)

    def on_buffer_drop(self, tp: TP) -> None:
        """Faust's conductor fetches a partition again once its stream queue drains (after ``on_buffer_full``), even
        when the partition was paused meanwhile (back-pressure, a hold): a paused partition stays paused.

        Faust's own version is not called: it puts the partition in the active set first (which the consumer thread
        reads for its next fetch) and takes it out here after. A held topic's partition not paused yet (the hold began
        during this batch) goes back to the active set: the batch being handed over still yields its records (Faust's
        getmany yields those of active and buffered partitions only), and ``_before_each_fetch`` pauses it before the
        next fetch. Left out, the rest of its batch would be skipped, to be read again only by the position check."""
        buffered = self._buffered_partitions
        if tp in buffered:
            buffered.discard(tp)
            if tp not in self._paused_partitions:
                self._get_active_partitions().add(tp)

    def stop_flow(self) -> None:
        """Faust stops the flow first thing at a revocation and at shutdown: work queued but not started is dropped
        then, before Faust waits for the work in flight (``wait_empty``)."""
        super().stop_flow()
        self._sought_this_generation = False
        self._flow_stops += 1
        self._voided.clear()
        self._interrupt_delivery()
        self._pause_requested.clear()  # back-pressure of the generation that ends; Faust resumes everything after
        for callback in getattr(self.app, "flow_stopped_callbacks", ()):
            callback()

    def ack(self, message: Message) -> bool:
        """Refuse the ack of a message no agent saw.

        Faust's pure-Python stream iterator (used when its Cython extension is not, ``NO_CYTHON``) acks an event it
        skips because the flow is stopped or the generation changed; the skip comes before the message is tracked,
        and a commit would then pass over a record nobody handled. Refused, the offset holds commits back until the
        seek that follows every such skip reads it again. (The Cython iterator does not ack skipped events.)
        """
        if not message.tracked and self._must_see_every_offset(message.tp):
            return False
        return super().ack(message)

    async def _seek(self, partition: TP, offset: int) -> None:
        # Through the consumer thread's queue, in order with Faust's seek_to_committed: aiokafka's seek touches fetcher
        # state that its own thread reads without locks (a seek from here could kill its fetch task with a KeyError).
        await self._thread.call_thread(cast(Any, self._thread.seek), partition, offset)

    async def _seek_if_assigned(self, tp: TP, offset: int) -> None:
        try:
            await self._seek(tp, offset)
        except (IllegalStateError, AssertionError):
            log.info("rebound: %s was revoked before it could be read again from %d", tp, offset)

    async def perform_seek(self) -> None:
        """Faust's seek to the committed offsets; where nothing (or 0) is committed, a seek to the log's start.

        aiokafka's ``seek_to_committed`` leaves such a partition wherever its fetcher got to, which may be past records
        handed to a stream that dropped them at a generation change; the log's start is where
        ``auto_offset_reset=earliest`` starts it anyway. If the start cannot be listed, offset 0 (aiokafka then
        resets to the start, and the jump is read twice like any other).
        """
        stops_at_start = self._flow_stops
        committed: dict[TP, int | None] = dict(await self.seek_to_committed())
        watched: dict[TP, int | None] = {}
        for tp, offset in committed.items():
            self._read_offset[tp] = offset if offset is not None and offset >= 0 else None
            if offset is not None:
                self._committed_offset[tp] = offset if offset else None
            if self._must_see_every_offset(tp):
                watched[tp] = offset if offset is not None and offset > 0 else None
                if watched[tp] is not None:
                    self.read_cursors.positioned(tp, watched[tp])
        from_start = [tp for tp, offset in watched.items() if offset is None]
        if from_start:
            for tp, start in (await self._log_starts(from_start)).items():
                self.read_cursors.positioned(tp, start)
                watched[tp] = start
                await self._seek_if_assigned(tp, start)
        self._positioned_at = dict(watched)
        self._reposition.clear()
        # Only the recovery's seek, with no flow stop since it began: Faust's getmany also seeks when a fetch comes
        # back after the flow stopped (mid-rebalance), and a seek a new stop overtook belongs to the ended generation.
        if self._flow_stops == stops_at_start and asyncio.current_task() is not self._drain_task:
            self._sought_this_generation = True

    async def _log_starts(self, tps: list[TP]) -> dict[TP, int]:
        try:
            starts = dict(await self.earliest_offsets(*tps))
        except (KafkaError, TimeoutError) as exc:
            log.warning("rebound: could not list where %s start (%r); reading them from 0", tps, exc)
            starts = {}
        return {tp: starts.get(tp) or 0 for tp in tps}

    async def _position_from_committed(self, tp: TP, offset_at_hand: int) -> int | None:
        """Seek a partition with no known position to the group's committed offset (the log's start if none); answer
        that position (None if unknown).

        Faust resumes stream partitions before it awaits its seek to the committed offsets, so records can arrive
        first; if the broker cannot be asked, the position stays unknown and the next record asks again. When the
        record at hand is the one at that position no seek is made: it is taken, and the fetcher is already past it
        (seeking would drop it and the rest of its batch, to read them again).
        """
        try:
            committed = await asyncio.wait_for(
                self._thread.call_thread(cast(Any, self._thread.committed), tp),
                timeout=self.app.conf.broker_request_timeout,
            )
        except (KafkaError, IllegalStateError, AssertionError, TimeoutError) as exc:
            log.warning("rebound: could not ask the committed offset of %s (%r); its records wait", tp, exc)
            return None
        if committed:
            self._committed_offset[tp] = committed
            start = int(committed)
        else:
            start = (await self._log_starts([tp]))[tp]
        log.info("rebound: %s had no read position yet; reading from %d", tp, start)
        self.read_cursors.positioned(tp, start)
        if start != offset_at_hand:
            await self._seek_if_assigned(tp, start)
        return start

    def resume_flow(self) -> None:
        """Records handed over between the recovery's seek and the flow's resumption sit in stream queues that
        resuming clears: those partitions are read again from where the seek put them.

        The cursor goes back there at once, not only at the seek before the next fetch: the fetch loop may still be
        handing over the rest of a batch fetched past the cleared records, and delivering those first ran a key's
        later records before its earlier ones (seen in a key-ordered chaos run; in any mode they ran twice).
        """
        repositioned = set()
        for tp, offset in self._positioned_at.items():
            current = self.read_cursors.next_offset(tp)
            if offset is not None and current is not None and current != offset:  # (None: revoked since)
                self._reposition[tp] = offset
                self.read_cursors.positioned(tp, offset)
                repositioned.add((tp.topic, tp.partition))
        self._positioned_at = {}
        delivering = self._delivering_tp
        if delivering is not None and (delivering.topic, delivering.partition) in repositioned:
            # A hand-over under way (waiting for room, or for the producer to ebb) would land in the emptied queue
            # ahead of the records read again: it is read again with them instead. Faust's conductor may have left
            # its put to a full queue running on its own, so the message is also marked void: if it still reaches
            # a stream, the dispatcher lets it go (see :meth:`take_void`).
            message = self._delivering_message
            if message is not None:
                self._voided[id(message)] = message
            self._interrupt_delivery()
        self._pause_requested.clear()  # asked for before the rebalance ended: nothing of that is buffered any more
        super().resume_flow()
        if not self._sought_this_generation:
            return  # the tables' recovery resumes the flow to read changelogs: streams wait for the seek
        released, self._released_while_stopped = self._released_while_stopped - self._held_topics, frozenset()
        if released:
            with contextlib.suppress(ConsumerNotStarted):
                self.resume_partitions({tp for tp in ensure_TPset(self.assignment()) if tp.topic in released})

    async def seek(self, partition: TP, offset: int) -> None:
        await super().seek(partition, offset)
        if self._must_see_every_offset(partition):
            self.read_cursors.positioned(partition, offset)

    async def on_partitions_revoked(self, revoked: set[TP]) -> None:
        """Faust forgets the revoked partitions' acknowledgements and committed offsets, then stops the flow, waits for
        the streams and commits. Offsets acknowledged behind one still running (or still queued, see the dispatcher's
        drain) could then never be committed: the work before them finishes during that wait, but only its own offset
        is left to commit, and the next owner does everything after it again. So they are kept until that commit."""
        try:
            await self.maybe_wait_for_commit_to_finish()  # a periodic commit in flight would make ours a no-op
            await self.commit()  # what can be committed now, in case the commit after the wait fails
        except Exception:  # Faust's own commit at revocation follows; this one only saves duplicates
            log.exception("rebound: commit before revocation failed")
        self._kept_through_revocation = {
            tp: (self._acked.get(tp), self._acked_index.get(tp), self._gap.get(tp), self._committed_offset.get(tp))
            for tp in revoked
            if self._must_see_every_offset(tp)
        }
        try:
            await super().on_partitions_revoked(revoked)
        finally:
            self._kept_through_revocation = {}
            for tp in revoked:
                self._gap.pop(tp, None)
                self._acked.pop(tp, None)
                self._acked_index.pop(tp, None)
                self._committed_offset.pop(tp, None)
                self.read_cursors.forget(tp)
                self._stuck_seen.pop(tp, None)
                self._reposition.pop(tp, None)

    async def _revoke_with_acknowledgements_kept(self, revoked: set[TP]) -> None:
        """Put back what Faust's revocation forgot, before the app's part of the revocation waits and commits."""
        kept, self._kept_through_revocation = self._kept_through_revocation, {}
        for tp, (acked, acked_index, gap, committed) in kept.items():
            if acked is not None:
                self._acked[tp] = acked
            if acked_index is not None:
                self._acked_index[tp] = acked_index
            if gap is not None:
                self._gap[tp] = gap
            if committed is not None:
                self._committed_offset[tp] = committed
        await self._app_revocation(revoked)

    async def _commit_offsets(self, offsets: Any, start_new_transaction: bool = True) -> bool:
        committed = await super()._commit_offsets(offsets, start_new_transaction=start_new_transaction)
        if committed:
            for tp, offset in offsets.items():
                if self._must_see_every_offset(tp):
                    self.read_cursors.committed(tp, offset)
        return committed

    async def _before_each_fetch(self) -> None:
        """Between batches every record fetched was handed over or dropped; put right what was dropped."""
        holds = frozenset(self._holds) if self.flow_active else None
        if self._held_topics and self.flow_active:
            assigned = ensure_TPset(self.assignment())
            self._pause_requested.update(tp for tp in assigned if tp.topic in self._held_topics)
        if self._pause_requested:
            paused, self._pause_requested = self._pause_requested, set()
            if self.flow_active:
                self.pause_partitions(paused & ensure_TPset(self.assignment()))
        if holds is not None:
            self._effective_holds = holds  # the fetches from here on leave their topics out
        # Taken whole: a recovery's perform_seek can clear the dict while the seeks below await.
        repositions, self._reposition = self._reposition, {}
        for tp, offset in repositions.items():
            log.info("rebound: reading %s again from %d (records handed over there were dropped)", tp, offset)
            self.read_cursors.positioned(tp, offset)
            await self._seek_if_assigned(tp, offset)
        now = monotonic()
        if now - self.positions_checked_at < self.positions_check_interval or not self.flow_active:
            return
        self.positions_checked_at = now
        whole, self._batches_whole = self._batches_whole, True
        watched = [tp for tp in self.assignment() if self._must_see_every_offset(tp)]
        if not watched:
            return
        for tp, position in (await self._thread.positions(watched)).items():
            ahead = self.read_cursors.fetcher_ahead(tp, position, batches_whole=whole)
            if ahead is None:
                continue
            verdict, first, last = ahead
            if verdict is Verdict.READ_AGAIN:
                log.info(
                    "rebound: %s fetcher at %d but offset %d was never handed over; reading again", tp, last, first
                )
                await self._seek_if_assigned(tp, first)
            else:
                self._add_confirmed_gap(tp, first, last)

    def _add_confirmed_gap(self, tp: TP, first: int, last: int) -> None:
        # Not Faust's _add_gap: it starts a gap after the committed offset, so a gap at the committed offset itself
        # would never let commits pass.
        log.warning("rebound: %s holds no records from offset %d to %d (read twice)", tp, first, last)
        gaps = self._gap[tp]
        gaps.addi(first, last + 1)
        gaps.merge_overlaps()

    def _new_offset(self, tp: TP) -> int | None:
        if not self._must_see_every_offset(tp):
            return super()._new_offset(tp)
        acked = self._acked[tp]
        if not acked:
            return None
        gaps = self._gap[tp]
        if gaps:
            # confirmed gaps below the highest acknowledged offset count as acknowledged (Faust does the same)
            highest = max(acked)
            covered = sorted(gaps.overlap(0, highest), key=lambda interval: interval.begin)
            if covered:
                for interval in covered:
                    acked.extend(range(interval.begin, interval.end))
                gaps.chop(0, max(covered[-1].end - 1, highest + 1))
        acked.sort()
        floor = self._committed_offset[tp]
        if floor is None:
            floor = self.read_cursors.commit_floor(tp)
        if floor is None or acked[0] > floor:
            if floor is not None:
                self._read_again_if_dropped(tp, floor, acked[0])
            return None  # the head is still being handled, or was dropped and will be read again after a seek
        self._stuck_seen.pop(tp, None)
        run = next(consecutive_numbers(acked))
        acked[: len(run)] = []
        self._acked_index[tp].difference_update(run)
        return int(run[-1]) + 1

    def _read_again_if_dropped(self, tp: TP, floor: int, first_acked: int) -> None:
        """Commits held at ``floor`` while later offsets are acknowledged, and no stream holds any of the offsets in
        between: those records were handed over and then dropped before an agent took them (a stream queue cleared
        when Faust resumed the flow, a record the stream skipped), and nothing would read them again before the next
        rebalance. Seen twice in a row (commits come seconds apart, so a record merely on its way has arrived by
        then; at least a commit interval apart), the partition is read again from ``floor``: records still in flight are dropped as second deliveries,
        the rest run again (at-least-once).
        """
        handed_over_to = self.read_cursors.next_offset(tp)
        if (
            handed_over_to is None
            or handed_over_to <= floor  # nothing handed over past the floor since the last seek: nothing dropped
            or not self.flow_active  # a rebalance or recovery: acknowledgements of the last generation linger
            or tp not in self._get_active_partitions()  # paused or not assigned: a seek would read nothing
            or any(
                message.tp == tp and message.offset < first_acked and not message.acked
                for message in list(self._unacked_messages)
            )
        ):
            self._stuck_seen.pop(tp, None)
            return
        seen = self._stuck_seen.get(tp)
        now = monotonic()
        if seen is None or seen[:2] != (floor, first_acked):
            self._stuck_seen[tp] = (floor, first_acked, now)
            return
        if now - seen[2] < self.app.conf.broker_commit_interval:
            return  # commits also run on every acknowledgement at a rebalance: wait a commit interval at least
        del self._stuck_seen[tp]
        log.warning(
            "rebound: %s commits held at %d while %d and later are done, and no stream holds offsets %d to %d; "
            "reading them again",
            tp,
            floor,
            first_acked,
            floor,
            first_acked - 1,
        )
        self._reposition[tp] = floor

    async def _deliver(self, message: Message) -> bool:
        """Hand the message to its streams; False when the flow stopped first (it will be read again).

        Faust races the hand-over against ``suspend_flow`` with ``wait_first``: four tasks and an ``asyncio.wait``
        per record, about a tenth of a healthy message's cost. The hand-over is awaited here directly instead, and
        :meth:`stop_flow` cancels it if it is still waiting (a stream's queue full): the same outcome, paid only when
        the flow actually stops during a hand-over.
        """
        if not self.flow_active:
            # Stopped between the fetch and here: Faust's flow control would hold the hand-over until the rebalance
            # resumes it, then put a record of the ended generation into the emptied stream queues.
            return False
        task = asyncio.current_task()
        self._delivering, self._delivery_interrupted = task, False
        self._delivering_tp, self._delivering_message = message.tp, message
        try:
            await self.callback(message)
        except asyncio.CancelledError:
            # Ours only if nobody else cancelled the fetcher at the same time (then it must stop as asked).
            if not self._delivery_interrupted or task is None or task.uncancel() > 0:
                raise
            return False
        finally:
            self._delivering = self._delivering_tp = self._delivering_message = None
        if self._delivery_interrupted and task is not None:
            task.uncancel()  # the callback swallowed the cancellation: it must not linger in the task's count
            return False
        return True

    def take_void(self, message: Message) -> bool:
        """Whether ``message`` was voided (its hand-over interrupted as the flow resumed, and read again since): the
        stream that got it anyway must let it go, unacknowledged. Answered once per voided message."""
        return self._voided.pop(id(message), None) is message

    def _interrupt_delivery(self) -> None:
        """Stop a hand-over that is waiting for room in a stream's queue (called when the flow stops)."""
        delivering = self._delivering
        if delivering is None or self._delivery_interrupted or delivering is asyncio.current_task():
            return
        self._delivery_interrupted = True
        delivering.cancel()

    async def _drain_messages(self, fetcher: ServiceT) -> None:  # pragma: no cover - runs in every worker test
        """Faust's loop, with the read cursors deciding what a jump in offsets means on acknowledged topics."""
        consumer_should_stop = cast(Service, self)._stopped.is_set
        fetcher_should_stop = cast(Service, fetcher)._stopped.is_set
        yield_every = 100
        since_yield = 0
        batch = 0
        self._drain_task = asyncio.current_task()
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                self.diag.set_flag(CONSUMER_FETCHING)
                await self._before_each_fetch()
                records = cast(Any, self.getmany(timeout=1.0))
                batch += 1
                generation = self.app.consumer_generation_id
                await self.sleep(0)
                if self.should_stop:
                    continue
                try:
                    async for tp, message in records:
                        since_yield += 1
                        if since_yield > yield_every:
                            await asyncio.sleep(0)
                            since_yield = 0
                        await self._drain_one(tp, message, batch)
                except (GroupAuthorizationFailedError, TopicAuthorizationFailedError):
                    raise
                except KafkaError as exc:
                    # aiokafka hands a coordinator error to whoever waits for an assignment, here the fetch; the
                    # thread's timer lets the coordinator join again, and Faust would have crashed the worker.
                    log.error("rebound: fetching failed (%r); fetching again", exc)
                    self._batches_whole = False
                    await self.sleep(1.0)
                    continue
                if not self.flow_active or generation != self.app.consumer_generation_id:
                    self._batches_whole = False  # Faust's getmany may have stopped yielding this batch
                self.diag.unset_flag(CONSUMER_FETCHING)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                self.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                self.log.info("Consumer shutting down for user cancel.")
                return
            raise
        except Exception as exc:
            self.log.exception("Drain messages raised: %r", exc)
            raise
        finally:
            self.diag.unset_flag(CONSUMER_FETCHING)

    async def _drain_one(self, tp: TP, message: Message, batch: int) -> None:
        if not self._must_see_every_offset(tp):
            await self._drain_as_faust_does(tp, message)
            return
        cursors = self.read_cursors
        offset = message.offset
        # Before the verdict, not between it and the hand-over: a flow resumed during this await moves the cursor.
        await self._maybe_commit_every()
        verdict = cursors.check(tp, offset, batch)
        if verdict is Verdict.STALE:
            return
        if verdict is Verdict.UNPOSITIONED:
            if await self._position_from_committed(tp, offset) != offset:
                return
            verdict = cursors.check(tp, offset, batch)  # the record at hand is where reading starts: take it
            if verdict is not Verdict.DELIVER:
                return
        if verdict is Verdict.READ_AGAIN:
            target = cursors.read_again(tp, batch)
            log.info("rebound: %s jumped from offset %d to %d; reading again from %d", tp, target, offset, target)
            await self._seek_if_assigned(tp, target)
            return
        epoch = cursors.epoch(tp)
        if verdict is Verdict.CONFIRMED_GAP:
            self._add_confirmed_gap(tp, *cursors.gap(tp, offset))
        if await self._deliver(message) and cursors.delivered(tp, offset, epoch):
            self._read_offset[tp] = offset

    async def _maybe_commit_every(self) -> None:
        if self._commit_every is not None and self._n_acked >= self._commit_every:
            self._n_acked = 0
            await self.commit()

    async def _drain_as_faust_does(self, tp: TP, message: Message) -> None:
        """Changelogs and unacknowledged topics: Faust's own reading (gaps are expected there)."""
        offset = message.offset
        last_read = self._read_offset[tp]
        if last_read is not None and offset < last_read:
            return
        if last_read and offset - last_read > 1 and self.app.topics.acks_enabled_for(message.topic):
            await self._add_gap(tp, last_read + 1, offset)
        await self._maybe_commit_every()
        await self._deliver(message)
        self._read_offset[tp] = offset


class ReboundTransport(driver.Transport):
    Consumer: ClassVar[type[Any]] = ReboundConsumer


class ReboundApp(faust.App):
    """A Faust app whose consumer transport is ``ReboundTransport`` (the producer's stays Faust's)."""

    fetch_max_wait_ms: int | None = None

    def __init__(self, *args: Any, fetch_max_wait_ms: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.flow_stopped_callbacks: list[Callable[[], None]] = []
        self.holds_at_start: dict[str, frozenset[str]] = {}
        """Topics the consumer holds from the start, per reason (see ``ReboundConsumer.hold_topics``): the operator's
        pause holds the main topics until the worker has read whether they are paused (``app/control.py``)."""

    async def on_start(self) -> None:
        await super().on_start()  # makes the consumer; it starts (and fetches) after this
        for reason, topics in self.holds_at_start.items():
            cast(ReboundConsumer, self.consumer).hold_topics(topics, reason=reason)

    async def on_started(self) -> None:
        await super().on_started()
        drop_unprinted_debug_level()

    def _new_transport(self) -> Any:
        url = self.conf.broker_consumer[0]
        if url.scheme not in ("kafka", "aiokafka"):
            raise ValueError(f"Rebound's consumer runs on aiokafka; broker URL scheme {url.scheme!r} is not Kafka")
        return ReboundTransport(self.conf.broker_consumer, self)
