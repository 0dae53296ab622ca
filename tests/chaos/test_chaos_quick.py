"""The quick chaos run: 2 workers, 600 messages, one SIGKILL + restart, one SIGSTOP/SIGCONT, on each Kafka
implementation ``REBOUND_TEST_KAFKA`` selects: the embedded broker (Tansu) and librdkafka's mock cluster (3 brokers).

It runs ``python -m chaos --quick --kafka KIND`` as a subprocess, as ``make chaos`` does, and reads its
``result.json``. On the embedded broker this run lost 11 to 24 messages to offsets skipped after a rebalance until
Rebound's own consumer (``app/consumer.py``); since then it is a gate there too.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.kafka_under_test import MOCK, selected_kafkas

pytestmark = pytest.mark.broker

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 240


def run_quick(out: Path, kafka: str) -> tuple[int, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "chaos", "--quick", "--kafka", "mock" if kafka == MOCK else "tansu", "--out", str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGTERM, not SIGKILL: the harness then ends the workers it started before exiting.
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
        pytest.fail(f"the quick chaos run took more than {RUN_TIMEOUT_S}s:\n{output.decode(errors='replace')[-4000:]}")
    return process.returncode, output.decode(errors="replace")


@pytest.mark.parametrize("kafka", selected_kafkas())
def test_quick_chaos_run_conserves_every_message(tmp_path: Path, kafka: str) -> None:
    returncode, output = run_quick(tmp_path, kafka)
    result_path = tmp_path / "result.json"
    assert result_path.exists(), output[-4000:]
    result: dict[str, Any] = json.loads(result_path.read_text())
    check, run = result["check"], result["run"]
    summary = (tmp_path / "summary.md").read_text()

    assert run["faults_injected"].get("kill", 0) >= 1, run["faults"]
    assert run["faults_injected"].get("stop", 0) >= 1, run["faults"]
    assert check["messages"] == run["messages_planned"] == 600, run["messages_unacknowledged"]
    assert check["lost"]["count"] == 0, json.dumps(check["lost"], indent=1)
    assert check["early"]["count"] == 0, json.dumps(check["early"], indent=1)
    assert check["multi_terminal"]["count"] == 0, json.dumps(check["multi_terminal"], indent=1)
    assert check["passed"], summary
    assert returncode == 0, output[-4000:]
