"""An orphan retry an end replaced (``rebound.state.without_orphan``) is counted and leaves the release schedule in
both modes: key order's ``record_outcome`` and ``run_held`` drop it as the default mode's ``remember_outcome`` does
(``agents.lifecycle.dropped_orphan``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agents.runtime import Runtime
from tests.agents.test_dead_letter_intent import calls, read_again_while_its_retry_parks  # noqa: F401


@pytest.mark.parametrize("ordering", ["none", "key"])
async def test_an_orphan_retry_ended_by_a_rerun_success_is_counted_and_leaves_the_schedule(
    make_runtime: Any,
    clock: Any,
    calls: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    ordering: str,
) -> None:
    """The record read again because of its *sending* mark (key order: its block) succeeds while the tier agent
    parks its retry: the end removes that entry in both modes; in both it is counted and its slot discarded, so no
    release request for it goes out to find nothing."""
    runtime: Runtime = make_runtime(ordering=ordering)
    made = await read_again_while_its_retry_parks(runtime, clock, monkeypatch, "fail", "ok", "permanent")
    assert made == [(0, 0), (0, 0)]
    assert runtime.store.load(b"k", entries=True).pending == ()
    stale = runtime.counters["release.stale"]
    assert runtime.counters["main.orphan_retry_ended"] == 1, (
        f"the orphan retry was dropped without being counted (stale requests: {stale})"
    )
    assert runtime.counters["release.stale"] == 0, "the dropped orphan's slot stayed in the schedule"
