"""The changelog-backed retry-state table: one :class:`~rebound.state.KeyState` per key, JSON in RocksDB.

Writes must happen inside a stream iteration (Faust takes the changelog partition from the current event), so only
the tier and release agents write; timers and views only read.
"""

from __future__ import annotations

from typing import Any

import faust

from rebound.settings import Settings
from rebound.state import KeyState

TABLE_NAME = "retry_state"


def create_state_table(app: faust.App, settings: Settings, partitions: int) -> Any:
    mib = 1024 * 1024
    options: dict[str, Any] = {}
    if settings.store.startswith("rocksdb"):
        # Faust's RocksDB defaults (64 MiB x 3 write buffers, 2 GiB block cache) are per partition: far too big.
        options = {
            "write_buffer_size": settings.rocksdb_write_buffer_mb * mib,
            "max_write_buffer_number": 2,
            "block_cache_size": settings.rocksdb_block_cache_mb * mib,
            "block_cache_compressed_size": settings.rocksdb_block_cache_mb * mib,
        }
    return app.Table(
        TABLE_NAME,
        default=None,
        partitions=partitions,
        key_type=bytes,
        value_type=bytes,
        help="Retry state per key: pending messages, attempts, first failure, next due, tier, last error.",
        options=options or None,
    )


def read_state(table: Any, table_key: bytes) -> KeyState:
    return KeyState.from_json(table.get(table_key))


def write_state(table: Any, table_key: bytes, state: KeyState) -> None:
    """Store ``state``; an idle key is deleted so the table holds only what is waiting."""
    if state.is_idle:
        if table_key in table:
            del table[table_key]
    else:
        table[table_key] = state.to_json()
