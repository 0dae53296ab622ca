"""Session-wide fixtures: real Kafka protocol servers for the integration tests (never a mock of the broker).

``broker`` is the embedded Tansu broker. ``kafka`` is the Kafka implementation a test runs on: Tansu, unless the test
(or its module) is marked ``every_kafka``; then it runs once on each implementation that ``REBOUND_TEST_KAFKA``
selects (``both``, the default; ``tansu``; or ``mock``, librdkafka's mock cluster of 3 brokers from the
confluent-kafka wheel).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

# The worker subprocesses and Spark's Python workers must run this interpreter, not whatever `python` is on PATH.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from rebound.embedded_broker import EmbeddedBroker, start_broker
from rebound.mock_cluster import MockCluster, start_mock_cluster
from tests.kafka_under_test import MOCK, MOCK_WORKER_SETTINGS, TANSU, Kafka, register, selected_kafkas


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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "every_kafka(skip_mock=None): run on each Kafka implementation REBOUND_TEST_KAFKA selects (both by default); "
        "skip_mock='reason' skips the mock cluster's run, for what it cannot do",
    )


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
