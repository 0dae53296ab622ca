"""A first try's dead letter and its intent (issue 22, one lifecycle), through the real agents (no broker).

A worker killed after the broker acknowledged a first try's dead letter and before its *ended* mark was durable left
nothing that said so: the record was read again and the handler ran again, and with a handler whose outcome is not
a function of the attempt the message ended twice (dead-lettered, then succeeded). The kill is modelled as the first
write of the message's end never reaching the state (the worker died before it); the record is then read again at
its own offset. The rules are unit-tested in ``tests/rebound/test_dead_letter_intent_rules.py``.

Also here: a record read again because of a *sending* mark whose retry the tier agent parks while it runs (cause F):
the end the record reaches wins over that retry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import agents.release as release_module
from agents.runtime import Runtime
from rebound.attempts import AttemptEvent
from rebound.headers import MAX_ERROR_MESSAGE_BYTES
from rebound.state import KeyState, Mark
from tests.agents.conftest import eventually
from tests.agents.support import (
    VALUE,
    Agents,
    calls,
    count_confirms,
    dead_letters,
    drain,
    first,
    per_call,
    redeliver,
    seen_at_each_dead_letter,
    stop_before_it_leaves_the_held_list,
)

__all__ = ["calls"]  # the fixture, used here (and by test_orphan_retry_counted.py)

ORIGIN = "items/0/0"
TIER = "items.retry.1s"


def crash_before(runtime: Runtime, monkeypatch: pytest.MonkeyPatch, wanted: Callable[[Mark], bool]) -> list[Mark]:
    """The first write of the key's state whose mark of ``ORIGIN`` is ``wanted`` never happens (the worker died
    before it: that mark is never durable); every other write is real. Returns the marks dropped."""
    save = runtime.store.save
    dropped: list[Mark] = []

    def crashing_save(table_key: bytes, before: KeyState, after: KeyState) -> None:
        mark = after.mark_of(ORIGIN)
        if not dropped and mark is not None and wanted(mark):
            dropped.append(mark)
            return
        save(table_key, before, after)

    monkeypatch.setattr(runtime.store, "save", crashing_save)
    return dropped


def is_end(mark: Mark) -> bool:
    return mark.ended


def is_forwarded(mark: Mark) -> bool:
    return not mark.ended and not mark.sending  # (the first such mark: an intent comes later)


def outcomes(runtime: Runtime) -> set[str]:
    return {AttemptEvent.from_json(sent.value).outcome for sent in runtime.attempts_topic.sent}


@pytest.mark.parametrize("ordering", ["none", "key"])
async def test_a_first_try_dead_lettered_before_the_kill_is_dead_lettered_again_not_run_again(
    make_runtime: Any, clock: Any, calls: Path, monkeypatch: pytest.MonkeyPatch, ordering: str
) -> None:
    """The kill falls between the dead letter's acknowledgement and its end (in key-ordered mode the end rides in
    the write that settles the key). Before the intent the record ran again and succeeded: one message, two ends."""
    runtime: Runtime = make_runtime(ordering=ordering)
    runtime.schedule.adopt(0, [])
    made, _ = per_call(runtime, "permanent", "ok")
    crashed = crash_before(runtime, monkeypatch, is_end)
    async with Agents(runtime) as agents_:
        await first(agents_, VALUE)
        await runtime.dispatcher.wait_idle()
        assert crashed, "the fake kill did not happen"
        assert len(dead_letters(runtime)) == 1
        await redeliver(agents_, VALUE, offset=0)
        await runtime.dispatcher.wait_idle()
        await drain(agents_, clock)
    assert made == [(0, 0)], "the handler ran again after its dead letter was sent"
    first_sent, again = dead_letters(runtime)
    assert first_sent == again, "the dead letter sent again is not the same"
    assert first_sent[:2] == (b"permanent", b"0") and first_sent[4] == VALUE
    assert "succeeded" not in outcomes(runtime)
    state = runtime.store.load(b"k")
    [mark] = state.marks
    assert (mark.origin, mark.attempt, mark.ended, mark.intent) == (ORIGIN, 0, True, None)
    assert runtime.counters["main.redelivery_dead_lettering"] == 1
    assert runtime.counters["main.dead_letter_resent"] == 1
    if ordering == "key":
        assert not state.is_blocked


@pytest.mark.parametrize("ordering", ["none", "key"])
async def test_the_intent_is_durable_before_the_dead_letter_is_sent_and_its_end_replaces_it(
    make_runtime: Any, clock: Any, calls: Path, monkeypatch: pytest.MonkeyPatch, ordering: str
) -> None:
    """One confirmed write before the send (the intent: reason, attempt, error class and message cut as the headers
    cut it), the end after it; a healthy first try still writes nothing."""
    runtime: Runtime = make_runtime(ordering=ordering)
    made, _ = per_call(runtime, "permanent", "ok")
    confirms = count_confirms(runtime, monkeypatch)
    at_send: list[Mark | None] = seen_at_each_dead_letter(
        runtime, monkeypatch, lambda: runtime.store.load(b"k").mark_of(ORIGIN)
    )
    async with Agents(runtime) as agents_:
        await first(agents_, VALUE)
        await runtime.dispatcher.wait_idle()
        [mark] = at_send
        assert mark is not None and mark.intent is not None, "the dead letter was sent with no intent written"
        assert confirms and confirms[0] == 0, "the dead letter was sent before its intent was confirmed"
        assert (mark.attempt, mark.ended, mark.intent.reason, mark.intent.error_class) == (
            0,
            False,
            "permanent",
            "rebound.errors.PermanentError",
        )
        [(_, _, _, carried, _)] = dead_letters(runtime)
        assert mark.intent.error_message.encode() == carried, "the intent keeps another error than its header"
        assert len(carried) <= MAX_ERROR_MESSAGE_BYTES
        [end] = runtime.store.load(b"k").marks
        assert end.ended and end.intent is None, "the end did not replace the intent"

        writes: list[object] = []
        save = runtime.store.save
        monkeypatch.setattr(runtime.store, "save", lambda *args: (writes.append(args), save(*args)))
        await agents_.main(VALUE, key=b"healthy")  # (the next call succeeds)
        await runtime.dispatcher.wait_idle()
        assert made[-1] == (1, 0) and writes == [], "a healthy first try wrote something"


async def test_a_dead_lettered_undecodable_first_try_read_again_is_not_decoded_again(
    make_runtime: Any, clock: Any, calls: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scripted handler's own path (not JSON: undecodable): the second read sends the same dead letter."""
    runtime: Runtime = make_runtime()
    crash_before(runtime, monkeypatch, is_end)
    async with Agents(runtime) as agents_:
        await first(agents_, b"\xffnot json")
        await runtime.dispatcher.wait_idle()
        await redeliver(agents_, b"\xffnot json", offset=0)
        await runtime.dispatcher.wait_idle()
    assert calls.read_text().count("\n") == 1, "the handler ran again"
    first_sent, again = dead_letters(runtime)
    assert first_sent == again and first_sent[:2] == (b"undecodable", b"0")


