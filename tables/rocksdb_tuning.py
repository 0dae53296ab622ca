"""RocksDB options tuned for Rebound's two tables, with one memory budget for every partition database of a worker.

Faust opens one RocksDB database per table partition and, on the rocksdict path, gives each its own 2 GiB-by-default
block cache and three 64 MiB write buffers, so memory grows with the partition count. :func:`install` replaces the
options of a table's store with :class:`TunedRocksDBOptions`: one LRU cache per worker (Faust app) holding the data,
index and filter blocks of every partition database, with every memtable charged to it through one write buffer
manager; 10 bits/key whole-key Bloom filters; LZ4 compression (ZSTD at the bottommost level); and compaction of
tombstone-dense files. The reasoning and the memory arithmetic are in ``docs/rocksdb.md``.

Only faust, rocksdict, rebound.settings and the standard library are imported here.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import faust.stores
import rocksdict
from faust.stores.rocksdb import RocksDBOptions
from faust.stores.rocksdb import Store as RocksDBStore

from rebound.settings import Settings

log = logging.getLogger(__name__)

MIB = 1024 * 1024
WRITE_BUFFERS_PER_DB = 2
"""One memtable taking writes while at most one other is flushed."""
BACKGROUND_JOBS = 4
"""Flushes and compactions at once; RocksDB's thread pools are process-wide, so this is for all databases together."""
BYTES_PER_SYNC = MIB
"""Write SST files out in 1 MiB steps rather than in one burst at the file's end."""
INFO_LOG_FILES_KEPT = 3
INFO_LOG_FILE_BYTES = 8 * MIB
"""Each partition database writes its own ``LOG``: bounded, instead of RocksDB's 1000 files of any size."""
DELETION_WINDOW = 128
DELETIONS_IN_WINDOW = 64
DELETION_RATIO = 0.5
"""An SST file with 64 tombstones in some 128 consecutive entries, or half tombstones overall, is compacted soon."""
DATA_BLOCK_HASH_RATIO = 0.75
"""A hash index in each data block finds a point get's key without a binary search (RocksDB's suggested ratio)."""

Compression = Literal["none", "snappy", "lz4", "zstd"]
_COMPRESSION: dict[str, Callable[[], rocksdict.DBCompressionType]] = {
    "none": rocksdict.DBCompressionType.none,
    "snappy": rocksdict.DBCompressionType.snappy,
    "lz4": rocksdict.DBCompressionType.lz4,
    "zstd": rocksdict.DBCompressionType.zstd,
}


