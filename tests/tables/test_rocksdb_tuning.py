"""Rebound's RocksDB tuning on real rocksdict databases, and its installation on real Faust tables."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faust
import pytest
import rocksdict

from rebound.errors import ConfigurationError
from rebound.settings import Settings, load_settings
from tables.rocksdb_tuning import MIB, SharedMemory, TunedRocksDBOptions, install

PARTITIONS = 4


def _settings(tmp_path: Path, **overrides: Any) -> Settings:
    overrides.setdefault("store", "rocksdb://")
    return load_settings(data_dir=str(tmp_path), provision_topics=False, **overrides)


def _payload_key(table_key: bytes, origin: str) -> bytes:
    """The layout of ``rebound.state.payload_key``: every entry of one key shares the length-prefixed key."""
    return len(table_key).to_bytes(4, "big") + table_key + origin.encode()


def _json_value(rnd: random.Random, i: int) -> bytes:
    """About 0.7 KiB of the JSON a parked message typically carries: compressible, but not trivially."""
    lines = [
        {"sku": f"SKU-{rnd.randrange(10**5):05d}", "qty": rnd.randrange(1, 9), "price": round(rnd.random() * 100, 2)}
        for _ in range(12)
    ]
    return json.dumps(
        {"order": f"ord-{rnd.randrange(10**9)}", "customer": f"c-{rnd.randrange(10**6)}", "n": i, "lines": lines}
    ).encode()


def _sst_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.glob("*.sst"))


def _options_file(path: Path) -> str:
    """The options RocksDB wrote down for the database it opened: what is in force, not what was asked for."""
    return max(path.glob("OPTIONS-*")).read_text()


@pytest.fixture
def open_dbs() -> Iterator[list[rocksdict.Rdict]]:
    opened: list[rocksdict.Rdict] = []
    yield opened
    for db in opened:
        db.close()


def _open(options: TunedRocksDBOptions, path: Path, opened: list[rocksdict.Rdict]) -> rocksdict.Rdict:
    db = options.open(path)
    opened.append(db)
    return db


def test_every_partition_database_is_charged_to_the_one_cache(tmp_path: Path, open_dbs: list[rocksdict.Rdict]) -> None:
    settings = _settings(tmp_path, rocksdb_block_cache_mb=8, rocksdb_write_buffer_total_mb=16)
    shared = SharedMemory.from_settings(settings)
    options = TunedRocksDBOptions.from_settings(settings, shared)
    dbs = [_open(options, tmp_path / f"retry_payloads-{partition}.db", open_dbs) for partition in range(PARTITIONS)]
    assert shared.capacity_bytes == 24 * MIB
    assert options.block_cache_size == 24 * MIB  # what Faust's fields report matches
    assert options.write_buffer_size == settings.rocksdb_write_buffer_mb * MIB

    for partition, db in enumerate(dbs):
        for i in range(2000):
            db.put(_payload_key(f"k{i}".encode(), f"items/{partition}/{i}"), b"x" * 200)

    memtables = sum(db.property_int_value("rocksdb.cur-size-all-mem-tables") or 0 for db in dbs)
    charged = shared.write_buffers.get_usage()
    assert memtables > 0
    assert charged >= memtables  # every database's memtables count in the one manager...
    assert shared.cache.get_usage() >= charged  # ...which reserves them in the one cache
    assert shared.write_buffers.get_buffer_size() == 16 * MIB
    for db in dbs:
        db.flush()
        db.get(_payload_key(b"k1", "items/0/1"))
    assert shared.cache.get_usage() <= shared.capacity_bytes + MIB  # bounded by the capacity, not by the partitions


def test_rocksdb_applies_the_tuning(tmp_path: Path, open_dbs: list[rocksdict.Rdict]) -> None:
    settings = _settings(tmp_path, rocksdb_max_open_files=100)
    options = TunedRocksDBOptions.from_settings(settings, SharedMemory.from_settings(settings))
    path = tmp_path / "retry_state-0.db"
    _open(options, path, open_dbs)

    written = _options_file(path)
    for expected in (
        "compression=kLZ4Compression",
        "bottommost_compression=kZSTD",
        "max_open_files=100",
        "max_write_buffer_number=2",
        f"write_buffer_size={8 * MIB}",
        "level_compaction_dynamic_level_bytes=true",
        "max_background_jobs=4",
        "cache_index_and_filter_blocks=true",
        "pin_l0_filter_and_index_blocks_in_cache=true",
        "filter_policy=bloomfilter",
        "whole_key_filtering=true",
        "data_block_index_type=kDataBlockBinaryAndHash",
        "CompactOnDeletionCollector",
    ):
        assert expected in written, expected


def _filter_bits_per_key(db: rocksdict.Rdict) -> float:
    properties = dict(
        part.strip().split("=", 1)
        for part in (db.property_value("rocksdb.aggregated-table-properties") or "").split(";")
        if "=" in part
    )
    return int(properties["filter block size"]) * 8 / int(properties["# entries"])


@pytest.mark.parametrize(("bits", "low", "high"), [(10, 9.5, 10.5), (4, 3.5, 4.5), (0, 0, 0)])
def test_filters_have_the_bits_per_key_asked(
    tmp_path: Path, open_dbs: list[rocksdict.Rdict], bits: int, low: float, high: float
) -> None:
    """Faust's default is 3 bits per key (about 24% of the gets of a missing key read a block); 10 makes it 1%."""
    settings = _settings(tmp_path, rocksdb_bloom_bits_per_key=bits)
    options = TunedRocksDBOptions.from_settings(settings, SharedMemory.from_settings(settings))
    db = _open(options, tmp_path / "retry_state-0.db", open_dbs)
    for i in range(20_000):
        db.put(f"key-{i:06d}".encode(), b"{}")
    db.flush()
    assert low <= _filter_bits_per_key(db) <= high