async def read_again_while_its_retry_parks(
    runtime: Runtime, clock: Any, monkeypatch: pytest.MonkeyPatch, *outcomes: str, release_request: bool = False
) -> list[tuple[int, int]]:
    """Cause F: the first try failed, its retry was sent, and the worker died before its *forwarded* mark (the
    *sending* mark stays). The record is read again and runs (the retry may not have been sent); while it runs, the
    tier agent parks that retry (the tier topic lags). ``release_request``: that retry is also due and its release
    request already on its way when the record runs. Returns the handler's calls."""
    runtime.schedule.adopt(0, [])
    made, hooks = per_call(runtime, *outcomes)
    crashed = crash_before(runtime, monkeypatch, is_forwarded)
    requests: list[Any] = []
    background: list[asyncio.Future[None]] = []
    async with Agents(runtime) as agents_:
        await first(agents_, VALUE)
        await runtime.dispatcher.wait_idle()
        assert crashed and len(runtime.tier_topics[TIER].sent) == 1, "the retry was sent, its mark dropped"

        async def park_the_orphan() -> None:
            parking = asyncio.ensure_future(agents_.park_tier_records())  # (its agent, beside this handler)
            await eventually(lambda: bool(runtime.store.load(b"k", entries=True).pending))  # (the orphan parked)
            background.append(parking)
            if release_request:
                clock.advance(1500)
                await release_module.release_due(runtime)
                requests.extend(runtime.release_topic.sent)
                runtime.release_topic.sent = []
                assert requests, "no release request for the orphan"

        hooks.append(park_the_orphan)
        await redeliver(agents_, VALUE, offset=0)
        await runtime.dispatcher.wait_idle()
        await asyncio.gather(*background)
        for request in requests:  # handled after the record, as the key's lane orders them
            await agents_.contexts["release"].put(request.value, key=request.key, partition=request.partition)
        await runtime.dispatcher.wait_idle()
        await drain(agents_, clock)
    if not runtime.settings.key_ordered:  # (in key order, the key's block on it says its retry may be out)
        assert runtime.counters["main.redelivery_sending"] == 1
    return made


