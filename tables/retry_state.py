"""The changelog-backed retry state: per-key metadata in ``retry_state``, message bytes in ``retry_payloads``.

Both tables are co-partitioned with the main topics and written in the same stream iteration, so a key's metadata
and its messages' payloads always live in the same partition. Writes must happen inside a stream iteration (Faust
takes the changelog partition from the current event), so only the tier and release agents write; timers and views
only read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import faust

from app.kafka_errors import is_too_large
from rebound.errors import KeyBacklogFullError, RecordTooLargeError
from rebound.ordering import HELD_PAYLOAD_PREFIX, is_unsettled
from rebound.records import estimated_record_bytes
from rebound.settings import Settings
from rebound.state import KeyState, PendingMessage, legacy_table_key, payload_key
from tables.fencing import is_internal_key

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


def _rocksdb_options(settings: Settings) -> dict[str, Any] | None:
    if not settings.store.startswith("rocksdb"):
        return None
    mib = 1024 * 1024
    # Faust's RocksDB defaults (64 MiB x 3 write buffers, 2 GiB block cache) are per partition: far too big.
    return {
        "write_buffer_size": settings.rocksdb_write_buffer_mb * mib,
        "max_write_buffer_number": 2,
        "block_cache_size": settings.rocksdb_block_cache_mb * mib,
        "block_cache_compressed_size": settings.rocksdb_block_cache_mb * mib,
    }


def _create_table(app: faust.App, settings: Settings, partitions: int, name: str, help_text: str) -> Any:
    return app.Table(
        name,
        default=None,
        partitions=partitions,
        key_type=bytes,
        value_type=bytes,
        help=help_text,
        options=_rocksdb_options(settings),
    )


def create_state_table(app: faust.App, settings: Settings, partitions: int) -> Any:
    help_text = "Retry state per key: pending messages' metadata, attempts, first failure, next due, tier, last error."
    return _create_table(app, settings, partitions, STATE_TABLE, help_text)


def create_payload_table(app: faust.App, settings: Settings, partitions: int) -> Any:
    help_text = "Bytes (key, value, headers) of each parked message, by origin topic/partition/offset."
    return _create_table(app, settings, partitions, PAYLOAD_TABLE, help_text)


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
    unsettled: dict[int, set[bytes]] = field(default_factory=dict)
    """Per adopted partition, every key with anything retrying, held or blocking: key-ordered mode reads the state
    only of those (a key not in it runs at once), so a healthy message costs no state read."""

    def __post_init__(self) -> None:
        for table in (self.states, self.payloads):
            self._watch(table)

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

        Each agent confirms its own writes, so a refusal is reported to the agent whose message it concerns. The
        wait is shielded: cancelling this task (a rebalance, a shutdown) must not cancel the shared send, which
        other parts of Faust await too. A record refused as too large is written once more before it counts as
        refused: aiokafka fails a whole batch with one record's error, so a small record batched with a large one
        is refused once, innocently.
        """
        pending = self._unconfirmed.pop(asyncio.current_task(), [])
        refused: list[str] = []
        backoff = 0.1
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
                    continue
                if not too_large:
                    log.warning("changelog write failed (%r); writing it again", exc)
            if not too_large:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            pending.append(write.again(refused=too_large))
        if refused:
            raise RecordTooLargeError(f"changelog record(s) refused as too large by the broker: {'; '.join(refused)}")

    def load(self, table_key: bytes, *, with_payloads: bool = True) -> KeyState:
        state = KeyState.from_json(self.states.get(table_key))
        if not with_payloads or not (state.pending or state.held):
            return state
        return replace(
            state,
            pending=tuple(self._with_payload(table_key, entry) for entry in state.pending),
            held=tuple(self._with_payload(table_key, entry, held=True) for entry in state.held),
        )

    def _with_payload(self, table_key: bytes, entry: PendingMessage, *, held: bool = False) -> PendingMessage:
        raw = self.payloads.get(payload_key(table_key, _payload_origin(entry.origin, held=held)))
        if raw is None:
            return entry
        return entry.with_held_payload(raw) if held else entry.with_payload(raw)

    def with_payload(self, table_key: bytes, entry: PendingMessage, *, held: bool = False) -> PendingMessage:
        """One entry with its bytes: a release reads only the payload it runs."""
        return self._with_payload(table_key, entry, held=held)

    def key_states(self) -> Iterator[tuple[bytes, KeyState]]:
        """Every key's state in the local copy (payloads not loaded): the one full scan.

        Skips the keys the table keeps for itself (the writer-epoch markers).
        """
        for table_key, raw in self.states.items():
            if not is_internal_key(table_key):
                yield table_key, KeyState.from_json(raw)

    def parked(self) -> Iterator[tuple[bytes, PendingMessage]]:
        """Every parked (retrying) entry of the local copy, with its table key."""
        for table_key, state in self.key_states():
            for entry in state.pending:
                yield table_key, entry

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
        value = entry.encode_held() if held else entry.encode_payload()
        if not self._fits(key, value):
            raise RecordTooLargeError(
                f"the parked copy of {entry.origin} would be a {estimated_record_bytes(key, value, ())}-byte "
                f"changelog record (REBOUND_PRODUCER_MAX_REQUEST_BYTES={self.max_record_bytes})"
            )

    def save(self, table_key: bytes, before: KeyState, after: KeyState) -> None:
        """Store ``after``: new payloads first, then the state, then deletions of settled payloads.

        That order means a crash between the writes leaves at worst an orphan payload, never a state entry whose
        bytes are gone. An idle key is deleted so the tables hold only what is waiting. Sizes are checked before the
        first write, so a refusal leaves the tables as they were.
        """
        encoded = None if after.is_idle else after.to_json()
        if encoded is not None and not self._fits(table_key, encoded):
            raise KeyBacklogFullError(
                f"the key's state would be {len(encoded)} bytes (REBOUND_PRODUCER_MAX_REQUEST_BYTES="
                f"{self.max_record_bytes})"
            )
        known = _payload_entries(table_key, before)
        wanted = _payload_entries(table_key, after)
        added = [
            (key, entry, held)
            for key, (entry, held) in wanted.items()
            if entry.has_payload and (key not in known or known[key][0].attempt != entry.attempt)
        ]
        for _, entry, held in added:
            self.check_fits(table_key, entry, held=held)
        for key, entry, held in added:
            self.payloads[key] = entry.encode_held() if held else entry.encode_payload()
        if encoded is None:
            self._delete(self.states, table_key)
        else:
            self.states[table_key] = encoded
        for key in known.keys() - wanted.keys():
            self._delete(self.payloads, key)
        self.count_blocked(table_key, before, after)

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

    def may_be_unsettled(self, table_key: bytes, partition: int) -> bool:
        """False only when the key certainly has nothing retrying, held or blocking on a partition whose index is
        complete (built when the partition was adopted, kept by every save since): then its state need not be read."""
        keys = self.unsettled.get(partition)
        return keys is None or table_key in keys

    def index_partition(self, partition: int) -> None:
        """Start the partition's index afresh (it is being adopted: a scan of its states follows)."""
        self.blocked[partition] = {}
        self.unsettled[partition] = set()

    def forget_partition(self, partition: int) -> None:
        self.blocked.pop(partition, None)
        self.unsettled.pop(partition, None)

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
        if self.payloads.get(key) is not None:
            self._rewrite(self.payloads, key)
        elif entry.has_payload and self._fits(key, entry.encode_payload()):
            self.payloads[key] = entry.encode_payload()

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
        if self.states.get(table_key) is not None:
            self._rewrite(self.states, table_key)
        else:
            self._tombstone(self.states, table_key)
        key = payload_key(table_key, origin)
        if key in self.payloads:
            del self.payloads[key]
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
