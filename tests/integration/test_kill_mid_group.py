"""A worker killed (SIGKILL) in the middle of its group-committed parks, then another in the middle of its releases'
settles, through real workers on the embedded broker (issue 23: nothing lost, nothing parked twice, nothing released
early).

The tier agent parks a partition's records in groups under one changelog confirmation and acknowledges them only after
it (``agents/tier.py``); a release settles its entry and confirms the changelog write (``agents/release.py``). A kill
between a group's writes and their confirmation, or between a retry's handler call and its settle, must cost at most
a repeat (at-least-once), never a lost message, a second lifecycle or a retry run before its due time.

The kills are triggered from what the workers report: the first when ``rebound_parked_total`` is between 20 % and 80 %
of the first tier's records (so groups are being parked), the second when the next worker has made between 20 % and
80 % of the first tier's retry calls (so settles are in flight). A third worker finishes the run.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from demo.harness import Record, Tail, Worker, produce
from tests.integration.conftest import Deployment, attempts_by_key, failed_records, wait_for

pytestmark = pytest.mark.broker

TIER = "2s"
SEQUENCE = f"{TIER},{TIER}"
"""Two tiers: messages that need two retries park twice, and those that always fail end ``exhausted`` at attempt 2."""
SCRIPTS: list[dict[str, Any]] = [{"succeed_on": 1}, {"succeed_on": 2}, {"fail": "always"}]
"""Message ``i`` follows ``SCRIPTS[i % 3]``: its outcome is a function of the attempt only, so a second lifecycle of a
message shows as a second call of one attempt."""
MESSAGES = 1200
REPEAT_WINDOW_MS = 2000
"""How long before its worker's kill a call may have started and still be run again by the next owner: the handler
call (instant here), then what makes its step durable, the changelog confirmation of the settle or of the forwarded
mark, and for a first try the offset commit (every 0.5 s here). A repeat of a call made earlier than that before the
kill means a finished step was forgotten: a message parked or run twice. (Seen: within 300 ms.)"""


def parked_total(worker: Worker) -> float:
    """``rebound_parked_total`` of one worker, summed over topics and tiers (0 while its web server is not up)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.web_port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("rebound_parked_total"))


def retry_calls_by(deployment: Deployment, pid: int) -> int:
    return sum(1 for call in deployment.calls() if call["pid"] == pid and call["attempt"] >= 1)


async def read_topic(deployment: Deployment, topic: str) -> list[Record]:
    """Every record of ``topic`` written so far (each partition read to its end, found by a quiet poll)."""
    async with Tail(deployment.broker.bootstrap, [topic]) as tail:
        while await tail.poll(timeout_ms=1000):
            pass
        return tail.records


def ended(records: list[Record], keys: set[str]) -> bool:
    done = {key for key, events in attempts_by_key(records).items() if any(e["outcome"] == "succeeded" for e in events)}
    done |= {record.key.decode() for record in failed_records(records) if record.key is not None}
    return keys <= done


def kill_when(worker: Worker, progress: Callable[[], float], what: str) -> tuple[int, list[float]]:
    """SIGKILL ``worker`` once ``progress()`` is between 20 % and 80 % of ``MESSAGES``; when (epoch ms), and the
    last values seen (a jump past 80 % between two looks fails: the kill would not be in the middle)."""
    seen: list[float] = []

    def under_way() -> bool:
        seen.append(progress())
        assert seen[-1] <= 0.8 * MESSAGES, f"{what} went past 80 % between two looks: {seen[-5:]}"
        return seen[-1] >= 0.2 * MESSAGES

    wait_for(under_way, 60, what, [worker], interval=0.02)
    worker.kill()
    return time.time_ns() // 1_000_000, seen[-6:]


