"""Pure backlog arithmetic: per-partition tier summaries on one worker, and their cluster-wide aggregation.

Nothing here touches Faust or Kafka, so it is unit-tested without a broker. A summary is kept per partition (not only
per worker) so that the aggregation can take, for every partition, the freshest report of it: during a rebalance two
workers can both report a partition for a moment, and counting it twice would inflate the backlog.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rebound.agreement import GroupSettings, differences

TierStats = dict[str, Any]
# partition -> tier topic -> stats
PartitionTiers = dict[int, dict[str, TierStats]]

STAT_FIELDS = ("waiting", "overdue", "oldest_due", "next_release", "oldest_first_received")


def empty_stats() -> TierStats:
    return {"waiting": 0, "overdue": 0, "oldest_due": None, "next_release": None, "oldest_first_received": None}


def _min(current: int | None, value: int | None) -> int | None:
    if value is None:
        return current
    return value if current is None else min(current, value)


def add_entry(stats: TierStats, *, due_at_ms: int, now_ms: int, first_received_ms: int | None = None) -> None:
    """Count one parked message into ``stats`` (in place)."""
    stats["waiting"] += 1
    stats["oldest_due"] = _min(stats["oldest_due"], due_at_ms)
    if due_at_ms <= now_ms:
        stats["overdue"] += 1
    else:
        stats["next_release"] = _min(stats["next_release"], due_at_ms)
    stats["oldest_first_received"] = _min(stats["oldest_first_received"], first_received_ms)


def merge_stats(into: TierStats, other: Mapping[str, Any]) -> None:
    into["waiting"] += int(other.get("waiting") or 0)
    into["overdue"] += int(other.get("overdue") or 0)
    for name in ("oldest_due", "next_release", "oldest_first_received"):
        into[name] = _min(into[name], other.get(name))


def main_topic_of_origin(origin: str) -> str:
    """``items/3/1207`` -> ``items`` (topic names may contain ``/``? Kafka forbids it, but split from the right)."""
    return origin.rsplit("/", 2)[0]


def tiers_from_counts(
    counts: Mapping[int, Mapping[str, int]],
    timing: Mapping[int, Mapping[str, Mapping[str, int | None]]],
    *,
    partitions: Iterable[int],
) -> PartitionTiers:
    """Per partition and tier topic: how many are parked from the store's counters, the time figures (overdue,
    oldest due, next release) from the release schedule's heaps. Neither is a scan.

    The counters are the truth for how many wait; the schedule can briefly hold a slot whose message already left
    (it is dropped when it comes due), so its overdue count is capped by the count. ``oldest_first_received`` is
    filled from the periodic survey (:func:`fill_first_received`).
    """
    result: PartitionTiers = {}
    for partition in partitions:
        by_tier = result[partition] = {}
        for topic, count in counts.get(partition, {}).items():
            stats = by_tier[topic] = empty_stats()
            times = timing.get(partition, {}).get(topic, {})
            stats["waiting"] = count
            stats["overdue"] = min(count, int(times.get("overdue") or 0))
            stats["oldest_due"] = times.get("oldest_due")
            stats["next_release"] = times.get("next_release")
    return result


def tiers_from_entries(
    entries: Iterable[Any], *, now_ms: int, partitions: Iterable[int] | None = None
) -> PartitionTiers:
    """Per partition and tier topic from table entries (:class:`rebound.state.PendingMessage`); exact but a scan.

    ``partitions`` given: only entries of those partitions count (the table iterates standbys too).
    """
    wanted = None if partitions is None else set(partitions)
    result: PartitionTiers = {partition: {} for partition in wanted or ()}
    for entry in entries:
        if wanted is not None and entry.partition not in wanted:
            continue
        stats = result.setdefault(entry.partition, {}).setdefault(entry.tier_topic, empty_stats())
        add_entry(
            stats, due_at_ms=entry.due_at_ms, now_ms=now_ms, first_received_ms=entry.provenance.first_received_at_ms
        )
    return result


def fill_first_received(tiers: PartitionTiers, oldest: Mapping[int, Mapping[str, int]]) -> None:
    for partition, by_tier in tiers.items():
        for topic, stats in by_tier.items():
            stats["oldest_first_received"] = oldest.get(partition, {}).get(topic)


def finish(stats: TierStats, now_ms: int) -> TierStats:
    """Add the time-based views of one tier's numbers: how far behind it is, when it releases next."""
    out = dict(stats)
    oldest_due = stats.get("oldest_due")
    next_release = stats.get("next_release")
    first = stats.get("oldest_first_received")
    out["max_overdue_ms"] = max(0, now_ms - oldest_due) if oldest_due is not None else 0
    out["next_release_in_ms"] = max(0, next_release - now_ms) if next_release is not None else None
    out["oldest_age_ms"] = max(0, now_ms - first) if first is not None else None
    return out


