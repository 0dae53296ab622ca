"""Park rate: how fast one worker parks a burst of retryable failures (the tier agent's group commit).

One worker, a handler that fails every first try retryably, policy ``120s`` (nothing comes due during the run),
10,000 messages, in two variants, each on a fresh worker:

- ``failures``: produced at once to the main topic after the worker is ready; the main agent forwards each failure to
  the tier and the tier agent parks it, both stages in the one worker;
- ``tier-backlog``: the same number of genuine tier records (retry headers as a worker writes them) produced straight
  to the tier topic, so only the park path runs: the tier agent's own rate.

``GET /metrics`` is sampled four times a second: ``rebound_attempts_total{outcome="scheduled"}`` counts the failures
forwarded to the tier, ``rebound_parked_total`` the tier records parked. Each rate is taken between the moments its
counter passed 10 % and 90 % of the messages, so start-up and the tail do not weigh in.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench.common import (
    FaustProcess,
    Placed,
    follow_counters,
    now_ms,
    produce_batch,
    produce_placed,
    rate_between,
    rebound_worker,
    running,
    wait_until,
)
from bench.scenarios.base import PARTITIONS, PRODUCTION_BATCH, Context, new_topic
from bench.scenarios.parked_memory import metrics_text, ready, samples
from demo.embedded_broker import EmbeddedBroker
from rebound.headers import Provenance, retry_headers
from rebound.policy import format_duration, parse_duration_ms
from rebound.topics import tier_topic

SEQUENCE = "120s"
VARIANTS = ("failures", "tier-backlog")


def run(ctx: Context, broker: EmbeddedBroker) -> dict[str, Any]:
    count = ctx.size(default=10_000, quick=1_000)
    variants = {variant: run_variant(ctx, broker, variant, count) for variant in VARIANTS}
    failed = [f"{name}: {result['verdict']}" for name, result in variants.items() if result["verdict"] != "ok"]
    return {
        "params": {"messages": count, "retry_sequence": SEQUENCE, "partitions": PARTITIONS},
        "variants": variants,
        "verdict": "; ".join(failed) or "ok",
    }


def run_variant(ctx: Context, broker: EmbeddedBroker, variant: str, count: int) -> dict[str, Any]:
    topic = new_topic(broker, "park")
    worker = rebound_worker(
        broker,
        ctx.root,
        "park",
        REBOUND_APP_ID=topic,
        REBOUND_MAIN_TOPICS=topic,
        REBOUND_RETRY_SEQUENCE=SEQUENCE,
        REBOUND_HANDLER="bench.handlers:always_fail",
        **PRODUCTION_BATCH,
    )
    with running(worker):
        if not wait_until(lambda: ready(worker), 90, check=[worker]):
            raise RuntimeError(f"worker never became ready:\n{worker.log_tail()}")
        started = time.monotonic()
        if variant == "failures":
            asyncio.run(produce_batch(broker.bootstrap, topic, ((f"p{i}".encode(), b"{}") for i in range(count))))
        else:
            asyncio.run(produce_tier_records(broker.bootstrap, topic, count))
        produced_s = time.monotonic() - started
        trace = follow_counters(
            worker,
            started,
            lambda: counters(worker),
            lambda found: found["parked"] >= count,
            timeout=120 + count / 50,
        )
    forward = rate_between(trace, "scheduled", count) if variant == "failures" else None
    park = rate_between(trace, "parked", count)
    last = trace[-1]
    summary = {
        "produce_s": round(produced_s, 2),
        "forward_per_s": forward,
        "park_per_s": park,
        "park_of_forward": round(park / forward, 2) if park is not None and forward else None,
        "all_parked_after_s": round(last["t"], 2) if last["parked"] >= count else None,
    }
    print(f"  park-rate {variant}: {summary}", flush=True)
    verdict = "ok" if summary["all_parked_after_s"] is not None else f"FAILED: {last['parked']} of {count} parked"
    return {"summary": summary, "verdict": verdict, "raw": {"trace": trace}}


async def produce_tier_records(bootstrap: str, main_topic: str, count: int) -> None:
    """Genuine tier records of ``count`` failures of ``main_topic`` (group = app id = the topic's name), each on the
    tier partition its original partition maps to, due after the whole delay."""
    now = now_ms()
    tier = tier_topic(main_topic, format_duration(parse_duration_ms(SEQUENCE, variable="SEQUENCE")))

    def record(i: int) -> Placed:
        partition = i % PARTITIONS
        provenance = Provenance(main_topic, partition, i // PARTITIONS, now, now)
        headers = retry_headers(
            [],
            provenance=provenance,
            group=main_topic,
            attempt=1,
            due_at_ms=now + 120_000,
            error_class="rebound.errors.RetryableError",
            error_message="bench: parked on purpose",
        )
        return partition, f"p{i}".encode(), b"{}", headers

    await produce_placed(bootstrap, tier, (record(i) for i in range(count)))


def counters(worker: FaustProcess) -> dict[str, float]:
    """Forwarded to a tier (``scheduled``) and ``parked`` from ``/metrics``, summed over topics and tiers."""
    scheduled = parked = 0.0
    for name, labels, value in samples(metrics_text(worker)):
        if name == "rebound_attempts_total" and labels.get("outcome") == "scheduled":
            scheduled += value
        elif name == "rebound_parked_total":
            parked += value
    return {"scheduled": scheduled, "parked": parked}
