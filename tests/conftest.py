"""Session-wide fixtures: real Kafka protocol servers for the integration tests (never a mock of the broker).

``broker`` is the embedded Tansu broker. ``kafka`` is the Kafka implementation a test runs on: Tansu, unless the test
(or its module) is marked ``every_kafka``; then it runs once on each implementation that ``REBOUND_TEST_KAFKA``
selects (``both``, the default; ``tansu``; or ``mock``, librdkafka's mock cluster of 3 brokers from the
confluent-kafka wheel).

Markers come from the fixtures a test uses (``pytest_collection_modifyitems`` below): a test whose fixture closure holds
a Kafka server fixture (``BROKER_FIXTURES``, and so every fixture built on one, like the integration tests' ``deploy``)
is marked ``broker``; one that holds ``spark`` is marked ``spark``. ``-m "not broker and not spark"`` (``make
test-fast``) therefore leaves out every test that starts a broker or Spark, and a guard keeps it so: a test that starts
a broker, a worker or Spark (a Tansu, mock cluster, ``faust ... worker``, chaos, demo, ``spark-submit`` or pipeline
process, or a SparkSession) without the matching marker fails, in every run. Under ``pytest -n 3 --dist loadgroup``
(``make test``), tests/integration and tests/pipeline each run in one worker process (``TIERS``).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import pytest
from hypothesis import settings

# The worker subprocesses and Spark's Python workers must run this interpreter, not whatever `python` is on PATH.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from demo.embedded_broker import EmbeddedBroker, start_broker
from demo.mock_cluster import MockCluster, start_mock_cluster
from tests import loop_hygiene
from tests.kafka_under_test import MOCK, MOCK_WORKER_SETTINGS, TANSU, Kafka, register, selected_kafkas

# Hypothesis' per-example deadline (200 ms) is a timed test: on a shared machine a slow example fails a rule that
# holds (seen under a load average of 7). Speed lives in the benchmarks; the properties are checked without a clock.
settings.register_profile("rebound", deadline=None)
settings.load_profile("rebound")


@pytest.fixture(autouse=True)
def _close_idle_thread_loops() -> Iterator[None]:
    """Close the event loops of consumer threads a test built but never started (tests/loop_hygiene.py says why)."""
    yield from loop_hygiene.each_test()


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    running = start_broker()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def mock_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockCluster]:
    pytest.importorskip("confluent_kafka", reason="the librdkafka mock cluster comes with confluent-kafka")
    running = start_mock_cluster(brokers=3, log_path=tmp_path_factory.mktemp("mock-cluster") / "mock.log")
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def tansu_kafka(broker: EmbeddedBroker) -> Kafka:
    return register(Kafka(TANSU, broker))


@pytest.fixture(scope="session")
def mock_kafka(mock_cluster: MockCluster) -> Kafka:
    return register(Kafka(MOCK, mock_cluster, MOCK_WORKER_SETTINGS))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("every_kafka")
    if "kafka" not in metafunc.fixturenames or marker is None:
        return
    skip_mock = marker.kwargs.get("skip_mock")
    params = [
        pytest.param(name, marks=pytest.mark.skip(reason=f"librdkafka mock cluster: {skip_mock}"))
        if name == MOCK and skip_mock
        else name
        for name in selected_kafkas()
    ]
    metafunc.parametrize("kafka", params, indirect=True, scope="session")


@pytest.fixture(scope="session")
def kafka(request: pytest.FixtureRequest) -> Kafka:
    """The Kafka implementation of this test: Tansu, or under ``every_kafka`` each selected one in turn."""
    name = getattr(request, "param", TANSU)
    chosen: Kafka = request.getfixturevalue("mock_kafka" if name == MOCK else "tansu_kafka")
    return chosen


# --------------------------------------------------------------------------------------- markers from the fixtures

# A test using one of these (directly or through a fixture built on one) needs a Kafka server: marked ``broker``.
BROKER_FIXTURES = frozenset({"broker", "mock_cluster", "tansu_kafka", "mock_kafka", "kafka"})
# A test using one of these needs a SparkSession: marked ``spark``.
SPARK_FIXTURES = frozenset({"spark"})

# `make test` runs `pytest -n 3 --dist loadgroup`: the tests under each of these paths run in one worker process
# (tests/integration and tests/pipeline with their session broker, SparkSession and workers as in a serial run, and
# never in the same process), the other tests spread over the three. Chosen from the node id by `TierScheduling`
# below: `xdist_group` marks have no effect with pytest 9.2, whose node ids no longer take the "@group" suffix that
# pytest-xdist 3.8 writes for them (pytest-xdist issue 1386), so its loadgroup scheduler sees no group at all.
TIERS = {
    "tests/integration/": "integration",
    "tests/pipeline/": "pipeline",
    "tests/app/test_wheel.py": "wheel",  # one wheel build (its module's xdist_group("wheel"))
}


def tier_of(nodeid: str) -> str | None:
    for prefix, tier in TIERS.items():
        if nodeid.startswith(prefix):
            return tier
    return None


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without pytest-xdist, never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class TierScheduling(LoadGroupScheduling):  # type: ignore[misc]
        """loadgroup, with every test of a folder in ``TIERS`` in that tier's group (its largest scopes go first)."""

        def _split_scope(self, nodeid: str) -> str:
            tier = tier_of(nodeid)
            return f"tier:{tier}" if tier else str(super()._split_scope(nodeid))

    return TierScheduling(config, log)


