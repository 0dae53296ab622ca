"""``facts --trigger``: a long-running query that keeps the table fresh, de-duplicates, and stops cleanly on SIGTERM
or Ctrl-C (SIGINT) with exit status 0."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import create_topics, produce, unique

from pipeline.jobs.facts import read_facts
from rebound.attempts import AttemptEvent, event_id

pytestmark = [pytest.mark.broker, pytest.mark.spark]

REPO = Path(__file__).resolve().parents[2]
DAY = dt.datetime(2024, 5, 1, tzinfo=dt.UTC)


def _ms(value: dt.datetime) -> int:
    return int(value.timestamp() * 1000)


def _event(offset: int, at: dt.datetime) -> AttemptEvent:
    return AttemptEvent(
        event_id=event_id("g", "items", 0, offset, 0, "succeeded"),
        group="g",
        key=f"k{offset}",
        original_topic="items",
        original_partition=0,
        original_offset=offset,
        attempt=0,
        tier=None,
        outcome="succeeded",
        reason=None,
        error_class=None,
        error_message=None,
        first_received_at=_ms(DAY + dt.timedelta(hours=23, minutes=50)),
        due_at=None,
        event_time=_ms(at),
        next_tier=None,
    )


def _publish(bootstrap: str, topic: str, events: list[AttemptEvent]) -> None:
    produce(bootstrap, topic, [{"value": e.to_json(), "key": e.event_id.encode()} for e in events])


def _event_ids(spark, out: Path) -> list[str]:
    if not any((out / "facts").glob("date=*")):
        return []
    return [r["event_id"] for r in read_facts(spark, out / "facts").select("event_id").collect()]


def _wait_for(condition: Callable[[], bool], proc: subprocess.Popen[str], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the streaming job exited early with {proc.returncode}:\n{out}\n{err[-4000:]}")
        if condition():
            return
        time.sleep(1)
    pytest.fail("the streaming job did not write the expected facts in time")


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_stream_writes_new_events_without_duplicates_and_stops_cleanly(spark, broker, tmp_path, stop_signal) -> None:
    app = unique("app")
    attempts = f"{app}.attempts"
    create_topics(broker.bootstrap, {attempts: 1})
    first, second = _event(1, DAY + dt.timedelta(hours=23, minutes=59)), _event(2, DAY + dt.timedelta(hours=23))
    _publish(broker.bootstrap, attempts, [first, second])
    command = [
        sys.executable,
        "-m",
        "pipeline",
        "facts",
        "--master",
        "local[1]",
        "--trigger",
        "2 seconds",
        "--bootstrap",
        broker.bootstrap,
        "--app-id",
        app,
        "--out",
        str(tmp_path),
    ]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: sorted(_event_ids(spark, tmp_path)) == sorted([first.event_id, second.event_id]), proc)

        # While it runs: a re-emission of the first event on the next UTC date, then a new event behind it on the
        # same partition. Once the new one is in the table, the re-emission has been processed too.
        reemitted = _event(1, DAY + dt.timedelta(days=1, seconds=30))
        third = _event(3, DAY + dt.timedelta(days=1, minutes=1))
        _publish(broker.bootstrap, attempts, [reemitted, third])
        _wait_for(lambda: third.event_id in _event_ids(spark, tmp_path), proc)
        assert sorted(_event_ids(spark, tmp_path)) == sorted([first.event_id, second.event_id, third.event_id])

        proc.send_signal(stop_signal)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    assert f"{stop_signal.name} received" in err
    assert "read 4 new attempt records" in out and "3 facts in" in out


def test_stream_stopped_with_its_whole_process_group_exits_cleanly(spark, broker, tmp_path) -> None:
    """A container runtime, ``timeout`` or a shell may signal the whole process group, so Spark's JVM gets SIGTERM
    too and its shutdown hook stops the SparkContext under the query: that is a stop, not a failed job."""
    app = unique("app")
    attempts = f"{app}.attempts"
    create_topics(broker.bootstrap, {attempts: 1})
    first = _event(1, DAY + dt.timedelta(hours=23, minutes=59))
    _publish(broker.bootstrap, attempts, [first])
    command = [sys.executable, "-m", "pipeline", "facts", "--master", "local[1]", "--trigger", "2 seconds"]
    command += ["--bootstrap", broker.bootstrap, "--app-id", app, "--out", str(tmp_path)]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _wait_for(lambda: _event_ids(spark, tmp_path) == [first.event_id], proc)
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    assert "facts:" in out
    assert _event_ids(spark, tmp_path) == [first.event_id]