def sum_tiers(
    per_partition: Mapping[int, Mapping[str, Mapping[str, Any]]], tier_names: Iterable[str]
) -> dict[str, TierStats]:
    totals: dict[str, TierStats] = {name: empty_stats() for name in tier_names}
    for by_tier in per_partition.values():
        for topic, stats in by_tier.items():
            merge_stats(totals.setdefault(topic, empty_stats()), stats)
    return totals


def in_tier_order(totals: Mapping[str, TierStats], tier_names: Iterable[str], now_ms: int) -> dict[str, TierStats]:
    """``totals`` finished, in the order of ``tier_names`` (the policy's: :class:`rebound.tiers.Tiers`), then any
    tier only another worker reports (a worker of another retry sequence), by name."""
    known = [name for name in tier_names if name in totals]
    others = sorted(set(totals) - set(known))
    return {name: finish(totals[name], now_ms) for name in (*known, *others)}


def worker_backlog(
    per_partition: PartitionTiers, *, now_ms: int, tier_names: Iterable[str], owned: Iterable[int]
) -> dict[str, Any]:
    """The local (``?scope=worker``) view."""
    tier_names = tuple(tier_names)
    return {
        "now": now_ms,
        "scope": "worker",
        "owned_partitions": sorted(owned),
        "tiers": in_tier_order(sum_tiers(per_partition, tier_names), tier_names, now_ms),
    }


