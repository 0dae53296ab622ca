"""A worker given a partition back does not run again what it finished there, through real workers on the embedded
broker (``ReboundConsumer._finished``; docs/guarantees.md, "One lifecycle per message").

One partition. The first worker, alone, runs and commits a first record @0. Then it takes key A's record @1, whose
call waits on a file the test creates (``tests/gated_handler.py``), and A@2, queued behind it on A's lane; the other
keys' records @3..@7 finish, and wait behind @1 for their commit. A second worker joins: the first worker's revocation
drops A@2 at once (``REBOUND_REVOKE_DRAIN=0``) and waits for the held call, which the test then lets succeed; the
commit reaches offset 2 only, so @3..@7 are finished and not committed. The embedded broker completes the rebalance once the revocation is
done (it waits for a member still in its revocation callback), the assignor keeps the partition with the first worker
(sticky: one partition, it had it), in the very next generation, same member id. Reading from offset 2, it runs A@2
and acknowledges @3..@7 without a handler call, counted in ``rebound_redelivery_skipped_total`` and logged. Without
the remembered offsets (``_skip_if_finished`` answering no) @3..@7 ran twice.

Why the first commit: with nothing committed yet on the partition, a seek to the committed offsets during the
revocation (Faust's fetch loop seeks when a fetch comes back after the flow stopped) finds none, and
``_forget_finished_below`` then forgets every finished offset (its rule for a topic deleted and created again): about
half the runs ran @3..@7 again that way.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from demo.harness import produce
from tests.integration.conftest import Deployment, wait_for

pytestmark = pytest.mark.broker

SLOW = "A"
OTHERS = ("B", "C", "D", "E", "F")
"""Keys of @3..@7, one record each: they finish while A@1 is held."""


def committed(bootstrap: str, group: str, topic: str) -> int | None:
    """The group's committed offset of the topic's partition 0 (None if none), asked without joining the group."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    async def ask() -> int | None:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
        await consumer.start()
        try:
            return await consumer.committed(TopicPartition(topic, 0))
        finally:
            await consumer.stop()

    return asyncio.run(ask())


def skipped(port: int, topic: str) -> float:
    """The worker's ``rebound_redelivery_skipped_total{topic=...}`` (0 before any)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.search(rf'^rebound_redelivery_skipped_total\{{topic="{re.escape(topic)}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_worker_given_its_partition_back_acknowledges_what_it_finished_without_running_it_again(
    deploy: Any, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    deployment: Deployment = deploy(
        partitions=1,
        REBOUND_REVOKE_DRAIN="0",  # the revocation drops A@1 at once
        REBOUND_HANDLER_TIMEOUT="120s",  # the held call is not cut short while the test holds it
    )

    print(f"deployment in {deployment.root}")
    (gate / "hold").touch()
    first = deployment.start_gated_worker("first", gate)
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, [(b"Z", b"{}", [])]))
    wait_for(
        lambda: committed(deployment.broker.bootstrap, deployment.app_id, deployment.topic) == 1,
        90,
        "the first worker committing the first record",
        deployment.workers,
    )
    records: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]] = [
        (SLOW.encode(), json.dumps({"gated": "succeed"}).encode(), []),
        (SLOW.encode(), b"{}", []),
        *((key.encode(), b"{}", []) for key in OTHERS),
    ]
    sent = asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    assert [(meta.partition, meta.offset) for meta in sent] == [(0, offset) for offset in range(1, len(records) + 1)]
    later = set(range(3, len(records) + 1))

    def calls_at(offset: int) -> list[dict[str, Any]]:
        return [call for call in deployment.calls() if call["offset"] == offset]

    wait_for(
        lambda: calls_at(1) and all(calls_at(offset) for offset in later),
        90,
        "the first worker holding A@1 with @3..@7 done",
        deployment.workers,
    )

    second = deployment.start_gated_worker("second", gate)
    outstanding = re.compile(
        rf"dispatcher: revocation: .*{re.escape(deployment.topic)}.*: committed 1, lowest unacknowledged 1, "
        rf"1 queued, 1 running, {len(later)} done behind a lower one"
    )
    wait_for(
        lambda: outstanding.search(first.log_text()),
        90,
        "the first worker's revocation with A@2 queued behind the held A@1 and @3..@7 done",
        deployment.workers,
    )
    (gate / "release").touch()

    wait_for(lambda: calls_at(2), 90, "A@2 run after the rebalance", deployment.workers)
    wait_for(
        lambda: skipped(first.web_port, deployment.topic) >= len(later),
        30,
        "the first worker skipping @3..@7",
        deployment.workers,
        ignore=(OSError,),
    )
    calls = deployment.calls()
    assert first.process is not None
    first_pid = first.process.pid
    print(f"calls (pid, offset, attempt): {[(c['pid'], c['offset'], c['attempt']) for c in calls]}")

    # Each record ran once, all on the first worker: A@2 after it got the partition back, @3..@7 not again.
    assert sorted((c["offset"], c["attempt"]) for c in calls) == [(offset, 0) for offset in range(len(records) + 1)]
    assert {c["pid"] for c in calls} == {first_pid}
    assert skipped(first.web_port, deployment.topic) == len(later)
    assert skipped(second.web_port, deployment.topic) == 0
    assert (
        f"offset 3 and {len(later) - 1} more later ones were finished by this worker before it last lost the partition"
        in first.log_text()
    ), first.log_text()[-4000:]
