"""Tier agents: one per tier topic. They validate the retry headers and park the message in the state table.

Parking (not sleeping) is what keeps a tier partition flowing: a record is read as soon as it arrives, whatever its
due time, and the timer releases it later. Whatever a record carries, it is either parked or sent on to the failed
topic byte-exact with a reason: nothing raises out of the agent (Faust would ack the record).

Parks are group-committed per partition (:class:`TierLanes`): a changelog round trip (``acks=all``) per record made
the first tier the slowest stage of the failure path, and its backlog under faults the largest part of retry
lateness.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import weakref
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from faust.streams import _current_event

from agents.attempt import dead_letter
from agents.lifecycle import forget_expired_marks, memory_of
from agents.ordering import retry_refused
from agents.ownership import current_generation, still_owns, taken_in
from agents.records import header_pairs
from agents.runtime import Runtime
from rebound.errors import InvalidRetryHeadersError, KeyBacklogFullError, RecordTooLargeError
from rebound.headers import (
    Header,
    Provenance,
    RetryHeaders,
    parse_retry_headers,
    restore_null_value,
    without_rebound_headers,
)
from rebound.routing import DeadLetter, Reason
from rebound.schedule import Slot
from rebound.state import (
    KeyState,
    Known,
    PendingMessage,
    legacy_table_key,
    null_table_key,
    payload_key,
    record_digest,
    remember,
    table_key,
    tier_duplicate,
)
from rebound.tiers import Tier
from rebound.topics import failed_topic
from tables.retry_state import ChangelogRefusedError

log = logging.getLogger(__name__)
STATE_ERROR_CHARS = 256  # the full message travels in the record's headers; the state keeps it short
TIER_BATCH_MAX = 500
"""Most records of one partition parked under one changelog confirmation (bench/scenarios/park_rate.py)."""
TIER_LINGER_S = 0.002
"""How long a lane waits for more records before it parks a group smaller than ``TIER_BATCH_MAX``."""
TIER_LANE_BUFFER = 1000
"""Most records of one partition waiting in its lane; a fuller lane makes the actor wait."""
RETRY_BACKOFF_S = (0.1, 0.5, 1.0, 5.0)


def register_tier_agent(runtime: Runtime, topic_name: str) -> Any:
    """One actor per tier topic on a worker; it hands each record to its partition's lane and never waits on a park.

    The lanes (:class:`TierLanes`) serve the partitions independently, so a backlogged partition does not hold the
    others, and each lane parks what it has ready in one group commit. One actor keeps every partition's records in
    one lane (Faust's ``concurrency`` > 1 would share them between actors and could commit past an in-flight
    record, faust-streaming #606). Acknowledgements are the lanes' (``noack``), in offset order per partition.
    """
    tier = runtime.tiers[topic_name]

    async def tier_agent(stream: Any) -> None:
        lanes = TierLanes(runtime, tier)
        tier_agent.rebound_lanes = lanes  # type: ignore[attr-defined]  # (tests wait for it to be idle)
        try:
            async for event in stream.noack().events():
                await lanes.offer(event)
        finally:
            await lanes.close()

    def drop_queued() -> None:
        lanes = getattr(tier_agent, "rebound_lanes", None)
        if lanes is not None:
            lanes.drop_queued()

    # Faust waits, at every revocation and at shutdown, for each record its streams took to be acknowledged: what
    # waits in the lanes is let go of as the flow stops instead of parked first (read again by the next owner).
    getattr(runtime.app, "flow_stopped_callbacks", []).append(drop_queued)
    topic = runtime.tier_topics[topic_name]
    return runtime.app.agent(topic, name=f"rebound.tier.{topic_name}", concurrency=1)(tier_agent)


class TierLanes:
    """One lane per tier partition: a bounded queue and a task that parks what is ready, a group at a time.

    A group is what the queue holds when the lane gets to it (at most ``batch_max``, after waiting ``linger_s`` for
    more if fewer are there): each record is parked as on its own, then the changelog acknowledgements of all their
    writes are awaited once, and only then are the records acknowledged, in offset order. While one group waits for
    its acknowledgements the next one gathers, so the group size follows the load without a tuned linger.

    ``lane_buffer`` bounds what one partition may hold: when its lane is that far behind, the actor waits for it
    (Faust's stream buffers behind it), so memory stays bounded at the cost of the other partitions waiting too.
    """

    def __init__(
        self,
        runtime: Runtime,
        tier: Tier,
        *,
        batch_max: int = TIER_BATCH_MAX,
        linger_s: float = TIER_LINGER_S,
        lane_buffer: int = TIER_LANE_BUFFER,
    ) -> None:
        self.runtime = runtime
        self.tier = tier
        self.batch_max = batch_max
        self.linger_s = linger_s
        self.lane_buffer = lane_buffer
        self._queues: dict[int, asyncio.Queue[tuple[int, Any]]] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._holding: dict[int, list[Any]] = {}  # the group each lane took and has not acknowledged yet
        self._taken_in: dict[int, int] = {}  # the dispatcher's generation when each lane took its group
        self._drops = 0  # flow stops seen: a record offered before one and queued after it is let go of too
        self._closing = False
        self._idle = asyncio.Event()
        self._idle.set()

    async def offer(self, event: Any) -> None:
        partition = event.message.partition
        queue = self._queues.get(partition)
        if queue is None:
            queue = self._queues[partition] = asyncio.Queue(maxsize=self.lane_buffer)
            self._start_lane(partition, queue, [])
        self._idle.clear()
        await queue.put((self._drops, event))

    def _start_lane(self, partition: int, queue: asyncio.Queue[tuple[int, Any]], held: list[Any]) -> None:
        task = asyncio.get_running_loop().create_task(
            self._serve(partition, queue, held), name=f"rebound.tier.{self.tier.topic}[{partition}]"
        )
        self._tasks[partition] = task
        task.add_done_callback(lambda done: self._lane_ended(partition, queue, done))

    def _lane_ended(self, partition: int, queue: asyncio.Queue[tuple[int, Any]], task: asyncio.Task[None]) -> None:
        """A lane that died (a bug: parking retries every failure) is started again with the group it held, so its
        records are parked and acknowledged in order instead of left unacknowledged for the generation."""
        if self._closing or task.cancelled() or self._tasks.get(partition) is not task:
            return
        log.error("the lane of %s[%d] died; starting it again", self.tier.topic, partition, exc_info=task.exception())
        self._start_lane(partition, queue, self._holding.pop(partition, []))

    def drop_queued(self) -> None:
        """The flow stopped (a revocation, a shutdown): let go of every record still waiting in a lane.

        The group a lane is parking is finished; what waits behind it is above every offset acknowledged (the lanes
        acknowledge in order), so it is abandoned, never acknowledged, and read again after the next seek.
        """
        self._drops += 1
        for queue in self._queues.values():
            while not queue.empty():
                _, event = queue.get_nowait()
                self._abandon(event)
        self._notify_if_idle()

    def _abandon(self, event: Any) -> None:
        abandon_event(self.runtime, event)

    async def wait_idle(self) -> None:
        """Until every record offered is parked (or sent on) and acknowledged."""
        while not self._is_idle():
            self._idle.clear()
            await self._idle.wait()

    def _is_idle(self) -> bool:
        return not any(self._holding.values()) and all(queue.empty() for queue in self._queues.values())

    def _notify_if_idle(self) -> None:
        if self._is_idle():
            self._idle.set()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop the lanes; a record they had not acknowledged is let go of and read again (at-least-once), never
        skipped, and never left counted as taken (commits would stall for the generation)."""
        self._closing = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        while tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in pending:
                log.warning("a lane of %s did not stop; cancelling it again", self.tier.topic)
                task.cancel()
            tasks = list(pending)
        for held in self._holding.values():
            for event in held:
                self._abandon(event)
        self._holding.clear()
        self.drop_queued()
        self._tasks.clear()
        self._queues.clear()

    async def _serve(self, partition: int, queue: asyncio.Queue[tuple[int, Any]], held: list[Any]) -> None:
        if held:  # started again after dying: a pause, so a bug failing every time does not spin
            self._holding[partition] = held
            await asyncio.sleep(RETRY_BACKOFF_S[0])
        batch = held
        while True:
            if not batch:
                batch = await self._gather(partition, queue)
            if batch:
                # Its checks before a send or a write (still_ours) end at the revocation of the group's generation,
                # even one under way before they begin: that revocation waits for this group (Faust's wait_empty).
                with taken_in(self._taken_in[partition]):
                    await self._park_until_done(batch)
            self._holding.pop(partition, None)
            self._notify_if_idle()
            batch = []

    async def _gather(self, partition: int, queue: asyncio.Queue[tuple[int, Any]]) -> list[Any]:
        """A group: what the queue holds, or what arrives within the linger. Held (``_holding``) as soon as taken,
        so a lane lingering with a record is not idle and a stopped lane lets its records go."""
        batch: list[Any] = self._holding.setdefault(partition, [])
        item = await queue.get()
        self._taken_in[partition] = current_generation(self.runtime)  # (kept for a lane started again with it)
        self._take(batch, item)
        deadline = asyncio.get_running_loop().time() + self.linger_s
        while len(batch) < self.batch_max:
            if not queue.empty():
                self._take(batch, queue.get_nowait())
                continue
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            try:
                # Not asyncio.wait_for: on 3.11 it swallows a cancellation arriving as the get completes.
                async with asyncio.timeout(remaining):
                    item = await queue.get()
            except TimeoutError:
                break
            self._take(batch, item)
        return batch

    def _take(self, batch: list[Any], item: tuple[int, Any]) -> None:
        """A record offered before the last flow stop and queued after it (its offer was waiting for room) is let go
        of like the ones the stop dropped: it is above them."""
        drops, event = item
        if drops == self._drops:
            batch.append(event)
        else:
            self._abandon(event)

    async def _park_until_done(self, batch: list[Any]) -> None:
        """Park the group; if something unforeseen fails, park it again after a pause (parking twice is harmless:
        a duplicate writes its entry again), never acknowledge it unparked."""
        for pause in itertools.chain(RETRY_BACKOFF_S, itertools.repeat(RETRY_BACKOFF_S[-1])):
            try:
                await park_group(self.runtime, batch, self.tier)
                return
            except Exception:
                log.exception("parking %d records of %s failed; parking them again", len(batch), self.tier.topic)
                await asyncio.sleep(pause)


@dataclass(frozen=True)
class Parked:
    """A record parked (or written again, ``written`` None) whose changelog writes are not confirmed yet."""

    record: TierRecord
    parsed: RetryHeaders
    written: tuple[bytes, KeyState, KeyState] | None
    table_key: bytes

    def concerned_by(self, keys: frozenset[bytes]) -> bool:
        """Whether a refused changelog record is one of this park's: its key's state or its message's payload."""
        origin = PendingMessage.origin_of(self.parsed.provenance)
        return self.table_key in keys or payload_key(self.table_key, origin) in keys


async def park_group(runtime: Runtime, events: list[Any], tier: Tier) -> None:
    """Park each record as on its own, confirm all their changelog writes at once, then acknowledge them in order.

    Each record is handled with Faust's current event set to its own event: table writes take their changelog
    partition (and their RocksDB partition) from it. Durable before committed holds for the whole group: no record
    is acknowledged before every write of the group is acknowledged by the broker (a failed one is written again,
    :meth:`tables.retry_state.RetryStore.confirm`). A record sent to the failed topic first has the parks before it
    confirmed: its own end is confirmed on its own, and a refusal must still reach the park it concerns.
    """
    parked: list[tuple[Parked, Any]] = []

    async def confirm_so_far() -> None:
        done = list(parked)
        parked.clear()
        await confirm_parks(runtime, tier, done)

    try:
        for event in events:
            with current(event):
                outcome = await take_in(runtime, event.message, tier, before_reject=confirm_so_far)
            if outcome is not None:
                parked.append((outcome, event))
        if events:
            with current(events[-1]):
                await confirm_parks(runtime, tier, parked)
    except PartitionMoved as moved:
        # Its end not sent (or not remembered): it and what follows it are left to the partition's next reader.
        index = next(index for index, event in enumerate(events) if event.message is moved.message)
        _acknowledge_in_order(runtime, events[:index])
        for event in events[index:]:
            abandon_event(runtime, event)
        return
    _acknowledge_in_order(runtime, events)


async def confirm_parks(runtime: Runtime, tier: Tier, parked: list[tuple[Parked, Any]]) -> None:
    """Await the changelog acknowledgements of every write this task made; a refusal ends the parks it concerns."""
    try:
        await runtime.store.confirm()
    except RecordTooLargeError as exc:
        keys = exc.keys if isinstance(exc, ChangelogRefusedError) else None
        for item, event in parked:
            if keys is None or item.concerned_by(keys):
                with current(event):
                    await refused_changelog_write(runtime, item, exc)
    except Exception:
        # Some of the writes may be durable: sending the records to the failed topic would give a parked one a
        # second end when it is released. The caller parks the group again (a duplicate writes its entry again).
        log.exception("could not confirm the parks of %d records of %s", len(parked), tier.topic)
        raise


@contextlib.contextmanager
def current(event: Any) -> Iterator[None]:
    """Faust's current event set to ``event`` for the table writes made meanwhile (they take its partition)."""
    token = _current_event.set(weakref.ref(event))
    try:
        yield
    finally:
        _current_event.reset(token)


def _acknowledge_in_order(runtime: Runtime, events: list[Any]) -> None:
    """Acknowledge the group in offset order; once one acknowledgement fails, the rest are let go of instead
    (read again after the next seek): acknowledged past a hole they would not be committed anyway, and Faust would
    wait for them at the next revocation."""
    for index, event in enumerate(events):
        try:
            event.ack()
        except Exception:
            log.exception("acknowledging %s@%d failed", event.message.tp, event.message.offset)
            for rest in events[index:]:
                abandon_event(runtime, rest)
            return


def abandon_event(runtime: Runtime, event: Any) -> None:
    """Let go of a record that will not be acknowledged (Faust stops waiting for it; its offset is read again)."""
    abandon = getattr(runtime.app.consumer, "abandon", None)
    if abandon is None:
        return
    try:
        abandon(event.message)
    except Exception:
        log.exception("letting go of %s@%d failed", event.message.tp, event.message.offset)


class PartitionMoved(Exception):
    """A tier record's end (a dead letter, or the write after one) not made: the session lease lapsed or the partition
    is no longer owned after an await (:func:`agents.ownership.still_owns`). The record is left unacknowledged, as a
    first try's is (``FirstTryRevokedError``): its partition's next reader reads it again and ends it once."""

    def __init__(self, message: Any) -> None:
        super().__init__(f"{message.topic}[{message.partition}]@{message.offset}: partition moved")
        self.message = message


async def still_ours(runtime: Runtime, message: Any) -> None:
    """Raise :class:`PartitionMoved` (one warning, counted ``tier.revoked_before_send``) unless the session lease
    holds and the record's partition is still owned: asked before every send and write of a tier record's end,
    each of which follows an await (the lane's waits, the confirm of the parks before it, its own send)."""
    if await still_owns(runtime, message.partition):
        return
    runtime.counters["tier.revoked_before_send"] += 1
    log.warning(
        "partition %d revoked before the end of %s[%d]@%d was sent or written: left to the new owner",
        message.partition,
        message.topic,
        message.partition,
        message.offset,
    )
    raise PartitionMoved(message)


@dataclass(frozen=True)
class TierRecord:
    """A record read from a tier topic, with what a rejection needs to send it on byte-exact."""

    message: Any
    tier: Tier
    headers: list[Header]

    @property
    def value(self) -> bytes | None:
        return restore_null_value(self.message.value, self.headers)

    @property
    def timestamp_ms(self) -> int:
        return max(0, int(self.message.timestamp * 1000)) if self.message.timestamp else 0

    def itself(self, now_ms: int) -> Provenance:
        """Provenance for a record whose headers cannot be trusted: the tier record itself."""
        return Provenance(self.tier.topic, self.message.partition, self.message.offset, self.timestamp_ms, now_ms)


async def take_in(
    runtime: Runtime, message: Any, tier: Tier, *, before_reject: Callable[[], Awaitable[None]]
) -> Parked | None:
    """Validate and park one record, its changelog writes left to the caller's confirm; None if it is done with
    (sent to the failed topic, or a copy of a retry whose message ended). ``before_reject`` runs before a record is
    sent to the failed topic (whose own writes are confirmed at once). Never raises, but :class:`PartitionMoved`
    before a send or a write of the record's end that its partition's next reader is left to make."""
    record = TierRecord(message, tier, header_pairs(message.headers))
    runtime.counters[f"tier.{tier.label}.received"] += 1
    parsed: RetryHeaders | None = None
    try:
        parsed = parse_retry_headers(record.headers, main_topics=runtime.settings.topics)
        tier.validate(
            parsed,
            group=runtime.group,
            partition=message.partition,
            partitions=runtime.partitions,
            record_timestamp_ms=record.timestamp_ms,
            now_ms=runtime.clock(),
            longest_wait_ms=runtime.settings.retry_after_max_ms,
        )
    except InvalidRetryHeadersError as exc:
        log.warning("invalid retry headers on %s[%d]@%d: %s", tier.topic, message.partition, message.offset, exc)
        await before_reject()
        itself = record.itself(runtime.clock())
        await reject(runtime, record, Reason.INVALID_RETRY_HEADERS, itself, 0, type(exc).__name__, str(exc))
        if _own_record(runtime, tier, message, parsed):
            # Our own retry, refused for its due time (clocks apart): in key-ordered mode its key stops waiting.
            await _lift_block(runtime, message, parsed)
        return None
    try:
        written = park(runtime, record, parsed)
        forget_expired_marks(runtime, message.partition)
    except (KeyBacklogFullError, RecordTooLargeError) as exc:
        reason = Reason.KEY_BACKLOG_FULL if isinstance(exc, KeyBacklogFullError) else Reason.TOO_LARGE
        await before_reject()
        await not_parked(runtime, Parked(record, parsed, None, b""), reason, parsed.error_class, str(exc))
        return None
    except Exception as exc:
        log.exception("could not park %s[%d]@%d", tier.topic, message.partition, message.offset)
        await before_reject()
        await not_parked(
            runtime, Parked(record, parsed, None, b""), Reason.INTERNAL_ERROR, type(exc).__name__, str(exc)
        )
        return None
    if isinstance(written, EndedBlocking):
        # A retry of a message that ended, while its key still waits for it (a stale run blocked it again): as the
        # other refusals do, the key stops waiting, and its held messages run.
        await before_reject()
        await still_ours(runtime, message)
        await retry_refused(runtime, written.table_key, message.partition, written.origin)
        return None
    if written is not None:
        stored_key = written[0]
    else:
        origin = PendingMessage.origin_of(parsed.provenance)
        stored_key = _key_parked_under(runtime, message.key, parsed.provenance, origin)
    return Parked(record, parsed, written, stored_key)


async def refused_changelog_write(runtime: Runtime, item: Parked, exc: RecordTooLargeError) -> None:
    """The broker refused one of this park's changelog records (its limit is below the producer's): the park is
    taken back and the message sent to the failed topic, unless it is not this record's to end."""
    message = item.record.message
    if item.written is None or not await take_back(runtime, item.written, item.parsed.attempt, message):
        # A duplicate whose first write stands, or a message already released: it is not this one's to end.
        log.error(
            "changelog write of %s[%d]@%d refused; the entry stays",
            item.record.tier.topic,
            message.partition,
            message.offset,
        )
        return
    await not_parked(runtime, item, Reason.TOO_LARGE, item.parsed.error_class, str(exc))


async def not_parked(runtime: Runtime, item: Parked, reason: Reason, error_class: str, error_text: str) -> None:
    """Send the record on to the failed topic (byte-exact, with the reason) and end its message."""
    record, parsed = item.record, item.parsed
    if reason is Reason.INTERNAL_ERROR:
        await reject(runtime, record, reason, parsed.provenance, parsed.attempt, error_class, error_text)
    else:
        text = f"{parsed.error_message} ({error_text})"
        await reject(runtime, record, reason, parsed.provenance, parsed.attempt, parsed.error_class, text)
    await _lift_block(runtime, record.message, parsed)


def _own_record(runtime: Runtime, tier: Tier, message: Any, parsed: RetryHeaders | None) -> bool:
    """Headers that parse and name this group, this tier's main topic and this partition: our own retry."""
    return (
        parsed is not None
        and parsed.group == runtime.group
        and parsed.provenance.topic == tier.main_topic
        and parsed.provenance.partition % runtime.partitions == message.partition
    )


async def _lift_block(runtime: Runtime, message: Any, parsed: RetryHeaders | None) -> None:
    """Our own retry went to the failed topic instead of being parked: the message has ended. It is remembered as
    ended (a redelivered first try, or another copy of this record, does not start it again) and, in key-ordered
    mode, its key stops waiting for it."""
    if parsed is not None:
        await still_ours(runtime, message)  # (after the dead letter's send)
        await _remember_ended(runtime, message, parsed)
    if parsed is not None and runtime.settings.key_ordered and message.key is not None:
        origin = PendingMessage.origin_of(parsed.provenance)
        await still_ours(runtime, message)  # (after the mark's confirm)
        await retry_refused(runtime, table_key(message.key, parsed.provenance), message.partition, origin)


async def _remember_ended(runtime: Runtime, message: Any, parsed: RetryHeaders) -> None:
    """Never raises: the dead letter is sent; without the mark only a redelivery's check is lost."""
    try:
        key = _key_parked_under(runtime, message.key, parsed.provenance, PendingMessage.origin_of(parsed.provenance))
        before = runtime.store.load(key, origin=PendingMessage.origin_of(parsed.provenance))
        after = remember(
            before,
            parsed.provenance,
            attempt=parsed.attempt,
            ended=True,
            partition=message.partition,
            now_ms=runtime.clock(),
            memory=memory_of(runtime),
            digest=record_digest(message.key, restore_null_value(message.value, header_pairs(message.headers))),
        )
        if after != before:
            runtime.store.save(key, before, after)
            await runtime.store.confirm()
    except Exception:
        log.exception("could not remember %s as ended", PendingMessage.origin_of(parsed.provenance))


async def reject(
    runtime: Runtime,
    record: TierRecord,
    reason: Reason,
    provenance: Provenance,
    attempt: int,
    error_class: str,
    error_message: str,
) -> None:
    await still_ours(runtime, record.message)
    await dead_letter(
        runtime,
        DeadLetter(failed_topic(record.tier.main_topic), reason),
        key=record.message.key,
        value=record.value,
        headers=record.headers,
        provenance=provenance,
        attempt=attempt,
        tier=record.tier.label,
        error_class=error_class,
        error_message=error_message,
    )


async def take_back(runtime: Runtime, written: tuple[bytes, KeyState, KeyState], attempt: int, message: Any) -> bool:
    """Remove a park whose changelog record was refused, so the message ends only on the failed topic.

    Done under the key's lock and on a fresh read (the confirm awaited: the key may have changed since); only this
    entry is removed, and only if it is still there. False if it is gone already (released): then it has ended.
    :class:`PartitionMoved` if the lease lapsed or the partition moved during the confirm or the lock's wait (asked
    before the read, so nothing written meanwhile is overwritten).
    """
    key, _, after = written
    origin = after.pending[-1].origin
    partition = message.partition
    async with runtime.key_locks.hold(key):
        await still_ours(runtime, message)
        current = runtime.store.load(key, origin=origin)
        entry = current.find(origin)
        if entry is None or entry.attempt != attempt:
            return False
        runtime.store.save(key, current, current.without({origin}))
        runtime.schedule.confirm(partition, key, origin, attempt)
        runtime.schedule.discard(partition, {(key, origin, attempt)})
        await runtime.store.confirm()
        return True


def _key_parked_under(runtime: Runtime, key: bytes | None, provenance: Provenance, origin: str) -> bytes:
    """The table key for this message: the escaped one, or the raw one an earlier version parked this origin under.

    The raw form is never the null key of this origin: that one belongs to a null-keyed record.
    """
    escaped = table_key(key, provenance)
    legacy = legacy_table_key(escaped)
    if legacy is None or legacy == null_table_key(provenance):
        return escaped
    if runtime.store.entry(legacy, origin) is not None:
        return legacy
    return escaped


@dataclass(frozen=True)
class EndedBlocking:
    """A retry :func:`park` refused because its message ended, in key-ordered mode while the key is still blocked by
    that message: nothing else would lift the block (the message will not settle again), so the caller does."""

    table_key: bytes
    origin: str


def park(
    runtime: Runtime, record: TierRecord, parsed: RetryHeaders
) -> tuple[bytes, KeyState, KeyState] | EndedBlocking | None:
    """Write the message into the state table and the release schedule; the key and its states before and after.

    None if it was already parked, or is refused as a duplicate (:class:`EndedBlocking` if the key waits for it).

    A record delivered again for an entry already parked writes that entry again, because the first write may
    never have reached the changelog (see :meth:`RetryStore.rewrite_parked`).
    """
    message, tier = record.message, record.tier
    entry = PendingMessage(
        origin=PendingMessage.origin_of(parsed.provenance),
        key=message.key,
        value=record.value,
        headers=tuple(without_rebound_headers(record.headers)),
        provenance=parsed.provenance,
        attempt=parsed.attempt,
        tier=tier.label,
        tier_topic=tier.topic,
        partition=message.partition,
        due_at_ms=parsed.due_at_ms,
        parked_at_ms=runtime.clock(),
        error_class=parsed.error_class,
        error_message=parsed.error_message[:STATE_ERROR_CHARS],
        value_size=None if record.value is None else len(record.value),
    )
    key = _key_parked_under(runtime, message.key, parsed.provenance, entry.origin)
    before = runtime.store.load(key, origin=entry.origin)
    digest = record_digest(message.key, record.value)
    now, memory = runtime.clock(), memory_of(runtime)
    known = tier_duplicate(before, parsed.provenance, parsed.attempt, now_ms=now, memory=memory, digest=digest)
    if known in (Known.ENDED, Known.FORWARDED):
        # A copy of a retry whose message ended (the copy read after the first one settled), or of an older
        # attempt than the one on its way: running it would start a second lifecycle.
        runtime.counters["tier.duplicates"] += 1
        runtime.counters[f"tier.duplicates_{known}"] += 1
        log.info("%s attempt %d read again, its message %s already: not parked", entry.origin, entry.attempt, known)
        if known is Known.ENDED and runtime.settings.key_ordered and before.blocked_by == entry.origin:
            return EndedBlocking(key, entry.origin)
        return None
    if before.parked >= runtime.settings.max_pending_per_key and before.find(entry.origin) is None:
        raise KeyBacklogFullError(f"key already has {before.parked} parked messages (REBOUND_MAX_PENDING_PER_KEY)")
    state, changed = before.park(entry)
    if not changed:
        runtime.counters["tier.duplicates"] += 1
        current = before.find(entry.origin)
        if current is not None and current.attempt == entry.attempt:
            runtime.store.rewrite_parked(key, entry)
        return None
    runtime.store.save(key, before, state)
    runtime.schedule.add(message.partition, Slot(entry.due_at_ms, key, entry.origin, entry.attempt, tier.label))
    runtime.release_wakeup.set()
    runtime.counters["parked"] += 1
    runtime.metrics.parked.labels(tier.main_topic, tier.label).inc()
    return key, before, state
