"""The worker's consumer reads committed records by default (``REBOUND_ISOLATION_LEVEL``), without Faust's
exactly-once guarantee (which would make its producer transactional too)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agents.readers import groupless_consumer
from app.factory import create_faust_app
from rebound.errors import ConfigurationError
from rebound.settings import load_settings


def test_read_committed_is_the_default_and_read_uncommitted_the_other_choice() -> None:
    assert load_settings().isolation_level == "read_committed"
    assert load_settings(isolation_level="read_uncommitted").isolation_level == "read_uncommitted"


def test_any_other_isolation_level_is_refused_at_start_up_naming_the_variable() -> None:
    with pytest.raises(
        ConfigurationError, match="REBOUND_ISOLATION_LEVEL='read-committed': must be 'read_committed' or"
    ):
        load_settings(isolation_level="read-committed")


@pytest.mark.parametrize("level", ["read_committed", "read_uncommitted"])
def test_the_worker_consumer_is_made_with_the_configured_isolation_level(tmp_path: Path, level: str) -> None:
    async def made() -> Any:
        app = create_faust_app(load_settings(isolation_level=level, data_dir=str(tmp_path)), partitions=1)
        assert app.conf.processing_guarantee.value == "at_least_once"  # not by way of Faust's transactions
        consumer = app.consumer._thread._create_worker_consumer(app.consumer.transport)
        await consumer._client.close()
        return consumer

    # aiokafka hands this to the fetcher it creates in start() (AIOKafkaConsumer.start: isolation_level=...)
    assert asyncio.run(made())._isolation_level == level


def test_the_groupless_readers_read_committed() -> None:
    async def made() -> Any:
        consumer = groupless_consumer("127.0.0.1:9", auto_offset_reset="earliest", fetch_max_wait_ms=10)
        await consumer._client.close()
        return consumer

    assert asyncio.run(made())._isolation_level == "read_committed"
