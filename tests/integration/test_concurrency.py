"""Concurrent handling through a real worker: keys run at once, one key runs in offset order, and a worker killed
with a hundred handler calls in flight loses none of them (its successor redoes them, still in order per key)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import defaultdict
from typing import Any

import pytest

from demo.harness import produce
from tests.integration.conftest import Deployment, outcome_offsets

pytestmark = [pytest.mark.broker, pytest.mark.every_kafka]


def first_tries_by_key(calls: list[dict[str, Any]], pid: int | None = None) -> dict[str, list[dict[str, Any]]]:
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for call in calls:
        if call["attempt"] == 0 and (pid is None or call["pid"] == pid):
            by_key[call["key"]].append(call)
    for key_calls in by_key.values():
        key_calls.sort(key=lambda call: call["now_ms"])
    return by_key


def assert_in_offset_order_one_at_a_time(by_key: dict[str, list[dict[str, Any]]], sleep_ms: int) -> None:
    for key, key_calls in by_key.items():
        offsets = [call["offset"] for call in key_calls]
        assert offsets == sorted(offsets), f"{key}: first tries started out of offset order: {offsets}"
        starts = [call["now_ms"] for call in key_calls]
        for earlier, later in itertools.pairwise(starts):
            # each call sleeps sleep_ms: a later start this close would mean two calls of one key at once
            assert later - earlier >= sleep_ms - 5, f"{key}: calls overlapped ({earlier} then {later})"


def succeeded_offsets(records: Any) -> set[tuple[int, int]]:
    return outcome_offsets(records, "succeeded")


def test_keys_run_at_once_and_each_key_in_offset_order(deploy: Any) -> None:
    deployment: Deployment = deploy(partitions=2, REBOUND_CONCURRENCY="32", REBOUND_RETRY_SEQUENCE="1s")
    deployment.start_worker("w")
    keys, per_key, sleep_s = 16, 5, 0.4
    records = [
        (f"key-{k}".encode(), json.dumps({"sleep": sleep_s, "n": n}).encode(), [])
        for n in range(per_key)
        for k in range(keys)
    ]
    started = time.monotonic()
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    seen = deployment.collect(lambda seen: len(succeeded_offsets(seen)) >= len(records), timeout=90)
    took = time.monotonic() - started
    assert len(succeeded_offsets(seen)) == len(records)
    by_key = first_tries_by_key(deployment.calls())
    assert sorted(by_key) == sorted(f"key-{k}" for k in range(keys))
    assert_in_offset_order_one_at_a_time(by_key, int(sleep_s * 1000))
    # one at a time, 80 calls of 0.4 s would take 32 s; keys in parallel bound it by one key's 5 calls (2 s)
    assert took < keys * per_key * sleep_s / 2, f"took {took:.1f}s: keys did not run at once"


def test_a_worker_killed_with_a_hundred_calls_in_flight_loses_none_and_keeps_each_key_in_order(deploy: Any) -> None:
    deployment: Deployment = deploy(partitions=4, REBOUND_CONCURRENCY="128", REBOUND_RETRY_SEQUENCE="1s")
    first = deployment.start_worker("first")
    keys, per_key, sleep_s = 100, 2, 4.0
    records = [
        (f"slow-{k}".encode(), json.dumps({"sleep": sleep_s, "n": n}).encode(), [])
        for n in range(per_key)
        for k in range(keys)
    ]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    deadline = time.monotonic() + 90
    while len(deployment.calls()) < keys:  # one call in flight per key: 100 handler calls sleeping right now
        assert time.monotonic() < deadline, f"only {len(deployment.calls())} calls started"
        assert not first.crashed, first.log_text()[-4000:]
        time.sleep(0.1)
    in_flight = len(deployment.calls())
    first.kill()  # SIGKILL with every one of those calls in its sleep: nothing of them was acknowledged
    first_pid = deployment.calls()[0]["pid"]
    second = deployment.start_worker("second")
    seen = deployment.collect(lambda seen: len(succeeded_offsets(seen)) >= len(records), timeout=150)
    assert in_flight >= keys
    assert len(succeeded_offsets(seen)) == len(records), "a message never succeeded"
    calls = deployment.calls()
    second_pid = next(call["pid"] for call in calls if call["pid"] != first_pid)
    redone = first_tries_by_key(calls, pid=second_pid)
    # every key the killed worker was handling is redone by its successor, from the first message, in order
    assert len(redone) == keys
    assert_in_offset_order_one_at_a_time(redone, int(sleep_s * 1000))
    for key, key_calls in redone.items():
        assert len(key_calls) == per_key, f"{key}: {len(key_calls)} first tries after the kill"
    assert not second.crashed


def test_a_partition_with_too_much_taken_is_paused_and_resumed_and_loses_nothing(deploy: Any) -> None:
    """Back-pressure on a real worker: one slow call at a time and a buffer of 4, so the partition is paused and
    resumed over and over while a backlog drains (the first resume crashed the worker: Faust's resume_partitions
    took aiokafka's TopicPartition as it was)."""
    deployment: Deployment = deploy(
        partitions=1, REBOUND_CONCURRENCY="1", REBOUND_PARTITION_BUFFER="4", REBOUND_RETRY_SEQUENCE="1s"
    )
    worker = deployment.start_worker("w")
    count = 60
    records = [(f"bp-{n}".encode(), json.dumps({"sleep": 0.05, "n": n}).encode(), []) for n in range(count)]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    seen = deployment.collect(lambda seen: len(succeeded_offsets(seen)) >= count, timeout=120)
    assert succeeded_offsets(seen) == {(0, offset) for offset in range(count)}
    starts = sorted((call["now_ms"], call["offset"]) for call in deployment.calls() if call["attempt"] == 0)
    assert [offset for _, offset in starts] == sorted(offset for _, offset in starts)  # one at a time, in order
    assert not worker.crashed, worker.log_text()[-4000:]


@pytest.mark.parametrize("drain", ["1.5", "0"])
def test_work_queued_at_a_shutdown_runs_within_the_drain_time_instead_of_being_done_again(
    deploy: Any, drain: str
) -> None:
    """A slow key's second record waits behind its first; ten quick keys after it are done. Without a drain, the
    second record is dropped at the shutdown, the ten cannot be committed past it, and the next worker calls them all
    again. With one, the second record runs before the revocation commits, and the next worker calls nothing."""
    deployment: Deployment = deploy(
        partitions=1,
        REBOUND_CONCURRENCY="4",
        REBOUND_REVOKE_DRAIN=drain,
        REBOUND_HANDLER_TIMEOUT="1s",  # 1.5 + 1 + 1 s grace + 0.5 s heartbeat stay under the 4 s rebalance timeout
        REBOUND_RETRY_SEQUENCE="1s",
    )
    first = deployment.start_worker("first")
    records = [
        (b"slow", json.dumps({"sleep": 0.6}).encode(), []),
        (b"slow", json.dumps({"n": 1}).encode(), []),  # queued behind offset 0 on its key's lane
        *((f"quick-{n}".encode(), json.dumps({"n": n}).encode(), []) for n in range(10)),
    ]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    deadline = time.monotonic() + 90
    while {call["offset"] for call in deployment.calls()} != {0, *range(2, 12)}:  # 1 waits for 0's second
        assert time.monotonic() < deadline, f"calls so far: {deployment.calls()}"
        assert not first.crashed, first.log_text()[-4000:]
        time.sleep(0.05)
    assert first.stop() == 0
    first_pid = deployment.calls()[0]["pid"]
    second = deployment.start_worker("second")
    marker = (b"marker", json.dumps({"n": "after"}).encode(), [])  # read by the second worker after what it redoes
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, [marker]))
    seen = deployment.collect(lambda seen: len(succeeded_offsets(seen)) > len(records), timeout=90)
    assert succeeded_offsets(seen) == {(0, offset) for offset in range(len(records) + 1)}
    redone = sorted(call["offset"] for call in deployment.calls() if call["pid"] != first_pid)
    if drain == "0":
        assert redone == list(range(1, 13))  # the dropped record, every one done after it, and the marker
    else:
        assert redone == [12]  # the marker only
    assert not second.crashed


