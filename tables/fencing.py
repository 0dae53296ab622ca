"""Writer epochs on Faust tables (``rebound/fencing.py`` says why): stamping, claiming, and skipping on replay.

Plugged into each table through the methods Faust itself calls: ``send_changelog`` for every write,
``apply_changelog_batch`` for every replayed batch (recovery and standbys), ``on_changelog_event`` for every record
the replay takes, ``on_rebalance`` before a recovery, ``persisted_offset`` where recovery starts,
``on_recovery_completed`` once a recovery is done. The marker of a partition is also a record of the table, so a store
reused after a restart knows the last epoch without reading the changelog again. What landed between a recovery's high
watermark and its claim's marker is read with a group-less consumer (``changelog_reader``, made by the app as its
other readers are) and written over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from rebound.backoff import backoff_s
from rebound.fencing import (
    PartitionReplay,
    decode_replay_point,
    describe_epoch,
    encode_epoch,
    encode_replay_point,
    epoch_key,
    is_epoch_key,
    next_claim,
    record_epoch,
    replay_point_key,
)
from rebound.headers import WRITER_EPOCH

log = logging.getLogger(__name__)

READ_FROM_THE_START = -1
"""What ``persisted_offset`` answers Faust for a replay from the start. Not ``None``: for a partition the worker
keeps across a rebalance, Faust would then go on from where its last recovery stopped."""

SPAN_STALL_S = 40.0
"""How long the read of the span between a recovery's high watermark and its claim's marker may go without getting
further before it is logged and goes on with a new consumer: aiokafka's consumer request timeout (its default, which
the app's group-less readers keep). A partition without a leader makes the consumer answer every fetch with nothing,
for ever, and logs nothing, while all of this worker's streams wait on the claim; past a request timeout the client
itself would have given a request up. A slow read that gets further is not cut short."""


class TableFence:
    """One table's writer epochs, per partition."""

    def __init__(self, table: Any, member_id: Callable[[], str | None], changelog_reader: Callable[[], Any]) -> None:
        """``changelog_reader`` makes an aiokafka consumer outside any group, not started, with the app's bootstrap
        and client settings (``agents/readers.py``'s ``groupless_consumer``): made only when a claim's marker did not
        land right after its recovery's high watermark (:meth:`_write_over_the_spans`)."""
        self.table = table
        self._member_id = member_id
        self._changelog_reader = changelog_reader
        self._member: str | None = None
        self._claimed: dict[int, int] = {}
        self._replays: dict[int, PartitionReplay] = {}
        self._points_here: set[int] = set()
        self.records_skipped = 0
        """Records written by an owner already superseded when they landed, left out of a replay. This counter and
        the four below are exported per table by ``agents/metrics.py`` (``rebound_fence_*``)."""
        self.records_deferred = 0
        """Replayed records past their recovery's high watermark, left to the next recovery (``_past_the_recovery``)."""
        self.records_fetched_before = 0
        """Records fetched before the group's last rebalance that reached a replay after it, left out and read again
        (:meth:`on_changelog_event`)."""
        self.records_before_the_marker = 0
        """Records read between a recovery's high watermark and its claim's marker (:meth:`_write_over_the_spans`)."""
        self.keys_written_over_the_span = 0
        """Keys of those records written again after the marker (those the claim wrote again already not counted)."""
        self._taken: dict[Any, int] = {}
        """Per changelog partition, the last offset the replay took: where recovery started, or a record since."""
        self._on_changelog_event = table.on_changelog_event
        self._apply = table.apply_changelog_batch
        self._on_recovery_completed = table.on_recovery_completed
        self._on_rebalance = table.on_rebalance
        table.on_rebalance = self.on_rebalance
        table.send_changelog = self.send_changelog
        table.apply_changelog_batch = self.apply_changelog_batch
        table.persisted_offset = self.persisted_offset
        table.on_recovery_completed = self.on_recovery_completed
        table.on_changelog_event = self.on_changelog_event

    def writer_epoch(self, partition: int | None) -> int:
        """The epoch this worker's writes to ``partition`` carry: its claim, else the highest it has read.

        Never none: a record without an epoch is applied by every replay, and a worker that noticed its eviction may
        still resend old writes (``RetryStore`` resends failed ones).
        """
        if partition is None:
            return 0
        claimed = self._claimed.get(partition)
        if claimed is not None:
            return claimed
        replay = self._replays.get(partition)
        return replay.epoch if replay is not None else 0

    def send_changelog(
        self,
        partition: int | None,
        key: Any,
        value: Any,
        key_serializer: Any = None,
        value_serializer: Any = None,
    ) -> Any:
        """Faust's ``send_changelog`` with the writer's epoch in a header."""
        table = self.table
        return table.changelog_topic.send_soon(
            key=key,
            value=value,
            partition=partition,
            headers=[(WRITER_EPOCH, encode_epoch(self.writer_epoch(partition)))],
            key_serializer=key_serializer if key_serializer is not None else table.key_serializer,
            value_serializer=value_serializer if value_serializer is not None else table.value_serializer,
            callback=table._on_changelog_sent,
            eager_partitioning=True,
        )

    async def on_rebalance(self, assigned: Any, revoked: Any, newly_assigned: Any, generation_id: int = 0) -> None:
        """Forget the replay point of every changelog partition taken from this worker, then Faust's.

        The point carries this worker's claim, which makes everything that landed after it read older than its copy:
        true while it owns the partition, not once another owner has read that tail from the start and accepted it (a
        previous owner's records that landed before this worker's marker). Resumed there on getting the partition
        back, it would skip them and, at its next claim, write its own older copy over what that owner acted on (a
        settled held message back in the table). Faust calls this before the recovery asks where to start.
        """
        changelog_topics = self.table.changelog_topic.topics
        for tp in revoked:
            if tp.topic in changelog_topics:
                self._points_here.discard(tp.partition)
        await self._on_rebalance(assigned, revoked, newly_assigned, generation_id)

    def persisted_offset(self, tp: Any) -> int | None:
        """Where recovery starts: the partition's replay point, with its epoch (a claim's, or the highest marker read).

        Not Faust's own offset, which for an owner is its last acknowledged write: records of others that landed
        between its writes (late writes) would never be read, and compaction could leave one as its key's only
        record. The point is where this process last read to (a recovery's end, a replayed batch), so an owner reads
        its own writes since its claim again, at that cost.

        A local copy this process has not rebuilt itself (after a restart: it may hold this worker's own writes that
        landed late and that every replay skips; after an eviction: the same) is emptied and read from the start, and
        so is one of a partition taken from this worker since (:meth:`on_rebalance`).
        """
        self._notice_member_change()
        partition = tp.partition
        point = self._point(partition) if partition in self._points_here else None
        previous = self._replays.get(partition)
        if point is None:
            _wipe_partition(self.table, partition)
            self._replays[partition] = PartitionReplay()
            self._taken[tp] = READ_FROM_THE_START
            return READ_FROM_THE_START
        offset, epoch = point
        # keys skipped before the point are not read again, but must still be written over at the next claim
        carried = {key: at for key, at in previous.overruled.items() if at <= offset} if previous else {}
        self._replays[partition] = PartitionReplay(epoch=epoch, overruled=carried)
        self._taken[tp] = offset
        return offset

    async def on_changelog_event(self, event: Any) -> None:
        """Faust's, for a record its replay takes; a record fetched before the group's last rebalance is given back.

        Faust's replay takes every record above the last offset it took, and drops the others as read. A rebalance
        clears the changelog queue, but not a record the conductor was still waiting to put there (the queue was full,
        and the put waits for the flow to resume): the next recovery resumes it, ahead of the records it fetches again
        from where the replay stopped. Taken, its offset would hide those records, which Faust then drops: the copy
        would lack them (a chaos run kept payloads whose deletions it never applied, and claimed below a newer
        owner's marker) while the partition counted as read to its high watermark. Such a record is removed from the
        replay's buffer and the partition's offset set back to the last one taken, so the records fetched again are
        all applied, this one among them.
        """
        message = event.message
        generation = getattr(message, "generation_id", None)
        if generation is None or generation == self.table.app.consumer_generation_id:
            self._taken[message.tp] = message.offset
            await self._on_changelog_event(event)
            return
        self.records_fetched_before += 1
        recovery = self.table.app.tables.recovery
        buffer = recovery.buffers[self.table]
        for index in range(len(buffer) - 1, -1, -1):
            if buffer[index] is event:
                del buffer[index]
                break
        offsets = recovery.active_offsets if message.tp in recovery.active_tps else recovery.standby_offsets
        offsets[message.tp] = self._taken.get(message.tp, READ_FROM_THE_START)
        log.warning(
            "rebound: %s[%d] offset %d: a record fetched in generation %s reached the replay of generation %s; left "
            "out, and read again after offset %d",
            self.table.name,
            message.partition,
            message.offset,
            generation,
            self.table.app.consumer_generation_id,
            offsets[message.tp],
        )

    def _point(self, partition: int) -> tuple[int, int] | None:
        if not _is_rocksdb(self.table):
            return None  # the memory store keeps nothing across restarts: every recovery reads from the start
        return decode_replay_point(_store_get(self.table, partition, replay_point_key(partition)))

    def _notice_member_change(self) -> None:
        """The group gives a member a new id only after dropping it from a generation (an eviction, a fenced
        request) or after it left: its local copies may then hold its own late writes, so none is trusted."""
        member = self._member_id()
        if member is None or member == self._member:
            return
        if self._member is not None:
            log.warning(
                "rebound: %s: this worker was dropped from the group (its member id changed); its local copies of "
                "the table will be read again from the changelog's start",
                self.table.name,
            )
            self._points_here.clear()
        self._member = member

    def apply_changelog_batch(self, batch: Iterable[Any]) -> None:
        """Faust's replay, without the records written by an owner already superseded when they landed, and without
        those past the recovery's high watermark (:meth:`_past_the_recovery`), which the claim writes over like the
        skipped ones."""
        kept = []
        last_offsets: dict[Any, int] = {}
        highwaters = self.table.app.tables.recovery.active_highwaters
        for event in batch:
            message = event.message
            if _past_the_recovery(highwaters, message.tp, message.offset):
                self.records_deferred += 1
                if message.key is not None and not is_epoch_key(message.key):
                    # every reader from the start applies it, this copy does not: the claim writes the copy over it
                    self._replay(message.partition).overruled.setdefault(message.key, message.offset)
                continue
            last_offsets[message.tp] = max(message.offset, last_offsets.get(message.tp, -1))
            replay = self._replay(message.partition)
            epoch = record_epoch(message.headers)
            if replay.keep(message.key, message.value, epoch, message.offset):
                kept.append(event)
                continue
            self.records_skipped += 1
            log.warning(
                "rebound: %s[%d] offset %d: skipped a write of epoch %s that landed after epoch %s was claimed",
                self.table.name,
                message.partition,
                message.offset,
                describe_epoch(epoch),
                describe_epoch(replay.epoch),
            )
        if kept:
            self._apply(kept)
        for tp, offset in last_offsets.items():  # skipped records at the end are read, not to be read again
            self.table.data.set_persisted_offset(tp, offset)
            self._save_point(tp.partition, offset, self._replay(tp.partition).epoch)

    def _save_point(self, partition: int, offset: int, epoch: int) -> None:
        if offset >= 0 and _is_rocksdb(self.table):
            _store_put(self.table, partition, replay_point_key(partition), encode_replay_point(offset, epoch))
            self._points_here.add(partition)

    def _replay(self, partition: int) -> PartitionReplay:
        replay = self._replays.get(partition)
        if replay is None:
            point = self._point(partition) if partition in self._points_here else None
            replay = self._replays[partition] = PartitionReplay(epoch=point[1] if point is not None else 0)
        return replay

    async def on_recovery_completed(self, active_tps: Any, standby_tps: Any) -> None:
        """Faust's, then the claim of every active partition read to the end, acknowledged before streams resume.

        A failure here ends the worker: Faust would resume the streams anyway (it gathers the tables' completions
        with ``asyncio.wait``, which keeps their exceptions), and writes without a claim could be overruled.
        """
        await self._on_recovery_completed(active_tps, standby_tps)
        try:
            read, generation = self._read_to_the_end(active_tps)
            if len(read) < len(active_tps):
                log.info(
                    "rebound: %s: recovery reported complete with partitions %s not read to the end (a newer "
                    "rebalance interrupted it); their claims wait for the recovery that reads them",
                    self.table.name,
                    sorted(tp.partition for tp in active_tps if tp not in read),
                )
            # the last offsets read (-1: an empty changelog), taken before a newer recovery can build its own
            highwaters = {tp.partition: int(self.table.app.tables.recovery.active_highwaters[tp]) for tp in read}
            records = self.claim((tp.partition for tp in read), generation)
            for partition, highwater in highwaters.items():  # where the next recovery reads again (persisted_offset)
                if highwater >= 0:  # with the claim's epoch: what landed after it read is older than its copy
                    self._save_point(partition, highwater, self._replay(partition).epoch)
            acknowledged = await self._send_acknowledged(records, generation)
            if acknowledged is not None:
                await self._write_over_the_spans(highwaters, records, acknowledged, generation)
        except Exception as exc:
            log.exception("rebound: %s: claiming writer epochs failed; stopping the worker", self.table.name)
            await self.table.app.crash(exc)
            raise

    def _read_to_the_end(self, active_tps: Any) -> tuple[list[Any], int]:
        """The active partitions whose changelog this recovery read up to its high watermark, and its generation.

        Faust calls the tables' completion for a recovery a newer rebalance interrupted (before it checks the
        generation and returns without resuming the streams), with the new assignment's partitions, some half read;
        and it takes the new generation before it signals the recovery to start again. A claim there would be based
        on part of the log (skipping the rest as older than the claim), or carry a generation it was not given.
        """
        recovery = self.table.app.tables.recovery
        generation = int(recovery._generation_id)
        if self._superseded(generation):
            return [], generation
        remaining = recovery.active_remaining()
        read = [tp for tp in active_tps if tp in recovery.active_highwaters and remaining.get(tp, 0) <= 0]
        return read, generation

    def _superseded(self, generation: int) -> bool:
        """Whether a newer rebalance than the one of the recovery of ``generation`` started: signalled, or the
        worker's or the recovery's generation moved on.

        The signal alone is not enough past the recovery's end. At a newer rebalance Faust cancels its wait for the
        tables' completions, not the completions themselves, so a claim runs on by itself; and the recovery that
        starts clears the signal a few loop turns after it was set, so a claim that looks between two awaits hardly
        ever sees it. A claim gone on would write, with an epoch the group no longer backs, from a copy that
        recovery may have emptied already.
        """
        app = self.table.app
        recovery = app.tables.recovery
        return (
            recovery.signal_recovery_start.is_set()
            or app.consumer_generation_id != generation
            or int(recovery._generation_id) != generation
        )

    def claim(self, partitions: Iterable[int], generation: int) -> list[tuple[int, bytes, bytes | None]]:
        """Claim the next epoch of each partition this worker now owns; answer the records that say so.

        After the marker, a key whose last record read was skipped, or left out past the recovery's high watermark, is
        written again from the local copy (a deletion if it has none), so compaction, which keeps only a key's last
        record, cannot leave the skipped record as the key's only one, and no reader applies a record this copy
        lacks. The local copy is one this process rebuilt (``persisted_offset``), so it holds what the
        changelog's rightful records say. What landed between the high watermark and the marker, which no fetch read,
        is written over once the marker's offset is known (:meth:`_write_over_the_spans`).
        """
        claimed: dict[int, str] = {}
        records: list[tuple[int, bytes, bytes | None]] = []
        for partition in sorted(partitions):
            replay = self._replay(partition)
            epoch = next_claim(max(replay.epoch, self._claimed.get(partition, 0)), generation)
            self._claimed[partition] = epoch
            claimed[partition] = describe_epoch(epoch)
            records.append((partition, epoch_key(partition), encode_epoch(epoch)))
            records.extend((partition, key, _store_get(self.table, partition, key)) for key in sorted(replay.overruled))
            self._replays[partition] = PartitionReplay(epoch=epoch)
        if claimed:
            log.info(
                "rebound: %s: writer epochs claimed (partition: round.generation) %s; %d key(s) whose last record "
                "was skipped or left out written again",
                self.table.name,
                claimed,
                len(records) - len(claimed),
            )
        return records

    async def _send_acknowledged(
        self, records: list[tuple[int, bytes, bytes | None]], generation: int
    ) -> list[Any] | None:
        """Send the claim's records and wait for the broker's acknowledgements, sending a failed one again with the
        same value (not the key's value at that time: a later recovery may be rewriting the local copy). Given up
        (None) when a rebalance newer than ``generation``'s starts (:meth:`_superseded`): the recovery that follows
        claims again. Answers each record's acknowledgement (Faust's ``RecordMetadata``), in the order of
        ``records``."""
        acknowledged: list[Any] = [None] * len(records)
        pending = [(index, self._send_raw(*record)) for index, record in enumerate(records)]
        failures = 0
        while pending:
            index, future = pending.pop(0)
            try:
                acknowledged[index] = await asyncio.shield(future)
                continue
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
            except Exception as exc:
                log.warning("rebound: %s: a claim record failed (%r); sending it again", self.table.name, exc)
            failures += 1
            await asyncio.sleep(backoff_s(failures))  # the rebalance may come during the backoff: looked at after it
            if self._superseded(generation):
                self._given_up(generation)
                return None
            pending.append((index, self._send_raw(*records[index])))
        return acknowledged

    async def _write_over_the_spans(
        self,
        highwaters: dict[int, int],
        records: list[tuple[int, bytes, bytes | None]],
        acknowledged: list[Any],
        generation: int,
    ) -> None:
        """Write again, after each claimed partition's marker, the keys of the records that landed between the high
        watermark its recovery read to and that marker.

        Such a record (a previous owner's last write, sent when it woke) is in no fetch of the recovery, so not in
        this copy, and not past the marker, so every later reader from the start (another worker, this one after
        an eviction) applies it: the chaos run of 92f73b4 lost three messages to a key blocked that way, by a message
        this owner had run as a free key. The claimer has written nothing but its claim yet (its streams resume
        after this), so its copy is what the key must be: written again after the marker, every reader ends with it.
        A marker right after the high watermark (the common case) reads nothing and makes no consumer.
        """
        markers: dict[int, int] = {}
        written_at: dict[tuple[int, bytes], int] = {}
        for (partition, key, _value), ack in zip(records, acknowledged, strict=True):
            offset = getattr(ack, "offset", None)
            if not isinstance(offset, int) or offset < 0:  # acks=-1 always answers one: never seen
                if is_epoch_key(key):
                    raise RuntimeError(f"the writer-epoch marker of partition {partition} was acknowledged as {ack!r}")
                offset = -1  # taken as before the marker: the key is written again if the span holds it
            if is_epoch_key(key):
                markers[partition] = offset
            else:
                written_at[partition, key] = offset
        spans: dict[int, list[bytes]] = {}
        for partition, marker in sorted(markers.items()):
            start = highwaters[partition] + 1
            if marker <= start:
                continue
            found = await self._read_span(partition, start, marker, generation)
            if found is None:
                return  # a newer rebalance: see _read_span
            spans[partition] = found
        if not spans:
            return
        if self._superseded(generation):  # the copy may be another recovery's by now: nothing built from it
            self._given_up(generation)
            return
        rewrites: list[tuple[int, bytes, bytes | None]] = []
        for partition, found in spans.items():
            marker = markers[partition]
            # a key the claim wrote after the marker is written over already; not one it wrote before it (the marker
            # sent again after its first send failed: the claim's rewrite, then a stale record, then the marker)
            keys = sorted(
                {key for key in found if not is_epoch_key(key) and written_at.get((partition, key), -1) < marker}
            )
            self.records_before_the_marker += len(found)
            self.keys_written_over_the_span += len(keys)
            log.warning(
                "rebound: %s[%d]: %d record(s) landed between the recovery's high watermark %d and the claim's "
                "marker at %d; %d key(s) written again after it",
                self.table.name,
                partition,
                len(found),
                highwaters[partition],
                marker,
                len(keys),
            )
            rewrites.extend((partition, key, _store_get(self.table, partition, key)) for key in keys)
        if rewrites:  # built and sent in this loop turn: no newer recovery in between
            await self._send_acknowledged(rewrites, generation)

    async def _read_span(self, partition: int, start: int, end: int, generation: int) -> list[bytes] | None:
        """The keys of the changelog records of ``partition`` from ``start`` up to ``end`` (not included); None if a
        rebalance newer than ``generation``'s started (:meth:`_superseded`, looked at before each fetch and after the
        last). The claim is then void like one given up: the recovery that follows reads the partition again, from
        this claim's point if the partition stays here, where these records are older than the claim and written over
        at the next claim.

        A compacted or truncated span has fewer records, or none: what is gone is gone for every reader too. A
        retriable Kafka error, a lost connection, or no progress for :data:`SPAN_STALL_S` (logged) is retried with
        backoff and a new consumer, from where the read got to, until the span is read or a newer rebalance starts;
        any other error is raised, and stops the worker like a failed claim: resuming the
        streams would let this owner act on keys every other reader sees otherwise, and the next owner reads the
        partition from the start, records and marker alike, before it acts on any.
        """
        from aiokafka import TopicPartition

        tp = TopicPartition(self.table.changelog_topic.get_topic_name(), partition)
        clock = asyncio.get_running_loop().time
        keys: list[bytes] = []
        position = start  # the next offset to read
        failures = 0
        while not self._superseded(generation):
            consumer = self._changelog_reader()
            try:
                await consumer.start()
                consumer.assign([tp])
                consumer.seek(tp, position)
                moved_at = clock()
                while position < end:
                    if self._superseded(generation):
                        self._given_up(generation)
                        return None
                    fetched = await consumer.getmany(tp, timeout_ms=500)
                    reached = position
                    for record in fetched.get(tp, ()):
                        if reached <= record.offset < end and record.key is not None:
                            keys.append(record.key)
                        reached = max(reached, record.offset + 1)
                    reached = max(reached, await consumer.position(tp))  # past records it does not answer
                    if reached > position:
                        position, moved_at = reached, clock()
                    elif clock() - moved_at >= SPAN_STALL_S:
                        log.warning(
                            "rebound: %s[%d]: reading the changelog between offsets %d and %d made no progress at "
                            "offset %d for %.0f s (no leader?); reading on with a new consumer",
                            self.table.name,
                            partition,
                            start,
                            end,
                            position,
                            clock() - moved_at,
                        )
                        break
                else:
                    if self._superseded(generation):  # during the last fetch
                        self._given_up(generation)
                        return None
                    return keys
            except Exception as exc:
                if not _retriable(exc):
                    raise
                log.warning(
                    "rebound: %s[%d]: reading the changelog between offsets %d and %d failed (%r); reading again",
                    self.table.name,
                    partition,
                    start,
                    end,
                    exc,
                )
            finally:
                await consumer.stop()
            failures += 1
            await asyncio.sleep(backoff_s(failures))
        self._given_up(generation)
        return None

    def _given_up(self, generation: int) -> None:
        log.info(
            "rebound: %s: a newer rebalance started (generation %s, recovery's %s) during the claim of generation %d; "
            "given up: the recovery that follows claims again",
            self.table.name,
            self.table.app.consumer_generation_id,
            self.table.app.tables.recovery._generation_id,
            generation,
        )

    def _send_raw(self, partition: int, key: bytes, value: bytes | None) -> Any:
        """Stamped, and not through ``RetryStore``'s confirmation, whose resends would read the local copy."""
        return self.send_changelog(partition, key, value, value_serializer="raw")


