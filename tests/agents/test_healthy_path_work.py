"""What the main agent does for a healthy message: no record digest and no lifecycle write when its key has no state,
and the same digests as before in the marks a failing message leaves (``agents/main.py``, ``agents/lifecycle.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import agents.main
from agents.lifecycle import remember_outcome
from rebound.state import KeyState, record_digest
from tests.agents.support import Agents, handler_calls
from tests.scripted_handler import CALLS_ENV

SUCCEEDS = b'{"succeed_on": 0}'
FAILS_ONCE = b'{"succeed_on": 1}'
WRITTEN_AT = 1_700_000_000.0


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "calls.jsonl"
    monkeypatch.setenv(CALLS_ENV, str(path))
    return path


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Counts the main agent's digests and lifecycle writes (both still done: these only watch)."""
    seen: dict[str, list[Any]] = {"digests": [], "remembered": []}

    def digest(key: bytes | None, value: bytes | None) -> int:
        seen["digests"].append((key, value))
        return record_digest(key, value)

    async def remember(*args: Any, **options: Any) -> None:
        seen["remembered"].append(args[4])  # the outcome
        await remember_outcome(*args, **options)

    monkeypatch.setattr(agents.main, "record_digest", digest)
    monkeypatch.setattr(agents.main, "remember_outcome", remember)
    return seen


@pytest.mark.parametrize("ordering", ["none", "key"])
async def test_a_healthy_message_of_a_key_with_no_state_computes_no_digest_and_remembers_nothing(
    make_runtime: Any, calls: Path, work: dict[str, list[Any]], ordering: str
) -> None:
    runtime = make_runtime(ordering=ordering)
    runtime.schedule.adopt(0, [])
    runtime.store.index_partition(0)  # the partition's index is complete, as after its adoption
    async with Agents(runtime) as agents_:
        for key in (b"a", b"b", b"a"):
            await agents_.contexts["main"].put(SUCCEEDS, key=key, partition=0, timestamp=WRITTEN_AT)
    assert handler_calls(calls) == [("a", 0, 0), ("b", 1, 0), ("a", 2, 0)]  # (key, offset, attempt)
    assert work == {"digests": [], "remembered": []}
    assert runtime.table.get(b"a") is None and runtime.table.get(b"b") is None


async def test_a_failing_first_try_still_names_its_record_by_its_digest(
    make_runtime: Any, clock: Any, calls: Path, work: dict[str, list[Any]]
) -> None:
    """The retried message's sending and forwarded marks carry the digest, computed when they are written."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    runtime.store.index_partition(0)  # the partition's index is complete, as after its adoption
    async with Agents(runtime) as agents_:
        await agents_.contexts["main"].put(FAILS_ONCE, key=b"k", partition=0, timestamp=WRITTEN_AT)
        [mark] = KeyState.from_json(runtime.table.get(b"k")).marks
        assert mark.digest == record_digest(b"k", FAILS_ONCE)
        assert not mark.sending and not mark.ended  # forwarded
        assert work["remembered"] == ["scheduled"]
        assert work["digests"] and set(work["digests"]) == {(b"k", FAILS_ONCE)}
        await agents_.contexts["main"].put(SUCCEEDS, key=b"other", partition=0, timestamp=WRITTEN_AT)
        assert set(work["digests"]) == {(b"k", FAILS_ONCE)}, "the healthy record of another key was digested"
    assert handler_calls(calls) == [("k", 0, 0), ("other", 1, 0)]
