"""What ``make broker`` (``python -m demo.embedded_broker``) tells a user to set for a worker started by hand.

A worker started with only what it printed before (the broker URL and the two Tansu settings) joined its group 30 s
after it started: Tansu's first join waits half the rebalance timeout, 60 s by default. The demo and the tests ask
for 4 s (``demo/harness.py``). The printed line must carry those group timeouts too, as one line a shell runs."""

from __future__ import annotations

import io
import shlex
import shutil
import signal
import subprocess
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from demo import embedded_broker
from demo.harness import FAST_GROUP_TIMEOUTS
from rebound.settings import load_settings

REPO = Path(__file__).resolve().parents[2]


class _Exited:
    returncode = 0

    def poll(self) -> int:
        return 0  # the broker "exits" at once: main() returns after printing


def test_make_broker_prints_one_export_line_with_the_fast_join_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    broker = embedded_broker.EmbeddedBroker(process=_Exited(), port=24999)  # type: ignore[arg-type]
    monkeypatch.setattr(embedded_broker, "start_broker", lambda port=None: broker)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    out = io.StringIO()
    with redirect_stdout(out):
        assert embedded_broker.main([]) == 0
    [export] = [line for line in out.getvalue().splitlines() if line.startswith("export ")]
    settings = dict(word.split("=", 1) for word in shlex.split(export)[1:])
    assert settings["REBOUND_BROKER"] == "kafka://127.0.0.1:24999"
    for name in ("REBOUND_REBALANCE_TIMEOUT", "REBOUND_SESSION_TIMEOUT", "REBOUND_HEARTBEAT_INTERVAL"):
        assert settings.get(name) == FAST_GROUP_TIMEOUTS[name], name  # as the demo's workers join
    for name, value in embedded_broker.TANSU_SETTINGS.items():
        assert settings[name] == value
    loaded: Any = load_settings(
        handler="demo.handler:handle",
        **{name.removeprefix("REBOUND_").lower(): value for name, value in settings.items()},
    )
    assert loaded.rebalance_timeout <= 4  # the first join waits about half of it on the embedded broker


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_worker_installs_what_the_demo_does_not_the_pipeline_and_dev_tools(tmp_path: Path) -> None:
    """Found trying it as a new user: after ``make demo`` (the project and the embedded broker), ``make worker`` first
    installed ``.[pipeline,dev]`` (Spark and the dev tools) though a worker needs neither. ``make -n`` in a fresh venv
    path shows what it would install."""
    venv = tmp_path / "venv"
    planned = subprocess.run(
        ["make", "-n", "worker", f"VENV={venv}"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert "-e '.[embedded]'" in planned
    assert "pipeline" not in planned and "dev]" not in planned
    assert "-m faust -A app worker" in planned
