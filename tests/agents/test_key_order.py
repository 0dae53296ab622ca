"""Key-ordered mode through the real agents (``test_context``): hold, release in order, unblock, adopt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agents import release as release_module
from rebound.attempts import AttemptEvent
from rebound.commands import AdminCommand
from rebound.errors import ConfigurationError
from rebound.headers import Provenance
from rebound.ordering import HELD_ATTEMPT, HELD_PAYLOAD_PREFIX, Placement, place
from rebound.settings import load_settings
from rebound.state import payload_key
from tests.agents.conftest import nothing_waits
from tests.agents.support import Agents, calls, first, handler_calls, redeliver, state_of

__all__ = ["calls"]  # the fixture, used here


def outcomes(runtime: Any) -> list[tuple[str | None, int, str]]:
    events = [AttemptEvent.from_json(sent.value) for sent in runtime.attempts_topic.sent]
    return [(event.key, event.original_offset, event.outcome) for event in events]


async def test_a_blocked_keys_later_messages_wait_and_then_run_in_offset_order(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 1}')  # offset 0: fails once
        await agents.main(b'{"succeed_on": 0}')  # offset 1: held
        await agents.main(b'{"succeed_on": 0}', key=b"other")  # another key runs at once
        await agents.main(b'{"succeed_on": 0}')  # offset 3: held
        assert handler_calls(calls) == [("k", 0, 0), ("other", 2, 0)]
        state = state_of(runtime, b"k")
        assert state.blocked_by == "items/0/0"
        assert [entry.origin for entry in state.held] == ["items/0/1", "items/0/3"]
        assert [entry.value for entry in runtime.store.load(b"k", entries=True, with_payloads=True).held] == [
            b'{"succeed_on": 0}'
        ] * 2
        assert ("k", 1, "held") in outcomes(runtime) and ("k", 3, "held") in outcomes(runtime)

        await agents.park_tier_records()
        await agents.release_due()  # not due yet: nothing runs
        assert len(handler_calls(calls)) == 2
        clock.advance(1000)
        await agents.release_due()
        assert handler_calls(calls)[2:] == [("k", 0, 1), ("k", 1, 0), ("k", 3, 0)]
        assert nothing_waits(runtime, b"k")
        assert nothing_waits(runtime, b"k")
        assert not [key for key in runtime.store.payloads if b"k" in key]


async def test_a_key_holding_all_it_may_sends_the_next_record_to_the_failed_topic(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    """``REBOUND_MAX_HELD_PER_KEY``: one more record is not held but dead-lettered (``key-backlog-full``) with its own
    bytes; it leaves the key's order, and the held ones still run once the block is lifted."""
    runtime = make_runtime(ordering="key", max_held_per_key="1")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 1}')  # 0: fails once, blocks the key
        await agents.main(b'{"succeed_on": 0}')  # 1: held
        await agents.main(b'{"succeed_on": 0, "n": 2}')  # 2: the key is full
        [failed] = runtime.failed_topics["items"].sent
        assert (failed.value, failed.headers["rebound.reason"]) == (b'{"succeed_on": 0, "n": 2}', b"key-backlog-full")
        assert failed.headers["rebound.original-offset"] == b"2"
        assert failed.headers["rebound.error-class"] == b"KeyBacklogFullError"
        assert failed.headers["rebound.error-message"] == (
            b"could not be held behind its key's blocking message: key already holds 1 messages "
            b"(REBOUND_MAX_HELD_PER_KEY)"
        )
        assert [entry.origin for entry in state_of(runtime, b"k").held] == ["items/0/1"]
        assert ("k", 2, "dead") in outcomes(runtime) and ("k", 2, "held") not in outcomes(runtime)
        await agents.park_tier_records()
        clock.advance(1000)
        await agents.release_due()
        assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1), ("k", 1, 0)]
        assert nothing_waits(runtime, b"k")


async def test_a_record_not_held_ends_with_an_attempt_event_naming_no_tier(make_runtime: Any) -> None:
    """A record dead-lettered instead of held never ran in a tier: its ``dead`` attempt event names none (the held
    entry it was built as has the internal tier ``held``, which no attempt event shows)."""
    runtime = make_runtime(ordering="key", max_held_per_key="1")
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 1}')  # 0: fails once, blocks the key
        await agents.main(b'{"succeed_on": 0}')  # 1: held
        await agents.main(b'{"succeed_on": 0, "n": 2}')  # 2: the key is full
    events = [AttemptEvent.from_json(sent.value) for sent in runtime.attempts_topic.sent]
    assert [(event.original_offset, event.tier) for event in events if event.outcome == "dead"] == [(2, None)]


