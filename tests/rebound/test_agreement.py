"""The settings a group must agree on: their values, fingerprint, and what differs between two workers' summaries."""

from __future__ import annotations

from typing import Any

from rebound.agreement import GroupSettings, differences, group_settings
from rebound.settings import load_settings
from rebound.summary import WorkerSummary, settings_mismatches

NOW = 1_000_000


def settings_of(**values: Any) -> GroupSettings:
    return group_settings(load_settings(handler="m:f", **values))


def test_the_same_decisions_give_the_same_fingerprint_however_they_are_written() -> None:
    a = settings_of(retry_sequence="60s,5m", main_topics="orders,items", permanent_errors="B,A")
    b = settings_of(retry_sequence="1m,300s", main_topics="items, orders", permanent_errors="A,B,A")
    assert a.fingerprint == b.fingerprint
    assert a.values["retry_sequence"] == "1m,5m" and a.values["main_topics"] == "items,orders"
    # Sizing and pacing one worker is its own business: no difference.
    assert settings_of(concurrency=8, release_rate="5").fingerprint == settings_of().fingerprint


def test_each_setting_that_changes_a_decision_changes_the_fingerprint() -> None:
    base = settings_of()
    for changed in (
        {"retry_sequence": "2s,5s,10s"},
        {"max_retry_duration": "1h"},
        {"main_topics": "orders"},
        {"retry_after_max": "2h"},
        {"retryable_errors": "TimeoutError"},
        {"unknown_errors": "permanent"},
        {"ordering": "key"},
        {"ordering": "key", "ordering_dead_letter_blocks": True},
        {"release_mode": "republish", "header_secret": "s"},
    ):
        assert settings_of(**changed).fingerprint != base.fingerprint, changed


def test_differences_carry_both_values() -> None:
    mine, theirs = settings_of(retry_sequence="2s,5s,10s"), settings_of(retry_sequence="1m", ordering="key")
    assert differences(mine, theirs) == {"retry_sequence": ["2s,5s,10s", "1m"], "ordering": ["none", "key"]}


def test_only_fresh_other_workers_that_say_and_differ_are_listed() -> None:
    mine, other = settings_of(retry_sequence="2s,5s,10s"), settings_of(retry_sequence="1m")

    def summary(worker: str, settings: GroupSettings | None, age_ms: int = 0) -> WorkerSummary:
        published = WorkerSummary(worker, f"http://{worker}", NOW - age_ms, {}, settings=settings).to_dict()
        return WorkerSummary.from_dict(published)  # as read from the status topic

    summaries = [
        summary("me", mine),
        summary("same", mine),
        summary("other", other),
        summary("gone", other, age_ms=60_000),  # stale
        summary("older", None),  # a worker from before: says nothing, no warning
    ]
    found = settings_mismatches(summaries, mine=mine, me="me", now_ms=NOW, stale_after_ms=6000)
    assert found == [
        {
            "worker": "other",
            "url": "http://other",
            "fingerprint": other.fingerprint,
            "differs": {"retry_sequence": ["2s,5s,10s", "1m"]},
        }
    ]
    assert WorkerSummary.from_dict({"worker": "w", "at": 1, "settings": {"fingerprint": "x"}}).settings is None
