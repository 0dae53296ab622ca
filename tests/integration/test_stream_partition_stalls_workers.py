"""Two retry-tier partitions through one agent's small stream queue, on a real worker: both are read to the end.

With a buffer of 8 (stream queue 8, batches of 4) Faust's buffer-full pause fires on nearly every batch of the tier
agent's queue, which is shared by the tier's two partitions; the consumer pauses and resumes them together
(``ReboundConsumer._share_stream_queues``) and puts back any stream partition nothing holds. The failing-first
reproduction of the stall is in tests/app/test_stream_partition_stalls.py; this checks the same code on a worker.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from demo.harness import produce
from tests.integration.conftest import Deployment, attempts_by_key

pytestmark = pytest.mark.broker


def test_both_partitions_of_a_tier_sharing_a_small_stream_queue_are_read_to_the_end(deploy: Any) -> None:
    deployment: Deployment = deploy(
        partitions=2, REBOUND_CONCURRENCY="16", REBOUND_PARTITION_BUFFER="8", REBOUND_RETRY_SEQUENCE="1s"
    )
    worker = deployment.start_worker("w")
    count = 240
    records = [(f"k-{n}".encode(), json.dumps({"succeed_on": 1, "n": n}).encode(), []) for n in range(count)]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))

    def succeeded(records: Any) -> set[tuple[int, int]]:
        return {
            (event["original_partition"], event["original_offset"])
            for events in attempts_by_key(records).values()
            for event in events
            if event["outcome"] == "succeeded" and event["attempt"] == 1
        }

    seen = deployment.collect(lambda seen: len(succeeded(seen)) >= count, timeout=150)
    done = succeeded(seen)
    assert len(done) == count
    assert {partition for partition, _ in done} == {0, 1}  # both tier partitions were read
    log = worker.log_text()
    assert not worker.crashed, log[-4000:]
    assert "Drain messages raised" not in log
    assert "with nothing holding it" not in log, log[-4000:]
