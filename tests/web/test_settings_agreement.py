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
    board.started_ms = clock()  # (made at the build with the wall clock, the fake one set after)
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


def test_a_restarted_worker_does_not_take_its_previous_process_for_a_worker_that_disagrees(
    make_runtime: Callable[..., Runtime], clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Restarted with new settings, a worker reads its previous process's last summary (its id has the old process
    id) while it is still fresh: published before this process started, it is not compared. (A real restart on the
    embedded broker reads it too late for that: tests/web/test_settings_agreement_workers.py.)"""
    runtime = make_runtime(retry_sequence="1m")
    board = status_board(runtime)
    board.started_ms = clock()  # (made at the build with the wall clock, the fake one set after)
    mine = build_summary(runtime)
    old_settings = group_settings(load_settings(handler="m:f", main_topics="items", retry_sequence="2s,5s"))
    previous = {**mine.to_dict(), "worker": f"{board.url.split('://')[-1]}/1", "settings": old_settings.to_dict()}
    caplog.set_level(logging.INFO, logger="agents.status")
    clock.advance(3000)  # its first read of the status topic, 3 s after its start
    board.record(WorkerSummary.from_dict({**previous, "at": clock() - 4000}))  # sent 1 s before this process started

    assert mismatch_gauge(runtime) == 0 and cluster_backlog(runtime)["settings_mismatch"] == []
    assert [r for r in caplog.records if r.levelno == logging.WARNING] == []
    # Another worker with those settings, still running (its summary sent since this worker started), is told.
    board.record(WorkerSummary.from_dict({**previous, "worker": "other/2", "at": clock() - 500}))
    assert mismatch_gauge(runtime) == 1
    assert [m["worker"] for m in cluster_backlog(runtime)["settings_mismatch"]] == ["other/2"]
