"""``make demo`` removes its ``rebound-demo-*`` directory when it ends (by itself, Ctrl-C or SIGTERM), keeps it with
``--keep-files`` or when it failed (the worker log is there). It left one behind at every run before."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from demo.__main__ import demo_files, main


@pytest.fixture(autouse=True)
def temporary_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def made(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("rebound-demo-*"))


def test_the_files_are_removed_when_the_demo_ends(tmp_path: Path) -> None:
    with demo_files(keep=False) as files:
        (files.path / "data").mkdir()
        (files.path / "worker.log").write_text("...")
        assert made(tmp_path) == [files.path]
    assert made(tmp_path) == []


@pytest.mark.parametrize("interruption", [asyncio.CancelledError, KeyboardInterrupt], ids=["sigterm", "ctrl-c"])
def test_the_files_are_removed_when_the_demo_is_interrupted(tmp_path: Path, interruption: type[BaseException]) -> None:
    with pytest.raises(interruption), demo_files(keep=False) as files:
        (files.path / "worker.log").write_text("...")
        raise interruption()
    assert made(tmp_path) == []


def test_the_files_are_kept_when_asked_or_when_the_demo_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with demo_files(keep=True) as kept:
        pass
    with pytest.raises(RuntimeError), demo_files(keep=False) as broken:
        raise RuntimeError("the broker went away")
    with demo_files(keep=False) as unfinished:
        unfinished.failed = True  # the scenario did not finish in time
    assert made(tmp_path) == sorted([kept.path, broken.path, unfinished.path])
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"kept {kept.path} (--keep-files): the worker log is {kept.path / 'worker.log'}",
        f"kept {broken.path} (the demo did not finish): the worker log is {broken.path / 'worker.log'}",
        f"kept {unfinished.path} (the demo did not finish): the worker log is {unfinished.path / 'worker.log'}",
    ]


def test_keep_files_is_a_flag_of_the_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    async def play(keep_running: bool, timeout: float, keep_files: bool = False) -> int:
        seen.update(keep_running=keep_running, keep_files=keep_files)
        return 0

    monkeypatch.setattr("demo.__main__.play", play)
    assert main(["--keep-files"]) == 0
    assert seen == {"keep_running": False, "keep_files": True}
