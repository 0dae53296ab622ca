"""The Kafka implementations the integration tests run on, and what a deployment on each needs.

A plain module (not a conftest) so that the fixtures and the test modules share one registry and one class.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest

from demo.embedded_broker import EmbeddedBroker
from demo.mock_cluster import MockCluster

TANSU = "tansu"
MOCK = "librdkafka-mock"
_CHOICES = {"both": [TANSU, MOCK], "tansu": [TANSU], "mock": [MOCK], MOCK: [MOCK]}


def selected_kafkas() -> list[str]:
    choice = os.environ.get("REBOUND_TEST_KAFKA", "both").strip().lower() or "both"
    if choice not in _CHOICES:
        raise pytest.UsageError(f"REBOUND_TEST_KAFKA={choice!r}: use one of both, tansu, mock")
    return _CHOICES[choice]


@dataclass
class Kafka:
    """One Kafka implementation under test, with what a deployment on it needs.

    ``worker_settings`` are environment overrides for every worker on it (the tests' own settings win over them).
    """

    name: str
    server: EmbeddedBroker | MockCluster
    worker_settings: Mapping[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def bootstrap(self) -> str:
        return self.server.bootstrap

    @property
    def is_mock(self) -> bool:
        return isinstance(self.server, MockCluster)

    async def create_topics(self, topics: list[str], partitions: int) -> None:
        if isinstance(self.server, MockCluster):
            # The mock cluster has no CreateTopics request: create through its control channel instead. With one
            # replica, partition p is led by broker p % 3 + 1, so clients talk to several brokers (with three the mock
            # picks each leader at random among them).
            self.server.create_topics(topics, partitions, replication=1)
            return
        from demo.harness import create_topics

        await create_topics(self.bootstrap, topics, partitions)

    async def provision(self, env: Mapping[str, str], partitions: int) -> None:
        """Create every topic a worker with this environment uses, where the worker cannot create them itself.

        On the mock cluster neither Rebound's provisioning nor Faust's topic declaration can create topics (no
        CreateTopics request), so the main, derived and Faust-internal topics are created beforehand.
        """
        if not self.is_mock:
            return
        from app.provisioning import derived_topics
        from rebound.settings import load_settings
        from rebound.topics import control_topic
        from tables.retry_state import PAYLOAD_TABLE, STATE_TABLE

        prefix = "REBOUND_"
        settings = load_settings(
            **{name[len(prefix) :].lower(): value for name, value in env.items() if name.startswith(prefix)}
        )
        changelogs = [f"{settings.app_id}-{table}-changelog" for table in (STATE_TABLE, PAYLOAD_TABLE)]
        await self.create_topics([*settings.topics, *derived_topics(settings), *changelogs], partitions)
        await self.create_topics([f"{settings.app_id}-__assignor-__leader"], 1)  # Faust's leader topic
        await self.create_topics([control_topic(settings.app_id)], 1)  # the pause state: one partition by design


# What the mock cluster needs instead of the embedded broker's work-arounds (demo/harness.FAST_GROUP_TIMEOUTS):
MOCK_WORKER_SETTINGS = {
    # The mock cluster does not implement CreateTopics: Kafka.provision creates every topic beforehand, Rebound only
    # checks that its topics exist, and Faust does not declare its changelog and leader topics (its
    # topic_allow_declare follows REBOUND_PROVISION_TOPICS).
    "REBOUND_PROVISION_TOPICS": "false",
    # Its ListOffsets(latest) is exact, so the producer batches normally (the product default) instead of sending
    # one record per batch as on the embedded broker.
    "REBOUND_PRODUCER_MAX_BATCH_BYTES": "16384",
    # REBOUND_FETCH_MAX_WAIT_MS=100 from FAST_GROUP_TIMEOUTS stays, for speed only: the mock cluster, too, answers a
    # fetch that finds no data after the whole wait, even if records arrive meanwhile (librdkafka says so in its
    # Fetch handler). With Faust's 1500 ms the tests pass as well, about 1.5 times slower.
}


_BY_BOOTSTRAP: dict[str, Kafka] = {}


def register(kafka: Kafka) -> Kafka:
    _BY_BOOTSTRAP[kafka.bootstrap] = kafka
    return kafka


async def create_topics(bootstrap: str, topics: list[str], partitions: int) -> None:
    """``demo.harness.create_topics`` on whichever registered Kafka implementation serves ``bootstrap``."""
    kafka = _BY_BOOTSTRAP.get(bootstrap)
    if kafka is None:
        from demo.harness import create_topics as create

        await create(bootstrap, topics, partitions)
    else:
        await kafka.create_topics(topics, partitions)
