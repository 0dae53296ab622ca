"""``tune``: recommend a retry sequence from the observed time-to-recovery distribution.

Model: a failing message's cause heals ``T`` after its first receipt (``T`` = observed time to recovery; messages
that never recovered have ``T`` = infinity). With delays ``d1..dn`` the message is retried at the cumulative delays
``c1 < c2 < ... < cn`` and recovers on the first retry with ``ck >= T``. For each candidate sequence this gives

* expected recovery rate: share of failing messages with ``T <= cn``;
* broker writes per failing message: one tier-topic record per retry made, plus one failed-topic record when all
  retries fail (attempt events are not counted);
* mean time to success of the recovered ones (``ck``), i.e. what the sequence adds on top of ``T``.

Candidates with ``n`` tiers put their cumulative delays at evenly spaced quantiles of ``T`` (up to the p99 of the
recovered messages, capped by ``--max-duration``), rounded up to readable durations. The recommendation is the
candidate with the fewest tiers that still covers that target and whose mean time to success is within
``--latency-slack`` (default 1.0, i.e. at most twice the mean observed ``T``); ties break on fewer writes.

``--since``/``--until`` learn from the attempt events whose ``event_time`` is in that window only (e.g. the weeks
after a dependency changed), read from those date partitions alone.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pipeline.common import JobConfig, check_window
from pipeline.jobs.facts import add_window_arguments, facts_in_window, facts_path

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_NICE_MS = [
    s * 1000
    for s in (
        1,
        2,
        5,
        10,
        15,
        20,
        30,
        45,
        60,
        90,
        120,
        180,
        300,
        600,
        900,
        1200,
        1800,
        2700,
        3600,
        5400,
        7200,
        10800,
        14400,
        21600,
        43200,
        86400,
    )
]
_UNITS = (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000))


def label(ms: int) -> str:
    for unit, size in _UNITS:
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def parse_duration(text: str) -> int:
    text = text.strip()
    for unit, size in (("ms", 1), *[(u, s) for u, s in _UNITS]):
        if text.endswith(unit) and text[: -len(unit)].isdigit():
            return int(text[: -len(unit)]) * size
    raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30s, 5m, 2h")


def nice_ceil(ms: float) -> int:
    for nice in _NICE_MS:
        if nice >= ms:
            return nice
    return math.ceil(ms / 86_400_000) * 86_400_000


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (same as Spark's ``percentile`` and numpy's default)."""
    if not sorted_values:
        raise ValueError("no values")
    pos = (len(sorted_values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class Candidate:
    delays_ms: tuple[int, ...]
    sequence: str
    total_ms: int
    recovery_rate: float
    writes_per_message: float
    mean_time_to_success_ms: float | None


def evaluate(delays_ms: Sequence[int], recovery_ms: Sequence[float], never_recovered: int) -> Candidate:
    cumulative = []
    total = 0
    for d in delays_ms:
        total += d
        cumulative.append(total)
    n = len(delays_ms)
    writes = 0
    recovered_times = []
    for t in recovery_ms:
        k = next((i for i, c in enumerate(cumulative) if c >= t), None)
        if k is None:
            writes += n + 1
        else:
            writes += k + 1
            recovered_times.append(cumulative[k])
    writes += never_recovered * (n + 1)
    failing = len(recovery_ms) + never_recovered
    return Candidate(
        delays_ms=tuple(delays_ms),
        sequence=",".join(label(d) for d in delays_ms),
        total_ms=total,
        recovery_rate=len(recovered_times) / failing if failing else 0.0,
        writes_per_message=writes / failing if failing else 0.0,
        mean_time_to_success_ms=sum(recovered_times) / len(recovered_times) if recovered_times else None,
    )


def candidate_sequences(recovery_ms: Sequence[float], max_duration_ms: int, max_tiers: int) -> list[tuple[int, ...]]:
    values = sorted(recovery_ms)
    target = min(quantile(values, 0.99), max_duration_ms)
    sequences = []
    for n in range(1, max_tiers + 1):
        cumulative: list[int] = []
        for i in range(1, n + 1):
            point = target if i == n else min(quantile(values, 0.99 * i / n), target)
            c = nice_ceil(point)
            c = min(c, max_duration_ms)
            if cumulative and c <= cumulative[-1]:
                continue
            cumulative.append(c)
        delays = tuple(b - a for a, b in zip([0, *cumulative[:-1]], cumulative, strict=True))
        if delays and delays not in sequences:
            sequences.append(delays)
    return sequences


def recommend(
    recovery_ms: Sequence[float],
    never_recovered: int,
    *,
    max_duration_ms: int,
    max_tiers: int = 8,
    latency_slack: float = 1.0,
) -> dict[str, Any]:
    if not recovery_ms:
        return {"recommendation": None, "candidates": [], "reason": "no recovered messages to learn from"}
    values = sorted(recovery_ms)
    p99 = quantile(values, 0.99)
    target = min(p99, max_duration_ms)
    candidates = [evaluate(s, values, never_recovered) for s in candidate_sequences(values, max_duration_ms, max_tiers)]
    mean_t = sum(values) / len(values)
    covered = [c for c in candidates if c.total_ms >= target]
    fitting = [
        c
        for c in covered
        if c.mean_time_to_success_ms is not None and c.mean_time_to_success_ms <= (1 + latency_slack) * mean_t
    ]
    pool = fitting or covered or candidates
    best = min(pool, key=lambda c: (len(c.delays_ms), c.writes_per_message))
    return {
        "observed": {
            "recovered": len(values),
            "never_recovered": never_recovered,
            "p50_ms": quantile(values, 0.5),
            "p90_ms": quantile(values, 0.9),
            "p99_ms": p99,
            "mean_ms": mean_t,
        },
        "max_duration_ms": max_duration_ms,
        "p99_within_max_duration": p99 <= max_duration_ms,
        "recommendation": asdict(best),
        "candidates": [asdict(c) for c in candidates],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-duration",
        type=parse_duration,
        default=parse_duration("24h"),
        help="longest total retry time allowed (default 24h)",
    )
    parser.add_argument("--max-tiers", type=int, default=8, help="most retries a candidate may have (default 8)")
    parser.add_argument(
        "--latency-slack",
        type=float,
        default=1.0,
        help="allowed mean time to success as a multiple of (1 + slack) of the observed mean",
    )
    add_window_arguments(parser, "attempt events (by event time)")


def run(args: argparse.Namespace, cfg: JobConfig, spark: SparkSession) -> dict[str, Any]:
    from pyspark.sql import functions as F

    from pipeline.jobs.report import messages, recovered

    source = facts_path(cfg)
    if not any(source.glob("date=*")):
        raise SystemExit(f"no facts under {source}; run `python -m pipeline facts` first")
    check_window(args.since, args.until)
    msgs = messages(facts_in_window(spark, source, args.since, args.until)).cache()
    recovery = [float(r["recovery_ms"]) for r in recovered(msgs).select("recovery_ms").collect()]
    never = msgs.where((F.col("terminal_failure") == 1) & F.col("success_attempt").isNull()).count()
    result = recommend(
        recovery, never, max_duration_ms=args.max_duration, max_tiers=args.max_tiers, latency_slack=args.latency_slack
    )
    result["since"] = args.since.isoformat() if args.since else None
    result["until"] = args.until.isoformat() if args.until else None
    (cfg.out / "tune" / "recommendation.json").write_text(json.dumps(result, indent=1))
    print(f"{'sequence':<40} {'tiers':>5} {'recovery':>9} {'writes/msg':>10} {'mean wait':>10}")
    for c in result["candidates"]:
        wait = c["mean_time_to_success_ms"]
        print(
            f"{c['sequence']:<40} {len(c['delays_ms']):>5} {c['recovery_rate']:>9.1%} "
            f"{c['writes_per_message']:>10.2f} {label(int(wait)) if wait else '-':>10}"
        )
    best = result["recommendation"]
    print(f"recommended REBOUND_RETRY_SEQUENCE={best['sequence']}" if best else f"tune: {result.get('reason')}")
    return result
