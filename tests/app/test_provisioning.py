"""Which existing topics are tiers of an earlier retry sequence (drained after a reconfiguration)."""

from __future__ import annotations

from app.provisioning import derived_topics, draining_tiers
from rebound.settings import load_settings
from rebound.topics import parse_tier_topic


def test_parse_tier_topic_accepts_only_tiers_of_main_topics() -> None:
    assert parse_tier_topic("items.retry.30m", ["items"]) == ("items", "30m")
    assert parse_tier_topic("items.retry.1500ms", ["items"]) == ("items", "1500ms")
    assert parse_tier_topic("orders.retry.30m", ["items"]) is None
    assert parse_tier_topic("items.retry.soon", ["items"]) is None
    assert parse_tier_topic("items.failed", ["items"]) is None
    assert parse_tier_topic("items", ["items"]) is None


def test_old_tiers_are_drained_current_ones_are_not(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings = load_settings(main_topics="items", retry_sequence="5m,30m")
    existing = [*derived_topics(settings), "items.retry.1h", "items.retry.10s", "other.retry.1h", "items.retry.x"]
    assert draining_tiers(settings, existing) == ("items.retry.10s", "items.retry.1h")
    assert draining_tiers(settings, derived_topics(settings)) == ()