def test_kills_in_the_middle_of_group_parks_and_settles_lose_nothing_park_nothing_twice_release_nothing_early(
    deploy: Any,
) -> None:
    deployment: Deployment = deploy(partitions=4, REBOUND_RETRY_SEQUENCE=SEQUENCE)
    keys = [f"mid-{index:04d}" for index in range(MESSAGES)]
    script_of = {key: SCRIPTS[index % len(SCRIPTS)] for index, key in enumerate(keys)}
    asyncio.run(
        produce(
            deployment.broker.bootstrap,
            deployment.topic,
            [(key.encode(), json.dumps(script_of[key]).encode(), []) for key in keys],
        )
    )
    print(f"deployment in {deployment.root}")
    # Every message fails its first try: MESSAGES first-tier parks, and as many first-tier retries.
    first = deployment.start_worker("first")
    assert first.process is not None
    kills = {first.process.pid: 0}
    kills[first.process.pid], parked_seen = kill_when(first, lambda: parked_total(first), "the first worker parking")
    second = deployment.start_worker("second")
    assert second.process is not None
    second_pid = second.process.pid
    kills[second_pid], retries_seen = kill_when(
        second, lambda: retry_calls_by(deployment, second_pid), "the second worker releasing"
    )
    deployment.start_worker("third")
    records = deployment.collect(lambda seen: ended(seen, set(keys)), timeout=60)

    calls = deployment.calls()
    check_terminal_states(records, script_of)
    check_never_early(calls, announced_due(deployment, records))
    repeats = check_repeats(calls, kills)
    expected_calls = sum((3 if script.get("fail") else script["succeed_on"] + 1) for script in script_of.values())
    print(
        f"parked at the first kill {parked_seen} of {MESSAGES}, retry calls at the second {retries_seen}; "
        f"{len(calls)} calls for {expected_calls} expected, repeats by attempt {dict(repeats)}"
    )


def check_terminal_states(records: list[Record], script_of: dict[str, dict[str, Any]]) -> None:
    """Nothing lost, one terminal state per message, and the one its script gives."""
    events = attempts_by_key(records)
    dead = {record.key.decode(): record for record in failed_records(records) if record.key is not None}
    succeeded = {str(key) for key, of_key in events.items() if any(e["outcome"] == "succeeded" for e in of_key)}
    assert not succeeded & dead.keys(), f"succeeded and dead-lettered: {sorted(succeeded & dead.keys())[:10]}"
    for key, script in script_of.items():
        if script.get("fail") == "always":
            assert key in dead, f"{key} never reached the failed topic"
            headers = dead[key].headers
            assert (headers["rebound.reason"], headers["rebound.attempt"]) == (b"exhausted", b"2"), (key, headers)
        else:
            assert key in succeeded, f"{key} never succeeded"
            wins = {e["attempt"] for e in events[key] if e["outcome"] == "succeeded"}
            assert wins == {script["succeed_on"]}, (key, wins)


def announced_due(deployment: Deployment, records: list[Record]) -> dict[tuple[str, int], int]:
    """The earliest due time announced for each message and retry, in an attempt event or on a tier record (a kill
    can drop the attempt event of a retry whose tier record was sent)."""
    announced = [
        (str(key), event["attempt"] + 1, event["due_at"])
        for key, of_key in attempts_by_key(records).items()
        for event in of_key
        if event["outcome"] == "scheduled"
    ]
    announced += [
        (record.key.decode(), int(record.headers["rebound.attempt"]), int(record.headers["rebound.due-at"]))
        for record in asyncio.run(read_topic(deployment, f"{deployment.topic}.retry.{TIER}"))
        if record.key is not None
    ]
    due: dict[tuple[str, int], int] = {}
    for key, attempt, due_at in announced:
        due[(key, attempt)] = min(due.get((key, attempt), due_at), due_at)
    return due


def check_never_early(calls: list[dict[str, Any]], due: dict[tuple[str, int], int]) -> None:
    """Every retry call at or after the earliest due time announced for its message and attempt."""
    early = [call for call in calls if call["attempt"] >= 1 and call["now_ms"] < due[(call["key"], call["attempt"])]]
    assert not early, f"{len(early)} retries before due: {early[:5]}"


def check_repeats(calls: list[dict[str, Any]], kills: dict[int, int]) -> Counter[int]:
    """Nothing parked twice: a call repeated for one message and attempt is a repeat after a kill only, its first
    call made by a worker killed within ``REPEAT_WINDOW_MS`` of it and the repeat by a later worker, never one
    worker's own. The repeats per attempt."""
    by_slot: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for call in calls:
        by_slot[(call["key"], call["attempt"])].append(call)
    repeats: Counter[int] = Counter()
    for (key, attempt), of_slot in by_slot.items():
        of_slot.sort(key=lambda call: call["now_ms"])
        for earlier, later in itertools.pairwise(of_slot):
            killed_at = kills.get(earlier["pid"])
            assert killed_at is not None and later["pid"] != earlier["pid"], (
                f"{key} attempt {attempt} ran twice without a kill between: {of_slot}"
            )
            assert killed_at - REPEAT_WINDOW_MS <= earlier["now_ms"] <= killed_at, (
                f"{key} attempt {attempt} ran again although its call ended long before the kill: {of_slot}"
            )
            repeats[attempt] += 1
    return repeats
