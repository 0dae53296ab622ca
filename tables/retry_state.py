"""The changelog-backed retry state: per-key metadata in ``retry_state``, message bytes in ``retry_payloads``.

Both tables are co-partitioned with the main topics and written in the same stream iteration, so a key's metadata
and its messages' payloads always live in the same partition. Writes must happen inside a stream iteration (Faust
takes the changelog partition from the current event), so only the tier and release agents write; timers and views
only read.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import faust

from rebound.errors import KeyBacklogFullError
from rebound.settings import Settings
from rebound.state import KeyState, PendingMessage

log = logging.getLogger(__name__)
# Below Kafka's default max.message.bytes (1 MiB) with room for the record's own overhead.
MAX_STATE_BYTES = 900_000

STATE_TABLE = "retry_state"
PAYLOAD_TABLE = "retry_payloads"


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


def payload_key(table_key: bytes, entry: PendingMessage) -> bytes:
    """The key's own namespace plus the origin: a record claiming another key's origin can never touch its bytes."""
    return len(table_key).to_bytes(4, "big") + table_key + entry.origin.encode("utf-8")


@dataclass
class RetryStore:
    """Reads and writes a key's state together with its messages' payloads, and confirms the changelog writes.

    A Faust table write only queues its changelog record, and Faust's pre-commit flush may return before the queue
    is empty. The agents therefore ``await confirm()`` before moving on, so no source offset is committed while the
    record that makes the state durable could still be lost.
    """

    states: Any
    payloads: Any
    confirm_writes: bool = True
    _pending: list[tuple[Any, Any, Any, Any, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for table in (self.states, self.payloads):
            self._watch(table)

    def _watch(self, table: Any) -> None:
        send = table.send_changelog

        def send_and_remember(partition: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            pending = send(partition, key, value, *args, **kwargs)
            if self.confirm_writes:
                self._pending.append((send, partition, key, value, pending))
            return pending

        table.send_changelog = send_and_remember

    async def confirm(self) -> None:
        """Wait until every changelog record written so far is acknowledged; resend any that failed."""
        backoff = 0.1
        while self._pending:
            batch, self._pending = self._pending, []
            for send, partition, key, value, pending in batch:
                try:
                    await pending
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("changelog write failed (%r); writing it again", exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    self._pending.append((send, partition, key, value, send(partition, key, value)))

    def load(self, table_key: bytes, *, with_payloads: bool = True) -> KeyState:
        state = KeyState.from_json(self.states.get(table_key))
        if not with_payloads or not state.pending:
            return state
        loaded = []
        for entry in state.pending:
            raw = self.payloads.get(payload_key(table_key, entry))
            loaded.append(entry.with_payload(raw) if raw is not None else entry)
        return replace(state, pending=tuple(loaded))

    def has_payload(self, table_key: bytes, entry: PendingMessage) -> bool:
        return self.payloads.get(payload_key(table_key, entry)) is not None

    def save(self, table_key: bytes, before: KeyState, after: KeyState) -> None:
        """Store ``after``: new payloads first, then the state, then deletions of settled payloads.

        That order means a crash between the writes leaves at worst an orphan payload, never a state entry whose
        bytes are gone. An idle key is deleted so the tables hold only what is waiting.
        """
        encoded = None if after.is_idle else after.to_json()
        if encoded is not None and len(encoded) > MAX_STATE_BYTES:
            raise KeyBacklogFullError(f"the key's state would be {len(encoded)} bytes (limit {MAX_STATE_BYTES})")
        known = {(entry.origin, entry.attempt) for entry in before.pending}
        for entry in after.pending:
            if (entry.origin, entry.attempt) not in known and entry.has_payload:
                self.payloads[payload_key(table_key, entry)] = entry.encode_payload()
        if encoded is None:
            self._delete(self.states, table_key)
        else:
            self.states[table_key] = encoded
        kept = {entry.origin for entry in after.pending}
        for entry in before.pending:
            if entry.origin not in kept:
                self._delete(self.payloads, payload_key(table_key, entry))

    def repair_payload(self, table_key: bytes, entry: PendingMessage) -> None:
        """Write a payload the state refers to but the payload table lacks (a crash between the two writes)."""
        if entry.has_payload and not self.has_payload(table_key, entry):
            self.payloads[payload_key(table_key, entry)] = entry.encode_payload()

    @staticmethod
    def _delete(table: Any, key: bytes) -> None:
        if key in table:
            del table[key]
