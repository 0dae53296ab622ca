"""Pure backlog arithmetic and failed-topic summaries: no broker, no Faust."""

from __future__ import annotations

from types import SimpleNamespace

from app.web.admin import check_token
from app.web.failed import FailedTopicSummary, depth
from rebound import headers as h
from rebound.policy import RetryPolicy
from rebound.schedule import ReleaseSchedule, Slot
from rebound.settings import reveal
from rebound.summary import WorkerSummary, aggregate, tiers_from_counts, tiers_from_entries, worker_backlog
from rebound.tiers import Tiers

NOW = 1_000_000
TIERS = ["items.retry.1s", "items.retry.5m"]


def stats(waiting: int, overdue: int, oldest_due: int, next_release: int | None, first: int | None = None) -> dict:
    return {
        "waiting": waiting,
        "overdue": overdue,
        "oldest_due": oldest_due,
        "next_release": next_release,
        "oldest_first_received": first,
    }


def test_counts_and_schedule_times_are_grouped_by_partition_and_tier_topic() -> None:
    schedule = ReleaseSchedule()
    for partition in (0, 1, 2):
        schedule.adopt(partition, [])
    for partition, due, origin, tier in [
        (0, NOW - 500, "items/0/1", "1s"),
        (0, NOW + 300, "items/0/2", "1s"),
        (1, NOW + 90_000, "items/1/9", "5m"),
        (1, NOW + 1000, "orders/1/3", "1s"),
        (1, NOW - 9, "items/1/4", "5m"),  # a slot whose message already left: the count says so
    ]:
        schedule.add(partition, Slot(due, b"k", origin, 1, tier))
    counts = {0: {"items.retry.1s": 2}, 1: {"items.retry.5m": 1, "orders.retry.1s": 1}}
    tiers = tiers_from_counts(counts, schedule.tier_stats(NOW), partitions=[0, 1, 2])
    assert tiers[0]["items.retry.1s"] == stats(2, 1, NOW - 500, NOW + 300)
    assert tiers[1]["items.retry.5m"] == stats(1, 1, NOW - 9, NOW + 90_000)
    assert tiers[1]["orders.retry.1s"]["waiting"] == 1
    assert tiers[2] == {}  # an owned partition with nothing parked is still reported (covered, empty)


def test_table_entries_keep_only_owned_partitions_and_first_receipt() -> None:
    def entry(partition: int, due: int, first: int) -> SimpleNamespace:
        return SimpleNamespace(
            partition=partition,
            tier_topic="items.retry.1s",
            due_at_ms=due,
            provenance=SimpleNamespace(first_received_at_ms=first),
        )

    tiers = tiers_from_entries(
        [entry(0, NOW - 1, 50), entry(0, NOW + 5, 40), entry(3, NOW, 1)], now_ms=NOW, partitions=[0]
    )
    assert tiers == {0: {"items.retry.1s": stats(2, 1, NOW - 1, NOW + 5, 40)}}


def test_aggregate_sums_fresh_workers_drops_stale_and_counts_a_partition_once() -> None:
    a = WorkerSummary("a", "http://a", NOW - 1000, {0: {"items.retry.1s": stats(3, 1, NOW - 2000, NOW + 100, 10)}})
    b_old = WorkerSummary("b", "http://b", NOW - 1500, {1: {"items.retry.1s": stats(99, 0, NOW, NOW)}})
    # c took partition 1 over from b after a rebalance: its newer report wins, b's is not added on top.
    c = WorkerSummary("c", "http://c", NOW - 200, {1: {"items.retry.1s": stats(2, 0, NOW + 50, NOW + 50, 5)}})
    gone = WorkerSummary("d", "http://d", NOW - 60_000, {2: {"items.retry.5m": stats(7, 7, 1, None)}})
    result = aggregate([a, b_old, c, gone], now_ms=NOW, stale_after_ms=6000, tier_names=TIERS, partition_count=4)
    one = result["tiers"]["items.retry.1s"]
    assert (one["waiting"], one["overdue"], one["oldest_due"], one["next_release"]) == (5, 1, NOW - 2000, NOW + 50)
    assert one["max_overdue_ms"] == 2000 and one["next_release_in_ms"] == 50
    assert one["oldest_first_received"] == 5 and one["oldest_age_ms"] == NOW - 5
    assert result["tiers"]["items.retry.5m"]["waiting"] == 0  # configured tier, nothing fresh reported
    assert [w["worker"] for w in result["workers"]] == ["a", "b", "c"]
    assert next(w for w in result["workers"] if w["worker"] == "b")["partitions"] == []
    assert [w["worker"] for w in result["stale_workers"]] == ["d"]
    assert result["partitions_reported"] == [0, 1]
    assert result["partitions_missing"] == [2, 3]
    assert result["scope"] == "cluster"


def test_worker_summary_round_trips_through_json_shape() -> None:
    summary = WorkerSummary("w", "http://w", NOW, {3: {"items.retry.1s": stats(1, 0, NOW, NOW)}}, owned=(3,))
    assert WorkerSummary.from_dict(summary.to_dict()) == summary


def failed_record_headers(reason: str, error_class: str, topic: str = "items") -> list[tuple[str, bytes]]:
    return [
        ("trace-id", b"t"),
        (h.ORIGINAL_TOPIC, topic.encode()),
        (h.REASON, reason.encode()),
        (h.ERROR_CLASS, error_class.encode()),
    ]


