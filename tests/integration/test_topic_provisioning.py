"""Topics Rebound creates carry their configs on a real broker; topics that exist keep their operators' configs."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from app.provisioning import provision
from rebound.errors import ConfigurationError
from rebound.settings import load_settings
from rebound.topic_configs import DAY_MS, HOUR_MS


async def described(bootstrap: str, topics: list[str]) -> dict[str, dict[str, str]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        responses = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, t) for t in topics])
        found: dict[str, dict[str, str]] = {}
        for response in responses:
            for resource in response.resources:
                found[resource[3]] = {entry[0]: entry[1] for entry in resource[4]}
        return found
    finally:
        await admin.close()


async def create(bootstrap: str, topic: str, configs: dict[str, str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 2, 1, topic_configs=configs)])
    finally:
        await admin.close()


def test_created_topics_get_their_configs_and_existing_ones_are_left_alone(broker, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    main = f"prov-{uuid.uuid4().hex[:8]}"
    # The operator made the main topic and its failed topic beforehand, the failed one with a retention of their own.
    asyncio.run(create(broker.bootstrap, main, {}))
    asyncio.run(create(broker.bootstrap, f"{main}.failed", {"retention.ms": "12345"}))
    settings = load_settings(broker=broker.url, app_id=main, main_topics=main, retry_sequence="1s,1m")

    assert provision(settings).partitions == 2

    configs = asyncio.run(
        described(
            broker.bootstrap,
            [
                f"{main}.failed",
                f"{main}.retry.1s",
                f"{main}.status",
                f"{main}.release",
                f"{main}.attempts",
                f"{main}-retry_state-changelog",  # the app id is the main topic's name here
            ],
        )
    )
    assert configs[f"{main}.failed"]["retention.ms"] == "12345"  # existed: untouched
    assert configs[f"{main}.retry.1s"]["retention.ms"] == str(7 * DAY_MS)
    assert configs[f"{main}.retry.1s"]["max.message.bytes"] == "1049600"
    assert configs[f"{main}.status"]["retention.ms"] == str(HOUR_MS)
    assert configs[f"{main}.release"]["retention.ms"] == str(HOUR_MS)
    assert configs[f"{main}.attempts"]["retention.ms"] == str(7 * DAY_MS)
    assert configs[f"{main}-retry_state-changelog"]["cleanup.policy"] == "compact"  # as Faust declares it


def test_a_changelog_with_another_partition_count_stops_start_up_before_any_write(
    broker, tmp_path, monkeypatch
) -> None:
    """What a metadata lookup before the tables started left behind (the broker's default count): refused at start-up
    (a ``ConfigurationError``: exit 78) instead of failing every table write later."""
    monkeypatch.chdir(tmp_path)
    main = f"prov-{uuid.uuid4().hex[:8]}"
    asyncio.run(create(broker.bootstrap, main, {}))  # 2 partitions
    asyncio.run(create_with(broker.bootstrap, f"{main}-retry_payloads-changelog", 4))
    settings = load_settings(broker=broker.url, app_id=main, main_topics=main, retry_sequence="1s")
    with pytest.raises(ConfigurationError, match=rf"{main}-retry_payloads-changelog has 4 partitions but the main"):
        provision(settings)


async def create_with(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        await admin.close()