async def test_a_held_message_whose_bytes_are_gone_is_dead_lettered_as_received_when_its_turn_came(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    """A held message whose bytes are gone ends ``payload-missing`` when its turn comes, with its key alone, no tier,
    and, as a held message's run, first received at that turn (the stored stub has no receipt time)."""
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 1}')  # 0: fails once, blocks the key
        await agents.main(b'{"succeed_on": 0}')  # 1: held
        del runtime.store.payloads.data[payload_key(b"k", HELD_PAYLOAD_PREFIX + "items/0/1")]
        await agents.park_tier_records()
        clock.advance(1000)
        await agents.release_due()
    [failed] = runtime.failed_topics["items"].sent
    assert (failed.key, failed.value, failed.headers["rebound.reason"]) == (b"k", None, b"payload-missing")
    assert failed.headers["rebound.original-offset"] == b"1"
    assert failed.headers["rebound.first-received-at"] == str(clock.now_ms).encode()
    events = [AttemptEvent.from_json(sent.value) for sent in runtime.attempts_topic.sent]
    assert [(event.original_offset, event.tier) for event in events if event.outcome == "dead"] == [(1, None)]
    assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1)]


async def test_a_record_whose_hold_is_too_large_is_taken_back_and_dead_lettered(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch, calls: Path
) -> None:
    """A hold the changelog refuses as too large is taken out of the key's state again and the record goes to the
    failed topic (``too-large``): nothing of it stays held, and the key's block is its blocker's as before."""
    from rebound.errors import RecordTooLargeError

    runtime = make_runtime(ordering="key")
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 1}')  # 0: fails once, blocks the key
        real_confirm = runtime.store.confirm
        refused: list[bool] = []

        async def refuse_once() -> None:
            if not refused:
                refused.append(True)
                raise RecordTooLargeError("the hold's changelog record is too large")
            await real_confirm()

        monkeypatch.setattr(runtime.store, "confirm", refuse_once)
        await agents.main(b'{"succeed_on": 0}')  # 1: its hold refused
        [failed] = runtime.failed_topics["items"].sent
        assert (failed.headers["rebound.reason"], failed.headers["rebound.original-offset"]) == (b"too-large", b"1")
        assert failed.headers["rebound.error-class"] == b"RecordTooLargeError"
        state = state_of(runtime, b"k")
        assert (state.blocked_by, state.held) == ("items/0/0", ())
        assert ("k", 1, "held") not in outcomes(runtime)
        assert handler_calls(calls) == [("k", 0, 0)]


async def test_a_held_message_that_fails_blocks_the_key_again(make_runtime: Any, clock: Any, calls: Path) -> None:
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 1}')  # 0: fails once
        await agents.main(b'{"succeed_on": 1}')  # 1: held, then fails once
        await agents.main(b'{"succeed_on": 0}')  # 2: held until 1 succeeds
        await agents.park_tier_records()
        clock.advance(1000)
        await agents.release_due()
        assert handler_calls(calls)[1:] == [("k", 0, 1), ("k", 1, 0)]
        state = state_of(runtime, b"k")
        assert state.blocked_by == "items/0/1"
        assert [entry.origin for entry in state.held] == ["items/0/2"]
        await agents.park_tier_records()
        clock.advance(1000)
        await agents.release_due()
        assert handler_calls(calls)[3:] == [("k", 1, 1), ("k", 2, 0)]
        assert nothing_waits(runtime, b"k")


async def test_a_dead_letter_unblocks_the_key_by_default(make_runtime: Any, clock: Any, calls: Path) -> None:
    runtime = make_runtime(ordering="key", retry_sequence="1s")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await agents.main(b'{"fail": "always"}')
        await agents.main(b'{"succeed_on": 0}')
        await agents.park_tier_records()
        clock.advance(1000)
        await agents.release_due()
        assert handler_calls(calls)[1:] == [("k", 0, 1), ("k", 1, 0)]
        assert [sent.key for sent in runtime.failed_topics["items"].sent] == [b"k"]
        assert nothing_waits(runtime, b"k")


