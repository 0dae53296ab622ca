"""Workers of one group with other retry settings: logged once per change, a gauge, and listed in /retry/backlog."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from agents.runtime import Runtime
from agents.status import build_summary, status_board
from app.views import cluster_backlog
from rebound.agreement import group_settings
from rebound.settings import load_settings
from rebound.summary import WorkerSummary
from tests.agents.conftest import FakeClock


def mismatch_gauge(runtime: Runtime) -> float:
    lines = runtime.metrics.exposition()[0].decode().splitlines()
    return float(next(line for line in lines if line.startswith("rebound_settings_mismatch ")).split()[1])


def test_a_worker_with_another_sequence_is_warned_about_once_counted_and_listed(
    make_runtime: Callable[..., Runtime], clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = make_runtime(retry_sequence="2s,5s,10s")
    board = status_board(runtime)
    mine = build_summary(runtime)
    assert mine.settings is not None and mine.settings.values["retry_sequence"] == "2s,5s,10s"
    theirs = group_settings(load_settings(handler="m:f", main_topics="items", retry_sequence="1m"))

    def other(worker: str, settings: object) -> None:
        published = {**mine.to_dict(), "worker": worker, "url": f"http://{worker}", "at": clock()}
        published["settings"] = settings
        board.record(WorkerSummary.from_dict(published))  # as the status reader does with each record

    other("older", None)  # a worker from before the field: ignored
    other("same", mine.settings.to_dict())
    assert mismatch_gauge(runtime) == 0 and cluster_backlog(runtime)["settings_mismatch"] == []

    caplog.set_level(logging.INFO, logger="agents.status")
    other("b", theirs.to_dict())
    assert mismatch_gauge(runtime) == 1
    listed = cluster_backlog(runtime)["settings_mismatch"]
    assert [(m["worker"], m["differs"]) for m in listed] == [("b", {"retry_sequence": ["2s,5s,10s", "1m"]})]
    clock.advance(2000)
    other("b", theirs.to_dict())  # its next summary: same values, no second line
    board.settings_mismatch(clock())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert board.worker_id in warnings[0] and " b " in warnings[0] and "2s,5s,10s here, 1m there" in warnings[0]

    other("b", mine.settings.to_dict())  # b restarted with our settings
    assert mismatch_gauge(runtime) == 0
    other("b", theirs.to_dict())  # and back: a change, logged again
    assert mismatch_gauge(runtime) == 1
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2

    clock.advance(60_000)  # b stopped publishing: no longer fresh, no longer counted
    assert mismatch_gauge(runtime) == 0
