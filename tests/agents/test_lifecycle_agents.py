"""One message, one lifecycle (issue 22, defect 4), through the real agents (``test_context``, no broker).

A redelivery is modelled as the real one happens: the dispatcher starts a new generation (a rebalance: what it
acknowledged is forgotten) and the main topic's record is read again at its own offset. The rules are unit-tested in
``tests/rebound/test_lifecycle_rules.py``; ``tests/integration/test_one_lifecycle.py`` kills real workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import agents.main
from agents.lifecycle import memory_of
from rebound.commands import AdminCommand
from rebound.errors import RetryableError
from rebound.headers import Provenance
from rebound.state import KeyState, remember
from tests.agents.support import (
    WRITTEN_AT,
    Agents,
    calls,
    drain,
    first,
    handler_calls,
    redeliver,
    stop_before_it_leaves_the_held_list,
)

__all__ = ["calls"]  # the fixture, used here

FAILS_ONCE = b'{"succeed_on": 1}'
TIER = "items.retry.1s"


async def test_a_first_try_whose_retry_is_parked_is_not_started_over(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await first(agents, FAILS_ONCE)  # offset 0: fails, its retry goes to the 1s tier
        await agents.park_tier_records()
        await redeliver(agents, FAILS_ONCE, offset=0)
        assert handler_calls(calls) == [("k", 0, 0)], "the redelivered record ran attempt 0 again"
        assert runtime.tier_topics[TIER].sent == [], "a second retry was sent for the same message"
        assert runtime.counters["main.redelivery_parked"] == 1
        clock.advance(1000)
        await agents.release_due()
    assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1)]


async def test_a_first_try_whose_retry_is_still_on_the_tier_topic_is_not_started_over(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    """The retry was forwarded and not parked yet (the tier lags): the key's index remembers it on its way."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await first(agents, FAILS_ONCE)
        assert len(runtime.tier_topics[TIER].sent) == 1  # on the tier topic, not read yet
        await redeliver(agents, FAILS_ONCE, offset=0)
        assert handler_calls(calls) == [("k", 0, 0)], "the redelivered record ran attempt 0 again"
        assert len(runtime.tier_topics[TIER].sent) == 1, "a second retry was sent for the same message"
        assert runtime.counters["main.redelivery_forwarded"] == 1
        await agents.park_tier_records()
        assert KeyState.from_json(runtime.table.get(b"k")).marks == (), "the park did not replace the mark"
        clock.advance(1000)
        await agents.release_due()
    assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1)]


async def test_a_tier_record_arriving_again_after_its_retry_settled_does_not_run_it_again(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await first(agents, FAILS_ONCE)
        [copy] = runtime.tier_topics[TIER].sent
        await agents.park_tier_records()
        clock.advance(1000)
        await agents.release_due()  # attempt 1 succeeds: the message ended
        assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1)]
        runtime.tier_topics[TIER].sent = [copy]  # the same tier record once more (a crash before its commit)
        await agents.park_tier_records()
        clock.advance(1000)
        await agents.release_due()
        assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1)], "the settled retry ran again"
        assert runtime.counters["tier.duplicates_ended"] == 1


async def test_a_redelivered_first_try_of_a_message_that_ended_is_not_started_over(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await first(agents, FAILS_ONCE)
        await agents.park_tier_records()
        clock.advance(1000)
        await agents.release_due()
        await redeliver(agents, FAILS_ONCE, offset=0)
        assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1)], "the ended message started over"
        assert runtime.counters["main.redelivery_ended"] == 1


async def test_a_redelivered_first_try_that_was_dead_lettered_is_not_dead_lettered_again(
    make_runtime: Any, calls: Path
) -> None:
    """With a handler whose outcome is not a function of the attempt, a second run could succeed: a fork."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await first(agents, b'{"permanent": true}')
        await redeliver(agents, b'{"permanent": true}', offset=0)
    assert handler_calls(calls) == [("k", 0, 0)]
    assert len(runtime.failed_topics["items"].sent) == 1


async def test_a_healthy_first_try_writes_nothing(make_runtime: Any, calls: Path) -> None:
    """The check costs a healthy message of a key with nothing retrying no read and no write."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    runtime.store.index_partition(0)  # the partition's index is complete, as after its adoption
    async with Agents(runtime) as agents:
        await first(agents, b'{"succeed_on": 0}')
    assert runtime.table.get(b"k") is None
    assert handler_calls(calls) == [("k", 0, 0)]