# A test marked neither broker, spark nor slow runs in well under 10 s (the slowest took 7 s): one that hangs fails
# after this instead of the 300 s the others get (pyproject.toml's `timeout`).
LIGHT_TIMEOUT_S = 120


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & BROKER_FIXTURES and not item.get_closest_marker("broker"):
            item.add_marker(pytest.mark.broker)
        if used & SPARK_FIXTURES and not item.get_closest_marker("spark"):
            item.add_marker(pytest.mark.spark)
        heavy = any(item.get_closest_marker(name) for name in ("broker", "spark", "slow"))
        if not heavy and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(LIGHT_TIMEOUT_S))


# --------------------------------------------------------------------------- the guard: no heavy start unmarked


def heavy_kind(args: str | bytes | os.PathLike[str] | Sequence[Any]) -> str | None:
    """``"broker"`` or ``"spark"`` if a child process with these arguments starts a broker, a worker or Spark."""
    if isinstance(args, (str, bytes, os.PathLike)):
        argv = shlex.split(os.fsdecode(args))
    else:
        argv = [os.fsdecode(arg) if isinstance(arg, (bytes, os.PathLike)) else str(arg) for arg in args]
    if not argv:
        return None
    names = [os.path.basename(arg) for arg in argv]
    if any(name.startswith("tansu") for name in names):
        return "broker"
    if any(name in ("spark-submit", "spark-class", "pyspark") for name in names):
        return "spark"
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None
    if module is not None:
        top, last = module.split(".")[0], module.split(".")[-1]
        if top == "pipeline":  # the pipeline's CLI runs its jobs on Spark
            return "spark"
        if last in ("embedded_broker", "mock_cluster") or top in ("chaos", "demo", "bench"):
            return "broker"
        if top == "faust" and "worker" in argv:
            return "broker"
    if names[0] == "faust" and "worker" in argv:
        return "broker"
    return None


_running: list[pytest.Item] = []  # the test being run (set up, called, torn down), if any
_VIOLATIONS = pytest.StashKey[list[str]]()


def _refuse_unmarked(kind: str, what: str) -> None:
    item = _running[-1] if _running else None
    if item is None or item.get_closest_marker(kind) is not None:
        return
    message = (
        f"this test starts {what} without the `{kind}` marker: use the `{kind}` fixture (or one built on it), which "
        f'marks it (tests/conftest.py), or mark it `{kind}`. `make test-fast` (-m "not broker and not spark") must '
        f"start no broker, worker or Spark."
    )
    item.stash.setdefault(_VIOLATIONS, []).append(message)
    pytest.fail(message, pytrace=False)


_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
    kind = heavy_kind(args)
    if kind is not None:
        _refuse_unmarked(kind, f"{'a broker or worker' if kind == 'broker' else 'a Spark'} process ({args!r:.300})")
    _popen_init(self, args, *rest, **kwargs)


def _guard_spark_sessions() -> None:
    """A SparkSession made in this process without a new JVM (one already runs) does not go through Popen."""
    session = sys.modules.get("pyspark.sql.session")
    builder = getattr(session, "SparkSession", None) and session.SparkSession.Builder  # type: ignore[union-attr]
    if builder is None or getattr(builder.getOrCreate, "rebound_guarded", False):
        return
    original = builder.getOrCreate

    def get_or_create(self: Any) -> Any:
        _refuse_unmarked("spark", "a SparkSession")
        return original(self)

    get_or_create.rebound_guarded = True  # type: ignore[attr-defined]
    builder.getOrCreate = get_or_create


_sessions: list[pytest.Config] = []  # a pytester session inside this one shares the guard


def pytest_configure(config: pytest.Config) -> None:
    if not _sessions:
        subprocess.Popen.__init__ = _guarded_popen_init  # type: ignore[method-assign]
    _sessions.append(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    _sessions.remove(config)
    if not _sessions:
        subprocess.Popen.__init__ = _popen_init  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    _guard_spark_sessions()
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.remove(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    """A start refused inside code that swallowed the failure still fails the test."""
    report = yield
    violations = item.stash.get(_VIOLATIONS, [])
    if violations and report.passed and report.when in ("setup", "call"):
        report.outcome = "failed"
        report.longrepr = "\n".join(violations)
    return report
