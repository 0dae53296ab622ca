"""A resubscription's revocation, through a real worker and broker: the consumer reads no assignment then (aiokafka's
new subscription has none yet), so Faust's revocation skips its flow stop and its wait for the streams; Rebound's
does them (``ReboundApp._on_partitions_revoked``).

One partition. W@0 runs and is committed first. Then K@1 has the worker subscribe to one more topic
(:mod:`tests.resubscribe_injection`) and runs for 4 s, K@2 waiting on K's lane behind it. The revocation must stop
the flow and revoke the dispatcher with K@1 running, and wait for it: K@1 cannot be committed (aiokafka commits only
assigned partitions), so it is remembered as finished and not run again when the partition comes back; K@2, dropped,
is read again. Each record runs once, in order.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from demo.harness import produce
from tests.integration.conftest import Deployment, attempts_by_key, wait_for
from tests.integration.test_transactional_producers import committed_offset

pytestmark = [pytest.mark.broker]


def test_a_resubscription_s_revocation_stops_the_flow_revokes_the_dispatcher_and_waits_for_its_work(
    deploy: Any, kafka: Any
) -> None:
    deployment: Deployment = deploy(partitions=1)
    added = f"{deployment.topic}-added"
    asyncio.run(kafka.create_topics([added], 1))
    bootstrap, topic = deployment.broker.bootstrap, deployment.topic
    asyncio.run(produce(bootstrap, topic, [(b"W", b"{}", [])]))
    worker = deployment.start_worker("w", REBOUND_HANDLER="tests.resubscribe_injection:handle", RESUBSCRIBE_TOPIC=added)
    wait_for(
        lambda: asyncio.run(committed_offset(bootstrap, deployment.app_id, topic)) == 1,
        60,
        "W@0 committed",
        deployment.workers,
    )
    scripts: list[dict[str, Any]] = [{"resubscribe": True, "sleep": 4}, {}]
    asyncio.run(produce(bootstrap, topic, [(b"K", json.dumps(script).encode(), []) for script in scripts]))

    def both_succeeded(seen: Any) -> bool:
        events = attempts_by_key(seen).get("K", [])
        return {event["original_offset"] for event in events if event["outcome"] == "succeeded"} == {1, 2}

    deployment.collect(both_succeeded, timeout=90)
    log = worker.log_text()
    assert "resubscribe-injection: adding topic" in log, log[-4000:]
    after = log[log.index("resubscribe-injection: adding topic") :]
    assert "finds no assignment (a resubscription): the flow is stopped and the streams waited for" in after, after
    revoked = (
        f"dispatcher: revocation: TopicPartition(topic='{topic}', partition=0): committed 1, lowest unacknowledged 1"
    )
    assert revoked in after and "1 running" in after[after.index(revoked) :].splitlines()[0], after
    calls = [(call["offset"], call["attempt"]) for call in deployment.calls()]
    assert calls == [(0, 0), (1, 0), (2, 0)]