@dataclass(frozen=True)
class WorkerSummary:
    """What one worker publishes on ``<app id>.status`` every interval (JSON, key = worker id)."""

    worker: str
    url: str
    at_ms: int
    partitions: dict[int, dict[str, TierStats]]
    owned: tuple[int, ...] = ()
    counters: dict[str, int] = field(default_factory=dict)
    ordering: dict[int, dict[str, int]] = field(default_factory=dict)
    """Key-ordered mode, per partition: keys blocked and messages held."""
    breaker: dict[str, Any] | None = None
    """The worker's circuit breaker (its snapshot), None when it is off."""
    pause_state_known: bool | None = None
    """Whether the worker has read the operator's pause state (it holds the main topics until then); None from a
    worker that does not say."""
    concurrency: dict[str, Any] | None = None
    """The worker's limit on handler calls and its calls in flight (``Dispatcher.concurrency``); None from a worker
    that does not say."""
    settings: GroupSettings | None = None
    """The settings the group must agree on (:mod:`rebound.agreement`); None from a worker that does not say."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": 1,
            "worker": self.worker,
            "url": self.url,
            "at": self.at_ms,
            "owned": list(self.owned),
            "partitions": {str(p): tiers for p, tiers in self.partitions.items()},
            "counters": self.counters,
            "ordering": {str(p): counts for p, counts in self.ordering.items()},
            "breaker": self.breaker,
            "pause_state_known": self.pause_state_known,
            "concurrency": self.concurrency,
            "settings": self.settings.to_dict() if self.settings is not None else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerSummary:
        return cls(
            worker=str(data["worker"]),
            url=str(data.get("url") or ""),
            at_ms=int(data["at"]),
            partitions={int(p): dict(tiers) for p, tiers in (data.get("partitions") or {}).items()},
            owned=tuple(int(p) for p in data.get("owned") or ()),
            counters={str(k): int(v) for k, v in (data.get("counters") or {}).items()},
            ordering={int(p): dict(counts) for p, counts in (data.get("ordering") or {}).items()},
            breaker=data.get("breaker"),
            pause_state_known=None if data.get("pause_state_known") is None else bool(data["pause_state_known"]),
            concurrency=data.get("concurrency"),
            settings=GroupSettings.from_dict(data.get("settings")),
        )


def aggregate(
    summaries: Iterable[WorkerSummary],
    *,
    now_ms: int,
    stale_after_ms: int,
    tier_names: Iterable[str] = (),
    partition_count: int | None = None,
) -> dict[str, Any]:
    """The cluster-wide backlog from the latest summary of every worker.

    Summaries older than ``stale_after_ms`` are left out (the worker is gone or stuck) and listed as stale. Each
    partition is counted once, from the freshest summary that reports it. With ``partition_count`` the partitions
    no fresh worker reports are listed: the total then covers only part of the cluster.
    """
    fresh: list[WorkerSummary] = []
    stale: list[dict[str, Any]] = []
    for summary in summaries:
        if now_ms - summary.at_ms > stale_after_ms:
            stale.append({"worker": summary.worker, "url": summary.url, "age_ms": now_ms - summary.at_ms})
        else:
            fresh.append(summary)
    chosen: dict[int, WorkerSummary] = {}
    for summary in sorted(fresh, key=lambda s: s.at_ms):  # newest last, so it wins
        for partition in summary.partitions:
            chosen[partition] = summary
    per_partition = {partition: summary.partitions[partition] for partition, summary in chosen.items()}
    tier_names = tuple(tier_names)
    totals = sum_tiers(per_partition, tier_names)
    result: dict[str, Any] = {
        "now": now_ms,
        "scope": "cluster",
        "workers": [
            {
                "worker": s.worker,
                "url": s.url,
                "age_ms": now_ms - s.at_ms,
                "partitions": sorted(p for p, owner in chosen.items() if owner is s),
                "pause_state_known": s.pause_state_known,
            }
            for s in sorted(fresh, key=lambda s: s.worker)
        ],
        "stale_workers": sorted(stale, key=lambda s: s["worker"]),
        "partitions_reported": sorted(chosen),
        "tiers": in_tier_order(totals, tier_names, now_ms),
        "ordering": sum_ordering({p: owner.ordering[p] for p, owner in chosen.items() if p in owner.ordering}.values()),
        "breakers": {s.worker: s.breaker for s in sorted(fresh, key=lambda s: s.worker) if s.breaker is not None},
        "pause_state_unknown": sorted(s.worker for s in fresh if s.pause_state_known is False),
        "concurrency": {
            s.worker: s.concurrency for s in sorted(fresh, key=lambda s: s.worker) if s.concurrency is not None
        },
    }
    if partition_count is not None:
        result["partitions_missing"] = sorted(set(range(partition_count)) - set(chosen))
    return result


def settings_mismatches(
    summaries: Iterable[WorkerSummary],
    *,
    mine: GroupSettings,
    me: str,
    now_ms: int,
    stale_after_ms: int,
    since_ms: int = 0,
) -> list[dict[str, Any]]:
    """The fresh workers other than ``me`` whose group settings differ from ``mine``, each with what differs as
    ``{setting: [mine, theirs]}``. A worker that does not say (an older version) is left out.

    Only summaries published at or after ``since_ms`` (when ``me`` started) count: the last summary of ``me``'s own
    previous process (another worker id, the id having the process id) is still fresh when a restarted worker first
    reads the status topic, and would be taken for a worker that disagrees with the new settings. A live worker's
    next summary comes one interval later."""
    found = []
    for summary in sorted(summaries, key=lambda s: s.worker):
        theirs = summary.settings
        if summary.worker == me or theirs is None or now_ms - summary.at_ms > stale_after_ms:
            continue
        if summary.at_ms < since_ms:
            continue
        if theirs.fingerprint != mine.fingerprint:
            found.append(
                {
                    "worker": summary.worker,
                    "url": summary.url,
                    "fingerprint": theirs.fingerprint,
                    "differs": differences(mine, theirs),
                }
            )
    return found


def ordering_by_partition(states: Iterable[Any], partitions: Iterable[int] | None = None) -> dict[int, dict[str, int]]:
    """Key-ordered mode, per partition: keys blocked (waiting for a message, or holding messages) and held messages,
    from key states (:class:`rebound.state.KeyState`); a scan, to check the counts kept as the states change."""
    wanted = None if partitions is None else set(partitions)
    result: dict[int, dict[str, int]] = {p: {"blocked_keys": 0, "held": 0} for p in wanted or ()}
    for state in states:
        partition = state.partition
        if not state.is_blocked or partition is None or (wanted is not None and partition not in wanted):
            continue
        counts = result.setdefault(partition, {"blocked_keys": 0, "held": 0})
        counts["blocked_keys"] += 1
        counts["held"] += len(state.held)
    return result


def sum_ordering(per_partition: Iterable[Mapping[str, int]]) -> dict[str, int]:
    total = {"blocked_keys": 0, "held": 0}
    for counts in per_partition:
        for name in total:
            total[name] += int(counts.get(name, 0))
    return total