@pytest.mark.parametrize(("ordering", "release_request"), [("none", False), ("none", True), ("key", False)])
async def test_a_rerun_dead_lettered_while_its_orphan_retry_parked_ends_once(
    make_runtime: Any, clock: Any, calls: Path, monkeypatch: pytest.MonkeyPatch, ordering: str, release_request: bool
) -> None:
    """Before: the end could not be written over the parked later attempt, so the message was dead-lettered at
    attempt 0 and its orphan retry ran later and succeeded (a fork). Now the end wins: the entry goes, and its
    release request, if one is on its way, finds nothing."""
    runtime: Runtime = make_runtime(ordering=ordering)
    made = await read_again_while_its_retry_parks(
        runtime, clock, monkeypatch, "fail", "permanent", "ok", release_request=release_request
    )
    assert made == [(0, 0), (0, 0)], "the orphan retry ran after the message was dead-lettered"
    assert [item[:2] for item in dead_letters(runtime)] == [(b"permanent", b"0")]
    assert "succeeded" not in outcomes(runtime)
    state = runtime.store.load(b"k", entries=True)
    assert state.pending == () and runtime.store.entry(b"k", ORIGIN) is None
    [mark] = state.marks
    assert (mark.attempt, mark.ended) == (0, True)
    assert runtime.counters["main.orphan_retry_ended"] == 1
    assert not state.is_blocked
    if release_request:
        assert runtime.counters["release.stale"] >= 1


@pytest.mark.parametrize("ordering", ["none", "key"])
async def test_a_rerun_that_succeeds_while_its_orphan_retry_parked_ends_once(
    make_runtime: Any, clock: Any, calls: Path, monkeypatch: pytest.MonkeyPatch, ordering: str
) -> None:
    """The same with a success, and a handler whose next call fails permanently (not idempotent: the chaos run's
    random handler succeeds once it succeeded, so there the orphan's run was an extra call): before, the orphan
    retry ran after the success and was dead-lettered (a fork)."""
    runtime: Runtime = make_runtime(ordering=ordering)
    made = await read_again_while_its_retry_parks(runtime, clock, monkeypatch, "fail", "ok", "permanent")
    assert made == [(0, 0), (0, 0)], "the orphan retry ran after the message succeeded"
    assert dead_letters(runtime) == []
    [mark] = runtime.store.load(b"k").marks
    assert (mark.attempt, mark.ended) == (0, True)


async def test_a_held_message_dead_lettered_before_the_kill_is_dead_lettered_again_not_run_again(
    make_runtime: Any, clock: Any, calls: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Key-ordered mode, a held message: it ran once its key was free, was dead-lettered, and its worker stopped
    before it left the held list (the write that also remembers its end). Before, it ran again and succeeded."""
    runtime: Runtime = make_runtime(ordering="key")
    runtime.schedule.adopt(0, [])
    made, _ = per_call(runtime, "fail", "ok", "permanent", "ok")  # 0 fails, 0's retry ok, held 1 fails for good
    async with Agents(runtime) as agents_:
        await first(agents_, VALUE)  # offset 0 fails and blocks the key
        await first(agents_, VALUE)  # offset 1 is held behind it
        await agents_.park_tier_records()
        crashed = stop_before_it_leaves_the_held_list(monkeypatch, "items/0/1")
        clock.advance(1000)
        await agents_.release_due()  # 0's retry succeeds; held 1 runs and is dead-lettered; then the stop
        assert crashed and made == [(0, 0), (0, 1), (1, 0)]
        for _ in range(3):  # held 1 is taken up again
            clock.advance(1000)
            await agents_.release_due()
        await drain(agents_, clock)
    assert made == [(0, 0), (0, 1), (1, 0)], "held 1 ran again after its dead letter was sent"
    first_sent, again = dead_letters(runtime)
    assert first_sent == again and first_sent[:2] == (b"permanent", b"0")
    state = runtime.store.load(b"k", entries=True)
    assert state.held == () and not state.is_blocked
    mark = state.mark_of("items/0/1")
    assert mark is not None and mark.ended and mark.intent is None
