"""The pure parts of ``noop-ratio`` and its stock-Faust baseline: the variant list, the ratios to each bare agent, the
target's baseline, the check that the stock baseline runs Faust's own classes with the fetch wait set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import faust
import pytest

from bench.baselines.stock import PATH_LINE, FetchWaitConsumerThread, check_path, make_stock_app, path_in_use
from bench.scenarios.noop_ratio import VARIANTS, path_line, round_ratios, summarize, variants


def test_all_variants_by_default_with_stock_faust_among_them() -> None:
    assert list(variants("")) == list(VARIANTS)
    assert variants("")["stock-faust"] == {"BENCH_STOCK_FAUST": "1"}


def test_the_chosen_variants_run_in_the_order_given() -> None:
    assert list(variants("stock-faust, rebound,bare-faust")) == ["stock-faust", "rebound", "bare-faust"]
    assert list(variants("rebound,stock-faust")) == ["rebound", "stock-faust"]  # stock Faust alone as the baseline


@pytest.mark.parametrize("text", ["rebound", "rebound,rebound-c1", "rebound,bare", "rebound,bare-faust,rebound"])
def test_a_choice_without_a_bare_agent_or_with_an_unknown_or_repeated_name_is_refused(text: str) -> None:
    with pytest.raises(SystemExit, match="BENCH_NOOP_VARIANTS"):
        variants(text)


def test_rebound_is_compared_with_each_bare_agent_that_ran_by_rate_and_by_cpu() -> None:
    rates = {"rebound": 6000.0, "bare-faust": 8000.0, "stock-faust": 4000.0}
    cpu: dict[str, float | None] = {"rebound": 100.0, "bare-faust": 70.0, "stock-faust": 150.0}
    assert round_ratios(rates, cpu) == {
        "rebound_vs_bare": 0.75,
        "rebound_vs_bare_cpu": 0.7,
        "rebound_vs_stock": 1.5,
        "rebound_vs_stock_cpu": 1.5,
        "bare_vs_stock": 2.0,
        "bare_vs_stock_cpu": 2.143,
    }


def test_a_ratio_whose_variant_or_baseline_did_not_run_is_left_out_and_a_lost_cpu_sample_is_none() -> None:
    ratios = round_ratios({"rebound-c1": 3000.0, "stock-faust": 4000.0}, {"rebound-c1": None, "stock-faust": 150.0})
    assert ratios == {"rebound_c1_vs_stock": 0.75, "rebound_c1_vs_stock_cpu": None}


def a_round(index: int, rates: dict[str, float], cpu: dict[str, float | None]) -> dict[str, Any]:
    return {
        "round": index,
        "messages_per_s": rates,
        "cpu_us_per_message": cpu,
        "offsets_covered": dict.fromkeys(rates, True),
        **round_ratios(rates, cpu),
    }


def test_the_target_is_measured_against_stock_faust_when_it_ran() -> None:
    chosen = variants("rebound,bare-faust,stock-faust")
    runs = [
        a_round(1, {"rebound": 5000.0, "bare-faust": 8000.0, "stock-faust": 5000.0}, dict.fromkeys(chosen, 100.0)),
        a_round(2, {"rebound": 6000.0, "bare-faust": 8000.0, "stock-faust": 4000.0}, dict.fromkeys(chosen, 100.0)),
        a_round(3, {"rebound": 4000.0, "bare-faust": 8000.0, "stock-faust": 5000.0}, dict.fromkeys(chosen, 100.0)),
    ]
    summary = summarize(runs, 20_000, chosen)["summary"]
    assert summary["rebound_vs_stock"] == 1.0  # 1.0, 1.5, 0.8
    assert summary["rebound_vs_stock_spread"] == {"median": 1.0, "min": 0.8, "max": 1.5, "range": 0.7}
    assert summary["rebound_vs_bare"] == 0.625  # 0.625, 0.75, 0.5
    assert summary["rebound_c1_vs_bare"] is None
    assert (summary["target_against"], summary["target_met"]) == ("stock-faust", True)
    assert summary["offsets_covered"] == {"rebound": True, "bare-faust": True, "stock-faust": True}


def test_without_stock_faust_the_target_is_measured_against_the_other_bare_agent() -> None:
    chosen = variants("rebound,bare-faust")
    runs = [a_round(1, {"rebound": 5000.0, "bare-faust": 8000.0}, {"rebound": 100.0, "bare-faust": 70.0})]
    runs[0]["offsets_covered"]["bare-faust"] = False
    summary = summarize(runs, 20_000, chosen)["summary"]
    assert (summary["target_against"], summary["target_met"]) == ("bare-faust", False)
    assert summary["rebound_vs_stock"] is None
    assert summary["offsets_covered"] == {"rebound": True, "bare-faust": False}


STOCK_PATH = {
    "app": "faust.app.base.App",
    "maybe_start_producer": "faust.app.base.App",
    "consumer": "bench.baselines.stock.FetchWaitConsumer",
    "hand_over": "faust.transport.consumer.Consumer",
    "consumer_thread": "bench.baselines.stock.FetchWaitConsumerThread",
    "producer": "faust.transport.drivers.aiokafka.Producer",
    "fetch_max_wait_ms": 100,
    "isolation_level": "read_uncommitted",
    "rebound_imported": [],
}


def test_the_stock_path_passes_and_rebound_s_classes_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REBOUND_FETCH_MAX_WAIT_MS", "100")
    assert check_path(STOCK_PATH) == []
    rebound = {
        **STOCK_PATH,
        "app": "app.consumer.ReboundApp",
        "maybe_start_producer": "app.consumer.ReboundApp",
        "hand_over": "app.consumer.ReboundConsumer",
        "producer": "app.producer.ReboundProducer",
        "rebound_imported": ["app", "app.consumer", "app.producer", "rebound"],
    }
    assert len(check_path(rebound)) == 5
    assert check_path({**STOCK_PATH, "rebound_imported": ["rebound", "tables"]}) == []  # the floor's settings
    assert check_path({**STOCK_PATH, "fetch_max_wait_ms": 1500}) == ["the fetch wait is 1500, not 100"]


def test_the_path_line_is_read_from_faust_s_log_line(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    log.write_text(f"banner\n[2026-12-06 19:20:15,349] [25075] [WARNING] {PATH_LINE} {STOCK_PATH!r}\n")
    assert path_line(log) == STOCK_PATH
    assert path_line(tmp_path / "absent.log") is None
    log.write_text(f"[WARNING] {PATH_LINE} {{'app': \n")
    assert path_line(log) is None


async def test_the_stock_app_is_faust_s_and_only_its_fetch_wait_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_BROKER", "kafka://127.0.0.1:1")
    monkeypatch.setenv("BENCH_APP_ID", "stock-test")
    monkeypatch.setenv("REBOUND_FETCH_MAX_WAIT_MS", "100")
    app = make_stock_app()
    assert type(app) is faust.App
    thread = app.consumer._thread
    assert isinstance(thread, FetchWaitConsumerThread)
    consumer = thread._create_worker_consumer(app.transport)  # made, not started: no connection
    try:
        assert consumer._fetch_max_wait_ms == 100
        assert consumer._isolation_level == "read_uncommitted"  # Faust's, not Rebound's read_committed
    finally:
        await consumer._client.close()
    path = path_in_use(app)
    assert path["fetch_max_wait_ms"] is None  # no fetcher before the consumer starts
    assert check_path({**path, "fetch_max_wait_ms": 100, "rebound_imported": []}) == []
