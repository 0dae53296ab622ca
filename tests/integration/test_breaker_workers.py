"""The circuit breaker through a real worker: a dependency down for everyone, then back.

With a two-retry policy of one second each, every message would be dead-lettered within a few seconds of an outage
that lasts fifteen. With the breaker on, it opens after a handful of failures, holds consumption and releases, probes,
closes once the dependency answers again, and every message then succeeds: nothing is dead-lettered for the outage.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from itertools import pairwise
from typing import Any

import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from demo.harness import produce
from tests.integration.conftest import Deployment, attempts_by_key

pytestmark = [pytest.mark.broker]

FIRST, LATER = 30, 20
OUTAGE_S = 15


def get_json(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return json.loads(response.read())


def scripted(keys: list[str], outage_until: int) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    return [(key.encode(), json.dumps({"outage_until": outage_until}).encode(), []) for key in keys]


def test_an_outage_dead_letters_nothing_and_consumption_resumes_after_it(deploy: Any) -> None:
    deployment: Deployment = deploy(
        partitions=2,
        REBOUND_RETRY_SEQUENCE="1s,1s",
        REBOUND_BREAKER_ENABLED="true",
        REBOUND_BREAKER_WINDOW="10s",
        REBOUND_BREAKER_MIN_CALLS="5",
        REBOUND_BREAKER_FAILURE_RATIO="0.5",
        REBOUND_BREAKER_PROBE_INTERVAL="2s",
        REBOUND_BREAKER_PROBE_MAX_INTERVAL="4s",
    )
    worker = deployment.start_worker("solo")
    first = [f"first-{index}" for index in range(FIRST)]
    later = [f"later-{index}" for index in range(LATER)]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, scripted(["warm-up"], 0)))
    deployment.collect(lambda seen: "warm-up" in attempts_by_key(seen), timeout=60)

    outage_until = time.time_ns() // 1_000_000 + OUTAGE_S * 1000
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, scripted(first, outage_until)))
    deadline = time.monotonic() + 20
    while get_json(worker.web_port, "/retry/backlog?scope=worker")["breaker"]["state"] == "closed":
        assert time.monotonic() < deadline, "the breaker never opened"
        time.sleep(0.2)
    produced_while_open = time.time_ns() // 1_000_000
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, scripted(later, outage_until)))

    records = deployment.collect(
        lambda seen: all(
            any(e["outcome"] == "succeeded" for e in attempts_by_key(seen).get(key, [])) for key in first + later
        ),
        timeout=90,
    )
    by_key = attempts_by_key(records)
    assert not [e for events in by_key.values() for e in events if e["outcome"] in ("dead", "expired")]

    breaker = get_json(worker.web_port, "/retry/backlog?scope=worker")["breaker"]
    assert breaker["state"] == "closed"
    moves = [(t["from"], t["to"]) for t in breaker["transitions"]]
    assert moves[0] == ("closed", "open") and moves[-1] == ("half-open", "closed"), moves
    opened = breaker["transitions"][0]["at"]
    closed = breaker["transitions"][-1]["at"]
    assert closed >= outage_until  # it closed only once the dependency answered again
    calls = deployment.calls()
    # While it was open only probes ran: one per probe time, not one per message.
    while_open = [c for c in calls if opened < c["now_ms"] < closed and c["key"] != "warm-up"]
    assert len(while_open) <= breaker["probes_total"] + 2, (len(while_open), breaker["probes_total"])
    # The records produced while it was open ran before it closed only as probes: a fetch under way as it opened (or
    # one fetched for a probe) hands them over to wait at the gate, and each probe time lets one waiting call through.
    # So each such call ran while it was half-open, one per probe.
    transitions = breaker["transitions"]
    probing = [(t["at"], after["at"]) for t, after in pairwise(transitions) if t["to"] == "half-open"]
    early = [c for c in calls if c["key"].startswith("later-") and c["now_ms"] < closed]
    as_probe = [next((n for n, (start, end) in enumerate(probing) if start <= c["now_ms"] <= end), None) for c in early]
    assert None not in as_probe and len(set(as_probe)) == len(as_probe), (early, probing)
    assert produced_while_open < closed
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.web_port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"] == CONTENT_TYPE_LATEST
        metrics = {
            sample.name: sample.value
            for family in text_string_to_metric_families(response.read().decode())
            for sample in family.samples
            if not sample.labels
        }
    assert metrics["rebound_breaker_state"] == 0 and metrics["rebound_breaker_opens_total"] == 1
    assert metrics["rebound_breaker_probes_total"] == breaker["probes_total"]

    # Everything was handled: the lag of both main-topic partitions (read from the consumer, no broker request) is 0
    # once the last offsets are committed.
    deadline = time.monotonic() + 20
    while (lag := consumer_lag(worker.web_port, deployment.topic)) != {"0": 0, "1": 0}:
        assert time.monotonic() < deadline, lag
        time.sleep(0.5)


def consumer_lag(port: int, topic: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.labels["partition"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "rebound_consumer_lag" and sample.labels["topic"] == topic
    }
