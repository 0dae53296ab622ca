"""The changelog-backed retry state: per-key metadata in ``retry_state``, message bytes in ``retry_payloads``.

Both tables are co-partitioned with the main topics and written in the same stream iteration, so a key's metadata
and its messages' payloads always live in the same partition. Writes must happen inside a stream iteration (Faust
takes the changelog partition from the current event), so only the tier and release agents write; timers and views
only read.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import faust
from faust.stores.base import SerializedStore

from rebound.backoff import backoff_s
from rebound.errors import KeyBacklogFullError, RecordTooLargeError
from rebound.ordering import HELD_PAYLOAD_PREFIX, is_unsettled
from rebound.records import estimated_record_bytes
from rebound.settings import Settings
from rebound.state import (
    KeyState,
    LifecycleMemory,
    PendingMessage,
    forget_expired,
    is_entry_record,
    legacy_table_key,
    payload_key,
    split_entry,
    survey_fields,
)
from tables.fencing import is_internal_key
from tables.kafka_errors import is_too_large
from tables.rocksdb_tuning import install as install_rocksdb_tuning

log = logging.getLogger(__name__)

STATE_TABLE = "retry_state"
PAYLOAD_TABLE = "retry_payloads"


def _payload_origin(origin: str, *, held: bool) -> str:
    return HELD_PAYLOAD_PREFIX + origin if held else origin


def _payload_entries(table_key: bytes, state: KeyState) -> dict[bytes, tuple[PendingMessage, bool]]:
    """The payload-table key of every message of the state, with the message and whether it is a held one."""
    entries = {payload_key(table_key, entry.origin): (entry, False) for entry in state.pending}
    for entry in state.held:
        entries[payload_key(table_key, _payload_origin(entry.origin, held=True))] = (entry, True)
    return entries


def _stored(table: Any, key: bytes) -> Any:
    """``table.get(key)`` in one lookup of a serializing store (RocksDB): the same value, read once.

    Through the table, a read is a membership test and then the read itself (two RocksDB gets), a table-get sensor
    call, and a ``KeyError`` raised and caught for a missing key; every mark, park and release reads its key's
    index and entry this way. Other stores (``memory://``, tests' fakes) are read through the table as before.
    """
    store = getattr(table, "data", None)
    if isinstance(store, SerializedStore):
        raw = store._get(store._encode_key(key))
        return None if raw is None else store._decode_value(raw)
    return table.get(key)


def _with_entry(state: KeyState, origin: str, raw: bytes | None) -> KeyState:
    """A key's index with the one parked message ``origin`` decoded from its record ``raw`` (None: it has none)."""
    if raw is not None and is_entry_record(raw):
        entry = PendingMessage.from_entry(raw)
        return replace(state, pending=(entry,), others=max(0, state.others - 1), loaded=frozenset({origin}))
    return replace(state, pending=(), loaded=frozenset({origin}))


def _items(
    table: Any, *, prefix: bytes = b"", partition: int | None = None, partitions: frozenset[int] | None = None
) -> Iterator[tuple[bytes, bytes]]:
    """A table's local records starting with ``prefix``, from the given partitions' databases only.

    The RocksDB store keeps one database per partition, so a key's records are one seek away and a rebuild reads
    only the partitions it adopts. Stores without that split (``memory://``, tests) are scanned whole; their
    callers filter by the partition their records carry.
    """
    wanted = frozenset({partition}) if partition is not None else partitions
    store = getattr(table, "data", None)
    databases = getattr(store, "_dbs", None)
    if not isinstance(databases, dict):
        for key, value in list(table.items()):
            if key.startswith(prefix):
                yield key, value
        return
    offset_key = getattr(store, "offset_key", None)
    for number, database in list(databases.items()):
        if wanted is not None and number not in wanted:
            continue
        for key, value in database.items(from_key=prefix):
            if not key.startswith(prefix):
                break
            if key != offset_key:
                yield key, value


def _chunk(
    table: Any, partition: int, after: bytes | None, limit: int
) -> tuple[list[tuple[bytes, bytes]], bytes | None]:
    """Up to ``limit`` records of one partition after the key ``after``, and where to go on from (None: the end).

    For walks that yield to the event loop between chunks: nothing here outlives the call (no iterator, no database
    handle), so a partition revoked meanwhile is not held open. A store without per-partition databases
    (``memory://``) is read whole in one chunk.
    """
    store = getattr(table, "data", None)
    databases = getattr(store, "_dbs", None)
    if not isinstance(databases, dict):
        return (list(table.items()) if after is None else []), None
    database = databases.get(partition)
    if database is None:
        return [], None
    offset_key = getattr(store, "offset_key", None)
    records: list[tuple[bytes, bytes]] = []
    for key, value in database.items(from_key=after or b""):
        if key in (after, offset_key):
            continue
        records.append((key, value))
        if len(records) >= limit:
            return records, key
    return records, None


def _create_table(app: faust.App, settings: Settings, partitions: int, name: str, help_text: str) -> Any:
    table = app.Table(
        name,
        default=None,
        partitions=partitions,
        key_type=bytes,
        value_type=bytes,
        help=help_text,
    )
    install_rocksdb_tuning(table, settings)
    return table


def create_state_table(app: faust.App, settings: Settings, partitions: int) -> Any:
    help_text = "Retry state per key: pending messages' metadata, attempts, first failure, next due, tier, last error."
    return _create_table(app, settings, partitions, STATE_TABLE, help_text)


def create_payload_table(app: faust.App, settings: Settings, partitions: int) -> Any:
    help_text = "Bytes (key, value, headers) of each parked message, by origin topic/partition/offset."
    return _create_table(app, settings, partitions, PAYLOAD_TABLE, help_text)


class Loaded(NamedTuple):
    """A key's state with one parked message, as :meth:`RetryStore.read` decoded it, and the records it came from:
    the key's index and the message's own record (as the store's writers see it: None if gone or being deleted)."""

    table_key: bytes
    origin: str
    state: KeyState
    index_raw: bytes | None
    entry_raw: bytes | None


class ChangelogRefusedError(RecordTooLargeError):
    """Changelog records the broker refused as too large, twice: :attr:`keys` names them, so a writer that confirms
    many messages' writes at once (a tier agent's group commit) can tell which of its messages they concern."""

    def __init__(self, message: str, keys: frozenset[bytes]) -> None:
        super().__init__(message)
        self.keys = keys


@dataclass(frozen=True)
class _Write:
    """One changelog record its writer has not yet seen acknowledged, with what it takes to write it again."""

    table: Any
    send: Any
    partition: Any
    key: Any
    options: dict[str, Any]
    future: Any
    refused_once: bool = False

    def again(self, *, refused: bool = False) -> _Write:
        """Write the key's *current* local value again (a tombstone if it is gone), never the one captured earlier.

        aiokafka can fail one batch for good while later batches of the partition go through: resending an old value
        could land after a newer one and bring back a state the key no longer has.
        """
        current = self.table.get(self.key)
        options = {**self.options, "value_serializer": "raw"} if current is None else self.options
        future = self.send(self.partition, self.key, current, **options)
        return replace(self, future=future, refused_once=self.refused_once or refused)


@dataclass
class RetryStore:
    """Reads and writes a key's state together with its messages' payloads, and confirms the changelog writes.

    A Faust table write only queues its changelog record, and Faust's pre-commit flush may return before the queue
    is empty. The agents therefore ``await confirm()`` before moving on, so no source offset is committed while the
    record that makes the state durable could still be lost. Every write is size-checked first: Faust produces
    changelog records from a background buffer, and a record the producer refuses there stops that buffer (and with
    it every table write) for the whole worker.
    """

    states: Any
    payloads: Any
    max_record_bytes: int = 1_048_576
    confirm_writes: bool = True
    _unconfirmed: dict[asyncio.Task[Any] | None, list[_Write]] = field(default_factory=dict)
    blocked: dict[int, dict[bytes, int]] = field(default_factory=dict)
    """Key-ordered mode: per partition, every blocked key and how many messages it holds, kept as states are saved
    (and rebuilt when a partition is adopted), so the views count without scanning."""
    parked_per_tier: dict[int, dict[str, int]] = field(default_factory=dict)
    """Per adopted partition and tier topic, how many messages are parked: counted as entries are written and
    deleted (and from the adoption's read of the partition), so the backlog views need no scan."""
    unsettled: dict[int, set[bytes]] = field(default_factory=dict)
    """Per adopted partition, every key with anything retrying, held or blocking: key-ordered mode reads the state
    only of those (a key not in it runs at once), so a healthy message costs no state read."""
    _deleting: dict[bytes, tuple[bytes | None, int | None]] = field(default_factory=dict)
    """Payload-table records a save removed and whose deletion waits for its writer's confirm (:meth:`save`): the
    value they had then and their partition. Reads treat them as gone while they still hold that value."""
    _deferred: dict[asyncio.Task[Any] | None, list[tuple[bytes, tuple[bytes | None, int | None]]]] = field(
        default_factory=dict
    )
    """Per writer task, the records its saves marked for deletion, deleted at the end of its :meth:`confirm`, each
    with its mark in :attr:`_deleting`: a later save of the record (another task's) replaces the mark, and the
    deletion is then that save's to make, once its own index is durable (a settle's wait runs after its key's lane
    is free: :meth:`confirm_later`)."""
    replayed: set[int] = field(default_factory=set)
    """Partitions whose changelog records were replayed into the local copy since the schedule last read them: the
    ones an adoption must read again (a partition this worker kept, with nothing replayed, is up to date)."""
    remembered: dict[int, set[bytes]] = field(default_factory=dict)
    """Per adopted partition, every key whose index remembers a message (:class:`rebound.state.Mark`): with
    :attr:`unsettled`, the keys a main-topic record may be a redelivery of, so a healthy message costs no state read."""
    _expiries: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    """Per adopted partition, (when its oldest mark was written, key): one item per remembered key, pushed when the
    key gets its first mark or its oldest mark changes, and pushed again when :meth:`forget_marks` pops a key whose
    marks have not all expired (an item whose time no longer matches the key's oldest mark is stale and skipped)."""
    _expiry_items: dict[int, dict[bytes, int]] = field(default_factory=dict)
    """Per adopted partition, the time of each key's one item in :attr:`_expiries`: the heap holds at most one item
    per key remembered within the memory's time, not one per mark written (50,000 failures on 5,000 keys made
    100,000 items before)."""

    def __post_init__(self) -> None:
        for table in (self.states, self.payloads):
            self._watch(table)
            self._watch_replays(table)

    def _watch_replays(self, table: Any) -> None:
        apply = getattr(table, "apply_changelog_batch", None)
        if apply is None:
            return

        def apply_and_remember(batch: Any) -> None:
            events = list(batch)
            self.replayed.update(event.message.partition for event in events)
            apply(events)

        table.apply_changelog_batch = apply_and_remember

    def _watch(self, table: Any) -> None:
        send = table.send_changelog

        def send_and_remember(partition: Any, key: Any, value: Any, *args: Any, **options: Any) -> Any:
            if args:  # Faust passes the serializers by keyword; keep positional ones as keywords for resends
                options = {**dict(zip(("key_serializer", "value_serializer"), args, strict=False)), **options}
            pending = send(partition, key, value, **options)
            if self.confirm_writes:
                writer = asyncio.current_task()
                self._unconfirmed.setdefault(writer, []).append(_Write(table, send, partition, key, options, pending))
            return pending

        table.send_changelog = send_and_remember

    async def confirm(self) -> None:
        """Wait until every changelog record this task wrote is acknowledged, writing again any that failed.

        Each task confirms its own writes, so a refusal is reported to the agent whose message it concerns; a task that
        wrote for many messages (a tier lane's group) confirms them all in one wait, and a refusal names its keys
        (:class:`ChangelogRefusedError`). The
        wait is shielded: cancelling this task (a rebalance, a shutdown) must not cancel the shared send, which
        other parts of Faust await too. A record refused as too large is written once more before it counts as
        refused: aiokafka fails a whole batch with one record's error, so a small record batched with a large one
        is refused once, innocently.

        Then the deletions the task's saves deferred are made, and confirmed the same way: a message's record is
        deleted only once the index that stopped counting it is durable. The two records live in two changelog
        topics, so without that order a crash could keep the deletion and lose the index (a key ordered behind a
        message that is gone would wait for ever). A deletion whose record changed meanwhile (a newer attempt of
        the same message parked over it) is not made. If confirming fails, the deletions are dropped: the records
        stay, and run again (at-least-once) rather than vanish.
        """
        task = asyncio.current_task()
        try:
            await self._confirm_writes(task)
        except BaseException:
            self._drop_deferred(task)
            raise
        deletions = self._deferred.pop(task, [])
        try:
            for key, mark in deletions:
                if self._deleting.get(key) is mark:
                    del self._deleting[key]
                    stored = _stored(self.payloads, key)  # (one lookup: the record is there iff it is not None)
                    if stored is not None and stored == mark[0]:
                        del self.payloads[key]
        finally:  # a failure leaves the rest in place (they run again), never marked as gone
            self._forget_marks(deletions)
        if deletions:
            await self._confirm_writes(task)

    def confirm_later(self, failed: Callable[[Exception], object] | None = None) -> asyncio.Task[None] | None:
        """Hand this task's unconfirmed writes, and the deletions its saves deferred, to a task of their own that
        confirms them as :meth:`confirm` would; None if there are none. ``failed`` is called with what
        :meth:`confirm` raised (a record refused as too large), instead of the task failing with it.

        For a writer that only needs its source offset held back until they are durable (the dispatcher
        acknowledges it when the returned task ends): it goes on, and its handler slot serves other records, during
        the round trip. The task inherits the writer's context, Faust's current event included, so the deferred
        deletions go to the same changelog partition; cancelled (a shutdown), it deletes nothing, like a
        :meth:`confirm` cut short.
        """
        writer = asyncio.current_task()
        writes = self._unconfirmed.pop(writer, None)
        deletions = self._deferred.pop(writer, None)
        if not writes and not deletions:
            return None
        confirming = asyncio.get_running_loop().create_task(self._confirm_then(failed))
        # (It has not started yet: what it confirms is its own before its first step.)
        if writes:
            self._unconfirmed[confirming] = writes
        if deletions:
            self._deferred[confirming] = deletions
        # Cancelled before its first step (a shutdown's cut in the loop pass that made it), it never runs its body:
        # what it was handed is let go of here, or it would be held for ever and the records read as gone.
        confirming.add_done_callback(self._let_go_of)
        return confirming

    def _let_go_of(self, task: asyncio.Task[None]) -> None:
        self._unconfirmed.pop(task, None)
        self._drop_deferred(task)

    async def _confirm_then(self, failed: Callable[[Exception], object] | None) -> None:
        try:
            await self.confirm()
        except Exception as exc:
            if failed is None:
                raise
            failed(exc)

    def _drop_deferred(self, task: asyncio.Task[Any] | None) -> None:
        self._forget_marks(self._deferred.pop(task, []))

    def _forget_marks(self, deletions: list[tuple[bytes, tuple[bytes | None, int | None]]]) -> None:
        """Let go of these deferred deletions' marks, each only if still this deletion's (not a later save's)."""
        for key, mark in deletions:
            if self._deleting.get(key) is mark:
                del self._deleting[key]

    def _remove_payload(self, key: bytes, partition: int | None) -> None:
        """Delete a payload-table record, after this task's confirm when writes are confirmed (see :meth:`confirm`)."""
        if not self.confirm_writes:
            self._delete(self.payloads, key)
            return
        mark = self._deleting[key] = (_stored(self.payloads, key), partition)
        self._deferred.setdefault(asyncio.current_task(), []).append((key, mark))

    def _payload(self, key: bytes) -> bytes | None:
        """A payload-table record as this worker's writers see it: one whose deletion is deferred is gone."""
        raw: bytes | None = _stored(self.payloads, key)
        mark = self._deleting.get(key)
        return None if mark is not None and mark[0] == raw else raw

    def _is_deleting(self, key: bytes, raw: bytes) -> bool:
        mark = self._deleting.get(key)
        return mark is not None and mark[0] == raw

    async def _confirm_writes(self, task: asyncio.Task[Any] | None) -> None:
        pending = self._unconfirmed.pop(task, [])
        refused: list[str] = []
        refused_keys: set[bytes] = set()
        failures = 0
        while pending:
            write = pending.pop(0)
            try:
                await asyncio.shield(write.future)
                continue
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                too_large = False  # the send itself was cancelled (a producer stopping): write it again
            except Exception as exc:
                too_large = is_too_large(exc)
                if too_large and write.refused_once:
                    refused.append(f"{write.key!r}: {exc}")
                    refused_keys.add(write.key)
                    continue
                if not too_large:
                    log.warning("changelog write failed (%r); writing it again", exc)
            if not too_large:
                failures += 1
                await asyncio.sleep(backoff_s(failures))
            pending.append(write.again(refused=too_large))
        if refused:
            raise ChangelogRefusedError(
                f"changelog record(s) refused as too large by the broker: {'; '.join(refused)}", frozenset(refused_keys)
            )

    def load(
        self,
        table_key: bytes,
        *,
        origin: str | None = None,
        entries: bool = False,
        with_payloads: bool = False,
    ) -> KeyState:
        """The key's index, plus the one parked message ``origin`` (one read), or every parked message
        (``entries``: a prefix scan of the key's records, for a view or an operator's command, or key-ordered mode
        where a key has one or two).

        ``with_payloads`` reads the bytes of what is loaded (and of the held messages) too.
        """
        state = KeyState.from_json(_stored(self.states, table_key))
        if state.legacy:
            # Version 2: its list, plus any record of its own written since (a crash in the middle of the write that
            # converts it, or a parked message's record the list does not name): those are newer than the list.
            listed = {entry.origin: entry for entry in state.pending}
            for _key, entry in self._key_entries(table_key, state.partition):
                listed[entry.origin] = entry
            state = replace(state, pending=tuple(listed.values()))
        elif entries:
            found = tuple(entry for _key, entry in self._key_entries(table_key, state.partition))
            state = replace(state, pending=found, others=0, loaded=None)
        elif origin is not None:
            state = _with_entry(state, origin, self._payload(payload_key(table_key, origin)))
        if not with_payloads or not (state.pending or state.held):
            return state
        return replace(
            state,
            pending=tuple(self._with_payload(table_key, entry) for entry in state.pending),
            held=tuple(self._with_payload(table_key, entry, held=True) for entry in state.held),
        )

    def read(self, table_key: bytes, origin: str, *, since: Loaded | None = None) -> Loaded:
        """:meth:`load` of ``origin``, with the two records its state was decoded from.

        ``since`` is an earlier read of the same key and message (a release's, before its handler awaited): if
        neither record has changed since, byte for byte, it is returned as it is, for the same bytes decode to the
        same state; the records are read again either way (two RocksDB gets), only their decoding is saved. A write
        of any kind in between (a park of the same key, an intent, a deletion marked or made, a changelog replay)
        changes what is read, and the state is decoded afresh. A version 2 key (its messages listed in its index,
        and records of its own found by a scan) is always decoded afresh.
        """
        index = _stored(self.states, table_key)
        record = self._payload(payload_key(table_key, origin))
        if (
            since is not None
            and since.table_key == table_key
            and since.origin == origin
            and since.index_raw == index
            and since.entry_raw == record
            and not since.state.legacy
        ):
            return since
        state = KeyState.from_json(index)
        state = self.load(table_key, origin=origin) if state.legacy else _with_entry(state, origin, record)
        return Loaded(table_key, origin, state, index, record)

    def entry(self, table_key: bytes, origin: str) -> PendingMessage | None:
        """One parked message of the key, metadata only (one read; a version 2 key reads its state)."""
        return self.load(table_key, origin=origin).find(origin)

    def _with_payload(
        self, table_key: bytes, entry: PendingMessage, *, held: bool = False, read: Loaded | None = None
    ) -> PendingMessage:
        if read is not None and not held and read.table_key == table_key and read.origin == entry.origin:
            raw = read.entry_raw
        else:
            raw = self._payload(payload_key(table_key, _payload_origin(entry.origin, held=held)))
        if raw is None:
            return entry
        if held:
            return entry.with_held_payload(raw)
        _meta, payload = split_entry(raw)
        return entry.with_payload(payload) if payload else entry

    def with_payload(
        self, table_key: bytes, entry: PendingMessage, *, held: bool = False, read: Loaded | None = None
    ) -> PendingMessage:
        """One entry with its bytes: a release reads only the payload it runs. ``read`` is the :meth:`read` the entry
        came from, with nothing awaited since: its record is the one to take the bytes from, not read again."""
        return self._with_payload(table_key, entry, held=held, read=read)

    def _key_entries(self, table_key: bytes, partition: int | None) -> Iterator[tuple[bytes, PendingMessage]]:
        """The key's parked messages' records (metadata only), by a scan of its prefix in the payload table."""
        for key, raw in _items(self.payloads, prefix=payload_key(table_key, ""), partition=partition):
            if is_entry_record(raw) and not self._is_deleting(key, raw):
                yield key, PendingMessage.from_entry(raw)

    def _has_other_entry(self, table_key: bytes, partition: int | None, skip: set[bytes]) -> bool:
        return any(key not in skip for key, _entry in self._key_entries(table_key, partition))

    def key_states(self, partitions: frozenset[int] | None = None) -> Iterator[tuple[bytes, KeyState]]:
        """Every key's index in the local copy (of ``partitions`` only, where the store keeps them apart).

        Skips the keys the table keeps for itself (the writer-epoch markers). A version 2 state comes with its list.
        """
        for table_key, raw in _items(self.states, partitions=partitions):
            if not is_internal_key(table_key):
                state = KeyState.from_json(raw)
                if partitions is None or state.partition is None or state.partition in partitions:
                    yield table_key, state

    def parked(self, partitions: frozenset[int] | None = None) -> Iterator[tuple[bytes, PendingMessage]]:
        """Every parked (retrying) message of the local copy (of ``partitions``), metadata only, with its table key:
        one read of each record, for an adoption or an operator's view, never per message."""
        for key, raw in _items(self.payloads, partitions=partitions):
            if is_entry_record(raw) and not self._is_deleting(key, raw):
                entry = PendingMessage.from_entry(raw)
                if partitions is None or entry.partition in partitions:
                    yield key[4 : 4 + int.from_bytes(key[:4], "big")], entry
        for table_key, state in self.key_states(partitions):
            if state.legacy:
                for entry in state.pending:
                    stored = self._payload(payload_key(table_key, entry.origin))
                    if stored is None or not is_entry_record(stored):  # (one with a record of its own came above)
                        yield table_key, entry

    def parked_chunk(
        self, partition: int, after: bytes | None, limit: int, *, listed: bool = False
    ) -> tuple[list[PendingMessage], bytes | None]:
        """One chunk of :meth:`parked` for ``partition``: the records of their own (or, ``listed``, the messages
        version 2 states list), and where the next chunk starts (None: done). See :func:`_chunk`."""
        records, following = _chunk(self.states if listed else self.payloads, partition, after, limit)
        found: list[PendingMessage] = []
        for key, raw in records:
            if listed:
                if not is_internal_key(key):
                    state = KeyState.from_json(raw)
                    found.extend(state.pending if state.legacy else ())
            elif is_entry_record(raw) and not self._is_deleting(key, raw):
                found.append(PendingMessage.from_entry(raw))
        return [entry for entry in found if entry.partition == partition], following

    def first_received_chunk(
        self, partition: int, after: bytes | None, limit: int
    ) -> tuple[list[tuple[str, int]], bytes | None]:
        """One chunk of the first-receipt survey over ``partition``'s records of their own: ``(tier topic, first
        receipt)`` of each parked message, read without decoding the records (see :func:`survey_fields`)."""
        records, following = _chunk(self.payloads, partition, after, limit)
        found: list[tuple[str, int]] = []
        for key, raw in records:
            if not is_entry_record(raw) or self._is_deleting(key, raw):
                continue
            fields = survey_fields(raw)
            if fields is None:
                entry = PendingMessage.from_entry(raw)
                if entry.partition != partition:
                    continue
                fields = (entry.tier_topic, entry.provenance.first_received_at_ms)
            found.append(fields)
        return found, following

    def existing_key(self, table_key: bytes) -> bytes:
        """``table_key``, or the raw key an earlier version stored the same message key under, if only that exists."""
        legacy = legacy_table_key(table_key)
        if legacy is not None and self.states.get(table_key) is None and self.states.get(legacy) is not None:
            return legacy
        return table_key

    def _fits(self, key: bytes, value: bytes) -> bool:
        return estimated_record_bytes(key, value, ()) <= self.max_record_bytes

    def check_fits(self, table_key: bytes, entry: PendingMessage, *, held: bool = False) -> None:
        """Raise :class:`RecordTooLargeError` if the entry's payload record could not be produced to the changelog."""
        key = payload_key(table_key, _payload_origin(entry.origin, held=held))
        value = entry.encode_held() if held else entry.encode_entry()
        if not self._fits(key, value):
            raise RecordTooLargeError(
                f"the parked copy of {entry.origin} would be a {estimated_record_bytes(key, value, ())}-byte "
                f"changelog record (REBOUND_PRODUCER_MAX_REQUEST_BYTES={self.max_record_bytes})"
            )

    def save(self, table_key: bytes, before: KeyState, after: KeyState) -> None:
        """Store ``after``: new or changed entries first, then the index, then deletions of settled entries.

        Only the messages loaded with ``before`` are compared, so a park or settle writes one entry and the index.
        That order means a crash between the writes leaves at worst an orphan entry (released by the schedule like
        any other: the schedule is built from the entries), never an index counting bytes that are gone. An idle key's
        index is deleted, so the tables hold only what is waiting; before that, one seek makes sure no entry the
        index did not count is left (a crash between two writes), so the count heals instead of drifting. Sizes
        are checked before the first write, so a refusal leaves the tables as they were. A version 2 state keeps its
        layout until it drains (:meth:`KeyState.to_json` says why). Deletions wait for :meth:`confirm`.
        """
        known = _payload_entries(table_key, before)
        wanted = _payload_entries(table_key, after)
        removed = known.keys() - wanted.keys()
        if after.is_idle and not after.complete and self._has_other_entry(table_key, after.partition, removed):
            after = replace(after, others=after.others + 1)
        encoded = None if after.is_idle else after.to_json()
        if encoded is not None and not self._fits(table_key, encoded):
            raise KeyBacklogFullError(
                f"the key's state would be {len(encoded)} bytes (REBOUND_PRODUCER_MAX_REQUEST_BYTES="
                f"{self.max_record_bytes})"
            )
        writes: list[tuple[bytes, bytes]] = []
        for key, (entry, held) in wanted.items():
            previous = known.get(key)
            if held:
                if entry.has_payload and (previous is None or previous[0].attempt != entry.attempt):
                    writes.append((key, entry.encode_held()))
            elif after.legacy:  # version 2 until it drains: its list has the metadata, the record the bytes only
                if entry.has_payload and (previous is None or previous[0].attempt != entry.attempt):
                    writes.append((key, entry.encode_payload()))
            elif previous is None or previous[0].to_dict() != entry.to_dict():
                stored = None if entry.has_payload else split_entry(self._payload(key) or b"")[1]
                writes.append((key, entry.encode_entry(stored)))
        for key, value in writes:
            if not self._fits(key, value):
                raise RecordTooLargeError(
                    f"the parked copy of {key[4 + int.from_bytes(key[:4], 'big') :].decode(errors='replace')} would "
                    f"be a {estimated_record_bytes(key, value, ())}-byte changelog record "
                    f"(REBOUND_PRODUCER_MAX_REQUEST_BYTES={self.max_record_bytes})"
                )
        for key, value in writes:
            self.payloads[key] = value
        if encoded is None:
            self._delete(self.states, table_key)
        else:
            self.states[table_key] = encoded
        for key in removed:
            self._remove_payload(key, after.partition)
        self.count_blocked(table_key, before, after)
        for key in removed | {key for key, _value in writes}:
            if key in known and not known[key][1]:
                self.count_parked(known[key][0], -1)
            if key in wanted and not wanted[key][1]:
                self.count_parked(wanted[key][0], +1)

    def count_parked(self, entry: PendingMessage, change: int) -> None:
        """Keep :attr:`parked_per_tier` up to date (partitions not adopted yet are counted when they are)."""
        tiers = self.parked_per_tier.get(entry.partition)
        if tiers is not None:
            count = tiers[entry.tier_topic] = max(0, tiers.get(entry.tier_topic, 0) + change)
            if not count:
                del tiers[entry.tier_topic]

    def count_blocked(self, table_key: bytes, before: KeyState | None, after: KeyState) -> None:
        """Keep :attr:`blocked` and :attr:`unsettled` up to date with a key's new state."""
        partition = after.partition if after.partition is not None else (before.partition if before else None)
        if partition is None:
            return
        if after.is_blocked:
            self.blocked.setdefault(partition, {})[table_key] = len(after.held)
        else:
            self.blocked.get(partition, {}).pop(table_key, None)
        if is_unsettled(after):
            self.unsettled.setdefault(partition, set()).add(table_key)
        else:
            self.unsettled.get(partition, set()).discard(table_key)
        if after.marks:
            self.remembered.setdefault(partition, set()).add(table_key)
            self._schedule_expiry(partition, table_key, min(mark.at_ms for mark in after.marks))
        else:
            self.remembered.get(partition, set()).discard(table_key)

    def _schedule_expiry(self, partition: int, table_key: bytes, oldest_ms: int) -> None:
        """Give the key an item in the partition's expiry heap at ``oldest_ms`` unless it has one that pops no later
        (that one finds the key's marks when it pops, and pushes again if they have not all expired)."""
        items = self._expiry_items.setdefault(partition, {})
        current = items.get(table_key)
        if current is not None and current <= oldest_ms:
            return
        items[table_key] = oldest_ms  # (the memory's time is added when it is read)
        heapq.heappush(self._expiries.setdefault(partition, []), (oldest_ms, table_key))

    def may_know(self, table_key: bytes, partition: int) -> bool:
        """False only when the key certainly has nothing parked, held, blocking or remembered (see
        :meth:`may_be_unsettled`): then a main-topic record of it is no redelivery of a retried message."""
        if self.may_be_unsettled(table_key, partition):
            return True
        keys = self.remembered.get(partition)
        return keys is None or table_key in keys

    def forget_marks(self, partition: int, now_ms: int, memory: LifecycleMemory, limit: int = 16) -> int:
        """Forget the expired marks of up to ``limit`` keys of ``partition``; returns how many keys were written.

        Must run in a stream iteration of ``partition`` (a table write takes its changelog partition from the current
        event: every key of the table partition belongs there), and, like every read-modify-write of a key, without
        an await between the read and the write. Called after a park or a remembered outcome, so a partition that
        writes marks also forgets them; a partition that falls silent keeps its last marks until its next write (at
        most what was written within the memory's time).
        """
        heap = self._expiries.get(partition)
        items = self._expiry_items.setdefault(partition, {})
        written = 0
        while heap and written < limit and heap[0][0] + memory.keep_ms <= now_ms:
            at_ms, table_key = heapq.heappop(heap)
            if items.get(table_key) != at_ms:
                continue  # stale: the key's item is another one
            del items[table_key]
            before = self.load(table_key)
            after = forget_expired(before, now_ms, memory)
            if after != before:
                self.save(table_key, before, after)  # (its remaining marks, if any, give it a new item)
                written += 1
            elif after.marks:
                self._schedule_expiry(partition, table_key, min(mark.at_ms for mark in after.marks))
        return written

    def may_be_unsettled(self, table_key: bytes, partition: int) -> bool:
        """False only when the key certainly has nothing retrying, held or blocking on a partition whose index is
        complete (built when the partition was adopted, kept by every save since): then its state need not be read."""
        keys = self.unsettled.get(partition)
        return keys is None or table_key in keys

    def index_partition(self, partition: int) -> None:
        """Start the partition's index afresh (it is being adopted: a scan of its states follows)."""
        self.blocked[partition] = {}
        self.unsettled[partition] = set()
        self.remembered[partition] = set()
        self._expiries[partition] = []
        self._expiry_items[partition] = {}
        self.parked_per_tier[partition] = {}

    def forget_partition(self, partition: int) -> None:
        self.blocked.pop(partition, None)
        self.unsettled.pop(partition, None)
        self.remembered.pop(partition, None)
        self._expiries.pop(partition, None)
        self._expiry_items.pop(partition, None)
        self.parked_per_tier.pop(partition, None)
        for key, (_raw, marked) in list(self._deleting.items()):
            if marked == partition:  # its writer was cut short by the revocation: the next owner has the record
                del self._deleting[key]

    def ordering_counts(self, partitions: frozenset[int]) -> dict[int, dict[str, int]]:
        return {
            partition: {"blocked_keys": len(keys), "held": sum(keys.values())}
            for partition in partitions
            for keys in (self.blocked.get(partition, {}),)
        }

    def rewrite_parked(self, table_key: bytes, entry: PendingMessage) -> None:
        """Write a parked entry's state and payload again, for a tier record delivered a second time.

        After a crash Faust reuses the local RocksDB and replays the changelog only from its last acknowledged offset:
        the local copy can hold a write whose changelog record was never acknowledged. Taking the redelivered record
        for a mere duplicate would leave that entry missing from the changelog, and lost when the partition moves.
        The stored bytes are what is written again: a duplicate (or a forgery claiming the same origin) can fill in a
        missing payload but never replace one. Nothing here raises: the entry is parked either way.
        """
        self._rewrite(self.states, table_key)
        key = payload_key(table_key, entry.origin)
        if self._payload(key) is not None:
            self._rewrite(self.payloads, key)
        elif entry.has_payload and self._fits(key, entry.encode_payload()):
            self.payloads[key] = entry.encode_payload()  # (a version 2 key: its list names it)

    def rewrite_held(self, table_key: bytes, origin: str) -> None:
        """Write a held message's state and payload again (its record delivered a second time: see
        :meth:`rewrite_parked`)."""
        self._rewrite(self.states, table_key)
        self._rewrite(self.payloads, payload_key(table_key, _payload_origin(origin, held=True)))

    def rewrite_state(self, table_key: bytes) -> None:
        self._rewrite(self.states, table_key)

    def reassert_settled(self, table_key: bytes, origin: str) -> None:
        """Write again what settling ``origin`` wrote: the key's current state (or its deletion), the payload's.

        Called when a release request finds its entry already gone. That may follow a crash between the local settle
        and the acknowledgement of its changelog records; without writing them again the entry would come back on
        the partition's next owner and run a second time. Writing the same values again is harmless.
        """
        state = self.load(table_key, entries=True)
        if state.is_idle:
            self._delete(self.states, table_key) if table_key in self.states else self._tombstone(
                self.states, table_key
            )
        elif not state.legacy:  # the index as its records say (a settle half-written by a crash counted one too many)
            self.states[table_key] = state.to_json()
        else:
            self._rewrite(self.states, table_key)
        key = payload_key(table_key, origin)
        if key in self.payloads:
            self._remove_payload(key, state.partition)
        else:
            self._tombstone(self.payloads, key)

    def _rewrite(self, table: Any, key: bytes) -> None:
        """Produce a stored value's changelog record again, unless it no longer fits (the limit was lowered)."""
        value = table.get(key)
        if value is None:
            return
        if self._fits(key, value):
            table[key] = value
        else:
            log.error("not writing %r again: %d bytes exceed the producer's limit now", key, len(value))

    @staticmethod
    def _tombstone(table: Any, key: bytes) -> None:
        """The deletion record of a key the local store no longer has (Faust's own ``__delitem__`` needs the key)."""
        table.send_changelog(table.partition_for_key(key), key, None, value_serializer="raw")

    @staticmethod
    def _delete(table: Any, key: bytes) -> None:
        if key in table:
            del table[key]
