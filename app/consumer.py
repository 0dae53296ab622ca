"""Faust's aiokafka consumer, with reading and committing that never pass over a record Rebound has not handled.

Faust's ``Consumer._drain_messages`` treats any jump in offsets as a compacted-topic gap and ``_new_offset`` commits
across it, and also across a single missing offset at the head of the acknowledged ones (faust-streaming issue 606).
On Rebound's topics (never compacted) those jumps come from Faust itself around rebalances and seeks (see
``rebound/read_cursors.py``); committed across, they lost records in chaos runs. Here, on every topic whose messages
are acknowledged (not changelogs): a jump is read again from the expected offset, committing starts only at the
committed offset and runs over acknowledged offsets and confirmed gaps only, and a partition with nothing committed
starts from its earliest offset, where ``auto_offset_reset=earliest`` would also have started it.

Plugged in through Faust's own seams: ``App._new_transport`` picks the transport, whose ``Consumer`` class this is (its
``Producer`` is ``app/producer.py``'s).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
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
from aiokafka.protocol.group import JoinGroupRequest, SyncGroupRequest
from aiokafka.structs import TopicPartition
from faust.exceptions import ConsumerNotStarted
from faust.sensors import Sensor
from faust.transport.consumer import CONSUMER_FETCHING, ensure_TPset
from faust.transport.drivers import aiokafka as driver
from faust.types import TP, Message
from mode import Service, ServiceT
from mode.utils.futures import notify, stampede
from mode.utils.objects import cached_property
from mode.utils.queues import FlowControlEvent

from app.fetch_guard import guard_fetcher
from app.fetch_holes import report_fetch_holes
from app.log_levels import drop_unprinted_debug_level
from app.producer import ReboundProducer
from rebound.commit_runs import run_end
from rebound.read_cursors import ReadCursors, Verdict
from rebound.undecodable import UndecodableBatches

log = logging.getLogger(__name__)
READ_COMMITTED = "read_committed"


class SessionLease:
    """Whether this worker's group membership is known fresh: a queued record starts only while it is.

    The group evicts a member that sent no heartbeat for the session timeout; its partitions go to other members at
    once, but the member learns of it only from its next heartbeat's answer (or a join). A worker stopped (SIGSTOP, a
    paused VM) past its session timeout and woken went on starting the records it had queued, for up to ~100 ms before
    that answer and the revocation after it, and the partitions' new owners ran them too (issue 22). The lease runs for
    a session timeout from when the last successful heartbeat was sent (the group's timer restarted no earlier) or from
    when the last join's SyncGroup was sent: past it, the group may have evicted this worker, and a record waits
    (:meth:`wait`) for the heartbeat's word instead of starting. Renewed: the record starts; evicted: the revocation
    ends the wait and drops it with the rest of the queue.

    The clock is monotonic: it keeps counting while the process is stopped, which is what makes a woken worker's lease
    stale (Linux's CLOCK_MONOTONIC does not count the time the host itself is suspended: a woken host's lease cannot
    tell, as before the lease). Renewed in the consumer thread (where aiokafka heartbeats), read in the worker's loop:
    one float. Off (``until`` infinite) until the consumer thread watches the heartbeats, so a worker whose aiokafka no
    longer lets it (a logged error) runs as it did before the lease.
    """

    def __init__(
        self,
        session_timeout_s: float,
        *,
        clock: Callable[[], float] = monotonic,
        stopping: Callable[[], bool] = lambda: False,
        poll_s: float = 0.05,
        max_wait_s: float | None = None,
    ) -> None:
        self.session_timeout_s = session_timeout_s
        self.clock = clock
        self.stopping = stopping
        """The consumer is stopping: no heartbeat may come any more, so no record waits for one."""
        self.poll_s = poll_s
        self.max_wait_s = session_timeout_s if max_wait_s is None else max_wait_s
        """The longest a stall holds records back: a heartbeat is answered within a heartbeat interval and a request's
        round trip, so a session timeout more of silence means the coordinator cannot be reached. Records then start
        as they would have without the lease (a call possibly made twice, at-least-once) until it is renewed, rather
        than stall their partitions for as long as the coordinator is away."""
        self.until = math.inf
        self._stall_of = math.inf
        """The lease (its ``until``) whose expiry the current stall is about: a renewal ends the stall."""
        self._stall_began = 0.0
        self._gave_up = False
        self._waiting = 0
        self._outcomes: collections.Counter[str] = collections.Counter()

    def renewed(self, sent_at: float) -> None:
        """A heartbeat sent at ``sent_at`` succeeded, or a join completed then: the lease runs a session timeout from
        there. Never shortened (a join's stamp may be later than a heartbeat answered after it)."""
        until = sent_at + self.session_timeout_s
        if self.until == math.inf or until > self.until:
            self.until = until

    def fresh(self) -> bool:
        """The healthy path, before every start: one clock read and one comparison."""
        return self.clock() < self.until

    async def wait(self, revoked: Callable[[], bool]) -> bool:
        """Wait while the lease is stale: True when the record may start (renewed, or the stall is ``max_wait_s``
        old), False when it must not (``revoked()``: the revocation dropped it; or the consumer is stopping).
        Re-checks every ``poll_s``. A stall (one expired lease, however many records wait on it) is logged when it
        begins and when its waits end."""
        now = self.clock()
        if self.until != self._stall_of:
            self._stall_of, self._stall_began, self._gave_up = self.until, now, False
            log.warning(
                "rebound: the group membership is not known fresh (last heartbeat or join %.1f s ago, session "
                "timeout %.1f s): queued records wait for the next heartbeat (renewed: they run; evicted: the "
                "revocation drops them)",
                now - (self.until - self.session_timeout_s),
                self.session_timeout_s,
            )
        elif self._gave_up:
            return True  # this stall outlasted max_wait_s (said so once): records run until the lease is renewed
        if not self._waiting:
            self._outcomes.clear()
        self._waiting += 1
        outcome = "cancelled"
        try:
            while True:
                if revoked() or self.stopping():
                    outcome = "dropped"
                    return False
                now = self.clock()
                if now < self.until:
                    outcome = "started"
                    return True
                if now - self._stall_began >= self.max_wait_s:
                    self._gave_up = True
                    outcome = "started unconfirmed"
                    return True
                await asyncio.sleep(self.poll_s)
        finally:
            self._waiting -= 1
            self._outcomes[outcome] += 1
            if not self._waiting:
                self._waits_ended()

    def _waits_ended(self) -> None:
        outcomes = ", ".join(f"{count} {outcome}" for outcome, count in sorted(self._outcomes.items()))
        log.log(
            logging.WARNING if self._gave_up else logging.INFO,
            "rebound: the wait for a fresh group membership ended after %.2f s (%s)%s",
            self.clock() - self._stall_began,
            outcomes,
            f"; no heartbeat answered within {self.max_wait_s:.1f} s: records start unconfirmed until one does"
            if self._gave_up
            else "",
        )


class ReboundConsumerThread(driver.AIOKafkaConsumerThread):
    """faust-streaming hard-codes ``fetch_max_wait_ms=1500``; the app's ``fetch_max_wait_ms`` replaces it.

    Real Kafka answers a fetch as soon as any partition has data, so the value rarely matters there; the embedded
    broker answers a multi-partition fetch only when the wait is over, which puts up to 1.5 s between a due time and
    the release.
    """

    def _create_worker_consumer(self, transport: Any) -> Any:
        """Faust's worker consumer, with Rebound's fetch wait and isolation level.

        Faust reads committed only under its exactly-once guarantee, which also makes its producer transactional;
        Rebound reads committed by default without it (``REBOUND_ISOLATION_LEVEL``): records of aborted transactions
        never reach a handler. Both values are set before the consumer starts: aiokafka hands them to the fetcher
        it creates in ``start()`` (the fetcher builds every fetch and ListOffsets request with its isolation level).
        """
        consumer = super()._create_worker_consumer(transport)
        wait_ms = getattr(self.app, "fetch_max_wait_ms", None)
        if wait_ms is not None:
            consumer._fetch_max_wait_ms = wait_ms  # read when the consumer starts its fetcher
        isolation_level = getattr(self.app, "isolation_level", None) or READ_COMMITTED
        consumer._isolation_level = isolation_level  # read when the consumer starts its fetcher
        log.info("rebound: the worker reads with isolation level %s", isolation_level)
        return consumer

    _lease_watched = False
    _sync_sent_at: float | None = None
    """When this member last sent a SyncGroup (the lease's clock): the group restarted its session no earlier."""

    async def on_start(self) -> None:
        await super().on_start()  # starts aiokafka's consumer, which makes its group coordinator
        self.watch_heartbeats()

    def watch_heartbeats(self) -> None:
        """Renew the consumer's :class:`SessionLease` on every successful heartbeat, and note when each SyncGroup is
        sent (a join renews it from there: :meth:`on_partitions_assigned`).

        aiokafka's heartbeat task calls its coordinator's ``_do_heartbeat`` once per beat, looked up on the instance
        each time, and that answers True when the member is still in the group (also while it rebalances); nothing
        public says when a heartbeat succeeded. A join's SyncGroup goes through the coordinator's ``_send_req``, also
        looked up per request. The lease runs from when the request was sent: an answer read late (the process stopped
        in between) must not renew it past what the group counted."""
        consumer = self._consumer
        coordinator = getattr(consumer, "_coordinator", None) if consumer is not None else None
        beat = getattr(coordinator, "_do_heartbeat", None)
        send = getattr(coordinator, "_send_req", None)
        if beat is None or send is None:
            log.error(
                "rebound: aiokafka's group coordinator has no _do_heartbeat or _send_req: the session lease is off, "
                "and a worker woken after its eviction may start queued records its partitions' new owners run too"
            )
            return
        lease = cast(ReboundConsumer, self.consumer).session_lease
        clock = lease.clock

        async def heartbeat() -> bool:
            sent_at = clock()
            succeeded = bool(await beat())
            if succeeded:
                lease.renewed(sent_at)
            return succeeded

        async def send_req(request: Any) -> Any:
            if isinstance(request, SyncGroupRequest):
                self._sync_sent_at = clock()
            return await send(request)

        coordinator._do_heartbeat = heartbeat  # type: ignore[union-attr]
        coordinator._send_req = send_req  # type: ignore[union-attr]
        self._lease_watched = True
        lease.renewed(clock())  # the group is joined before any record is taken: the join renews it again

    async def on_partitions_assigned(self, assigned: set[TP], generation_id: int = 0) -> None:
        """aiokafka hands over an assignment once the group's SyncGroup answered (its heartbeats start only after
        this returns): the member's session runs from when that SyncGroup was sent at the earliest. Not from now: a
        worker stopped while the answer was on its way and woken past its session timeout may have been evicted again
        (its next heartbeat says so)."""
        # aiokafka's _on_join_complete calls this right after the assignor's on_assignment: ownership reads the
        # new assignment from here (the window a revocation opened ends, ReboundConsumer.between_assignments).
        cast(ReboundConsumer, self.consumer).assignment_handed_over(assigned, generation_id)
        cast(ReboundConsumer, self.consumer).joined = True  # a blank member id from now on is an eviction
        sent_at = self._sync_sent_at
        if self._lease_watched and sent_at is not None:
            cast(ReboundConsumer, self.consumer).session_lease.renewed(sent_at)
        await super().on_partitions_assigned(assigned, generation_id)

    undecodable: UndecodableBatches

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.undecodable = UndecodableBatches()
        super().__init__(*args, **kwargs)

    async def _fetch_records(
        self,
        consumer: Any,
        active_partitions: Any,
        timeout: float | None = None,
        max_records: int | None = None,
    ) -> Any:
        """Faust's fetch, with a batch that cannot be decoded stopping its own partition only (``app/fetch_guard.py``):
        without the guard, it made every fetch of every partition fail, for ever."""
        fetcher = getattr(consumer, "_fetcher", None)
        if fetcher is not None:
            guard_fetcher(fetcher, self._on_undecodable)
            report_fetch_holes(fetcher, self._on_undecodable, self._on_fetch_hole)  # app/fetch_holes.py
        records = await super()._fetch_records(consumer, active_partitions, timeout=timeout, max_records=max_records)
        if records and self.undecodable.any_stuck():
            self._note_decoded(records)
        return records

    def _on_fetch_hole(self, tp: TopicPartition, first: int, last: int) -> None:
        """Called inside aiokafka's decoding (this thread): the consumer's read cursors take it on its own loop."""
        cast(ReboundConsumer, self.consumer).fetch_holes.append((tp.topic, tp.partition, first, last))

    def _on_undecodable(self, tp: TopicPartition, offset: int, next_offset: int | None, exc: Exception) -> None:
        """Called by the guard, inside aiokafka's draining: pause the partition at once (else the fetcher fetches the
        same batch again straight away, over and over), note where it stopped, and say so."""
        consumer = self._consumer
        if consumer is not None:
            with contextlib.suppress(IllegalStateError):  # revoked meanwhile: nothing to pause
                consumer.pause(TopicPartition(tp.topic, tp.partition))
        failure = self.undecodable.failed(
            tp.topic, tp.partition, offset, next_offset, repr(exc), now=monotonic(), now_ms=time.time_ns() // 1_000_000
        )
        if failure.log:
            log.error(
                "rebound: %s[%d] offset %d: a record batch that cannot be decoded (%r; the batch ends before offset "
                "%s); reading of this partition stops there, every other partition goes on, and it is tried again "
                "every %.0f s. To go on without the batch, move the group's offset past it "
                "(docs/undecodable-batches.md)",
                tp.topic,
                tp.partition,
                offset,
                exc,
                "unknown" if next_offset is None else next_offset,
                self.undecodable.retry_interval_s,
            )

    def _note_decoded(self, records: Any) -> None:
        for tp, messages in records.items():
            if messages and self.undecodable.is_stuck(tp.topic, tp.partition):
                freed = self.undecodable.decoded(tp.topic, tp.partition, messages[-1].offset)
                if freed is not None:
                    log.warning(
                        "rebound: %s[%d] offset %d decodes now (after %d failed tries); reading goes on",
                        tp.topic,
                        tp.partition,
                        freed.offset,
                        freed.failures,
                    )

    @Service.timer(1.0)
    async def _retry_undecodable(self) -> None:
        self.retry_undecodable(monotonic())

    def retry_undecodable(self, now: float) -> None:
        """Fetch again each partition whose try is due, and forget partitions no longer assigned here.

        Resumed in aiokafka whether or not Faust or Rebound paused it on purpose (back-pressure, a hold): their pauses
        live in Faust's own sets only (``Consumer.pause_partitions``/``resume_partitions`` never reach aiokafka), so
        only this resume undoes the guard's aiokafka pause. A partition Faust paused is still fetched then, but its
        records stay in the fetcher: Faust's fetch passes its active partitions only, and
        ``Fetcher.fetched_records`` drains (and so decodes) no other partition's."""
        consumer = self._consumer
        if consumer is None or not self.undecodable.any_stuck():
            return
        assigned = [(tp.topic, tp.partition) for tp in consumer.assignment()]
        for gone in self.undecodable.keep_only(assigned):
            log.info(
                "rebound: %s[%d] (stopped at offset %d) is no longer assigned here",
                gone.topic,
                gone.partition,
                gone.offset,
            )
        for stuck in self.undecodable.due(now):
            with contextlib.suppress(IllegalStateError):
                consumer.resume(TopicPartition(stuck.topic, stuck.partition))

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
    left_out_report_s = 5.0
    """An assigned stream partition not fetched for longer than this is logged, with the reason."""
    left_out_log_interval_s = 60.0
    queue_starvation_s = 2.0
    """A partition out of fetching for a full stream queue this long has its siblings paused too (they keep the queue
    from draining)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.read_cursors = ReadCursors()
        self._positioned_at: dict[TP, int | None] = {}
        self._reposition: dict[TP, int] = {}
        self._batches_whole = True
        self._changelog_topic: dict[str, bool] = {}
        self._pause_requested: set[TP] = set()
        self._back_pressured: set[TP] = set()
        self._held_topics: frozenset[str] = frozenset()
        self._holds: dict[str, frozenset[str]] = {}
        self._effective_holds: frozenset[str] = frozenset()
        self._released_while_stopped: frozenset[str] = frozenset()
        self._stuck_seen: dict[TP, tuple[int, int, float]] = {}
        self._left_out: dict[TP, tuple[float, float]] = {}
        """Assigned stream partitions not fetched: since when, and when that was last logged."""
        self._put_back_logged: dict[TP, float] = {}
        self._queue_waits: dict[TP, float] = {}
        """Partitions out of fetching for a full stream queue, since when."""
        self._delivering: asyncio.Task[Any] | None = None
        self._delivering_tp: Any = None
        self._delivering_message: Message | None = None
        self._sought_this_generation = False
        self._flow_stops = 0
        self._drain_task: asyncio.Task[Any] | None = None
        self._voided: dict[int, Message] = {}
        self._landed_copies: dict[int, Message] = {}
        """Copies of records whose hand-over a clear interrupted, landed in a stream queue after it (see
        ``_cleared_during_hand_over``): voided like ``_voided``'s, and dropped once no queue holds them."""
        self._delivery_interrupted = False
        self._kept_through_revocation: dict[TP, tuple[Any, Any, Any, Any]] = {}
        self._finished: dict[TP, set[int]] = {}
        """Offsets of acknowledged topics this process finished (handled, or forwarded, parked or held durably) and did
        not commit: those its dispatcher let go of unacknowledged behind an earlier offset it dropped (:meth:`abandon`),
        at a revocation those acknowledged and not committed (:meth:`_remember_finished`), and after it those whose
        acknowledgement came late (:meth:`ack`). Read again here, such a record is acknowledged without reaching a
        stream (:meth:`_skip_if_finished`)."""
        self._finished_logged: set[TP] = set()
        self._finished_in: tuple[int, str | None] | None = None
        """The generation and member id the partitions of :attr:`_finished` were held in, as the last revocation
        ended: the next assignment keeps :attr:`_finished` only if it is the very next generation, same member id
        (:meth:`on_partitions_assigned`)."""
        self._kept_from: tuple[int, frozenset[TP]] | None = None
        """Set as the current assignment was handed over (:meth:`assignment_handed_over`): the generation before it
        and the partitions it gave back to this member, when it is the very next generation to the same member id
        (the rule :attr:`_finished` is kept by): nobody else held those partitions meanwhile, and a late ack of that
        generation's messages is taken (:meth:`ack`)."""
        self.redeliveries_skipped: collections.Counter[str] = collections.Counter()
        """Records read again and acknowledged without a hand-over (this process had finished them), per topic."""
        self.fetch_holes: collections.deque[tuple[str, int, int, int]] = collections.deque()
        """Offset ranges the broker's answers showed empty (topic, partition, first, last), appended by the consumer
        thread while it decodes a fetch, before the records after them are handed over; taken by the read cursors."""
        super().__init__(*args, **kwargs)
        self.session_lease = SessionLease(
            float(self.app.conf.broker_session_timeout),
            stopping=lambda: bool(self.should_stop or self._thread.should_stop),
        )
        """Whether the group still counts this worker in: the dispatcher starts no queued record while it is stale
        (renewed by the consumer thread's heartbeats, see ``ReboundConsumerThread.watch_heartbeats``)."""
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

    @property
    def evicted(self) -> bool:
        """Whether the group evicted this worker: aiokafka blanks its member id (``reset_generation``) only when the
        coordinator answered UnknownMemberId or IllegalGeneration (a worker stopped past its session timeout), or as
        it leaves the group at close; a normal rebalance keeps it. The revocation that follows an eviction comes
        after the reset (``_on_join_prepare`` runs in the next coordination round), and the group has already given
        the partitions to their new owners, who run what this worker still has queued. Read live, not set by
        :meth:`on_partitions_revoked`: the dispatcher's revoke (Faust's app revocation, called from it) and the tables'
        writer epochs read it too. False before the consumer exists, and until its first assignment (:attr:`joined`):
        aiokafka's member id is just as blank before the first JoinGroup (``GroupCoordinator.__init__`` sets what
        ``reset_generation`` sets), and the first join's revocation (of nothing) is no eviction."""
        if not self.joined:
            return False
        consumer = getattr(self._thread, "_consumer", None)
        coordinator = getattr(consumer, "_coordinator", None)
        return coordinator is not None and getattr(coordinator, "member_id", None) == JoinGroupRequest.UNKNOWN_MEMBER_ID

    joined = False
    """True once aiokafka handed this worker an assignment (``ReboundConsumerThread.on_partitions_assigned``, after
    a JoinGroup and SyncGroup answered): from then on a blank member id means the group dropped it (:attr:`evicted`)."""

    between_assignments = False
    """True from the end of a revocation callback (:meth:`on_partitions_revoked`, its drain and commit done) until
    aiokafka hands over the next assignment (``ReboundConsumerThread.on_partitions_assigned``): this worker then owns
    nothing (``agents/ownership.py``), though Faust's assignor still lists the partitions it gave up (only
    ``on_assignment`` changes it). aiokafka's ``_on_join_prepare`` awaits the callback before the JoinGroup, and its
    ``_on_join_complete`` calls ``on_assignment``, then the listener's ``on_partitions_assigned``."""

    def assignment_handed_over(self, assigned: set[TP], generation_id: int) -> None:
        """The consumer thread's first step as aiokafka hands over an assignment (Faust's listener has set the app's
        generation id): the window a revocation opened ends (:attr:`between_assignments`), and :attr:`_kept_from` is
        set before it ends. Here, not in :meth:`on_partitions_assigned`, which runs later in the worker's loop: an ack
        in between would see the new generation and not yet know the partitions were kept, and refuse it."""
        held = self._finished_in
        member = self.member_id()
        kept = held is not None and member is not None and held == (generation_id - 1, member)
        self._kept_from = (generation_id - 1, frozenset(assigned)) if kept else None
        self.between_assignments = False

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

    def abandon(self, message: Message, *, finished: bool = False, revoked_generation: int | None = None) -> None:
        """Let go of a message that will never be acknowledged (its offset is read again after the next seek).

        Faust waits, at every rebalance and at shutdown, until each message its streams took is acknowledged
        (``wait_empty``); a message Rebound's dispatcher dropped must stop counting there without its offset ever
        becoming committable.

        ``finished``: its work was done all the same (handled, or forwarded, parked or held durably; the dispatcher
        acknowledges in offset order, and an earlier offset was dropped): read again by this process, it is not run
        again (:meth:`_skip_if_finished`).

        ``revoked_generation``: the generation whose revocation it belongs to, by default the app's current one (see
        :meth:`ack` for the one case it is not).
        """
        self._unacked_messages.discard(message)
        # Only a message of the generation whose revocation is under way (the one Faust read it in: the generation id
        # moves at the next assignment): one ending after that (a shutdown's straggler) is not remembered.
        if revoked_generation is None:
            revoked_generation = self.app.consumer_generation_id
        if finished and message.generation_id == revoked_generation and self._must_see_every_offset(message.tp):
            self._finished.setdefault(message.tp, set()).add(message.offset)
        notify(self._waiting_for_ack)  # Faust's wait_empty polls once a second otherwise

    def pause_between_batches(self, tps: list[TP]) -> None:
        """Back-pressure: the dispatcher holds too much of these partitions. They stay paused, re-applied before every
        fetch (the batch being handed over is done by then, see ``_before_each_fetch``), until the dispatcher has
        drained them (:meth:`resume_after_pause`) or forgets them itself (a flow stop: :meth:`stop_flow`).

        A state, not a one-shot request: Faust's recovery resumes the flow and every stream partition
        (``on_recovery_completed``) while the main agent is already taking records, and a request lost there left the
        dispatcher believing a partition paused that was fetched without bound.
        """
        self._back_pressured.update(ensure_TPset(tps))

    def resume_after_pause(self, tps: list[TP]) -> None:
        # A message's tp is aiokafka's TopicPartition; Faust's resume_partitions adds what it is given to the active
        # set as it is, and the next fetch asserts that every member is Faust's own TP (a crash of the worker).
        drained = ensure_TPset(tps)
        self._back_pressured.difference_update(drained)
        if not self.flow_active or not self._sought_this_generation:
            # Never undo the pause of a rebalance in progress, nor the tables' recovery's (the flow runs again for the
            # changelogs before the seek to the committed offsets): Faust resumes every partition after them.
            return
        resumed = {tp for tp in drained if tp.topic not in self._held_topics}
        self._pause_requested.difference_update(resumed)
        self.resume_partitions(resumed)

    @property
    def back_pressured(self) -> frozenset[TP]:
        """Partitions kept paused because the dispatcher holds too much of them."""
        return frozenset(self._back_pressured)

    def resume_partitions(self, tps: Any) -> None:
        """Never resume a held topic's partition, nor one under back-pressure: Faust resumes every partition after a
        rebalance (its recovery's ``_resume_streams`` and ``on_recovery_completed``), which would fetch a batch of the
        main topics while the circuit breaker is open, or more of a partition the dispatcher cannot take."""
        held, pressed = self._held_topics, self._back_pressured
        if not held and not pressed:
            super().resume_partitions(tps)
            return
        super().resume_partitions({tp for tp in ensure_TPset(tps) if tp.topic not in held and tp not in pressed})

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
        next fetch. Left out, the rest of its batch would be skipped, to be read again only by the position check.
        Also called before each fetch for a queue with room again (:meth:`_share_stream_queues`)."""
        buffered = self._buffered_partitions
        if tp in buffered:
            buffered.discard(tp)
            if tp not in self._paused_partitions:
                self._get_active_partitions().add(tp)

    def _fetch_every_stream_partition(self, now: float) -> None:
        """Level-triggered, before each fetch: every assigned stream partition nothing keeps out is fetched.

        Kept out on purpose: a held topic (breaker, operator), a partition under back-pressure, one whose stream queue
        has no room for a batch yet (:meth:`_share_stream_queues`), one stopped at an undecodable batch (paused in
        aiokafka itself). Whatever else left a partition out of Faust's active set is undone here, whoever forgot to
        put it back (a pause whose resume reached a partition paused meanwhile, a seek to read records again). Not
        before the recovery's seek: Faust pauses the stream partitions itself while the tables recover.
        """
        if not self.flow_active or not self._sought_this_generation:
            self._left_out.clear()
            return
        try:
            assigned = ensure_TPset(self.assignment())
        except ConsumerNotStarted:
            return
        self._share_stream_queues(assigned, now)
        active = self._get_active_partitions()
        for tp in assigned:
            if self._is_changelog_topic(tp):
                continue
            reason = self._left_out_reason(tp)
            if reason is not None:
                self._report_left_out(tp, reason, now)
                continue
            if tp not in active:
                active.add(tp)
                self._paused_partitions.discard(tp)
                self._report_put_back(tp, now)
            self._left_out.pop(tp, None)
        for gone in self._left_out.keys() - assigned:
            del self._left_out[gone]

    def _share_stream_queues(self, assigned: set[TP], now: float) -> None:
        """End Faust's buffer-full pause of a stream queue's partitions once the queue has room for a whole batch; when
        one of them has waited for that longer than ``queue_starvation_s``, pause its siblings too until then.

        Faust takes a partition out of fetching when its record finds the stream queue at 80 % of
        ``stream_buffer_maxsize``; mode puts it back only when the agent takes a record from the queue at 40 % or less
        (one pending partition per record taken), and Faust's recovery empties the queues without putting any back.
        One queue serves all partitions of an agent's topics: while a sibling partition kept it between the two marks,
        the paused partition was not fetched at all, for as long as that lasted (chaos runs: ``retry.1s`` partitions
        unread for 12 to 57 s, ended by the next rebalance; tests/app/test_stream_partition_stalls.py). Pausing the
        siblings lets the queue drain; not at once, because every pause costs its partitions a fetch, and with a small
        queue the pause comes on nearly every batch. Room for a whole batch, not Faust's 80 %: a batch that finds the
        queue full makes the hand-over, and so every partition's reading, wait for that agent. mode's pending
        call-backs of a queue with room are ended too: a partition with one pending is never reported full again
        (``in_pressure_high_state`` skips it).
        """
        buffered = self._buffered_partitions
        for tp in buffered - assigned:
            buffered.discard(tp)  # revoked: Faust's revocation leaves it there
            self._get_active_partitions().discard(tp)
        waiting = self._queue_waits
        for tp in waiting.keys() - buffered:
            del waiting[tp]
        for tp in buffered:
            waiting.setdefault(tp, now)
        pressed: set[TP] = set()
        starved: set[TP] = set()
        streamed = {tp for tp in assigned if not self._is_changelog_topic(tp)}
        for channel in list(self.app.topics):
            queue = channel.queue
            feeding = {tp for tp in streamed if tp.topic in channel.topics}
            if feeding & buffered and queue.qsize() > self._room_mark(queue):
                pressed |= feeding & buffered
                if any(now - waiting[tp] >= self.queue_starvation_s for tp in feeding & buffered):
                    starved |= feeding
                continue
            pending = queue._pending_pressure_drop_callbacks
            if pending:
                callbacks = list(pending)
                pending.clear()
                for callback in callbacks:
                    callback()  # -> on_buffer_drop
        for tp in starved - buffered:
            self.on_buffer_full(tp)
            waiting[tp] = now
        for tp in (buffered & streamed) - pressed - starved:
            self.on_buffer_drop(tp)

    def _room_mark(self, queue: Any) -> int:
        """The most a stream queue may hold for its partitions to be fetched again: room left for a whole batch
        (``broker_max_poll_records``), or mode's own mark (40 %) if that is higher."""
        batch = self.app.conf.broker_max_poll_records
        room = queue.maxsize - batch if batch else 0
        return max(int(queue.pressure_drop_size), room)

    def _is_changelog_topic(self, tp: TP) -> bool:
        changelog = self._changelog_topic.get(tp.topic)
        if changelog is None:
            changelog = self._changelog_topic[tp.topic] = self._is_changelog_tp(tp)
        return changelog

    def _left_out_reason(self, tp: TP) -> str | None:
        """Why the assigned stream partition ``tp`` is not to be fetched now (None: it is to be)."""
        if tp.topic in self._held_topics:
            reasons = sorted(reason for reason, topics in self._holds.items() if tp.topic in topics)
            return f"held ({', '.join(reasons)})"
        if tp in self._back_pressured:
            return "back-pressure (the dispatcher holds too much of it)"
        if tp in self._buffered_partitions:
            return "stream queue full (its agent is behind)"
        undecodable = getattr(self._thread, "undecodable", None)
        if undecodable is not None and undecodable.is_stuck(tp.topic, tp.partition):
            return "undecodable batch"
        return None

    def _report_left_out(self, tp: TP, reason: str, now: float) -> None:
        """Log, at most every ``left_out_log_interval_s``, a partition left out longer than ``left_out_report_s``."""
        since, logged = self._left_out.get(tp, (now, -float("inf")))
        if now - since >= self.left_out_report_s and now - logged >= self.left_out_log_interval_s:
            log.info("rebound: %s left out of fetching for %.0f s: %s", tp, now - since, reason)
            logged = now
        self._left_out[tp] = (since, logged)

    def _report_put_back(self, tp: TP, now: float) -> None:
        """Say (at most every ``left_out_log_interval_s`` a partition) that a partition nothing held was not fetched."""
        if now - self._put_back_logged.get(tp, -float("inf")) >= self.left_out_log_interval_s:
            self._put_back_logged[tp] = now
            log.info("rebound: %s was left out of fetching with nothing holding it; fetching it again", tp)

    def stop_flow(self) -> None:
        """Faust stops the flow first thing at a revocation and at shutdown: work queued but not started is dropped
        then, before Faust waits for the work in flight (``wait_empty``)."""
        super().stop_flow()
        self._sought_this_generation = False
        self._flow_stops += 1
        self._voided.clear()
        self._interrupt_delivery()
        self._pause_requested.clear()
        # The dispatcher forgets its back-pressure as the flow stops (its revoke, among the callbacks below: a new
        # generation counts from nothing); Faust pauses every partition itself until the rebalance ends.
        self._back_pressured.clear()
        for callback in getattr(self.app, "flow_stopped_callbacks", ()):
            callback()

    def ack(self, message: Message) -> bool:
        """Refuse the ack of a message no agent saw; a late one, after its generation's revocation ended, only where
        another member may have held its partition meanwhile.

        Faust's pure-Python stream iterator (used when its Cython extension is not, ``NO_CYTHON``) acks an event it
        skips because the flow is stopped or the generation changed; the skip comes before the message is tracked,
        and a commit would then pass over a record nobody handled. Refused, the offset holds commits back until the
        seek that follows every such skip reads it again. (The Cython iterator does not ack skipped events.)

        Late: the revocation's clean-up is done (:attr:`between_assignments`) or the message was read in an earlier
        generation (its ``generation_id``, which Faust's stream compares the same way). Such an ack comes only when the
        revocation did not wait for the streams (``wait_empty``): the app or the consumer stopping (one that reads no
        assignment otherwise waits too, :meth:`ReboundApp._on_partitions_revoked`).
        Faust's ``ack`` would recreate the acknowledgements the clean-up popped (defaultdicts), which nothing forgot: a
        partition given back generations later skipped the offset unread (:meth:`_skip_if_finished`) and committed over
        it, though the member that held it meanwhile may have fenced the work's writes (a lost message). Refusing them
        all ran the offset twice when the partition came straight back (the assignor's usual choice), or stalled it: the
        dispatcher abandons the copy read again as a second delivery, then forgets the acknowledgement refused. So
        :attr:`_finished`'s rule decides: between assignments the message is let go of as finished (:meth:`abandon`),
        remembered only if the very next generation gives its partition back to the same member id; after an assignment
        that did so (:attr:`_kept_from`, the message's generation before it) the ack is taken; otherwise it is refused
        and the message let go of (the record runs again if read again, at-least-once; no later ``wait_empty`` waits for
        it), and read again if a copy read since was let go of (:meth:`_read_again_if_refused`).
        """
        if not message.tracked and self._must_see_every_offset(message.tp):
            return False
        if (
            self.between_assignments or message.generation_id != self.app.consumer_generation_id
        ) and self._must_see_every_offset(message.tp):
            if self.between_assignments:
                # Faust's listener sets the app's next generation before the consumer thread ends this window
                # (:meth:`assignment_handed_over`): the generation to compare is the one the revocation ended in.
                held = self._finished_in
                self.abandon(message, finished=True, revoked_generation=held[0] if held is not None else -1)
                return False
            kept = self._kept_from
            if kept is None or message.generation_id != kept[0] or message.tp not in kept[1]:
                self.abandon(message)
                self._read_again_if_refused(message)
                return False
        return super().ack(message)

    def _read_again_if_refused(self, message: Message) -> None:
        """A late ack refused after an assignment: where the partition was read past the message's offset since (so it
        is assigned now) and that offset is neither committed nor acknowledged, the copy read again was let go of (the
        dispatcher, which still tracked this message's work, dropped it as a second delivery), and nothing would
        read it again before the next rebalance: commits would hold there. The partition is read again from it before
        the next fetch, as :meth:`_read_again_if_dropped` does (the dispatcher has let go of the work by then)."""
        tp, offset = message.tp, message.offset
        read_to = self.read_cursors.next_offset(tp)
        committed = self._committed_offset.get(tp)
        if (
            read_to is None  # not read since the revocation: it is read from the committed offset
            or read_to <= offset  # not read again yet: it will be
            or (committed is not None and offset < committed)
            or offset in self._acked_index.get(tp, ())
            or any(other.tp == tp and other.offset == offset for other in list(self._unacked_messages))
        ):
            return
        self._reposition[tp] = min(offset, self._reposition.get(tp, offset))

    async def _seek(self, partition: TP, offset: int) -> None:
        # Through the consumer thread's queue, so it runs in that thread's loop: aiokafka's seek touches fetcher state
        # that its own thread reads without locks (a seek from here could kill its fetch task with a KeyError). Not in
        # order with Faust's seek_to_committed: mode's MethodQueue runs two calls at once, so either may land last;
        # the read cursors check the offsets that follow and read again or drop what does not match
        # (tests/contract/test_suspicions.py).
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
        stops_at_start, active_at_start = self._flow_stops, self.flow_active
        committed: dict[TP, int | None] = dict(await self.seek_to_committed())
        watched: dict[TP, int | None] = {}
        for tp, offset in committed.items():
            self._read_offset[tp] = offset if offset is not None and offset >= 0 else None
            if offset is not None:
                self._committed_offset[tp] = offset if offset else None
            self._forget_finished_below(tp, offset)
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
        # Only the recovery's seek, with the flow running (the recovery resumes it to read the changelogs; an app
        # without tables, as the benchmarks' baselines, seeks before it resumes the flow, after Faust's own check of
        # the generation) and no flow stop since it began: Faust's getmany also seeks when a fetch comes back after the
        # flow stopped (mid-rebalance), and a seek that began after a revocation's stop, or that a new stop overtook,
        # belongs to the ended generation (a recovery Faust does not cancel at the revocation goes on to seek).
        if (
            ((active_at_start and self.flow_active) or not self.app.tables)
            and self._flow_stops == stops_at_start
            and asyncio.current_task() is not self._drain_task
        ):
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
        self._forget_finished_below(tp, committed)
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
        # Back-pressure is kept: what the dispatcher took since the flow stopped is still there (resuming clears only
        # the stream queues), and it lets go of a partition only once it has drained it (``resume_after_pause``).
        self._pause_requested.clear()
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
        is left to commit, and the next owner does everything after it again. So they are kept until that commit.

        A worker the group evicted skips the commit before the revocation: the group no longer accepts its commits,
        and the commit first flushes the producer (``ReboundProducer.flush``), which lets the queued records it is still
        running reach their topics for a second or more before the app's revocation (where the dispatcher drops the queue) is reached;
        under chaos that window ran ~380 records whose partitions already had new owners."""
        if self.evicted:
            log.info("rebound: evicted from the group: revoking without the commit the group would refuse")
        else:
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
            self.between_assignments = True  # drained and committed: the group may give the partitions away now
            self._kept_through_revocation = {}
            for tp in revoked:
                self._remember_finished(tp)
                self._gap.pop(tp, None)
                self._acked.pop(tp, None)
                self._acked_index.pop(tp, None)
                self._committed_offset.pop(tp, None)
                self.read_cursors.forget(tp)
                self._back_pressured.discard(tp)
                self._stuck_seen.pop(tp, None)
                self._reposition.pop(tp, None)
            self._finished_in = self._finished_holder(revoked)

    def _finished_holder(self, revoked: set[TP]) -> tuple[int, str | None] | None:
        """Where the revoked partitions' finished offsets were finished: the generation and member id, read once the
        app's commit is done (a commit the group refused blanks the member id). An evicted worker's are forgotten:
        the group gave its partitions to others, whose writer epochs may have fenced the writes of records it
        finished (acknowledged once confirmed, the write then refused); its commit refused, only reading them again
        runs them again."""
        if self.evicted:
            for tp in revoked:
                self._finished.pop(tp, None)
            return None
        return self.app.consumer_generation_id, self.member_id()

    def _remember_finished(self, tp: TP) -> None:
        """A revoked partition's acknowledged offsets Faust could not commit (they lie past an offset still unfinished,
        or dropped) join those finished and let go of (:meth:`abandon`): if the group gives the partition back to
        this worker, reading from the committed offset does not run them again (:meth:`_skip_if_finished`). At most
        what the partition had taken and not committed (the dispatcher's ``partition_buffer`` and a fetched batch).
        None lies below the committed offset: Faust's ``ack`` takes no offset below it, and every move of it forgets
        those it passes (:meth:`_commit_offsets`, :meth:`perform_seek`, :meth:`_position_from_committed`)."""
        if not self._must_see_every_offset(tp):
            return
        acked = self._acked.get(tp)
        if acked:
            self._finished.setdefault(tp, set()).update(acked)

    def _forget_finished_below(self, tp: TP, committed: int | None) -> None:
        """Forget the finished offsets below ``committed``; all of them when nothing is committed: a topic deleted and
        created again (its offsets start over, the group's committed offsets are deleted with it) must not have a new
        record taken for one finished at the same offset."""
        finished = self._finished.get(tp)
        if finished:
            floor = committed if committed is not None and committed > 0 else math.inf
            finished.difference_update([offset for offset in finished if offset < floor])
        if not finished:
            self._finished.pop(tp, None)

    async def on_partitions_assigned(self, assigned: set[TP], generation_id: int = 0) -> None:
        """Offsets finished on a partition the group did not give back are forgotten: its new owner reads it from the
        committed offset and runs them itself, and commits past them, usually long before it could come back here;
        kept, they would only take memory. (One generation, not a time limit: the assignor gives a partition back to
        the worker that had it when it can, at the very next assignment.)

        All are forgotten unless this assignment is of the generation right after the one they were finished in, to
        the same member id (:meth:`_finished_holder`): only then did no other member hold the partitions meanwhile.
        A new member id (dropped from the group, as after a revocation that outlasted the rebalance timeout, which
        aiokafka learns only at the next JoinGroup) means another member may have owned them and fenced their writes.
        A generation skipped (a SyncGroup refused as the group rebalanced again) means another member may have owned
        them and run them again, leaving what only a run of the record read again clears: in key order a block it
        confirmed before being cut short ahead of its retry's send (the key would stay held), in the default mode an
        orphan retry sent before its *forwarded* mark (the re-run's remembered end refuses it).
        """
        # A new generation's streams wait for its own recovery's seek (:meth:`perform_seek`), whatever an earlier
        # generation's recovery, overtaken by this rebalance, set: fetched before the tables are restored, their records
        # were handled against a partial state (a chaos run lost 26 messages so).
        self._sought_this_generation = False
        held, self._finished_in = self._finished_in, None
        member = self.member_id()
        if self._finished and (member is None or held != (generation_id - 1, member)):
            log.info(
                "rebound: generation %d (member %s) does not directly follow the one records were finished in (%s): "
                "they run again if read again",
                generation_id,
                member,
                held,
            )
            self._finished.clear()
        for tp in [tp for tp in self._finished if tp not in assigned]:
            del self._finished[tp]
        self._finished_logged.clear()
        await super().on_partitions_assigned(assigned, generation_id)

    def _skip_if_finished(self, tp: TP, message: Message) -> bool:
        """Acknowledge, without handing it to a stream, a record read again that this process finished already: one
        its streams acknowledged and not yet committed (a seek back in the same generation), or one it finished
        before a revocation or let go of unacknowledged (:attr:`_finished`). Acknowledged by Faust's ``ack`` (its
        bookkeeping, and the wake of what waits for acks), so commits run over it in offset order as over one a stream
        acknowledged. Never an offset this process did not finish: every other record is handed over."""
        offset = message.offset
        index = self._acked_index.get(tp)
        if index is not None and offset in index:
            self.redeliveries_skipped[tp.topic] += 1  # acknowledged already: it only waits for its commit
            return True
        finished = self._finished.get(tp)
        if finished is None or offset not in finished:
            return False
        finished.discard(offset)
        if not finished:
            del self._finished[tp]
        super().ack(message)  # Faust's own: this class's refuses an untracked message, and this one is done
        self.redeliveries_skipped[tp.topic] += 1
        if tp not in self._finished_logged:
            self._finished_logged.add(tp)
            log.info(
                "rebound: %s offset %d and %d more later ones were finished by this worker before it last lost the "
                "partition: acknowledged as they are read again, not run again",
                tp,
                offset,
                len(finished),
            )
        return True

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

    def _filter_committable_offsets(self, tps: Any) -> dict[TP, int]:
        """Faust's, for the assigned partitions only (and every partition of a topic not acknowledged).

        Faust's ``_commit_offsets`` discards the offsets of a partition not assigned ("Discarded commit for revoked
        partitions"), but :meth:`_new_offset` has taken them out of the acknowledged ones already: a partition
        acknowledged while the consumer reads no assignment (a revocation after a resubscription, whose wait for the
        streams ``ReboundApp._on_partitions_revoked`` runs) lost them, and :meth:`_remember_finished` with them, so
        they ran again when the partition came back (seen in tests/integration/test_resubscription_revocation.py).
        Left acknowledged, they are remembered as finished at the revocation's end. Faust's ``_commit_offsets`` reads
        the assignment again, after ``_handle_attached`` (sending the records attached to the offsets, if any): a
        resubscription by the consumer thread between the two reads still has it discard offsets taken here, whose
        records then run again when read again (at-least-once, nothing lost; docs/design.md, "Rebalances")."""
        pending = list(tps)
        if not pending:
            return {}
        assigned = self.assignment()
        committable = [tp for tp in pending if tp in assigned or not self._must_see_every_offset(tp)]
        return super()._filter_committable_offsets(committable)

    async def _commit_offsets(self, offsets: Any, start_new_transaction: bool = True) -> bool:
        """Faust's, which flushes the app's producer before it commits (outside a transaction): that flush waits for
        what the producer held when the commit got there, not for an empty buffer (``app/producer.py``); the offsets
        were taken before (Faust's ``_commit_tps``), so every record written before they were acknowledged is among
        those waited for (tests/app/test_commit_flush.py)."""
        committed = await super()._commit_offsets(offsets, start_new_transaction=start_new_transaction)
        if committed:
            for tp, offset in offsets.items():
                if self._must_see_every_offset(tp):
                    self.read_cursors.committed(tp, offset)
                    if self._finished:
                        self._forget_finished_below(tp, offset)
        return committed

    async def _before_each_fetch(self) -> None:
        """Between batches every record fetched was handed over or dropped; put right what was dropped."""
        if self.fetch_holes:
            self._take_fetch_holes()  # also while nothing is watched: the consumer thread keeps appending
        holds = frozenset(self._holds) if self.flow_active else None
        if (self._held_topics or self._back_pressured) and self.flow_active:
            assigned = ensure_TPset(self.assignment())
            self._pause_requested.update(tp for tp in assigned if tp.topic in self._held_topics)
            # Level-triggered: whatever resumed it since (Faust's recovery, its buffer drop), a partition stays paused
            # while the dispatcher holds too much of it.
            self._pause_requested.update(self._back_pressured & assigned)
        if self._pause_requested:
            paused, self._pause_requested = self._pause_requested, set()
            if self.flow_active:
                self.pause_partitions(paused & ensure_TPset(self.assignment()))
        if holds is not None:
            self._effective_holds = holds  # the fetches from here on leave their topics out
        self._fetch_every_stream_partition(monotonic())
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
        positions = await self._thread.positions(watched)
        self._take_fetch_holes()  # after the positions: every range stepped over up to them has been reported
        for tp, position in positions.items():
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

    def _take_fetch_holes(self) -> None:
        """Hand the read cursors the ranges the consumer thread found empty in the broker's answers."""
        holes = self.fetch_holes
        while holes:
            topic, partition, first, last = holes.popleft()
            tp = TP(topic, partition)
            if self._must_see_every_offset(tp):
                self.read_cursors.broker_gap(tp, first, last)

    def _add_confirmed_gap(self, tp: TP, first: int, last: int) -> None:
        # Not Faust's _add_gap: it starts a gap after the committed offset, so a gap at the committed offset itself
        # would never let commits pass.
        if self.read_cursors.shown_empty(tp, first, last):
            # transaction markers and aborted transactions: expected on a topic written transactionally
            log.debug("rebound: %s holds no records to read from offset %d to %d (broker's answer)", tp, first, last)
        else:
            log.warning("rebound: %s holds no records from offset %d to %d (read twice)", tp, first, last)
        gaps = self._gap[tp]
        gaps.addi(first, last + 1)
        gaps.merge_overlaps()

    def _new_offset(self, tp: TP) -> int | None:
        if not self._must_see_every_offset(tp):
            return super()._new_offset(tp)
        acked = self._acked[tp]
        if not acked:
            return self._past_gap_at_floor(tp)
        acked.sort()
        gaps = self._gap[tp]
        # Confirmed gaps below the highest acknowledged offset count as acknowledged (Faust does the same), kept as
        # intervals: never listed offset by offset (rebound/commit_runs.py says why).
        covered = sorted((int(gap.begin), int(gap.end)) for gap in gaps.overlap(0, acked[-1])) if gaps else []
        head = min(acked[0], covered[0][0]) if covered else acked[0]
        floor = self._committed_offset[tp]
        if floor is None:
            floor = self.read_cursors.commit_floor(tp)
        if floor is None or head > floor:
            if floor is not None:
                self._read_again_if_dropped(tp, floor, head)
            return None  # the head is still being handled, or was dropped and will be read again after a seek
        self._stuck_seen.pop(tp, None)
        end, taken = run_end(acked, covered, head)
        self._acked_index[tp].difference_update(acked[:taken])
        acked[:taken] = []
        if covered:
            gaps.chop(0, end)
        return end

    def _past_gap_at_floor(self, tp: TP) -> int | None:
        """Nothing acknowledged, and a confirmed gap starts at the committed offset: commit past it. A transaction's
        marker at the end of a partition is such a gap (nothing follows it to be acknowledged); committed past, the
        group's lag reaches 0 and the next owner does not fetch the marker again."""
        floor = self._committed_offset[tp]
        if floor is None:
            floor = self.read_cursors.commit_floor(tp)
        gaps = self._gap[tp]
        if floor is None or not gaps:
            return None
        for interval in gaps.at(floor):
            gaps.chop(0, interval.end)
            return int(interval.end)
        return None

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
            return self._not_handed_over(message)
        task = asyncio.current_task()
        self._delivering, self._delivery_interrupted = task, False
        self._delivering_tp, self._delivering_message = message.tp, message
        clears = queue_clears(self.app)
        try:
            await self.callback(message)
        except asyncio.CancelledError:
            # Ours only if nobody else cancelled the fetcher at the same time (then it must stop as asked).
            if not self._delivery_interrupted or task is None or task.uncancel() > 0:
                raise
            return self._not_handed_over(message)
        finally:
            self._delivering = self._delivering_tp = self._delivering_message = None
        if self._delivery_interrupted and task is not None:
            task.uncancel()  # the callback swallowed the cancellation: it must not linger in the task's count
            return self._not_handed_over(message)
        if queue_clears(self.app) != clears:
            return self._cleared_during_hand_over(message)
        return True

    def _not_handed_over(self, message: Message) -> bool:
        """Answer False for a hand-over that failed, and tell the read cursor: a record we fetched and did not hand
        over is no evidence that the broker lacks it (``ReadCursors.not_handed_over``). Kept as evidence, a second
        failed hand-over of the same offset in a later batch made it a confirmed gap, committed over: never run."""
        if self._must_see_every_offset(message.tp):
            self.read_cursors.not_handed_over(message.tp)
        return False

    def _cleared_during_hand_over(self, message: Message) -> bool:
        """The stream queues were cleared while ``message`` was being handed over: counted as not delivered.

        mode's ``ThrowableQueue.clear()`` cancels the puts waiting for room, and Faust's conductor awaits its put
        inside ``asyncio.wait``, which swallows the cancellation: the callback returns as if the record had been put.
        A record put before the clear was emptied out with the queue. But a put can also land after the clear: one
        that waited for the flow to resume, and one the stream woke just before the clear (it took an event, and so
        made room): a woken put has left the putters the clear cancels, and it puts into the emptied queue. The
        callback's return does not say which happened, so the record is read again (the read cursor stays on it, in
        order), and a copy that landed is voided: the dispatcher lets it go (:meth:`take_void`) and the copy read
        again runs. Only a copy still sitting in a stream queue is voided: a copy no queue holds was cancelled,
        emptied out, or already taken (the dispatcher then drops the copy read again as a second delivery), and its
        entry would never be taken back. Entries whose copy has left the queues since are dropped here too: one taken
        by a stream that is not the dispatcher's, or emptied out by a later clear, can no longer arrive.
        """
        self._forget_copies_that_cannot_arrive()
        if not self._must_see_every_offset(message.tp):
            return False  # a changelog's reading goes on as Faust's does
        if queued_in_streams(self.app, message):
            self._landed_copies[id(message)] = message
        log.info(
            "rebound: %s@%d was being handed over when the stream queues were cleared; reading it again",
            message.tp,
            message.offset,
        )
        return self._not_handed_over(message)

    def _forget_copies_that_cannot_arrive(self) -> None:
        """Drop landed copies no stream queue holds any more. Only these: each was put (or its put cancelled) before
        its hand-over returned, whereas a hand-over :meth:`resume_flow` interrupted may still have its put waiting."""
        landed = self._landed_copies
        if landed:
            self._landed_copies = {
                key: message for key, message in landed.items() if queued_in_streams(self.app, message)
            }

    def take_void(self, message: Message) -> bool:
        """Whether ``message`` was voided (its hand-over interrupted as the flow resumed or the stream queues were
        cleared, and read again since): the stream that got it anyway must let it go, unacknowledged. Answered once
        per voided message."""
        if not (self._voided or self._landed_copies):
            return False
        key = id(message)
        return self._voided.pop(key, None) is message or self._landed_copies.pop(key, None) is message

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
                    # thread's timer lets the coordinator join again, and Faust would have crashed the worker. (A
                    # batch that cannot be decoded no longer gets here: it stops its own partition only, see
                    # ReboundConsumerThread._fetch_records.)
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
        if self.fetch_holes:
            self._take_fetch_holes()
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
        if self._skip_if_finished(tp, message):
            cursors.delivered(tp, offset, epoch)
            self._read_offset[tp] = offset
            return
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


class CountingFlowControl(FlowControlEvent):
    """Faust's flow control of the stream queues, counting how often it emptied them.

    Clearing also cancels the puts waiting for room (mode's ``ThrowableQueue.clear``) and Faust's conductor swallows
    that cancellation: a hand-over that saw the count move cannot tell from its own result whether its record reached
    a stream (see ``ReboundConsumer._cleared_during_hand_over``).
    """

    clears = 0

    def clear(self) -> None:
        self.clears += 1
        super().clear()

    def queued(self, message: Any) -> bool:
        """Whether a queue it manages (every stream queue: Faust makes them ``clear_on_resume``) holds an event of
        ``message``, one a stream has yet to take. Walks the queues: only for the rare hand-over a clear interrupted."""
        return any(
            getattr(event, "message", None) is message
            for queue in list(self._queues)
            for event in list(cast(Any, queue)._queue)  # asyncio.Queue's items (a deque), only read
        )


def queue_clears(app: Any) -> int:
    """How often the app's flow control emptied the stream queues (0 for a flow control that does not count)."""
    return cast(int, getattr(app.flow_control, "clears", 0))


def queued_in_streams(app: Any, message: Any) -> bool:
    """Whether a stream queue of the app holds an event of ``message`` (True when the flow control cannot tell: a
    copy that may still arrive is voided rather than run out of order)."""
    queued = getattr(app.flow_control, "queued", None)
    return True if queued is None else bool(queued(message))


class ReboundTransport(driver.Transport):
    Consumer: ClassVar[type[Any]] = ReboundConsumer
    Producer: ClassVar[type[Any]] = ReboundProducer


_FAUST_MAYBE_START_PRODUCER: Callable[[Any], Any] = getattr(
    faust.App.maybe_start_producer, "__wrapped__", faust.App.maybe_start_producer
)
"""Faust's ``App.maybe_start_producer`` without mode's stampede around it (``ReboundApp._start_producer`` puts its own
around it; tests/contract checks the wrapper is still there)."""


class StreamInboundTime(Sensor):
    """The one per-event figure of Faust's ``Monitor`` Faust itself reads: when each partition's stream last took an
    event (``stream_inbound_time``, read by the livelock detector, ``AIOKafkaConsumerThread.verify_event_path``)."""

    def __init__(self, inbound: dict[TP, float]) -> None:
        super().__init__()
        self.inbound = inbound

    def on_stream_event_in(self, tp: TP, offset: int, stream: Any, event: Any) -> None:
        self.inbound[tp] = monotonic()


class ReboundApp(faust.App):
    """A Faust app whose transport is ``ReboundTransport``: it makes the app's consumer and producer (Faust's
    ``producer_transport``, for the ``broker_producer`` URLs, makes none here)."""

    fetch_max_wait_ms: int | None = None
    isolation_level: str = "read_committed"
    _producer_starts: int = 0
    """How many publishes are in :meth:`_start_producer` (Faust's path) now."""

    def __init__(
        self,
        *args: Any,
        fetch_max_wait_ms: int | None = None,
        isolation_level: str = "read_committed",
        per_event_monitor: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.per_event_monitor = per_event_monitor
        """False: Faust's ``Monitor`` gets no per-event calls (see :meth:`drop_per_event_monitor`)."""
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.isolation_level = isolation_level
        self.flow_stopped_callbacks: list[Callable[[], None]] = []
        self.holds_at_start: dict[str, frozenset[str]] = {}
        """Topics the consumer holds from the start, per reason (see ``ReboundConsumer.hold_topics``): the operator's
        pause holds the main topics until the worker has read whether they are paused (``agents/control.py``)."""

    @cached_property
    def flow_control(self) -> FlowControlEvent:
        """Faust's flow control, counting the clears of the stream queues (see :class:`CountingFlowControl`)."""
        return CountingFlowControl(loop=self.loop)

    async def _on_partitions_revoked(self, revoked: set[TP]) -> None:
        """Faust's revocation, with its flow stop, wait for the streams and producer flush done also where its
        consumer reads no assignment: after a resubscription, or as the worker stops (docs/design.md, "Rebalances",
        says when and why).

        Faust's ``App._on_partitions_revoked`` does those steps only when ``consumer.assignment()`` is non-empty, and
        Rebound's own revocation hangs off its flow stop (``ReboundConsumer.stop_flow``: the dispatcher's revoke, the
        tier lanes' queued records dropped, the breaker's flow stop). Where it reads none, the steps run here, for
        ``revoked`` (with aiokafka's eager rebalancing that is everything this worker held: the flow stop is the
        consumer's as a whole), before Faust's revocation, which then skips its own: once in every path. Nothing is
        paused (aiokafka no longer fetches an unassigned partition) and nothing committed (aiokafka commits assigned
        partitions only, ``ReboundConsumer._filter_committable_offsets``). The wait runs before Faust's
        ``tables.on_partitions_revoked`` then, not after it (harmless: that flushes the tables' recovery buffers, which
        the streams do not read). If the consumer thread empties the assignment between the check here and Faust's own
        (a resubscription landing in between), Faust's revocation stops no flow and the steps run after it, so after
        its ``on_partitions_revoked`` signal: the release schedule suspends the revoked partitions
        (``agents/release.py``) before the flow stops (harmless: the timer only stops releasing them sooner).

        A stopping app: Faust's revocation only closes the consumer, and its stop (``_stop_consumer``) stops the flow
        only if the assignment reads non-empty; where it reads empty, the flow is stopped here and nothing waited for
        (the dispatcher bounds the work by the shutdown's time). Exactly-once transactions, which Faust's branch also
        ends, are not used by Rebound."""
        consumer = cast(ReboundConsumer, self.consumer)
        stopping = bool(self.should_stop)
        stops_before = consumer._flow_stops
        try:
            unassigned = bool(revoked) and not consumer.assignment()
        except ConsumerNotStarted:
            unassigned = False  # Faust's revocation meets it too, and crashes the app
        if unassigned and not await self._stop_flow_unassigned(consumer, revoked, wait=not stopping):
            return
        await super()._on_partitions_revoked(revoked)
        if revoked and not (stopping or unassigned or self.should_stop) and consumer._flow_stops == stops_before:
            await self._stop_flow_unassigned(consumer, revoked, wait=True)

    async def _stop_flow_unassigned(self, consumer: ReboundConsumer, revoked: set[TP], *, wait: bool) -> bool:
        """The steps of Faust's revocation it skips when the consumer reads no assignment (see
        :meth:`_on_partitions_revoked`); False if one failed, and the app crashes as in Faust's."""
        log.info(
            "rebound: the revocation of %d partitions finds no assignment (a resubscription%s): the flow is stopped%s "
            "here, as Faust's revocation does when it finds one",
            len(revoked),
            ", the worker stopping" if not wait else "",
            " and the streams waited for" if wait else "",
        )
        try:
            consumer.stop_flow()
            self.flow_control.suspend()
            self.flow_control.clear()
            if wait:
                if self.conf.stream_wait_empty:
                    await consumer.wait_empty()
                await self._producer_flush(log)
        except Exception as exc:
            await self.crash(exc)
            return False
        return True

    async def on_start(self) -> None:
        await super().on_start()  # makes the consumer; it starts (and fetches) after this
        if not self.per_event_monitor:
            self.drop_per_event_monitor()
        for reason, topics in self.holds_at_start.items():
            cast(ReboundConsumer, self.consumer).hold_topics(topics, reason=reason)

    async def on_started(self) -> None:
        await super().on_started()
        drop_unprinted_debug_level()

    def drop_per_event_monitor(self) -> None:
        """Take Faust's ``Monitor`` out of the app's sensors (``on_init_dependencies`` put it there): every record
        handed over, every stream event in and out and every send called it (its counters, a state dict per event,
        timings), a few µs per healthy message that nothing reads here: Rebound's own metrics count what it reports,
        and Faust's views that serve the monitor's figures are off. The monitor itself stays (the consumer gives it
        end offsets and commits, once per batch)."""
        if self.monitor in set(self.sensors):
            self.sensors.remove(self.monitor)
            self.sensors.add(StreamInboundTime(self.monitor.stream_inbound_time))

    @property
    def producer_ready(self) -> bool:
        """Whether the producer is started and no start of it is under way in :meth:`maybe_start_producer`: what
        ``agents/delivery.py`` ``direct_producer`` asks before it puts a record straight into aiokafka's buffer (mode
        marks a service started before its ``on_start`` has connected it)."""
        return not self._producer_starts and self.producer.started

    async def maybe_start_producer(self) -> Any:
        """Faust's, without its three turns of the event loop per publish once the producer is started.

        Every publish of every topic asks the app for its producer (``Topic.publish_message``: each direct send, and
        each record of the producer buffer, which sends all tables' changelog records one at a time in one task).
        Faust's answer is wrapped in mode's ``stampede`` (concurrent callers share one start), which gives the event
        loop away three times per call: on a busy loop the buffer moved one record per three turns and every
        confirmed table write, forward, dead letter and release request waited there. Once the producer is started
        and no start is in flight here, it is returned at once, the answer Faust's path gives then (its
        ``maybe_start`` returns at once for a started service). Otherwise (not started, a start in flight, a
        transaction's producer) Faust's own path runs, and a caller arriving meanwhile waits with it: no publish
        overtakes one waiting for a start made here, nor gets the producer that start is still connecting (mode marks
        a service started before its ``on_start`` runs). A producer the worker starts (one of the app's services,
        before the agents) is taken while connecting by both paths alike.
        """
        if not self._producer_starts and not self.in_transaction:
            producer = self.producer
            if producer.started:
                return producer
        self._producer_starts += 1
        try:
            return await self._start_producer()
        finally:
            self._producer_starts -= 1

    @stampede
    async def _start_producer(self) -> Any:
        """Faust's ``maybe_start_producer`` under its own stampede protection. Not ``super()``'s: mode's stampede
        caches its wrapper in the instance's ``__dict__`` under the method's name, which would hide the override
        above from then on."""
        return await _FAUST_MAYBE_START_PRODUCER(self)

    def _new_transport(self) -> Any:
        url = self.conf.broker_consumer[0]
        if url.scheme not in ("kafka", "aiokafka"):
            raise ValueError(f"Rebound's consumer runs on aiokafka; broker URL scheme {url.scheme!r} is not Kafka")
        return ReboundTransport(self.conf.broker_consumer, self)
