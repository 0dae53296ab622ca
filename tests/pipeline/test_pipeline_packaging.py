"""Packaging for clusters: ``make pipeline-zip`` builds what ``spark-submit --py-files`` ships, and a real
``spark-submit`` runs a job from it where the repository is not importable (driver and Python workers alike)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import create_topics, produce, unique

from demo.embedded_broker import EmbeddedBroker

REPO = Path(__file__).resolve().parents[2]

# Hides this checkout from a child Python: the dev venv's editable install maps ``pipeline`` (and app, rebound, ...)
# to the repository through a meta-path finder, which would make any "runs from the zip" check pass vacuously.
HIDE_EDITABLE_INSTALL = """\
import sys

sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
"""


def test_pipeline_imports_nothing_of_the_faust_app() -> None:
    """The zip holds only ``pipeline/``: importing every module of it must not reach the Faust app or Rebound's core."""
    code = """
import importlib, json, pkgutil, sys
import pipeline
for module in pkgutil.walk_packages(pipeline.__path__, "pipeline."):
    if module.name != "pipeline.__main__":
        importlib.import_module(module.name)
import pipeline.__main__
roots = {"app", "agents", "tables", "rebound", "demo", "faust", "mode", "rocksdict"}
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in roots)))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, cwd=REPO
    )
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def _make_pipeline_zip(dist: Path) -> None:
    subprocess.run(
        ["make", "--no-print-directory", "pipeline-zip", f"DIST={dist}", f"PYTHON={sys.executable}"],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=120,
    )


def test_pipeline_zip_holds_the_package_only(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    _make_pipeline_zip(dist)
    names = zipfile.ZipFile(dist / "pipeline.zip").namelist()
    sources = sorted(
        str(p.relative_to(REPO)) for p in (REPO / "pipeline").rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )
    assert sorted(n for n in names if not n.endswith("/")) == sources
    assert not [n for n in names if "__pycache__" in n or not n.startswith("pipeline/")]
    requirements = (dist / "pipeline-requirements.txt").read_text().split()
    assert {re.split(r"[\[<>=!~;]", r)[0] for r in requirements} >= {"aiokafka", "pyarrow", "pandas"}
    assert not [r for r in requirements if r.startswith("pyspark")]  # the cluster's Spark brings its own
    # Executors decode the fetched batches: snappy, lz4 and zstd need aiokafka's extras (cramjam), gzip nothing.
    (aiokafka_line,) = [r for r in requirements if r.startswith("aiokafka")]
    extras = re.fullmatch(r"aiokafka\[([^\]]*)\].*", aiokafka_line)
    assert extras is not None, aiokafka_line
    assert {extra.strip() for extra in extras.group(1).split(",")} >= {"lz4", "snappy", "zstd"}


def test_aiokafkas_codec_extras_bring_cramjam() -> None:
    """What pip installs for ``aiokafka[lz4,snappy,zstd]`` (pyproject's dependency, and the executors' requirement
    ``make pipeline-zip`` copies from it): each extra must pull ``cramjam``, which aiokafka decodes those codecs with."""
    import importlib.metadata

    requires = importlib.metadata.requires("aiokafka") or []
    for extra in ("lz4", "snappy", "zstd"):
        assert any(r.startswith("cramjam") and f'extra == "{extra}"' in r for r in requires), (extra, requires)
    import aiokafka.codec

    assert aiokafka.codec.has_snappy() and aiokafka.codec.has_lz4() and aiokafka.codec.has_zstd()


def _failed_record(original_topic: str, key: bytes, reason: str, error: str, ts: int) -> dict[str, object]:
    headers = [
        ("rebound.original-topic", original_topic.encode()),
        ("rebound.original-partition", b"0"),
        ("rebound.original-offset", b"7"),
        ("rebound.reason", reason.encode()),
        ("rebound.error-class", error.encode()),
        ("rebound.error-message", b"boom"),
    ]
    return {"key": key, "value": b"{}", "headers": headers, "timestamp_ms": ts}


@pytest.mark.broker
@pytest.mark.spark
def test_spark_submit_runs_inventory_from_the_zip_outside_the_repo(tmp_path: Path, broker: EmbeddedBroker) -> None:
    """Build the zip, put four failed records on a fresh topic and run ``inventory`` through pyspark's own
    ``bin/spark-submit`` on ``local[2]`` from an empty directory; check the outputs against the records sent."""
    import pyspark

    bootstrap = broker.bootstrap

    dist = tmp_path / "dist"
    _make_pipeline_zip(dist)
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_EDITABLE_INSTALL)
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(hide),  # spark-submit passes it on to the driver and the Python workers
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }
    env.pop("SPARK_HOME", None)
    probe = subprocess.run(
        [sys.executable, "-c", "import pipeline"], cwd=work, env=env, capture_output=True, text=True, check=False
    )
    assert "No module named 'pipeline'" in probe.stderr, "the repository is still importable from the temp dir"

    main_topic = unique("pack")
    failed = f"{main_topic}.failed"
    create_topics(bootstrap, {failed: 2})
    ts = 1_714_608_000_000
    records = [
        _failed_record(main_topic, b"a", "exhausted", "TimeoutError", ts),
        _failed_record(main_topic, b"b", "exhausted", "TimeoutError", ts + 1),
        _failed_record(main_topic, b"a", "exhausted", "TimeoutError", ts + 2),
        _failed_record(main_topic, b"c", "permanent", "ValueError", ts + 3),
    ]
    produce(bootstrap, failed, records)

    spark_submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    out = work / "out"
    result = subprocess.run(
        [
            str(spark_submit),
            "--master",
            "local[2]",
            "--conf",
            "spark.ui.enabled=false",
            "--conf",
            "spark.driver.memory=1g",
            "--py-files",
            str(dist / "pipeline.zip"),
            str(dist / "run_pipeline.py"),
            "inventory",
            "--bootstrap",
            bootstrap,
            "--main-topics",
            main_topic,
            "--out",
            str(out),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    errors = [line for line in result.stderr.splitlines() if "Error" in line or "Exception" in line]
    assert result.returncode == 0, "\n".join(errors[-30:]) or result.stderr[-4000:]
    summary = json.loads((out / "inventory" / "summary.json").read_text())
    assert summary["topics"][failed]["depth"] == len(records)
    by_reason = {r["reason"]: r["records"] for r in json.loads((out / "inventory" / "by_reason.json").read_text())}
    assert by_reason == {"exhausted": 3, "permanent": 1}
    top_keys = {r["key_text"]: r["count"] for r in json.loads((out / "inventory" / "top_keys.json").read_text())}
    assert top_keys == {"a": 2, "b": 1, "c": 1}
