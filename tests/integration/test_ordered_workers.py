"""Key-ordered mode through real workers: a key's successes come in offset order, through a kill and partition moves.

Each key gets three messages; the first fails once, so the other two are held behind it in the state table. While
they are held, one worker is killed (SIGKILL, no commit) and a fresh one (empty data directory) joins: the held
messages move with their partitions' changelog and are run, in order, by their new owners.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import defaultdict
from typing import Any

import pytest

from demo.harness import produce
from tests.integration.conftest import Deployment, attempts_by_key, has_outcomes, outcome_offsets
from tests.integration.test_scaling import wait_for_assignment

pytestmark = [pytest.mark.broker]

KEYS = 40


def get_json(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return json.loads(response.read())


def outcome_count(records: Any, outcome: str) -> int:
    return sum(1 for events in attempts_by_key(records).values() for e in events if e["outcome"] == outcome)


def successes_in_order(calls: list[dict[str, Any]], keys: set[str]) -> dict[str, list[int]]:
    """Per key, the offsets of its messages in the order they first succeeded (a call succeeds when its attempt
    reaches the script's ``succeed_on``: 1 for each key's first message, 0 for the others)."""
    first_success: dict[tuple[str, int], int] = {}
    for call in calls:
        if call["key"] not in keys:
            continue
        needed = 1 if call["offset"] == min(c["offset"] for c in calls if c["key"] == call["key"]) else 0
        if call["attempt"] >= needed:
            ident = (call["key"], call["offset"])
            first_success[ident] = min(first_success.get(ident, call["now_ms"]), call["now_ms"])
    order: dict[str, list[int]] = defaultdict(list)
    for (key, offset), _at in sorted(first_success.items(), key=lambda item: item[1]):
        order[key].append(offset)
    return order


def test_each_keys_successes_keep_offset_order_through_a_kill_and_partition_moves(deploy: Any) -> None:
    deployment: Deployment = deploy(
        partitions=4, REBOUND_ORDERING="key", REBOUND_RETRY_SEQUENCE="6s", REBOUND_CONCURRENCY="16"
    )
    doomed = deployment.start_worker("a")
    survivor = deployment.start_worker("b")
    wait_for_assignment(deployment, 2)
    time.sleep(3)  # the second join triggers a rebalance; let it finish before producing

    keys = [f"ordered-{index}" for index in range(KEYS)]
    records = []
    for position in range(3):
        for key in keys:
            script = {"succeed_on": 1 if position == 0 else 0, "position": position}
            records.append((key.encode(), json.dumps(script).encode(), []))
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    deployment.collect(
        lambda seen: outcome_count(seen, "held") >= 2 * KEYS and outcome_count(seen, "scheduled") >= KEYS, timeout=60
    )
    # The cluster view: this worker's counts now, the other's from its last status record (published every 2 s).
    deadline = time.monotonic() + 5
    while True:
        ordering = get_json(survivor.web_port, "/retry/backlog")["ordering"]
        if ordering == {"mode": "key", "blocked_keys": KEYS, "held": 2 * KEYS} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert ordering == {"mode": "key", "blocked_keys": KEYS, "held": 2 * KEYS}
    key_view = get_json(survivor.web_port, "/retry/keys/ordered-0")
    assert key_view["blocked"] and len(key_view["held"]) == 2

    doomed.kill()  # SIGKILL: no graceful leave, no final commit; its partitions move with their changelog
    deployment.start_worker("c")  # a fresh worker, empty data directory: another partition move
    # Messages, not events: after the kill a message may succeed twice (at-least-once), and a count of events could
    # be reached while another message has not succeeded yet; the calls below must be there for every message.
    final = deployment.collect(lambda seen: len(outcome_offsets(seen, "succeeded")) >= 3 * KEYS, timeout=120)

    calls = deployment.calls()
    order = successes_in_order(calls, set(keys))
    assert set(order) == set(keys)
    for key in keys:
        offsets = order[key]
        assert len(offsets) == 3, (key, offsets)  # every message succeeded: none lost
        assert offsets == sorted(offsets), (key, offsets)  # and in offset order
    # Held messages never ran before their key's first message had succeeded.
    for key in keys:
        key_calls = [call for call in calls if call["key"] == key]
        first_offset = min(call["offset"] for call in key_calls)
        blocker_success = min(c["now_ms"] for c in key_calls if c["offset"] == first_offset and c["attempt"] >= 1)
        assert all(c["now_ms"] >= blocker_success for c in key_calls if c["offset"] != first_offset), key
    assert outcome_count(final, "dead") == 0
    movers = {call["pid"] for call in calls if call["key"] in keys and call["attempt"] == 1}
    assert len(movers) >= 2  # the retries ran on more than one worker: partitions did move


def test_an_unrelated_key_flows_while_another_is_blocked(deploy: Any) -> None:
    deployment: Deployment = deploy(partitions=1, REBOUND_ORDERING="key", REBOUND_RETRY_SEQUENCE="30s")
    deployment.start_worker("solo")
    records = [(b"stuck", json.dumps({"succeed_on": 1}).encode(), [])]
    records += [(b"stuck", b'{"succeed_on": 0}', [])] * 5
    records += [(f"free-{index}".encode(), b'{"succeed_on": 0}', []) for index in range(50)]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    # "stuck"'s held events come after their confirmed writes, and may come after the 50 others' successes.
    seen = deployment.collect(
        lambda seen: len(outcome_offsets(seen, "succeeded")) >= 50 and has_outcomes(seen, {"stuck": ["held"] * 5}),
        timeout=60,
    )
    by_key = attempts_by_key(seen)
    assert [e["outcome"] for e in by_key["stuck"]].count("held") == 5
    assert not any(e["outcome"] == "succeeded" for e in by_key["stuck"])  # still waiting for its 30 s retry
