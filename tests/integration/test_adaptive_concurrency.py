"""``REBOUND_CONCURRENCY=auto`` through a real worker: a handler whose service runs N calls at once and queues the rest
(tests/capacity_handler.py). Started at a limit far above N, the worker brings it down near N from the latency it
sees, and every message is handled."""

from __future__ import annotations

import asyncio
import statistics
import time
import urllib.request
from typing import Any

from demo.harness import Worker, produce
from tests.integration.conftest import Deployment, outcome_offsets

CAPACITY = 6
MESSAGES = 2400  # about 8 s at the service's 300 calls/s


def scrape(worker: Worker) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.web_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith(("rebound_concurrency", "rebound_handler_in_flight"))
    }


def test_the_limit_comes_down_to_the_services_capacity_and_every_message_is_handled(deploy: Any) -> None:
    deployment: Deployment = deploy(
        partitions=2,
        REBOUND_CONCURRENCY="auto",
        REBOUND_CONCURRENCY_INITIAL="64",
        REBOUND_RETRY_SEQUENCE="1s",
    )
    env = deployment.worker_env(deployment.root / "data-auto")
    env.update(REBOUND_HANDLER="tests.capacity_handler:handle", CAPACITY_SLOTS=str(CAPACITY), CAPACITY_SERVICE_MS="20")
    worker = Worker(env, deployment.root / "auto.log").start()
    deployment.workers.append(worker)
    records = [(f"key-{n % 600}".encode(), b"{}", []) for n in range(MESSAGES)]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))

    limits: list[tuple[int, float, float, bool]] = []  # (calls so far, limit, in flight, probing)
    deadline = time.monotonic() + 120
    while (calls := len(deployment.calls())) < MESSAGES and time.monotonic() < deadline:
        assert not worker.crashed, worker.log_text()[-4000:]
        try:
            metrics = scrape(worker)
        except OSError:
            metrics = {}  # the web server is not up yet
        if "rebound_concurrency_limit" in metrics:
            limits.append(
                (
                    calls,
                    metrics["rebound_concurrency_limit"],
                    metrics["rebound_handler_in_flight"],
                    metrics["rebound_concurrency_probing"] == 1,
                )
            )
        time.sleep(0.2)

    seen = deployment.collect(lambda seen: len(outcome_offsets(seen, "succeeded")) >= MESSAGES, timeout=120)
    succeeded = outcome_offsets(seen, "succeeded")
    assert len(succeeded) == MESSAGES
    final = scrape(worker)
    assert final["rebound_concurrency_min"] == 2 and final["rebound_concurrency_max"] == 256
    assert 0.015 <= final["rebound_concurrency_baseline_seconds"] <= 0.2  # the 20 ms service time, no queue

    # Saturated (a backlog of thousands), in the second half of the run: near the capacity, not at 64.
    late = [limit for done, limit, in_flight, probing in limits if done > MESSAGES / 2 and not probing]
    assert late, f"no scrape in the second half: {limits}"
    assert statistics.median(late) <= 2 * CAPACITY + 2, limits
    assert max(late) < 32, limits
    # The service saw the same: calls at it (served and queued) on arrival, over the second half.
    arrivals = [call["at_service"] for call in deployment.calls()[MESSAGES // 2 :]]
    assert statistics.median(arrivals) <= 2 * CAPACITY + 2
    assert max(limit for _, limit, _, _ in limits) >= CAPACITY  # it did run calls at once
