"""The markers come from the fixtures, and the guard holds: a test that starts a broker, a worker or Spark without the
marker fails (tests/conftest.py). Checked on small inner pytest sessions (pytester) with stand-in fixtures and
stand-in programs, so nothing heavy is started here."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest_plugins = ["pytester"]

INNER_CONFTEST = """
import pytest

@pytest.fixture(scope="session")
def broker():
    return "a stand-in: the fixture's name is what marks"

@pytest.fixture
def deploy(broker):
    return broker

@pytest.fixture(scope="session")
def spark():
    return "a stand-in"
"""

INNER_TESTS = """
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAMS = Path({programs!r})


def test_light_child_processes_are_fine():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_broker_start():
    subprocess.run([str(PROGRAMS / "tansu-stand-in"), "broker"], check=True)


def test_unmarked_worker_start():
    subprocess.run([sys.executable, "-m", "faust", "-A", "app", "worker", "--help"], check=True)


def test_unmarked_spark_submit():
    subprocess.run([str(PROGRAMS / "spark-submit")], check=True)


def test_unmarked_start_swallowed():
    try:
        subprocess.run([str(PROGRAMS / "tansu-stand-in")], check=True)
    except BaseException:
        pass


@pytest.mark.broker
def test_marked_broker_start():
    subprocess.run([str(PROGRAMS / "tansu-stand-in"), "broker"], check=True)


def test_broker_start_through_a_fixture(deploy):
    subprocess.run([str(PROGRAMS / "tansu-stand-in"), "broker"], check=True)


def test_spark_submit_through_the_fixture(spark):
    subprocess.run([str(PROGRAMS / "spark-submit")], check=True)
"""


@pytest.fixture
def root_conftest(request: pytest.FixtureRequest) -> ModuleType:
    """tests/conftest.py as this session loaded it (its guard is installed once, shared with inner sessions)."""
    wanted = (Path(__file__).parent / "conftest.py").resolve()
    for plugin in request.config.pluginmanager.get_plugins():
        path = getattr(plugin, "__file__", None)
        if isinstance(plugin, ModuleType) and path and Path(path).resolve() == wanted:
            return plugin
    raise AssertionError("tests/conftest.py is not loaded")


@pytest.fixture
def inner(pytester: pytest.Pytester, tmp_path: Path) -> pytest.Pytester:
    programs = tmp_path / "programs"
    programs.mkdir()
    for name in ("tansu-stand-in", "spark-submit"):  # exit at once: named like what they stand in for
        program = programs / name
        program.write_text("#!/bin/sh\nexit 0\n")
        program.chmod(0o755)
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_inner=INNER_TESTS.format(programs=str(programs)))
    pytester.makeini(
        "[pytest]\naddopts = --strict-markers\nasyncio_default_fixture_loop_scope = function\n"
        "markers =\n    broker: b\n    spark: s\n    xdist_group: g\n"
    )
    return pytester


def outcomes(result: pytest.RunResult) -> dict[str, tuple[str, str]]:
    """Each inner test's outcome and failure text, by test name (setup failures count as failures)."""
    seen: dict[str, tuple[str, str]] = {}
    assert result.reprec is not None  # type: ignore[attr-defined]
    for report in result.reprec.getreports("pytest_runtest_logreport"):  # type: ignore[attr-defined]
        name = report.nodeid.split("::")[-1]
        if report.failed or (report.when == "call" and name not in seen):
            seen[name] = (report.outcome, report.longreprtext)
    return seen


def test_a_start_without_the_marker_fails_and_one_through_a_fixture_passes(
    inner: pytest.Pytester, root_conftest: ModuleType
) -> None:
    result = inner.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", plugins=[root_conftest])
    seen = outcomes(result)
    for name in (
        "test_light_child_processes_are_fine",
        "test_marked_broker_start",
        "test_broker_start_through_a_fixture",
        "test_spark_submit_through_the_fixture",
    ):
        assert seen[name] == ("passed", ""), name
    for name in ("test_unmarked_broker_start", "test_unmarked_worker_start", "test_unmarked_start_swallowed"):
        outcome, text = seen[name]
        assert outcome == "failed", name
        assert "starts a broker or worker process" in text and "without the `broker` marker" in text, text
    outcome, text = seen["test_unmarked_spark_submit"]
    assert outcome == "failed"
    assert "starts a Spark process" in text and "without the `spark` marker" in text, text
    assert len(seen) == 8


