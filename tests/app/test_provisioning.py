"""Which existing topics are tiers of an earlier retry sequence (drained after a reconfiguration)."""

from __future__ import annotations

import pytest

from app.provisioning import changelog_topics, derived_topics, draining_tiers, plan_topics
from rebound.errors import ConfigurationError
from rebound.policy import RetryPolicy
from rebound.settings import load_settings
from rebound.tiers import Tier, Tiers


def draining(existing: list[str], mains: tuple[str, ...] = ("items",)) -> dict[str, Tier]:
    return {name: tier for name, tier in Tiers.build(mains, RetryPolicy((1000,)), existing).items() if tier.draining}


def test_only_canonical_tiers_of_main_topics_are_drained() -> None:
    assert draining(["items.retry.30m"]) == {"items.retry.30m": Tier("items", "30m", 1_800_000, draining=True)}
    assert draining(["items.retry.1500ms"])["items.retry.1500ms"].delay_ms == 1500
    assert draining(["orders.retry.30m", "items.retry.soon", "items.failed", "items", "items.retry.60s"]) == {}


def test_old_tiers_are_drained_current_ones_are_not(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings = load_settings(main_topics="items", retry_sequence="5m,30m")
    existing = [*derived_topics(settings), "items.retry.1h", "items.retry.10s", "other.retry.1h", "items.retry.x"]
    assert draining_tiers(settings, existing) == ("items.retry.10s", "items.retry.1h")
    assert draining_tiers(settings, derived_topics(settings)) == ()


def test_main_topic_named_like_a_tier_prefix_gets_its_own_tiers() -> None:
    """``pay.retry``'s tier ``pay.retry.retry.1s`` is not split at the first ``.retry.`` (which gave main ``pay``)."""
    tiers = Tiers.build(("pay", "pay.retry"), RetryPolicy((1000, 30_000)), ["pay.retry.retry.5m", "pay.retry.5m"])
    assert tiers["pay.retry.retry.1s"] == Tier("pay.retry", "1s", 1000)
    assert tiers["pay.retry.1s"] == Tier("pay", "1s", 1000)
    assert tiers["pay.retry.retry.5m"] == Tier("pay.retry", "5m", 300_000, draining=True)
    assert tiers["pay.retry.5m"] == Tier("pay", "5m", 300_000, draining=True)


def test_the_control_topic_has_one_partition_outside_the_co_partitioning_check(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings = load_settings(app_id="svc", main_topics="items", retry_sequence="5m")
    assert "svc.control" not in derived_topics(settings)
    partitions, missing = plan_topics(settings, {"items": 4})
    assert partitions == 4 and missing["svc.control"] == 1 and missing["items.failed"] == 4
    everything = dict.fromkeys(["items", *derived_topics(settings), *changelog_topics(settings)], 4)
    assert plan_topics(settings, {**everything, "svc.control": 1}) == (4, {})
    with pytest.raises(ConfigurationError, match=r"svc\.control has 4 partitions; it must have exactly 1"):
        plan_topics(settings, {**everything, "svc.control": 4})
    with pytest.raises(ConfigurationError, match="co-partitioning"):
        plan_topics(settings, {**everything, "svc.admin": 1, "svc.control": 1})


def test_the_tables_changelogs_are_created_with_the_main_topics_partition_count(tmp_path, monkeypatch) -> None:
    """Created before Faust asks about them: a broker that creates a topic on a metadata request would give it its
    own default partition count."""
    monkeypatch.chdir(tmp_path)
    settings = load_settings(app_id="svc", main_topics="items", retry_sequence="5m")
    assert changelog_topics(settings) == ["svc-retry_state-changelog", "svc-retry_payloads-changelog"]
    everything = {**dict.fromkeys(["items", *derived_topics(settings)], 3), "svc.control": 1}
    assert plan_topics(settings, everything) == (
        3,
        {"svc-retry_state-changelog": 3, "svc-retry_payloads-changelog": 3},
    )
    assert plan_topics(settings, {**everything, **dict.fromkeys(changelog_topics(settings), 3)}) == (3, {})


def test_a_changelog_with_another_partition_count_fails_start_up_naming_it_and_the_fix(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings = load_settings(app_id="svc", main_topics="items", retry_sequence="5m")
    everything = {
        **dict.fromkeys(["items", *derived_topics(settings), *changelog_topics(settings)], 2),
        "svc.control": 1,
    }
    with pytest.raises(ConfigurationError) as raised:
        plan_topics(settings, {**everything, "svc-retry_state-changelog": 4})
    message = str(raised.value)
    assert "\n" not in message
    assert "svc-retry_state-changelog has 4 partitions" in message and "main topics have 2" in message
    assert "PartitionsMismatch" in message and "delete" in message