async def test_a_held_message_whose_retry_was_sent_before_its_worker_stopped_does_not_run_again(
    make_runtime: Any, clock: Any, calls: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Key-ordered mode: the worker stops between a held message's retry being sent and its removal from the held
    list (modelled by that write failing). The message is then held and parked at once; once its retry settles, the
    held copy must not run again as attempt 0."""
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents_:
        await first(agents_, FAILS_ONCE)  # offset 0 blocks the key
        await first(agents_, FAILS_ONCE)  # offset 1 is held behind it
        await agents_.park_tier_records()
        crashed = stop_before_it_leaves_the_held_list(monkeypatch, "items/0/1")
        clock.advance(1000)
        await agents_.release_due()  # 0 succeeds; held 1 runs, fails, its retry is sent; the removal is lost
        assert crashed and handler_calls(calls) == [("k", 0, 0), ("k", 0, 1), ("k", 1, 0)]
        await agents_.park_tier_records()  # 1's retry is parked while 1 is still held
        clock.advance(1000)
        await agents_.release_due()
        clock.advance(1000)
        await agents_.release_due()
        assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1), ("k", 1, 0), ("k", 1, 1)], "held 1 ran twice"
        assert runtime.counters["ordering.held_ran_already"] == 1
    assert runtime.store.load(b"k", entries=True).held == ()


def outcome_per_call(runtime: Any, *outcomes: str) -> list[tuple[int, int]]:
    """Make the handler's outcome a function of the call, not of the attempt (as the chaos run's random mode does):
    the n-th call fails retryably ("fail") or succeeds ("ok"); calls past the list fail. Returns the calls made."""
    made: list[tuple[int, int]] = []
    real = runtime.handler

    async def handler(event: Any) -> None:
        await real(event)  # records the call (and raises what the script says; the scripts used here succeed)
        made.append((event.offset, event.attempt))
        if len(made) > len(outcomes) or outcomes[len(made) - 1] == "fail":
            raise RetryableError(f"call {len(made)} fails")

    runtime.handler = handler
    return made


async def test_a_crash_after_the_retry_was_sent_and_before_its_mark_does_not_fork_the_message(
    make_runtime: Any, clock: Any, calls: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unordered mode: the broker acknowledged the first try's retry, and the worker stopped before its forwarded mark
    was written (modelled by that write never happening). The redelivered record runs again (the retry may not have
    been sent) and succeeds: the retry that was sent must then not run, or the message ends succeeded and
    dead-lettered. Before the fix it parked, failed every retry and was dead-lettered."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    made = outcome_per_call(runtime, "fail", "ok")
    real = agents.main.remember_outcome
    skipped: list[object] = []

    async def stop_before_the_mark(*args: Any, **options: Any) -> None:
        if not skipped:
            skipped.append(args)
            return
        await real(*args, **options)

    monkeypatch.setattr(agents.main, "remember_outcome", stop_before_the_mark)
    async with Agents(runtime) as agents_:
        await first(agents_, b'{"succeed_on": 0}')
        assert len(runtime.tier_topics[TIER].sent) == 1, "the retry was sent"
        await redeliver(agents_, b'{"succeed_on": 0}', offset=0)
        assert made == [(0, 0), (0, 0)], "the redelivery ran attempt 0 again (its retry may never have been sent)"
        await drain(agents_, clock)
    assert runtime.failed_topics["items"].sent == [], "fork: succeeded on the rerun and dead-lettered"
    assert made == [(0, 0), (0, 0)], "the orphan retry ran after the message succeeded"
    assert runtime.counters["main.redelivery_sending"] == 1
    assert runtime.counters["tier.duplicates_ended"] == 1


async def test_a_crash_before_the_retry_was_sent_runs_the_redelivery_and_loses_nothing(
    make_runtime: Any, clock: Any, calls: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sending mark is written, the worker stops before the send: the redelivery must run (a refused one would
    lose the message), and its retry, sent this time, runs."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    made = outcome_per_call(runtime, "fail", "ok")
    record = Provenance("items", 0, 0, int(WRITTEN_AT * 1000), clock())
    left = remember(
        KeyState(), record, attempt=1, ended=False, partition=0, now_ms=clock(), memory=memory_of(runtime), sending=True
    )
    runtime.table.data[b"k"] = left.to_json()  # what the stopped worker left: the sending mark, no retry sent
    async with Agents(runtime) as agents_:
        await first(agents_, b'{"succeed_on": 0}')  # read again: it runs, fails, its retry is sent this time
        assert runtime.counters["main.redelivery_sending"] == 1
        assert len(runtime.tier_topics[TIER].sent) == 1
        await drain(agents_, clock)
    assert made == [(0, 0), (0, 1)]
    assert runtime.failed_topics["items"].sent == []


async def test_a_held_message_rerun_after_its_retry_was_sent_does_not_fork(
    make_runtime: Any, clock: Any, calls: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Key-ordered mode: held 1 ran, failed, its retry was sent, and its worker stopped before it left the held list.
    Its block (written before the send) says its retry may be on its way: it runs again, and when that run succeeds,
    its orphan retry must be refused. Before the fix the orphan parked, failed every retry and was dead-lettered."""
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    made = outcome_per_call(runtime, "fail", "ok", "fail", "ok")  # 0 fails, 1 held, 0's retry ok, 1 fails, 1 ok
    async with Agents(runtime) as agents_:
        await first(agents_, b'{"succeed_on": 0}')  # offset 0 fails and blocks the key
        await first(agents_, b'{"succeed_on": 0}')  # offset 1 is held behind it
        await agents_.park_tier_records()
        crashed = stop_before_it_leaves_the_held_list(monkeypatch, "items/0/1")
        clock.advance(1000)
        await agents_.release_due()  # 0's retry succeeds; held 1 runs, fails, its retry is sent; then the stop
        assert crashed and made == [(0, 0), (0, 1), (1, 0)]
        orphan = list(runtime.tier_topics[TIER].sent)
        assert len(orphan) == 1
        runtime.tier_topics[TIER].sent = []  # the tier lags: held 1 runs again before its retry is read
        for _ in range(3):
            clock.advance(1000)
            await agents_.release_due()
        assert made == [(0, 0), (0, 1), (1, 0), (1, 0)], "held 1 did not run again"
        runtime.tier_topics[TIER].sent = orphan
        await drain(agents_, clock)
    assert made == [(0, 0), (0, 1), (1, 0), (1, 0)], "the orphan retry of held 1 ran after it succeeded"
    assert runtime.failed_topics["items"].sent == [], "fork: held 1 succeeded and was dead-lettered"
    state = runtime.store.load(b"k", entries=True)
    assert state.held == () and state.blocked_by is None and state.pending == ()


