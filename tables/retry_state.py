"""The changelog-backed retry state: per-key metadata in ``retry_state``, message bytes in ``retry_payloads``.

Both tables are co-partitioned with the main topics and written in the same stream iteration, so a key's metadata
and its messages' payloads always live in the same partition. Writes must happen inside a stream iteration (Faust
takes the changelog partition from the current event), so only the tier and release agents write; timers and views
only read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import faust

from rebound.settings import Settings
from rebound.state import KeyState, PendingMessage

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


def payload_key(entry: PendingMessage) -> bytes:
    return entry.origin.encode("utf-8")


@dataclass
class RetryStore:
    """Reads and writes a key's state together with its messages' payloads."""

    states: Any
    payloads: Any

    def load(self, table_key: bytes, *, with_payloads: bool = True) -> KeyState:
        state = KeyState.from_json(self.states.get(table_key))
        if not with_payloads or not state.pending:
            return state
        loaded = []
        for entry in state.pending:
            raw = self.payloads.get(payload_key(entry))
            loaded.append(entry.with_payload(raw) if raw is not None else entry)
        return KeyState(
            pending=tuple(loaded),
            attempts=state.attempts,
            first_failure_ms=state.first_failure_ms,
            last_error=state.last_error,
            last_error_class=state.last_error_class,
            released=state.released,
            extra=state.extra,
        )

    def save(self, table_key: bytes, before: KeyState, after: KeyState) -> None:
        """Store ``after``; payloads are written for new entries and deleted for settled ones.

        An idle key is deleted so the tables hold only what is waiting.
        """
        kept = {entry.origin for entry in after.pending}
        for entry in before.pending:
            if entry.origin not in kept:
                self._delete(self.payloads, payload_key(entry))
        known = {(entry.origin, entry.attempt) for entry in before.pending}
        for entry in after.pending:
            if (entry.origin, entry.attempt) not in known and entry.has_payload:
                self.payloads[payload_key(entry)] = entry.encode_payload()
        if after.is_idle:
            self._delete(self.states, table_key)
        else:
            self.states[table_key] = after.to_json()

    @staticmethod
    def _delete(table: Any, key: bytes) -> None:
        if key in table:
            del table[key]