async def test_dead_letters_can_keep_blocking_until_an_operator_unblocks(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    runtime = make_runtime(ordering="key", retry_sequence="1s", ordering_dead_letter_blocks=True)
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await agents.main(b'{"fail": "always"}')
        await agents.main(b'{"succeed_on": 0}')
        await agents.park_tier_records()
        clock.advance(1000)
        await agents.release_due()
        assert handler_calls(calls)[1:] == [("k", 0, 1)]
        state = state_of(runtime, b"k")
        assert (state.blocked_by, state.blocked_dead, len(state.held)) == ("items/0/0", True, 1)
        await agents.main(b'{"succeed_on": 0}')  # still held behind the dead letter
        assert len(state_of(runtime, b"k").held) == 2

        await agents.admin(AdminCommand("c1", "unblock", b"k"))
        assert runtime.counters["admin.unblocked"] == 1
        await agents.release_due()  # the held slot the unblock scheduled runs both, in order
        assert handler_calls(calls)[2:] == [("k", 1, 0), ("k", 2, 0)]
        assert nothing_waits(runtime, b"k")


async def test_a_first_try_dead_lettered_blocks_the_key_when_dead_letters_block(make_runtime: Any, calls: Path) -> None:
    runtime = make_runtime(ordering="key", ordering_dead_letter_blocks=True)
    async with Agents(runtime) as agents:
        await agents.main(b'{"permanent": true}')
        await agents.main(b'{"succeed_on": 0}')
        assert handler_calls(calls) == [("k", 0, 0)]
        state = state_of(runtime, b"k")
        assert (state.blocked_by, state.blocked_dead, [e.origin for e in state.held]) == (
            "items/0/0",
            True,
            ["items/0/1"],
        )


async def test_a_redelivered_blocking_record_runs_and_its_success_lifts_the_block(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    """A crash before the commit delivers the blocking record again: it runs (at-least-once), not held behind
    itself; records of the key before it run again too, in their order."""
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 1}')  # 0: blocks
        await agents.main(b'{"succeed_on": 0}')  # 1: held
    state = state_of(runtime, b"k")
    assert place(state, Provenance("items", 0, 0, 0, 0)) is Placement.RUN
    assert place(state, Provenance("items", 0, 1, 0, 0)) is Placement.ALREADY_HELD
    assert place(state, Provenance("items", 0, 2, 0, 0)) is Placement.HOLD
    assert place(state, Provenance("items", 1, 5, 0, 0)) is Placement.HOLD


async def test_null_keys_and_unordered_mode_never_hold(make_runtime: Any, calls: Path) -> None:
    runtime = make_runtime(ordering="key")
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 1}', key=None)
        await agents.main(b'{"succeed_on": 0}', key=None)
    assert [call[1] for call in handler_calls(calls)] == [0, 1]
    unordered = make_runtime()
    async with Agents(unordered) as agents:
        await agents.main(b'{"succeed_on": 1}')
        await agents.main(b'{"succeed_on": 0}')
    assert state_of(unordered, b"k").blocked_by is None
    assert [call[1] for call in handler_calls(calls)[2:]] == [0, 1]


async def test_a_partition_adopted_with_unblocked_held_messages_schedules_them(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    """The worker stopped after the block was lifted and before every held message ran: the next owner runs them."""
    runtime = make_runtime(ordering="key", retry_sequence="1s")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await agents.main(b'{"fail": "always"}')
        await agents.main(b'{"succeed_on": 0}')
        await agents.park_tier_records()
        # An operator dead-letters the blocking message; the worker stops before the held slot is released.
        await agents.admin(AdminCommand("c2", "dead-letter", b"k"))
        assert state_of(runtime, b"k").blocked_by is None
        runtime.schedule.drop(0)
        release_module.adopt_owned_partitions(runtime)
        [(partition, slot)] = list(runtime.schedule.slots())
        assert (partition, slot.origin, slot.attempt) == (0, "items/0/1", HELD_ATTEMPT)
        await agents.release_due()
        assert handler_calls(calls)[1:] == [("k", 1, 0)]
        assert nothing_waits(runtime, b"k")


async def test_a_stale_held_request_runs_nothing(make_runtime: Any, calls: Path) -> None:
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 1}')
        await agents.main(b'{"succeed_on": 0}')
        request = json.dumps({"origin": "items/0/1", "attempt": HELD_ATTEMPT}).encode()
        await agents.contexts["release"].put(request, key=b"k", partition=0)  # still blocked: not its turn
        assert handler_calls(calls) == [("k", 0, 0)]
        assert runtime.counters["release.stale"] == 1


