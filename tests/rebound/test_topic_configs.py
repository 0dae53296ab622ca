"""What each topic Rebound creates is created with."""

from __future__ import annotations

import pytest

from rebound.errors import ConfigurationError
from rebound.settings import load_settings
from rebound.topic_configs import DAY_MS, HOUR_MS, topic_configs


@pytest.fixture
def settings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return load_settings(app_id="svc", main_topics="orders,pay", retry_sequence="5m,1h", failed_retention="90d")


def retention(topic: str, settings) -> int:
    return int(topic_configs(topic, settings)["retention.ms"])


def test_retention_follows_what_each_topic_is_for(settings) -> None:
    assert retention("orders.failed", settings) == 90 * DAY_MS  # REBOUND_FAILED_RETENTION
    assert retention("pay.failed", settings) == 90 * DAY_MS
    assert retention("svc.attempts", settings) == 7 * DAY_MS  # REBOUND_ATTEMPTS_RETENTION default
    assert retention("svc.status", settings) == HOUR_MS
    assert retention("svc.release", settings) == HOUR_MS
    assert retention("svc.admin", settings) == DAY_MS
    assert retention("orders.retry.5m", settings) == 7 * DAY_MS
    assert retention("pay.retry.1h", settings) == 7 * DAY_MS


def test_the_control_topic_is_compacted_and_never_deleted_by_age(settings) -> None:
    configs = topic_configs("svc.control", settings)
    assert configs["cleanup.policy"] == "compact" and configs["retention.ms"] == "-1"
    assert "delete" not in configs["cleanup.policy"]


def test_main_and_unknown_topics_get_nothing(settings) -> None:
    assert topic_configs("orders", settings) == {}
    assert topic_configs("other.failed", settings) == {}
    assert topic_configs("other.retry.5m", settings) == {}


def test_record_limit_admits_the_largest_record_rebound_produces(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    small = load_settings(main_topics="orders")
    large = load_settings(main_topics="orders", producer_max_request_bytes=5_000_000)
    assert topic_configs("orders.failed", small)["max.message.bytes"] == "1049600"  # 1 MiB and a batch header
    assert int(topic_configs("orders.failed", large)["max.message.bytes"]) > 5_000_000
    assert topic_configs("orders.retry.1s", small)["cleanup.policy"] == "delete"


def test_retention_settings_are_durations(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match="REBOUND_FAILED_RETENTION"):
        load_settings(main_topics="orders", failed_retention="forever")


def test_the_tables_changelogs_are_compacted_as_faust_creates_them(settings) -> None:
    configs = topic_configs("svc-retry_state-changelog", settings)
    assert configs == {"cleanup.policy": "compact", "max.message.bytes": str(1_048_576 + 1024)}  # the largest record
    assert topic_configs("other-retry_state-changelog", settings) == {}