def _retriable(exc: BaseException) -> bool:
    """A Kafka error its client calls retriable (a leader moving, a request timing out), or a lost connection."""
    from aiokafka.errors import KafkaError, KafkaTimeoutError

    if isinstance(exc, KafkaError):
        return bool(exc.retriable) or isinstance(exc, KafkaTimeoutError)  # aiokafka's own wait ran out: not marked
    return isinstance(exc, OSError | TimeoutError)


def _past_the_recovery(highwaters: Any, tp: Any, offset: int) -> bool:
    """Whether a replayed record of an active partition lies past the high watermark its recovery reads to.

    Faust applies every changelog record it fetched, and a fetch can run past the high watermark taken when the
    recovery started: records of the previous owner's last moments (a worker frozen and evicted while it drained
    its revocation runs on when it wakes). The two tables are fetched separately, so such a tail was applied in one
    and not the other, or applied before the claim in one and skipped after it in the other: a chaos run dead-lettered
    8 succeeded held messages as ``payload-missing`` (their payloads' deletions applied, the states that ended them
    skipped). Left out, both tables are the changelog as it stood at one moment; the claim writes their keys again
    from this copy after its marker (a reader from the start applies them: they landed before it), and its epoch,
    which the replay point carries, makes that tail older than every write of this owner when it is read again.
    """
    highwater = highwaters.get(tp)
    return highwater is not None and offset > highwater