def test_key_order_needs_in_place_releases() -> None:
    with pytest.raises(ConfigurationError, match="ORDERING=key needs"):
        load_settings(ordering="key", release_mode="republish", header_secret="s")


async def test_a_held_record_delivered_again_writes_its_hold_again(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch, calls: Path
) -> None:
    """The offset of a held record is committed only after its hold is confirmed: delivered again, the hold found in
    the local store may never have reached the changelog, so it is written again (else a partition move loses it)."""
    from agents.ordering import KeyOrder

    runtime = make_runtime(ordering="key")
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 1}')
        await agents.main(b'{"succeed_on": 0}')
    rewritten: list[tuple[bytes, str]] = []
    monkeypatch.setattr(runtime.store, "rewrite_held", lambda key, origin: rewritten.append((key, origin)))
    placement, _ = await KeyOrder(runtime).admit(
        b"k", key=b"k", value=b"{}", headers=[], provenance=Provenance("items", 0, 1, 0, 0)
    )
    assert placement is Placement.ALREADY_HELD
    assert rewritten == [(b"k", "items/0/1")]


async def test_a_held_message_whose_run_keeps_failing_is_retried_then_dead_lettered(
    make_runtime: Any, clock: Any, monkeypatch: pytest.MonkeyPatch, calls: Path
) -> None:
    """An error out of running a held message (not the handler's: the handler's failures are routed) must neither
    lose it nor block its key for ever: it is tried again after a backoff, then ends as internal-error."""
    import agents.ordering as ordering_agents

    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 1}')
        await agents.main(b'{"succeed_on": 0}')  # held
        await agents.main(b'{"succeed_on": 0}')  # held
        await agents.park_tier_records()
        real_run_attempt = ordering_agents.run_attempt

        async def broken(runtime: Any, **kwargs: Any) -> Any:
            if kwargs["provenance"].offset == 1:
                raise RuntimeError("the failed topic refused the record")
            return await real_run_attempt(runtime, **kwargs)

        monkeypatch.setattr(ordering_agents, "run_attempt", broken)
        clock.advance(1000)
        await agents.release_due()
        assert [slot.attempt for _, slot in runtime.schedule.slots()] == [HELD_ATTEMPT]
        for _ in range(2):
            clock.advance(5000)
            await agents.release_due()
        [failed] = runtime.failed_topics["items"].sent
        assert failed.headers["rebound.reason"] == b"internal-error"
        assert failed.headers["rebound.original-offset"] == b"1"
        assert handler_calls(calls)[-1] == ("k", 2, 0)  # the next one ran once the bad one was out of the way
        assert nothing_waits(runtime, b"k")


async def test_a_retry_failing_again_keeps_the_key_blocked_even_if_its_block_was_lifted(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    """Lifted by an operator while a retry is parked, the block is written again before that retry's next attempt
    is sent: between its release and its next park nothing else of the key is pending, and held messages would
    overtake it."""
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 2}')  # fails twice
        await agents.main(b'{"succeed_on": 0}')  # held
        await agents.park_tier_records()
        await agents.admin(AdminCommand("c3", "unblock", b"k"))
        assert state_of(runtime, b"k").blocked_by is None
        clock.advance(1000)
        await agents.release_due()
        assert handler_calls(calls)[1:] == [("k", 0, 1)]  # failed again: the held message did not overtake it
        assert state_of(runtime, b"k").blocked_by == "items/0/0"
        await agents.park_tier_records()
        clock.advance(1000)
        await agents.release_due()
        assert handler_calls(calls)[2:] == [("k", 0, 2), ("k", 1, 0)]


async def test_held_messages_still_run_after_key_order_is_switched_off(
    make_runtime: Any, clock: Any, calls: Path, tmp_path: Path
) -> None:
    """Their offsets were committed when they were held: a worker without key order still runs them, once their
    blocking message settles."""
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await agents.main(b'{"succeed_on": 1}')
        await agents.main(b'{"succeed_on": 0}')
        await agents.park_tier_records()
    runtime.settings = runtime.settings.model_copy(update={"ordering": "none"})
    async with Agents(runtime) as agents:
        clock.advance(1000)
        await agents.release_due()
        assert handler_calls(calls)[1:] == [("k", 0, 1), ("k", 1, 0)]
        assert nothing_waits(runtime, b"k")