def test_the_fast_tier_leaves_out_the_tests_marked_by_their_fixtures(
    inner: pytest.Pytester, root_conftest: ModuleType
) -> None:
    result = inner.runpytest_inprocess(
        "-p", "no:cacheprovider", "-p", "no:xdist", "-m", "not broker and not spark", plugins=[root_conftest]
    )
    result.assert_outcomes(passed=1, failed=4, deselected=3)
    assert outcomes(result)["test_light_child_processes_are_fine"] == ("passed", "")


def test_the_guard_outlives_an_inner_session(root_conftest: ModuleType) -> None:
    """The inner sessions above configure and unconfigure the same plugin: the outer guard stays installed."""
    import subprocess

    assert subprocess.Popen.__init__ is root_conftest._guarded_popen_init


def test_a_spark_session_made_in_process_without_the_marker_fails(
    pytester: pytest.Pytester, root_conftest: ModuleType
) -> None:
    pytest.importorskip("pyspark")
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(
        test_inner="""
import pyspark.sql


def test_unmarked_session():
    pyspark.sql.SparkSession.builder.getOrCreate()
"""
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", plugins=[root_conftest])
    outcome, text = outcomes(result)["test_unmarked_session"]
    assert outcome == "failed"
    assert "starts a SparkSession without the `spark` marker" in text, text


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (["/root/.calfkit/bin/tansu-v0.6.0-510f3e2", "broker", "--listener-url", "tcp://127.0.0.1:1"], "broker"),
        ([sys.executable, "-m", "demo.mock_cluster", "--brokers", "3"], "broker"),
        ([sys.executable, "-m", "faust", "-A", "app", "worker", "-l", "info"], "broker"),
        (["faust", "-A", "app", "worker"], "broker"),
        ([sys.executable, "-m", "chaos", "--quick"], "broker"),
        ([sys.executable, "-m", "demo", "--keep-running"], "broker"),
        ("/opt/spark/bin/spark-submit --master local[2] run.py", "spark"),
        ([Path("/x/pyspark/bin/spark-submit"), "--master", "local[2]"], "spark"),
        ([sys.executable, "-m", "pipeline", "facts", "--master", "local[1]"], "spark"),
        ([sys.executable, "-c", "import pipeline"], None),
        (["promtool", "check", "rules", "alerts.yml"], None),
        (["make", "--no-print-directory", "pipeline-zip"], None),
        ([sys.executable, "-m", "faust", "-A", "app", "replay", "t", "0", "1"], None),
        ([], None),
    ],
)
def test_heavy_kind(root_conftest: ModuleType, argv: object, kind: str | None) -> None:
    assert root_conftest.heavy_kind(argv) == kind


def test_make_test_runs_each_tier_in_one_worker(pytester: pytest.Pytester, root_conftest: ModuleType) -> None:
    """Under ``-n 3 --dist loadgroup`` every test of tests/integration is one scope, every test of tests/pipeline
    another; the other tests are scopes of their own (spread over the workers)."""
    pytest.importorskip("xdist")
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    config = pytester.parseconfigure("--tx", "3*popen", "--dist", "loadgroup", "-p", "no:cacheprovider")
    scheduler = root_conftest.pytest_xdist_make_scheduler(config=config, log=None)
    scopes = {
        nodeid: scheduler._split_scope(nodeid)
        for nodeid in (
            "tests/integration/test_retry_flow.py::test_a[tansu]",
            "tests/integration/test_mock_cluster.py::test_b",
            "tests/pipeline/test_pipeline_jobs.py::test_c",
            "tests/pipeline/test_pipeline_options.py::test_d[x]",
            "tests/rebound/test_policy.py::test_e",
            "tests/app/test_wheel.py::test_f",
            "tests/app/test_wheel.py::test_g",
        )
    }
    assert set(scopes.values()) == {
        "tier:integration",
        "tier:pipeline",
        "tier:wheel",
        "tests/rebound/test_policy.py::test_e",
    }
    assert scopes["tests/integration/test_mock_cluster.py::test_b"] == "tier:integration"
    assert scopes["tests/pipeline/test_pipeline_options.py::test_d[x]"] == "tier:pipeline"
    other = pytester.parseconfigure("--tx", "3*popen", "--dist", "load", "-p", "no:cacheprovider")
    assert root_conftest.pytest_xdist_make_scheduler(config=other, log=None) is None