def _is_rocksdb(table: Any) -> bool:
    return hasattr(table.data, "_db_for_partition")


def _store_get(table: Any, partition: int, key: bytes) -> bytes | None:
    store = table.data
    db_for = getattr(store, "_db_for_partition", None)
    if db_for is not None:  # RocksDB: one database per partition
        return db_for(partition).get(key)  # type: ignore[no-any-return]
    return store.data.get(key)  # type: ignore[no-any-return]


def _store_put(table: Any, partition: int, key: bytes, value: bytes) -> None:
    """Write the local copy only (no changelog record): Faust's own store writes need a current stream event."""
    store = table.data
    db_for = getattr(store, "_db_for_partition", None)
    if db_for is not None:
        db_for(partition).put(key, value)
        store._key_index[key] = partition
    else:
        store.data[key] = value


def _wipe_partition(table: Any, partition: int) -> None:
    """Empty the local copy of a partition before it is read from the start.

    A RocksDB store keeps one database per partition; the memory store (tests, the demo) keeps all partitions in
    one dict, where only the marker is removed (the replay overwrites every key the changelog holds).
    """
    store = table.data
    db_for = getattr(store, "_db_for_partition", None)
    if db_for is not None:
        db = db_for(partition)
        for key in list(db.keys()):
            db.delete(key)
        return
    store.data.pop(epoch_key(partition), None)


def is_internal_key(key: bytes) -> bool:
    """Keys the fence keeps in a table next to the data (every scan of the table skips them)."""
    return is_epoch_key(key)
