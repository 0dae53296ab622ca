"""The stall figure of issue 22 on small synthetic timelines: a stream with work ready and no call for longer than
30 s after a fault is found, a busy stream has none, and a stall that ended before any fault is not counted."""

from __future__ import annotations

import json
from pathlib import Path

from chaos.__main__ import RECHECK_RESULT, RECHECK_SUMMARY, main
from chaos.calllog import Call, CallLogWriter
from chaos.checker import CheckInputs, DueTime, Produced, StallWork, check, stall_summary
from chaos.evidence import save_observed, save_produced
from chaos.report import markdown
from chaos.scenario import SUCCEEDED, CallOutcome

TOPIC = "orders"
MAIN = (TOPIC, 0)
FAULT = [(10_000, 12_000, "kill w1.0")]


def at(ms: int, offset: int = 0, partition: int = 0, attempt: int = 0, tier: str | None = None) -> Call:
    return Call(
        mid=None,
        topic=TOPIC,
        partition=partition,
        offset=offset,
        attempt=attempt,
        call_ms=ms,
        outcome=CallOutcome.OK.value,
        tier=tier,
    )


def test_a_stream_with_work_waiting_over_30_s_after_its_fault_is_a_stall_over_target() -> None:
    # Calls at 5 s and 55 s; work ready at 8 s waits for the 55 s call. Counted from the fault's end (12 s): 43 s.
    work = [StallWork(MAIN, 1_000, 5_000), StallWork(MAIN, 8_000, 55_000)]
    stalls = stall_summary(work, [at(5_000), at(55_000, offset=1)], FAULT)
    assert stalls["worst_stream"] == "orders p0"
    assert stalls["worst_ms"] == 43_000
    assert stalls["over_target"] == 1 and stalls["streams"] == 1
    assert stalls["per_stream"]["orders p0"]["after"] == "kill w1.0"


def test_the_stall_counts_from_when_the_work_became_ready_if_that_is_after_the_fault() -> None:
    work = [StallWork(MAIN, 1_000, 5_000), StallWork(MAIN, 20_000, 55_000)]
    stalls = stall_summary(work, [at(5_000), at(55_000, offset=1)], FAULT)
    assert stalls["worst_ms"] == 35_000


def test_an_idle_stream_with_nothing_ready_is_not_stalled() -> None:
    # The same 50 s without a call, but the second record only became ready just before it was run.
    work = [StallWork(MAIN, 1_000, 5_000), StallWork(MAIN, 54_000, 55_000)]
    stalls = stall_summary(work, [at(5_000), at(55_000, offset=1)], FAULT)
    assert stalls["worst_ms"] == 1_000 and stalls["over_target"] == 0


def test_a_busy_stream_has_no_stall_beyond_its_call_spacing() -> None:
    calls = [at(ms, offset=index) for index, ms in enumerate(range(0, 60_000, 500))]
    work = [StallWork(MAIN, call.call_ms - 2_000, call.call_ms) for call in calls]  # a steady backlog
    stalls = stall_summary(work, calls, FAULT)
    assert stalls["worst_ms"] == 500 and stalls["over_target"] == 0


def test_a_stall_before_the_fault_is_ignored() -> None:
    # 40 s waiting from 1 s to 41 s; the only fault starts at 50 s: not caused by a fault, not counted.
    work = [StallWork(MAIN, 1_000, 41_000), StallWork(MAIN, 42_000, 43_000)]
    stalls = stall_summary(work, [at(41_000), at(43_000, offset=1)], [(50_000, 51_000, "stop w1.0")])
    assert stalls["worst_ms"] == 0 and stalls["over_target"] == 0


def test_a_stall_inside_a_fault_counts_only_after_the_fault_ended() -> None:
    work = [StallWork(MAIN, 1_000, 40_000)]
    stalls = stall_summary(work, [at(40_000)], [(2_000, 15_000, "stop w1.0")])
    assert stalls["worst_ms"] == 25_000


def test_work_never_run_stalls_until_the_last_call_of_the_run() -> None:
    work = [StallWork(MAIN, 1_000, 2_000), StallWork(MAIN, 3_000, None)]
    calls = [at(2_000), at(60_000, partition=1)]
    stalls = stall_summary(work, calls, FAULT)
    row = stalls["per_stream"]["orders p0"]
    assert row["stall_ms"] == 48_000 and row["unserved"] is True