@dataclass(frozen=True, eq=False)
class SharedMemory:
    """The one cache and the one write buffer manager that every partition database of a worker uses.

    The cache holds up to ``block_cache_bytes`` of blocks on top of the memtables the write buffer manager charges
    to it (at most ``write_buffer_bytes`` before it makes the writing database flush), so its capacity is the sum.
    """

    cache: rocksdict.Cache
    write_buffers: rocksdict.WriteBufferManager
    block_cache_bytes: int
    write_buffer_bytes: int

    @classmethod
    def from_settings(cls, settings: Settings) -> SharedMemory:
        block_cache_bytes = settings.rocksdb_block_cache_mb * MIB
        write_buffer_bytes = settings.rocksdb_write_buffer_total_mb * MIB
        cache = rocksdict.Cache(block_cache_bytes + write_buffer_bytes)
        # allow_stall=False: a stall would block Faust's event loop, which writes to RocksDB synchronously; past the
        # budget the manager makes the writing database switch to a new memtable and flush the full one instead.
        write_buffers = rocksdict.WriteBufferManager.new_write_buffer_manager_with_cache(
            write_buffer_bytes, False, cache
        )
        return cls(cache, write_buffers, block_cache_bytes, write_buffer_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self.block_cache_bytes + self.write_buffer_bytes


_shared_by_app: weakref.WeakKeyDictionary[Any, SharedMemory] = weakref.WeakKeyDictionary()


def shared_memory(app: Any, settings: Settings) -> SharedMemory:
    """The cache and write buffer manager of ``app``'s worker, made on the first call (later settings are ignored)."""
    shared = _shared_by_app.get(app)
    if shared is None:
        shared = _shared_by_app[app] = SharedMemory.from_settings(settings)
    return shared


class TunedRocksDBOptions(RocksDBOptions):
    """Faust's RocksDB options, with :meth:`as_options` building Rebound's tuning on the rocksdict path."""

    def __init__(
        self,
        shared: SharedMemory,
        *,
        bloom_bits_per_key: int,
        compression: Compression,
        bottommost_compression: Compression,
        **faust_options: Any,
    ) -> None:
        faust_options.setdefault("block_cache_size", shared.capacity_bytes)  # what Faust's own fields report
        faust_options.setdefault("bloom_filter_size", bloom_bits_per_key)
        super().__init__(**faust_options)
        self.shared = shared
        self.bloom_bits_per_key = bloom_bits_per_key
        self.compression = compression
        self.bottommost_compression = bottommost_compression

    @classmethod
    def from_settings(cls, settings: Settings, shared: SharedMemory, **faust_options: Any) -> TunedRocksDBOptions:
        """``faust_options`` carries what Faust knows and Rebound does not set: ``ttl``, ``use_rocksdict``..."""
        return cls(
            shared,
            bloom_bits_per_key=settings.rocksdb_bloom_bits_per_key,
            compression=settings.rocksdb_compression,
            bottommost_compression=settings.rocksdb_bottommost_compression,
            max_open_files=settings.rocksdb_max_open_files,
            write_buffer_size=settings.rocksdb_write_buffer_mb * MIB,
            max_write_buffer_number=WRITE_BUFFERS_PER_DB,
            **faust_options,
        )

    def as_options(self) -> Any:
        if not self.use_rocksdict:  # python-rocksdb: Faust's own options (install() leaves such stores alone)
            return super().as_options()
        options = rocksdict.Options(raw_mode=True)  # Faust's stores read and write bytes
        options.create_if_missing(True)
        if self.max_open_files is not None:  # always set from the settings; None only in Faust's own type
            options.set_max_open_files(self.max_open_files)
        options.set_target_file_size_base(self.target_file_size_base)
        options.set_write_buffer_size(self.write_buffer_size)
        options.set_max_write_buffer_number(self.max_write_buffer_number)
        options.set_write_buffer_manager(self.shared.write_buffers)
        options.set_level_compaction_dynamic_level_bytes(True)
        options.set_compression_type(_COMPRESSION[self.compression]())
        options.set_bottommost_compression_type(_COMPRESSION[self.bottommost_compression]())
        options.add_compact_on_deletion_collector_factory(DELETION_WINDOW, DELETIONS_IN_WINDOW, DELETION_RATIO)
        options.set_max_background_jobs(BACKGROUND_JOBS)
        options.set_bytes_per_sync(BYTES_PER_SYNC)
        options.set_keep_log_file_num(INFO_LOG_FILES_KEPT)
        options.set_max_log_file_size(INFO_LOG_FILE_BYTES)

        table = rocksdict.BlockBasedOptions()
        table.set_block_cache(self.shared.cache)
        table.set_cache_index_and_filter_blocks(True)  # charged to the shared cache, not unbounded table readers
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)  # L0 is read by every get: never evicted
        if self.bloom_bits_per_key > 0:
            table.set_bloom_filter(self.bloom_bits_per_key, False)  # a full (whole-key) filter per SST file
        table.set_index_type(rocksdict.BlockBasedIndexType.binary_search())
        table.set_data_block_index_type(rocksdict.DataBlockIndexType.binary_and_hash())
        table.set_data_block_hash_ratio(DATA_BLOCK_HASH_RATIO)
        options.set_block_based_table_factory(table)
        return options


def is_rocksdb_table(table: Any) -> bool:
    """Whether ``table`` keeps its data in Faust's RocksDB store (``rocksdb://``), found without creating the store."""
    url = getattr(table, "_store", None) or table.app.conf.store
    return issubclass(faust.stores.by_url(url), RocksDBStore)


def install(table: Any, settings: Settings) -> None:
    """Give ``table``'s RocksDB store the tuned options; nothing for another store (``memory://``).

    Call it right after ``app.Table(...)``. Faust makes a table's store lazily, on the first read of ``table.data``
    (when the table starts, unless something reads it earlier), and opens a partition's database only when the
    partition is assigned or recovered. Reading ``table.data`` here would bind the store (and the table) to an event
    loop before the worker runs one, so the options are swapped in as Faust makes the store; a store that already
    exists is tuned at once, unless it has a database open (its options are fixed then).
    """
    if not is_rocksdb_table(table):
        return
    shared = shared_memory(table.app, settings)
    existing = getattr(table, "_data", None)
    if existing is not None:
        _tune(existing, settings, shared)
        return
    make_store = table._new_store_by_url

    def make_tuned_store(url: Any) -> Any:
        store = make_store(url)
        _tune(store, settings, shared)
        return store

    table._new_store_by_url = make_tuned_store


def _tune(store: Any, settings: Settings, shared: SharedMemory) -> None:
    current = getattr(store, "rocksdb_options", None)
    if not isinstance(current, RocksDBOptions) or not current.use_rocksdict:
        log.info("rebound: %s: not a rocksdict store, RocksDB tuning left out", getattr(store, "table_name", store))
        return
    if getattr(store, "_dbs", None):
        raise RuntimeError(
            f"RocksDB tuning for {store.table_name!r} comes too late: partition databases are open already"
        )
    store.rocksdb_options = TunedRocksDBOptions.from_settings(
        settings,
        shared,
        target_file_size_base=current.target_file_size_base,
        use_rocksdict=current.use_rocksdict,
        ttl=current.ttl,
        **dict(current.extra_options),
    )