def test_failed_summary_counts_and_keeps_only_the_latest_metadata() -> None:
    summary = FailedTopicSummary("items.failed", latest_size=2)
    records = [
        ("exhausted", "RetryableError", 300),
        ("permanent", "ValueError", 100),
        ("exhausted", "RetryableError", 200),
    ]
    for offset, (reason, error_class, ts) in enumerate(records):
        summary.add(
            partition=0,
            offset=offset,
            timestamp_ms=ts,
            key=f"k{offset}".encode(),
            value=b"secret",
            headers=failed_record_headers(reason, error_class),
        )
    hidden = summary.to_dict()
    assert hidden["counted"] == 3
    assert hidden["by_reason"] == {"exhausted": 2, "permanent": 1}
    assert hidden["by_error_class"] == {"RetryableError": 2, "ValueError": 1}
    assert hidden["by_original_topic"] == {"items": 3}
    assert (hidden["oldest_record"], hidden["newest_record"]) == (100, 300)
    assert [item["key"] for item in hidden["latest"]] == ["k2", "k1"]  # newest first, capped at 2
    assert hidden["latest"][0]["headers"][h.REASON] == "exhausted"
    assert all("value" not in item and item["value_bytes"] == 6 for item in hidden["latest"])
    shown = summary.to_dict(show_payloads=True)
    assert shown["latest"][0]["value"] == "secret"


def test_depth_is_position_minus_start_per_partition() -> None:
    assert depth({0: 0, 1: 5}, {0: 7, 1: 9}) == 11
    assert depth({0: 3}, {}) == 0  # nothing read yet: no claim


def test_admin_token_check() -> None:
    assert check_token(None, "Bearer x")[0] == 403  # type: ignore[index]
    assert check_token("", "Bearer x")[0] == 403  # type: ignore[index]
    assert check_token("s3cret", None)[0] == 401  # type: ignore[index]
    assert check_token("s3cret", "Basic s3cret")[0] == 401  # type: ignore[index]
    assert check_token("s3cret", "Bearer wrong")[0] == 401  # type: ignore[index]
    assert check_token("s3cret", "Bearer s3cret") is None
    assert check_token("s3cret", "bearer s3cret") is None


def test_empty_admin_token_setting_means_off() -> None:
    from rebound.settings import load_settings

    assert load_settings(admin_token="").admin_token is None
    assert load_settings(admin_token="  ").admin_token is None
    assert reveal(load_settings(admin_token="t").admin_token) == "t"


def test_a_worker_that_has_not_read_the_pause_state_is_carried_and_listed() -> None:
    held = WorkerSummary("h", "http://h", NOW - 100, {0: {}}, pause_state_known=False)
    assert WorkerSummary.from_dict(held.to_dict()) == held
    ok = WorkerSummary("o", "http://o", NOW - 100, {1: {}}, pause_state_known=True)
    old = WorkerSummary.from_dict({k: v for k, v in ok.to_dict().items() if k != "pause_state_known"} | {"worker": "x"})
    assert old.pause_state_known is None  # a worker that does not say is not listed
    result = aggregate([held, ok, old], now_ms=NOW, stale_after_ms=6000)
    assert result["pause_state_unknown"] == ["h"]
    assert [w["pause_state_known"] for w in result["workers"]] == [False, True, None]


def test_failed_summary_names_a_key_its_text_does_not_name_by_its_base64_too() -> None:
    """As the key view does (``rebound/key_names.py``): the text of a key that is not UTF-8 is no name to send back."""
    summary = FailedTopicSummary("items.failed")
    for offset, key in enumerate((b"retry-\xff\xfe", b"plain", None)):
        summary.add(
            partition=0,
            offset=offset,
            timestamp_ms=100,
            key=key,
            value=b"v",
            headers=failed_record_headers("exhausted", "RetryableError"),
        )
    latest = summary.to_dict()["latest"]  # newest first
    assert [{name: item[name] for name in item if name.startswith("key")} for item in latest] == [
        {"key": None},
        {"key": "plain"},
        {"key": "retry-\\xff\\xfe", "key_base64": "cmV0cnkt__4="},
    ]


def test_the_backlog_lists_the_tiers_in_the_policy_s_order_by_delay_not_by_name() -> None:
    """Reported: ``faust -A app backlog`` listed ``10s, 2s, 5s``. The order is the policy's (``Tiers``: each main topic
    as configured, its tiers by delay, a draining tier of an earlier sequence among them), the backlog keeps it, and a
    tier only another worker reports comes after them."""
    tiers = Tiers.build(("items", "orders"), RetryPolicy.parse("10s,2s,5s"), ["items.retry.7s", "items.failed"])
    assert list(tiers) == [
        "items.retry.2s",
        "items.retry.5s",
        "items.retry.7s",
        "items.retry.10s",
        "orders.retry.2s",
        "orders.retry.5s",
        "orders.retry.10s",
    ]
    one = {0: {name: stats(1, 0, NOW + 5, NOW + 5) for name in ("items.retry.10s", "items.retry.2s", "items.retry.5s")}}
    local = worker_backlog(one, now_ms=NOW, tier_names=tiers, owned=[0])
    assert list(local["tiers"]) == list(tiers)
    other = WorkerSummary("w2", "", NOW, {1: {"items.retry.1m": stats(1, 0, NOW + 5, NOW + 5)}})
    cluster = aggregate([WorkerSummary("w1", "", NOW, one), other], now_ms=NOW, stale_after_ms=6000, tier_names=tiers)
    assert list(cluster["tiers"]) == [*tiers, "items.retry.1m"]
