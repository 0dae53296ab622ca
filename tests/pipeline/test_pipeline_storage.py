"""``pipeline.storage.Location`` on a local directory and on fsspec's in-memory file system (an object store stand-in
that behaves like one: no directories, whole-object writes); S3 itself is exercised through the jobs' tests."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from pipeline.storage import Location, StorageError, location


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    if request.param == "local":
        return Location(tmp_path / "out")
    return Location(f"memory://bucket-{uuid.uuid4().hex[:8]}/out")


def test_write_read_and_children(root: Location) -> None:
    target = root / "redrive" / "plans" / "run-1.jsonl"
    assert not target.exists()
    target.write_text('{"a": 1}\n')
    assert target.exists()
    assert target.read_text() == '{"a": 1}\n'
    assert target.name == "run-1.jsonl"
    assert target.parent == root / "redrive" / "plans"
    target.write_bytes(b"replaced")  # a whole-object replace, never an append
    assert target.read_bytes() == b"replaced"


def test_glob_lists_children_sorted_with_the_same_url_form(root: Location) -> None:
    for name in ("b.jsonl", "a.jsonl", "c.txt"):
        (root / "ledger" / name).write_text(name)
    assert (root / "ledger").glob("*.jsonl") == [root / "ledger" / "a.jsonl", root / "ledger" / "b.jsonl"]
    assert (root / "nothing-here").glob("*") == []


def test_create_exclusive_lets_exactly_one_writer_win(root: Location) -> None:
    lock = root / "redrive" / "lock"
    assert lock.create_exclusive(b"first")
    assert not lock.create_exclusive(b"second")
    assert lock.read_bytes() == b"first"
    lock.unlink()
    assert lock.create_exclusive(b"third")


def test_local_paths_are_absolute_for_spark_and_usable_as_fspath(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    loc = Location("out/pipeline")
    assert str(loc) == str(tmp_path / "out" / "pipeline")
    assert Location(f"file://{tmp_path}/x") == Location(tmp_path / "x")
    assert Path(loc / "facts") == tmp_path / "out" / "pipeline" / "facts"


def test_remote_urls_are_kept_as_spark_spells_them() -> None:
    loc = Location("s3a://bucket/rebound/out/")
    assert str(loc / "facts") == "s3a://bucket/rebound/out/facts"
    assert (loc / "facts").parent == loc
    with pytest.raises(StorageError, match="not a local path"):
        Path(loc)  # type: ignore[arg-type]
    assert location(loc) is loc


def test_a_url_without_an_fsspec_driver_says_what_to_install() -> None:
    with pytest.raises(StorageError, match="no fsspec driver for nosuchfs://"):
        Location("nosuchfs://bucket/out").exists()