def test_no_compression_when_asked(tmp_path: Path, open_dbs: list[rocksdict.Rdict]) -> None:
    settings = _settings(tmp_path, rocksdb_compression="none", rocksdb_bottommost_compression="none")
    options = TunedRocksDBOptions.from_settings(settings, SharedMemory.from_settings(settings))
    path = tmp_path / "retry_state-0.db"
    _open(options, path, open_dbs)

    written = _options_file(path)
    assert "compression=kNoCompression" in written
    assert "bottommost_compression=kNoCompression" in written


def test_puts_gets_deletes_and_prefix_iteration(tmp_path: Path, open_dbs: list[rocksdict.Rdict]) -> None:
    settings = _settings(tmp_path)
    options = TunedRocksDBOptions.from_settings(settings, SharedMemory.from_settings(settings))
    dbs = [_open(options, tmp_path / f"retry_payloads-{partition}.db", open_dbs) for partition in range(PARTITIONS)]
    keys = [b"a", b"ab", b"b", b"key-1"]
    for partition, db in enumerate(dbs):
        for key in keys:
            for offset in range(5):
                db.put(_payload_key(key, f"items/{partition}/{offset}"), f"{key!r}@{offset}".encode())
    db = dbs[2]
    db.delete(_payload_key(b"ab", "items/2/3"))
    db.flush()  # from the SST files too, not only from the memtable
    db.put(_payload_key(b"ab", "items/2/9"), b"late")

    assert db.get(_payload_key(b"ab", "items/2/0")) == b"b'ab'@0"
    assert db.get(_payload_key(b"ab", "items/2/3")) is None
    assert db.get(_payload_key(b"ab", "items/1/0")) is None  # another partition's entry is in another database
    prefix = _payload_key(b"ab", "")
    found = []
    for key, value in db.items(from_key=prefix):
        if not key.startswith(prefix):
            break
        found.append((key[len(prefix) :], value))
    assert found == [
        (b"items/2/0", b"b'ab'@0"),
        (b"items/2/1", b"b'ab'@1"),
        (b"items/2/2", b"b'ab'@2"),
        (b"items/2/4", b"b'ab'@4"),
        (b"items/2/9", b"late"),
    ]  # not "a"'s entries, though b"a" is a prefix of b"ab": the length comes first
    assert len(list(db.keys())) == len(keys) * 5


