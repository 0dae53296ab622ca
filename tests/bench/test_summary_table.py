"""The table ``python -m bench`` prints at the end: every scenario's committed JSON gives it rows; and without
matplotlib (``make demo``'s install) a run still writes its JSON and the table, skipping only the chart with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import charts
from bench.__main__ import SCENARIOS

REPO = Path(__file__).resolve().parents[2]
RESULTS = sorted((REPO / "bench" / "results").glob("*.json"))


def scenario_of(path: Path) -> Any:
    return json.loads(path.read_text()).get("scenario")


def test_every_scenario_has_a_result_to_check_its_table_rows_on() -> None:
    assert set(SCENARIOS) <= {scenario_of(path) for path in RESULTS}


@pytest.mark.parametrize("path", [p for p in RESULTS if scenario_of(p) in SCENARIOS], ids=lambda p: p.name)
def test_each_scenarios_result_gives_the_table_its_headline_rows(path: Path) -> None:
    payload = json.loads(path.read_text())
    name = payload["scenario"]
    lines = charts.table({name: payload}).splitlines()
    assert lines[0].split() == ["scenario", "variant", "figure", "value"]
    assert len(lines) > 1
    assert all(line.startswith(name) for line in lines[1:])


# A run of failure-path as the new user's install meets it: matplotlib cannot be imported, the broker and the scenario
# are stood in for (no broker starts here), the figures are those of the committed JSON.
WITHOUT_MATPLOTLIB = """
import contextlib, json, sys
sys.modules["matplotlib"] = None  # import matplotlib -> ModuleNotFoundError
import bench.__main__ as bench_main
import bench.scenarios.failure_path as scenario
payload = json.loads(open(sys.argv[1]).read())
bench_main.fresh_broker = lambda root: contextlib.nullcontext(None)
scenario.run = lambda ctx, broker: {k: v for k, v in payload.items() if k not in ("scenario", "machine", "quick")}
sys.exit(bench_main.main(sys.argv[2:]))
"""


def run_without_matplotlib(*args: str) -> subprocess.CompletedProcess[str]:
    source = REPO / "bench" / "results" / "failure-path.json"
    command = [sys.executable, "-c", WITHOUT_MATPLOTLIB, str(source), *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)


def test_without_matplotlib_a_run_writes_the_json_and_the_table_and_skips_the_chart(tmp_path: Path) -> None:
    done = run_without_matplotlib("failure-path", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    notes = [line for line in done.stderr.splitlines() if "matplotlib" in line]
    assert len(notes) == 1
    assert notes[0].startswith("charts skipped:") and "make install" in notes[0]
    written = json.loads((tmp_path / "failure-path.json").read_text())
    assert written["summary"]["first_try_per_s"] == 3937.15
    assert not (tmp_path / "failure-path.png").exists()
    assert "failure-path  rebound 9dddc55  first try msg/s" in done.stdout


def test_without_matplotlib_a_redraw_prints_the_table(tmp_path: Path) -> None:
    (tmp_path / "release-burst.json").write_text((REPO / "bench" / "results" / "release-burst.json").read_text())
    done = run_without_matplotlib("--redraw", "--out", str(tmp_path), "release-burst")
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("charts skipped:") and len(done.stderr.splitlines()) == 1
    assert "release-burst  unpaced     most calls in 1 s / 100 ms" in done.stdout
    assert not (tmp_path / "release-burst.png").exists()