async def test_the_blocked_and_unsettled_indexes_match_a_scan_of_the_table(
    make_runtime: Any, clock: Any, monkeypatch: pytest.MonkeyPatch, calls: Path
) -> None:
    """The views count blocked keys and held messages, and the main agent skips reading the state of a key the
    index says is settled: both indexes are kept as states are saved, and must always equal a scan."""
    from rebound.summary import ordering_by_partition

    runtime = make_runtime(ordering="key")
    release_module.adopt_owned_partitions(runtime)  # the partition's index starts complete, as after an assignment

    def scanned() -> tuple[dict[int, dict[str, int]], set[bytes]]:
        states = list(runtime.store.key_states())
        unsettled = {key for key, state in states if state.is_blocked or state.pending}
        return ordering_by_partition([state for _, state in states], {0}), unsettled

    async with Agents(runtime) as agents:
        for value, key in [
            (b'{"succeed_on": 1}', b"a"),
            (b'{"succeed_on": 0}', b"a"),
            (b'{"succeed_on": 0}', b"b"),
            (b'{"succeed_on": 2}', b"c"),
            (b'{"succeed_on": 0}', b"c"),
            (b'{"succeed_on": 0}', b"c"),
        ]:
            await agents.main(value, key=key)
            counts, unsettled = scanned()
            assert runtime.store.ordering_counts(frozenset({0})) == counts
            assert runtime.store.unsettled[0] == unsettled
        assert runtime.store.ordering_counts(frozenset({0})) == {0: {"blocked_keys": 2, "held": 3}}
        for _ in range(2):
            await agents.park_tier_records()
            clock.advance(2000)
            await agents.release_due()
            counts, unsettled = scanned()
            assert runtime.store.ordering_counts(frozenset({0})) == counts
            assert runtime.store.unsettled[0] == unsettled
        assert runtime.store.unsettled[0] == set()

        reads: list[bytes] = []
        load = runtime.store.load
        monkeypatch.setattr(runtime.store, "load", lambda key, **kw: (reads.append(key), load(key, **kw))[1])
        await agents.main(b'{"succeed_on": 0}', key=b"d")
        assert reads == []  # a settled key's healthy message reads no state


async def block_then_run_held(agents: Agents, clock: Any, calls: Path) -> None:
    """Key ``k``: offset 0 fails once and blocks the key, offset 1 is held behind it; 0's retry is released and
    succeeds, then the held 1 runs and succeeds on its first try."""
    await first(agents, b'{"succeed_on": 1}')
    await first(agents, b'{"succeed_on": 0}')
    await agents.park_tier_records()
    clock.advance(1000)
    await agents.release_due()
    assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1), ("k", 1, 0)]


async def test_a_held_message_that_succeeds_is_not_run_again_when_its_record_is_read_again(
    make_runtime: Any, clock: Any, calls: Path
) -> None:
    """A held record's offset was acknowledged when it was held, but may be committed only later: read again after
    it ran (a seek to the committed offset), it finds its end and does not run a second time."""
    runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await block_then_run_held(agents, clock, calls)
        assert state_of(runtime, b"k").mark_of("items/0/1") is not None

        await redeliver(agents, b'{"succeed_on": 0}', 1)
        assert handler_calls(calls) == [("k", 0, 0), ("k", 0, 1), ("k", 1, 0)]
        assert runtime.counters["main.redelivery_ended"] == 1


async def test_a_held_success_does_not_push_out_an_older_end(make_runtime: Any, clock: Any, calls: Path) -> None:
    """The ends a key remembers are bounded (``REBOUND_ENDED_MEMORY_PER_KEY``): a held message's first-try success is
    remembered only if it fits, so the held runs after a blocker never push out the blocker's own end (which refuses
    an orphan retry of it still on its tier); a copy of the held record read again then runs again, as before."""
    runtime = make_runtime(ordering="key", ended_memory_per_key=1)
    runtime.schedule.adopt(0, [])
    async with Agents(runtime) as agents:
        await block_then_run_held(agents, clock, calls)
        state = state_of(runtime, b"k")
        assert state.mark_of("items/0/0") is not None  # the blocker's end, kept
        assert state.mark_of("items/0/1") is None  # no room: the held success is not remembered