def test_message_bytes_are_compressed_lz4_then_zstd_at_the_bottom(
    tmp_path: Path, open_dbs: list[rocksdict.Rdict]
) -> None:
    settings = _settings(tmp_path)
    options = TunedRocksDBOptions.from_settings(settings, SharedMemory.from_settings(settings))
    path = tmp_path / "retry_payloads-0.db"
    db = _open(options, path, open_dbs)
    rnd = random.Random(7)
    raw = 0
    written: dict[bytes, bytes] = {}
    while raw < 20 * MIB:
        i = len(written)
        key = _payload_key(f"key-{i % 5000:06d}".encode(), f"items/0/{i}")
        written[key] = _json_value(rnd, i)
        db.put(key, written[key])
        raw += len(key) + len(written[key])

    db.flush()
    flushed = _sst_bytes(path)  # written by flushes (LZ4), the bottommost level by compactions (ZSTD)
    compact = rocksdict.CompactOptions()
    compact.set_bottommost_level_compaction(rocksdict.BottommostLevelCompaction.force())
    db.compact_range(None, None, compact)  # every file rewritten into the bottommost level
    compacted = _sst_bytes(path)

    assert flushed < raw / 2
    assert compacted < flushed
    assert compacted < raw / 3
    sample = random.Random(1).sample(sorted(written), 100)
    assert [db.get(key) for key in sample] == [written[key] for key in sample]
    assert len(list(db.keys())) == len(written)


def test_a_file_dense_with_tombstones_is_compacted_away(tmp_path: Path, open_dbs: list[rocksdict.Rdict]) -> None:
    """Every settled message leaves a tombstone; a file full of them is compacted without waiting for L0 to fill."""
    settings = _settings(tmp_path)
    options = TunedRocksDBOptions.from_settings(settings, SharedMemory.from_settings(settings))
    path = tmp_path / "retry_payloads-0.db"
    db = _open(options, path, open_dbs)
    keys = [_payload_key(f"key-{i:06d}".encode(), f"items/0/{i}") for i in range(20_000)]
    for key in keys:
        db.put(key, b"v" * 300)
    db.flush()
    for key in keys[:-10]:
        db.delete(key)
    db.flush()

    deadline = time.monotonic() + 20
    while len(db.live_files()) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(db.live_files()) <= 1
    assert [key for key, _ in db.items()] == keys[-10:]


def _app(tmp_path: Path, store: str) -> Any:
    return faust.App("rebound-tuning-test", store=store, datadir=str(tmp_path), web_enabled=False)


def _table(app: Any, name: str) -> Any:
    return app.Table(name, default=None, partitions=PARTITIONS, key_type=bytes, value_type=bytes)


async def test_install_tunes_both_tables_of_a_worker_with_one_cache(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    app = _app(tmp_path, "rocksdb://")
    states, payloads = _table(app, "retry_state"), _table(app, "retry_payloads")
    for table in (states, payloads):
        install(table, settings)
        assert table._data is None  # the store is still made by Faust, when the table starts

    stores = [states.data, payloads.data]
    tuned = [store.rocksdb_options for store in stores]
    assert all(isinstance(options, TunedRocksDBOptions) for options in tuned)
    assert tuned[0].shared is tuned[1].shared  # one cache and one write buffer manager for the worker
    assert (
        tuned[0].shared.capacity_bytes
        == (settings.rocksdb_block_cache_mb + settings.rocksdb_write_buffer_total_mb) * MIB
    )
    try:
        for store in stores:
            for partition in range(PARTITIONS):
                db = store._db_for_partition(partition)  # what Faust opens when the partition is assigned
                db.put(b"k", b"v%d" % partition)
        assert stores[1]._db_for_partition(3).get(b"k") == b"v3"
        written = _options_file(stores[1].partition_path(3))
        assert "compression=kLZ4Compression" in written
        assert "filter_policy=bloomfilter" in written
    finally:
        for store in stores:
            for db in store._dbs.values():
                db.close()


async def test_install_tunes_a_store_already_made_but_not_one_with_open_databases(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    app = _app(tmp_path, "rocksdb://")
    early, late = _table(app, "early"), _table(app, "late")
    store = early.data
    install(early, settings)
    assert isinstance(store.rocksdb_options, TunedRocksDBOptions)

    db = late.data._db_for_partition(0)
    try:
        with pytest.raises(RuntimeError, match="too late"):
            install(late, settings)
    finally:
        db.close()


async def test_install_leaves_a_memory_table_alone(tmp_path: Path) -> None:
    settings = _settings(tmp_path, store="memory://")
    app = _app(tmp_path, "memory://")
    table = _table(app, "retry_state")
    make_store = table._new_store_by_url

    install(table, settings)

    assert table._new_store_by_url == make_store
    assert table._data is None
    assert not hasattr(table.data, "rocksdb_options")


def test_memtable_budget_below_one_memtable_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="REBOUND_ROCKSDB_WRITE_BUFFER_TOTAL_MB"):
        _settings(tmp_path, rocksdb_write_buffer_mb=64, rocksdb_write_buffer_total_mb=32)
