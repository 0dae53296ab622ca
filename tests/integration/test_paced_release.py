"""Paced releases through a real worker: 200 retries due within a second, ``REBOUND_RELEASE_RATE=50``.

Unpaced, the worker runs them all as soon as they are due (within about a second). Paced, they take about four
seconds, no second holds more than the rate (and the burst) allows, none runs before its due time, and the lateness
histogram on ``/metrics`` shows the delay pacing added rather than hiding it. And with the circuit breaker and
``REBOUND_RELEASE_RAMP``, a backlog held by an outage meets the ramp when the breaker closes, not the full rate.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from demo.harness import produce
from rebound import headers as h
from rebound.pacing import RAMP_START
from tests.integration.conftest import Deployment, attempts_by_key

pytestmark = [pytest.mark.broker]

COUNT, RATE, BURST = 200, 50, 5


def metric_samples(port: int) -> list[Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def test_paced_releases_keep_to_the_rate_and_are_never_early(deploy: Any) -> None:
    deployment: Deployment = deploy(partitions=2, REBOUND_RETRY_SEQUENCE="5s", REBOUND_RELEASE_RATE=str(RATE))
    worker = deployment.start_worker("paced")
    records: list[tuple[bytes, bytes, list[tuple[str, bytes]]]] = [
        (f"k{i}".encode(), json.dumps({"succeed_on": 1}).encode(), []) for i in range(COUNT)
    ]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    keys = {f"k{i}" for i in range(COUNT)}

    def done(seen: list[Any]) -> bool:
        by_key = attempts_by_key(seen)
        return all(key in by_key and by_key[key][-1]["outcome"] == "succeeded" for key in keys)

    by_key = attempts_by_key(deployment.collect(done, timeout=60))
    due = {key: events[0]["due_at"] for key, events in by_key.items() if key in keys}
    assert all(by_key[key][0]["outcome"] == "scheduled" for key in keys)
    retries = {call["key"]: call["now_ms"] for call in deployment.calls() if call["attempt"] == 1}
    assert set(retries) == keys

    assert all(retries[key] >= due[key] for key in keys), "a retry ran before its due time"
    assert max(due.values()) - min(due.values()) < 2_500  # they came due together: the spread below is pacing's
    times = sorted(retries.values())
    assert times[-1] - times[0] >= (COUNT - BURST) / RATE * 1000 - 300  # about 3.9 s, however close their due times
    for start in times:  # no second holds more than the rate allows (a fetch may bring a few requests together)
        assert sum(1 for t in times if start <= t < start + 1000) <= RATE + BURST + 10

    samples = metric_samples(worker.web_port)
    paced = next(s.value for s in samples if s.name == "rebound_release_paced_total")
    assert paced >= COUNT / 2
    assert next(s.value for s in samples if s.name == "rebound_release_rate_allowed") == RATE
    buckets = {
        s.labels["le"]: s.value for s in samples if s.name == "rebound_release_lateness_seconds_bucket" and s.value
    }
    assert buckets["+Inf"] == COUNT
    # The histogram shows the lateness the calls show: releases more than a second late are counted as such.
    late = [retries[key] - due[key] for key in keys]
    assert sum(1 for ms in late if ms > 1_200) <= COUNT - buckets.get("1.0", 0) <= sum(1 for ms in late if ms > 900)
    assert max(late) >= 2_000
    # The release timer's ticks are timed there too, one observation each.
    assert next(s.value for s in samples if s.name == "rebound_release_tick_seconds_count") > 0


async def produce_parked(bootstrap: str, tier: str, records: list[tuple[int, bytes, bytes, Any]]) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        sent = [
            await producer.send(tier, key=key, value=value, partition=partition, headers=headers)
            for partition, key, value, headers in records
        ]
        await asyncio.gather(*sent)
    finally:
        await producer.stop()


def test_after_an_outage_the_breaker_closes_onto_the_ramp_not_the_full_rate(deploy: Any) -> None:
    """150 retries written straight to the tier, due together while the dependency is down: the first releases
    fail, the breaker opens and holds the rest, a probe closes it once the dependency is back, and the backlog then
    climbs from a tenth of the rate (5/s) to 50/s over 4 s instead of starting at 50/s."""
    rate, ramp_s, count = 50, 4, 150
    deployment: Deployment = deploy(
        partitions=2,
        REBOUND_RETRY_SEQUENCE="30s,30s",
        REBOUND_RELEASE_RATE=str(rate),
        REBOUND_RELEASE_RAMP=f"{ramp_s}s",
        REBOUND_BREAKER_ENABLED="true",
        REBOUND_BREAKER_WINDOW="10s",
        REBOUND_BREAKER_MIN_CALLS="3",
        REBOUND_BREAKER_PROBE_INTERVAL="1s",
        REBOUND_BREAKER_PROBE_MAX_INTERVAL="1s",
    )
    worker = deployment.start_worker("ramped")
    deadline = time.monotonic() + 60
    while not ready(worker.web_port):
        assert time.monotonic() < deadline and not worker.crashed, worker.log_text()[-4000:]
        time.sleep(0.3)
    now = time.time_ns() // 1_000_000
    due_at, outage_until = now + 2_000, now + 5_000
    records = []
    for i in range(count):
        partition = i % 2
        headers = h.retry_headers(
            [],
            provenance=h.Provenance(deployment.topic, partition, i, now, now),
            group=deployment.app_id,
            attempt=1,
            due_at_ms=due_at,
            error_class="RetryableError",
            error_message="parked by the test",
        )
        value = json.dumps({"succeed_on": 1, "outage_until": outage_until}).encode()
        records.append((partition, f"r{i}".encode(), value, headers))
    asyncio.run(produce_parked(deployment.broker.bootstrap, f"{deployment.topic}.retry.30s", records))

    deadline = time.monotonic() + 40
    while True:
        calls = [c for c in deployment.calls() if c["attempt"] == 1]
        failed = [c for c in calls if c["now_ms"] < outage_until]
        if len(calls) >= count:
            break
        assert time.monotonic() < deadline, f"{len(calls)} of {count} released"
        time.sleep(0.5)
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.web_port}/retry/backlog?scope=worker") as response:
        breaker = json.loads(response.read())["breaker"]
    closes = [t["at"] for t in breaker["transitions"] if t["to"] == "closed"]
    assert breaker["opens_total"] >= 1 and closes, breaker["transitions"]
    closed_at = closes[-1]
    assert closed_at >= outage_until
    assert all(c["now_ms"] >= due_at for c in calls), "a retry ran before its due time"
    assert len(failed) < count / 4  # the breaker held most of them through the outage

    def ran_within(seconds: float) -> int:
        return sum(1 for c in calls if closed_at <= c["now_ms"] < closed_at + seconds * 1000)

    def ramp_allows(seconds: float) -> float:  # the area under the line from RAMP_START of the rate, plus the burst
        share = RAMP_START + (1 - RAMP_START) * min(seconds, ramp_s) / ramp_s
        return rate * min(seconds, ramp_s) * (RAMP_START + share) / 2 + rate * 0.1

    # Unramped, 2 s after the close would allow 105 releases; the ramp allows 37.5 (32.5 and the burst).
    assert 15 <= ran_within(2) <= ramp_allows(2) + 8
    assert ran_within(4) <= ramp_allows(4) + 8


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False