async def test_a_message_an_operator_dead_lettered_is_remembered_as_ended(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    """A copy of its retry still on a tier topic (written twice before a crash), or its main record read again, must
    not start it over: the operator's dead letter is its end. Before the fix the admin action wrote no mark, and the
    copy parked and ran the message again."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents_:
        await first(agents_, b'{"fail": "always"}')
        [copy] = runtime.tier_topics[TIER].sent
        await agents_.park_tier_records()
        await agents_.admin(AdminCommand("c1", "dead-letter", b"k"))
        assert len(runtime.failed_topics["items"].sent) == 1
        [mark] = KeyState.from_json(runtime.table.get(b"k")).marks
        assert mark.ended and mark.attempt == 1
        runtime.tier_topics[TIER].sent = [copy]
        await drain(agents_, clock)
        await redeliver(agents_, b'{"fail": "always"}', offset=0)
    assert handler_calls(calls) == [("k", 0, 0)], "the dead-lettered message ran again"
    assert len(runtime.failed_topics["items"].sent) == 1
    assert runtime.counters["tier.duplicates_ended"] == 1 and runtime.counters["main.redelivery_ended"] == 1


async def test_a_release_settle_forgets_expired_marks(make_runtime: Any, clock: Any, calls: Path) -> None:
    """A partition whose only writes are releases must forget its marks too (before the fix only parks and first
    tries called the forgetting, so a key's expired mark stayed while releases went on)."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    runtime.store.index_partition(0)
    async with Agents(runtime) as agents_:
        await first(agents_, FAILS_ONCE, key=b"old")
        await agents_.park_tier_records()
        clock.advance(1000)
        await agents_.release_due()  # "old" ends: remembered
        assert KeyState.from_json(runtime.table.get(b"old")).marks
        await first(agents_, b'{"succeed_on": 2}', key=b"new")
        await agents_.park_tier_records()
        clock.advance(memory_of(runtime).keep_ms)
        await agents_.release_due()  # only a release (and its settle) runs now
    assert runtime.table.get(b"old") is None, "the expired mark was not forgotten by the settle"


async def test_another_record_at_a_remembered_origin_and_timestamp_runs(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    """The topic was recreated and refilled with the same timestamps (a mirror) within the memory's time: the record
    at offset 0 now is another one, with other bytes. Refused as the ended message, it would be lost."""
    runtime = make_runtime()
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents_:
        await first(agents_, FAILS_ONCE)
        await agents_.park_tier_records()
        clock.advance(1000)
        await agents_.release_due()  # the message ended: remembered
        await redeliver(agents_, b'{"succeed_on": 0, "note": "another record"}', offset=0)
        await redeliver(agents_, FAILS_ONCE, offset=0)  # the ended one itself is still refused
    assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1), ("k", 0, 0)]
    assert runtime.counters["main.redelivery_ended"] == 1