def test_offsets_done_behind_a_call_still_running_at_a_shutdown_are_committed_with_it(deploy: Any) -> None:
    """Offsets 1 to 10 are done while 0 still runs when the worker is stopped. Their acknowledgements wait behind 0,
    Faust waits for 0 before it lets the partition go, and 0 to 10 are committed together: the next worker calls none
    of them again, and nothing is lost.

    At a shutdown rather than a rebalance: Kafka accepts a commit made while its group prepares a rebalance (the
    revocation's), but librdkafka's mock cluster refuses it (REBALANCE_IN_PROGRESS) and the embedded broker sometimes
    does, and the next owner then does the work again (at-least-once, seen in this test's first version)."""
    deployment: Deployment = deploy(
        partitions=1, REBOUND_CONCURRENCY="4", REBOUND_REVOKE_DRAIN="0", REBOUND_RETRY_SEQUENCE="1s"
    )
    first = deployment.start_worker("first")
    records = [
        (b"slow", json.dumps({"sleep": 2.0}).encode(), []),
        *((f"quick-{n}".encode(), json.dumps({"n": n}).encode(), []) for n in range(10)),
    ]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))
    deadline = time.monotonic() + 90
    while {call["offset"] for call in deployment.calls()} != set(range(11)):
        assert time.monotonic() < deadline, f"calls so far: {deployment.calls()}"
        assert not first.crashed, first.log_text()[-4000:]
        time.sleep(0.05)
    assert first.stop() == 0  # while offset 0 sleeps
    second = deployment.start_worker("second")
    marker = (b"marker", json.dumps({"n": "after"}).encode(), [])
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, [marker]))
    seen = deployment.collect(lambda seen: len(succeeded_offsets(seen)) > len(records), timeout=90)
    assert succeeded_offsets(seen) == {(0, offset) for offset in range(len(records) + 1)}
    calls = sorted(call["offset"] for call in deployment.calls())
    assert calls == list(range(len(records) + 1)), f"called again: {calls}"
    assert not second.crashed
