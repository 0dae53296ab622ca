"""The report's small files go through ``Location`` (fsspec), so they land on object stores too: here the in-memory
fsspec file system stands in for one (no local path exists for it)."""

from __future__ import annotations

import datetime as dt

import pandas as pd

from pipeline.jobs.report import render_charts, render_html
from pipeline.storage import Location

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tables() -> dict[str, pd.DataFrame]:
    hour = dt.datetime(2024, 5, 1, 10)
    return {
        "outcomes_per_tier": pd.DataFrame(
            {
                "tier": ["first try", "30s"],
                "succeeded": [3, 1],
                "scheduled": [2, 0],
                "dead": [0, 1],
                "expired": [0, 0],
                "scheduled_to": ["30s (2)", ""],
            }
        ),
        "attempts_to_success": pd.DataFrame({"attempts_before_success": [0, 1], "count": [3, 1]}),
        "recovery_percentiles": pd.DataFrame(
            {
                "error_class": ["TimeoutError"],
                "original_topic": ["items"],
                "recovered": [1],
                "p50_s": [30.0],
                "p90_s": [30.0],
                "p99_s": [30.0],
            }
        ),
        "failed_growth": pd.DataFrame(
            {
                "topic": ["items.failed"] * 2,
                "hour": [hour, hour + dt.timedelta(hours=1)],
                "reason": ["exhausted"] * 2,
                "count": [1, 2],
                "cumulative": [1, 3],
            }
        ),
    }


def test_charts_and_html_are_written_through_fsspec() -> None:
    out = Location("memory://rebound-report-test/out/report")
    tables = _tables()
    charts = render_charts(tables, out)
    assert charts == {name: f"{name}.png" for name in tables}
    for name in [*tables, "overview"]:
        data = (out / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
    render_html(tables, charts, {"events": 7}, out / "index.html")
    page = (out / "index.html").read_text()
    assert page.count("<img") == len(tables) and "&quot;events&quot;: 7" in page
    out.fs.rm(out.parent.fs_path, recursive=True)


def test_no_charts_without_data() -> None:
    out = Location("memory://rebound-report-test/empty/report")
    empty = {name: frame.iloc[0:0] for name, frame in _tables().items()}
    assert render_charts(empty, out) == {}
    assert not (out / "overview.png").exists()