def message(mid: str, partition: int, offset: int, expected_attempt: int = 0) -> Produced:
    return Produced(mid, (TOPIC, partition, offset), mid.encode(), b"{}", "success", SUCCEEDED, expected_attempt)


def stalled_run() -> CheckInputs:
    """Partition 0's second record (acknowledged before p1's, which was run at 9 s) waits until 50 s; a retry of
    tier 1s on partition 1, due at 11 s, waits until 45 s; a kill ran from 10 s to 12 s."""
    first, waiting, other = message("m1", 0, 0), message("m2", 0, 1), message("m3", 1, 0, expected_attempt=1)
    return CheckInputs(
        produced=[first, waiting, other],
        calls=[
            at(1_000),
            at(9_000, partition=1),
            at(50_000, offset=1),
            at(45_000, partition=1, attempt=1, tier="1s"),
        ],
        dead_letters=[],
        due_times=[DueTime(other.origin, 1, 11_000, "tier-header")],
        faults=[(10_000, "kill w1.0")],
        fault_windows=FAULT,
    )


def test_the_checker_bounds_ready_times_by_later_acknowledged_messages_and_streams_retries_by_tier() -> None:
    stalls = check(stalled_run()).stalls
    assert stalls["per_stream"]["orders p0"]["stall_ms"] == 38_000  # ready by 9 s, counted from 12 s, run at 50 s
    assert stalls["per_stream"]["tier 1s p1"]["stall_ms"] == 33_000  # due at 11 s, counted from 12 s, run at 45 s
    assert stalls["per_stream"]["orders p1"]["stall_ms"] == 0
    assert stalls["worst_stream"] == "orders p0" and stalls["over_target"] == 2


def test_without_fault_ends_the_fault_start_stands_in() -> None:
    inputs = stalled_run()
    inputs.fault_windows = ()
    assert check(inputs).stalls["worst_ms"] == 40_000


def test_the_report_shows_the_longest_stall_with_its_stream() -> None:
    result = {"check": check(stalled_run()).to_json(), "run": minimal_run()}
    assert "| longest stall after a fault, s (worst stream) | 38.0 (orders p0, after kill w1.0); 2 of 3 streams" in (
        markdown(result)
    )


def minimal_run() -> dict[str, object]:
    return {
        "run_id": "r",
        "started": "t",
        "commit": "c",
        "cpus": 2,
        "seed": 1,
        "workers": 1,
        "partitions": 2,
        "retry_sequence": "1s",
        "messages_planned": 3,
        "faults_injected": {"kill": 1},
        "faults": [{"kind": "kill", "target": "w1.0", "started_ms": 10_000, "ended_ms": 12_000}],
        "crashes": [],
        "wall_s": 60,
        "all_terminal_after_s": None,
    }


def test_recheck_measures_stalls_from_the_recorded_fault_ends_and_leaves_the_run_s_own_files_alone(
    tmp_path: Path,
) -> None:
    inputs = stalled_run()
    writer = CallLogWriter(tmp_path / "calls" / "w1.0.sqlite")
    for made in inputs.calls:
        writer.write(made)
    writer.close()
    save_produced(tmp_path, inputs.produced)
    save_observed(tmp_path, inputs)
    original = json.dumps({"run": minimal_run(), "check": {"old": True}})
    (tmp_path / "result.json").write_text(original, encoding="utf-8")
    (tmp_path / "summary.md").write_text("old", encoding="utf-8")
    main(["--recheck", str(tmp_path)])
    assert (tmp_path / "result.json").read_text(encoding="utf-8") == original
    assert (tmp_path / "summary.md").read_text(encoding="utf-8") == "old"
    rechecked = json.loads((tmp_path / RECHECK_RESULT).read_text(encoding="utf-8"))
    assert rechecked["check"]["stalls"]["worst_ms"] == 38_000
    assert "longest stall after a fault" in (tmp_path / RECHECK_SUMMARY).read_text(encoding="utf-8")
