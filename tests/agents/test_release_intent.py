"""A release killed after it sent its outcome and before its settle was durable (issue 22, one lifecycle).

The settle is replaced once by a crash: nothing of it reaches the state, as when the worker dies after the broker
acknowledged the dead letter or the next retry and before the settle's changelog records did. The release request
is then read again (its offset was never acknowledged). With a handler whose outcome is not a function of the
attempt, running it again forks the message; the release's *intent* (written and confirmed before the send) makes
the second request send the same outcome again instead (at-least-once) and settle.
"""

from __future__ import annotations

from typing import Any

import pytest

import agents.release as release_module
from agents.runtime import Runtime
from rebound import headers as h
from rebound.attempts import AttemptEvent
from rebound.errors import PermanentError, RetryableError
from rebound.event import RetryEvent
from rebound.records import estimated_record_bytes
from rebound.state import payload_key
from tests.agents.conftest import FakeClock, RecordingTopic, eventually, nothing_waits
from tests.agents.support import (
    REQUEST,
    count_confirms,
    park_one_due,
    revoke,
    scripted,
    seen_at_each_dead_letter,
    tier_headers,
)

ORIGIN = "items/0/7"


def crash_before_the_first_settle(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The first settle never happens (the worker died after the send); later ones are real."""
    real = release_module.settle
    crashed: list[Any] = []

    async def settle(runtime: Runtime, *args: Any, **kwargs: Any) -> None:
        if not crashed:
            crashed.append(args)
            return
        await real(runtime, *args, **kwargs)

    monkeypatch.setattr(release_module, "settle", settle)
    return crashed


def tier_sent(runtime: Runtime) -> list[Any]:
    return [sent for topic in runtime.tier_topics.values() for sent in topic.sent]


def refuse_settles(monkeypatch: pytest.MonkeyPatch, times: int, then: Any = None) -> list[int]:
    """The first ``times`` settles raise (the changelog refused them; ``then(n)`` runs first); later ones are real."""
    real = release_module.settle
    refused: list[int] = []

    async def settle(runtime: Runtime, *args: Any, **kwargs: Any) -> None:
        if len(refused) < times:
            refused.append(1)
            if then is not None:
                then(len(refused))
            raise RuntimeError("changelog unavailable")
        await real(runtime, *args, **kwargs)

    monkeypatch.setattr(release_module, "settle", settle)
    return refused


async def released_twice(runtime: Runtime, clock: FakeClock) -> None:
    await park_one_due(runtime, clock)
    async with runtime.agents["release"].test_context() as releaser:
        channel = releaser.stream().channel
        for offset in (0, 1):  # the request, then the same request read again after the crash
            await channel.put(await channel.decode(releaser.to_message(b"k", REQUEST, partition=0, offset=offset)))
            await runtime.dispatcher.wait_idle()
        await eventually(lambda: not runtime.store.load(b"k").parked)  # (key order: blocked while a retry is out)


@pytest.mark.parametrize("ordering", ["none", "key"])
async def test_a_dead_letter_sent_before_the_crash_is_sent_again_not_followed_by_a_success(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, ordering: str
) -> None:
    runtime: Runtime = make_runtime(ordering=ordering)
    calls = scripted(runtime, PermanentError("no"), None)
    crashed = crash_before_the_first_settle(monkeypatch)
    await released_twice(runtime, clock)
    assert crashed, "the fake crash did not happen"
    assert calls == [1], "the handler ran again after its outcome was sent"
    failed = runtime.failed_topics["items"].sent
    assert [(sent.headers[h.REASON], sent.headers[h.ATTEMPT]) for sent in failed] == [(b"permanent", b"1")] * 2
    assert failed[0].value == failed[1].value == b'{"any": 1}', "not byte-exact when sent again"
    outcomes = {AttemptEvent.from_json(sent.value).outcome for sent in runtime.attempts_topic.sent}
    assert "succeeded" not in outcomes
    [mark] = runtime.store.load(b"k").marks
    assert (mark.origin, mark.attempt, mark.ended) == (ORIGIN, 1, True)
    assert runtime.counters["release.resent"] == 1


@pytest.mark.parametrize("ordering", ["none", "key"])
async def test_a_retry_sent_before_the_crash_is_sent_again_not_dead_lettered_at_the_earlier_attempt(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, ordering: str
) -> None:
    runtime: Runtime = make_runtime(ordering=ordering)
    calls = scripted(runtime, RetryableError("later"), PermanentError("no"))
    crash_before_the_first_settle(monkeypatch)
    await released_twice(runtime, clock)
    assert calls == [1], "the handler ran again after its outcome was sent"
    assert runtime.failed_topics["items"].sent == [], "dead-lettered at attempt 1 while attempt 2 was sent"
    first, again = tier_sent(runtime)
    assert first.headers[h.ATTEMPT] == again.headers[h.ATTEMPT] == b"2"
    assert first.headers == again.headers and first.value == again.value, "the retry sent again is not the same"
    state = runtime.store.load(b"k")
    [mark] = state.marks
    assert (mark.origin, mark.attempt, mark.ended) == (ORIGIN, 2, False)
    if ordering == "key":
        assert state.blocked_by == ORIGIN, "the key is no longer blocked behind the retry on its way"


async def test_a_release_that_keeps_failing_after_its_retry_was_sent_ends_with_that_retry_not_internal_error(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settle fails three times (the first after the send, then after each send again): ``give_up`` sends the
    intended retry once more and settles, rather than dead-letter the message as ``internal-error`` while its next
    attempt is on the tier."""
    runtime: Runtime = make_runtime()
    calls = scripted(runtime, RetryableError("later"), PermanentError("no"))
    refuse_settles(monkeypatch, release_module.MAX_RELEASE_FAILURES)
    await park_one_due(runtime, clock)
    async with runtime.agents["release"].test_context() as releaser:
        channel = releaser.stream().channel
        for offset in range(release_module.MAX_RELEASE_FAILURES):
            await channel.put(await channel.decode(releaser.to_message(b"k", REQUEST, partition=0, offset=offset)))
            await runtime.dispatcher.wait_idle()
        await eventually(lambda: nothing_waits(runtime, b"k"))
    assert calls == [1]
    assert runtime.failed_topics["items"].sent == [], "dead-lettered while its next attempt is on the tier"
    assert {sent.headers[h.ATTEMPT] for sent in tier_sent(runtime)} == {b"2"}
    assert len(tier_sent(runtime)) == 4  # sent, sent again twice, and once more by give_up


async def test_the_intent_is_durable_before_the_send_and_a_success_writes_none(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failing release confirms its intent before its dead letter is sent (one more confirmed write); a succeeding
    one writes only its settle."""
    runtime: Runtime = make_runtime()
    scripted(runtime, PermanentError("no"))
    confirms = count_confirms(runtime, monkeypatch)

    def intent_of_k() -> Any:
        entry = runtime.store.entry(b"k", ORIGIN)
        return None if entry is None else entry.intent

    intents_at_send = seen_at_each_dead_letter(runtime, monkeypatch, intent_of_k)
    saves: list[Any] = []
    save = runtime.store.save

    def counted_save(table_key: bytes, before: Any, after: Any) -> None:
        saves.append(after)
        save(table_key, before, after)

    monkeypatch.setattr(runtime.store, "save", counted_save)
    runtime.schedule.adopt(0, [])
    async with runtime.agents["items.retry.1s"].test_context() as tier:
        for key in (b"k", b"k2"):
            await tier.put(b'{"any": 1}', key=key, headers=tier_headers(clock), partition=0)
    clock.advance(1000)
    async with runtime.agents["release"].test_context() as releaser:
        saves.clear()
        await releaser.put(REQUEST, key=b"k", partition=0)
        await eventually(lambda: nothing_waits(runtime, b"k"))
        [intent] = intents_at_send
        assert intent is not None and intent.dead and intent.reason == "permanent" and intent.attempt == 1
        assert confirms and confirms[0] == 0, "the dead letter was sent before the intent was confirmed"
        assert len(saves) == 2, "a failing release writes its intent and its settle"

        scripted(runtime, None)  # a success: its settle only
        saves.clear()
        await releaser.put(REQUEST, key=b"k2", partition=0)
        await eventually(lambda: nothing_waits(runtime, b"k2"))
        assert len(saves) == 1, "a succeeding release wrote more than its settle"


async def test_a_release_whose_partition_was_revoked_while_it_ran_sends_nothing(
    make_runtime: Any, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Revoked while the handler ran, the failure is neither written down nor sent: the new owner has the entry and
    runs it (its outcome is the only one), where before the old owner's dead letter went out too."""
    runtime: Runtime = make_runtime()
    calls: list[int] = []

    async def revoking(event: RetryEvent) -> None:
        calls.append(event.attempt)
        revoke(runtime)
        raise PermanentError("no")

    runtime.handler = revoking
    await park_one_due(runtime, clock)
    async with runtime.agents["release"].test_context() as releaser:
        await releaser.put(REQUEST, key=b"k", partition=0)
        await eventually(lambda: "revoked" in caplog.text)  # (before the send now; before the settle at 0aee0f1)
    assert calls == [1]
    assert runtime.failed_topics["items"].sent == []
    [entry] = runtime.store.load(b"k", entries=True).pending
    assert (entry.attempt, entry.intent) == (1, None)


async def test_a_retry_sent_again_that_the_broker_now_refuses_as_too_large_is_dead_lettered_once(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The intent's retry refused as too large when sent again (the broker's limit was lowered meanwhile): it was
    not sent then, and ends as the first run would have ended it (``too-large``), not in a loop of failed releases."""
    runtime: Runtime = make_runtime()
    calls = scripted(runtime, RetryableError("later"))
    crash_before_the_first_settle(monkeypatch)
    tier_topic: RecordingTopic = runtime.tier_topics["items.retry.1s"]
    send = tier_topic.send
    sends: list[int] = []

    async def lowered_after_the_first(**record: Any) -> Any:
        sends.append(1)
        if len(sends) > 1:
            tier_topic.broker_max_value_bytes = 1
        return await send(**record)

    monkeypatch.setattr(tier_topic, "send", lowered_after_the_first)
    await released_twice(runtime, clock)
    assert calls == [1]
    assert len(tier_topic.sent) == 1 and tier_topic.refused == 1
    [failed] = runtime.failed_topics["items"].sent
    assert (failed.headers[h.REASON], failed.headers[h.ATTEMPT]) == (b"too-large", b"1")


async def test_a_failure_whose_message_is_larger_than_a_changelog_record_still_sends_its_retry(
    make_runtime: Any, clock: FakeClock
) -> None:
    """The intent keeps the error message as its headers carry it (truncated): an exception whose text is larger
    than a changelog record (a validator quoting the whole value) must not make the intent's write refused, the
    release fail until ``give_up`` and the message end ``internal-error`` where its retry was due."""
    runtime: Runtime = make_runtime()
    calls = scripted(runtime, RetryableError("x" * (runtime.store.max_record_bytes + 1)))
    await park_one_due(runtime, clock)
    async with runtime.agents["release"].test_context() as releaser:
        await releaser.put(REQUEST, key=b"k", partition=0)
        await eventually(lambda: bool(tier_sent(runtime)) or bool(runtime.release_failures))
    assert calls == [1]
    assert not runtime.release_failures, "the release failed"
    [sent] = tier_sent(runtime)
    assert sent.headers[h.ATTEMPT] == b"2"


@pytest.mark.parametrize("ordering", ["none", "key"])
async def test_a_release_whose_partition_was_revoked_while_it_ran_writes_nothing_before_its_retry(
    make_runtime: Any,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    ordering: str,
) -> None:
    """Revoked while a failing handler ran, its retry is not sent and nothing is written for it: in key-ordered mode
    the key's block was written before the ownership was asked (this worker's stale view of a partition its new
    owner writes)."""
    runtime: Runtime = make_runtime(ordering=ordering)
    revoked: list[int] = []

    async def revoking(event: RetryEvent) -> None:
        revoked.append(event.attempt)
        revoke(runtime)
        raise RetryableError("later")

    writes: list[str] = []
    save, rewrite = runtime.store.save, runtime.store.rewrite_state

    def recorded_save(*args: Any) -> None:
        if revoked:
            writes.append("save")
        save(*args)

    def recorded_rewrite(*args: Any) -> Any:
        if revoked:
            writes.append("rewrite_state")
        return rewrite(*args)

    monkeypatch.setattr(runtime.store, "save", recorded_save)
    monkeypatch.setattr(runtime.store, "rewrite_state", recorded_rewrite)
    runtime.handler = revoking
    await park_one_due(runtime, clock)
    async with runtime.agents["release"].test_context() as releaser:
        await releaser.put(REQUEST, key=b"k", partition=0)
        await eventually(lambda: "revoked" in caplog.text)
    assert revoked == [1]
    assert tier_sent(runtime) == []
    assert writes == [], "the old owner wrote to a partition revoked from it"


async def test_a_parked_message_near_the_record_limit_still_sends_its_retry_when_its_intent_does_not_fit(
    make_runtime: Any, clock: FakeClock
) -> None:
    """The intent makes the entry's record larger (up to its error's kept bytes): a message parked within that
    margin of the changelog's limit must still get its retry, without an intent (as before it), not fail its
    release until ``give_up`` ends it ``internal-error``."""
    runtime: Runtime = make_runtime()
    limit = runtime.store.max_record_bytes
    runtime.schedule.adopt(0, [])
    async with runtime.agents["items.retry.1s"].test_context() as tier:
        await tier.put(b'"x"', key=b"small", headers=tier_headers(clock), partition=0)
        raw = runtime.store.payloads[payload_key(b"small", ORIGIN)]
        overhead = estimated_record_bytes(payload_key(b"small", ORIGIN), raw, ()) - len(b'"x"')
        value = b'"' + b"x" * (limit - overhead - 100 - 2) + b'"'  # its entry record 100 bytes under the limit
        await tier.put(value, key=b"k", headers=tier_headers(clock), partition=0)
    assert runtime.store.entry(b"k", ORIGIN) is not None
    clock.advance(1000)
    calls = scripted(runtime, RetryableError("later"))  # (its retry, with the error's headers, fits)
    async with runtime.agents["release"].test_context() as releaser:
        await releaser.put(REQUEST, key=b"k", partition=0)
        await eventually(lambda: bool(tier_sent(runtime)) or bool(runtime.release_failures))
    assert calls == [1]
    assert not runtime.release_failures, "the release failed"
    assert runtime.failed_topics["items"].sent == []
    [sent] = tier_sent(runtime)
    assert sent.headers[h.ATTEMPT] == b"2" and sent.value == value
    assert runtime.counters["release.intent_too_large"] == 1


async def test_a_release_whose_partition_is_revoked_while_its_intent_is_confirmed_sends_nothing(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Revoked during the intent's round trip, the dead letter is not sent: the new owner may have read the
    changelog before the intent was acknowledged and run the handler itself (two ends). Its intent, if the new
    owner saw it, makes that owner send the same."""
    runtime: Runtime = make_runtime()
    scripted(runtime, PermanentError("no"))
    confirm = runtime.store.confirm

    async def revoked_meanwhile() -> None:
        await confirm()
        revoke(runtime)

    await park_one_due(runtime, clock)
    monkeypatch.setattr(runtime.store, "confirm", revoked_meanwhile)
    async with runtime.agents["release"].test_context() as releaser:
        await releaser.put(REQUEST, key=b"k", partition=0)
        await eventually(lambda: "revoked" in caplog.text)
    assert runtime.failed_topics["items"].sent == [], "sent on a partition revoked before the send"
    [entry] = runtime.store.load(b"k", entries=True).pending
    assert entry.intent is not None and entry.intent.dead, "the intent the new owner sends again"


def lose_the_payload(runtime: Runtime) -> None:
    """The entry's record keeps its metadata (its intent included) and no bytes: a payload lost in the local copy."""
    entry = runtime.store.entry(b"k", ORIGIN)
    assert entry is not None and entry.intent is not None
    runtime.store.payloads.data[payload_key(b"k", ORIGIN)] = entry.encode_entry()


async def parked_then_requested(runtime: Runtime, clock: FakeClock, requests: int, between: Any = None) -> None:
    """Park one message, then read its release request ``requests`` times (``between(n)`` before the n-th read)."""
    await park_one_due(runtime, clock)
    async with runtime.agents["release"].test_context() as releaser:
        for offset in range(requests):
            if between is not None:
                between(offset)
            await releaser.put(REQUEST, key=b"k", partition=0)  # (returns once the dispatcher is idle)


async def test_give_up_sends_nothing_on_a_partition_revoked_from_it(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``give_up`` asks the partition's ownership before it sends, as a release does after its intent's confirm:
    revoked (here as its third settle was refused), the new owner has the entry and its intent and ends it; the
    old owner sent the intended retry once more before."""
    runtime: Runtime = make_runtime()
    calls = scripted(runtime, RetryableError("later"))
    last = release_module.MAX_RELEASE_FAILURES
    refuse_settles(monkeypatch, last, then=lambda n: revoke(runtime) if n == last else None)
    await parked_then_requested(runtime, clock, last)
    assert calls == [1]
    assert len(tier_sent(runtime)) == last, "give_up sent on a partition revoked from it"  # sent, sent again twice
    assert runtime.failed_topics["items"].sent == []
    [entry] = runtime.store.load(b"k", entries=True).pending
    assert entry.intent is not None and entry.intent.next_attempt == 2, "the intent its new owner sends"
    assert runtime.counters["release.revoked"] == 1


async def test_a_request_read_again_on_a_partition_revoked_meanwhile_sends_nothing_again(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The intent is sent again only while the partition is this worker's (its request may wait in its key's lane
    while a rebalance takes it): the new owner sends it, not both."""
    runtime: Runtime = make_runtime()
    calls = scripted(runtime, PermanentError("no"))
    crash_before_the_first_settle(monkeypatch)
    await parked_then_requested(runtime, clock, 2, between=lambda n: revoke(runtime) if n == 1 else None)
    assert calls == [1]
    assert len(runtime.failed_topics["items"].sent) == 1, "sent again on a partition revoked from it"
    assert runtime.counters["release.resent"] == 0 and runtime.counters["release.revoked"] == 1


async def test_a_revoked_release_is_one_warning_without_a_trace_counted_and_not_a_failure(
    make_runtime: Any, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A release revoked while it ran is a rebalance's ordinary outcome: one line, no traceback, counted in
    ``rebound_release_skipped_total{reason="revoked"}``, not counted towards ``give_up``."""
    runtime: Runtime = make_runtime()

    async def revoking(event: RetryEvent) -> None:
        revoke(runtime)
        raise PermanentError("no")

    runtime.handler = revoking
    await parked_then_requested(runtime, clock, 1)
    revoked = [record for record in caplog.records if "revoked" in record.getMessage()]
    assert len(revoked) == 1 and revoked[0].levelname == "WARNING", [r.getMessage() for r in revoked]
    assert all(record.exc_info is None for record in caplog.records), "a traceback for a rebalance"
    assert not runtime.release_failures, "counted as a failed release (give_up after three)"
    assert runtime.counters["release.revoked"] == 1
    skipped = runtime.metrics.registry.get_sample_value("rebound_release_skipped_total", {"reason": "revoked"})
    assert skipped == 1.0


@pytest.mark.parametrize("first", [PermanentError("no"), RetryableError("later")], ids=["dead", "retry"])
async def test_an_intent_whose_payload_is_lost_ends_payload_missing_with_the_intents_attempt_and_error(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, first: Exception
) -> None:
    """The bytes gone, neither the retry nor a dead letter can carry them: the message ends ``payload-missing``
    (its key, no value), at the intent's attempt and with its error, at once; not a retry's failed releases until
    ``internal-error``, nor a ``permanent`` dead letter without a value (a tombstone if redriven)."""
    runtime: Runtime = make_runtime()
    calls = scripted(runtime, first)
    crash_before_the_first_settle(monkeypatch)
    await parked_then_requested(runtime, clock, 2, between=lambda n: lose_the_payload(runtime) if n == 1 else None)
    assert calls == [1]
    assert not runtime.release_failures, "the release failed"
    failed = runtime.failed_topics["items"].sent
    assert len(failed) == (2 if isinstance(first, PermanentError) else 1)
    last = failed[-1]
    assert (last.key, last.value) == (b"k", None)
    assert (last.headers[h.REASON], last.headers[h.ATTEMPT]) == (b"payload-missing", b"1")
    assert last.headers[h.ERROR_CLASS].endswith(type(first).__name__.encode())
    assert nothing_waits(runtime, b"k")


async def test_give_up_with_an_intent_whose_payload_is_lost_ends_payload_missing_not_internal_error(
    make_runtime: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release that keeps failing after its intent, with its bytes lost: ``give_up`` too ends it as the intent
    says it can, ``payload-missing`` at the intent's attempt, not ``internal-error``."""
    runtime: Runtime = make_runtime()
    calls = scripted(runtime, RetryableError("later"))
    last = release_module.MAX_RELEASE_FAILURES
    refuse_settles(monkeypatch, last)
    await parked_then_requested(runtime, clock, last, between=lambda n: lose_the_payload(runtime) if n == 1 else None)
    assert calls == [1]
    reasons = {(sent.headers[h.REASON], sent.headers[h.ATTEMPT]) for sent in runtime.failed_topics["items"].sent}
    assert reasons == {(b"payload-missing", b"1")}
    assert nothing_waits(runtime, b"k")


async def test_a_release_whose_payload_is_lost_ends_payload_missing_with_its_own_attempt_and_error(
    make_runtime: Any, clock: FakeClock
) -> None:
    """The counterpart without an intent: a parked message whose bytes are gone when its release runs is not run; it
    ends ``payload-missing`` (its key, no value) at its parked attempt and with the error it was parked with."""
    runtime: Runtime = make_runtime()
    calls = scripted(runtime, None)
    await park_one_due(runtime, clock)
    entry = runtime.store.entry(b"k", ORIGIN)
    assert entry is not None and entry.intent is None
    runtime.store.payloads.data[payload_key(b"k", ORIGIN)] = entry.encode_entry()  # (metadata, no bytes)
    async with runtime.agents["release"].test_context() as releaser:
        await releaser.put(REQUEST, key=b"k", partition=0)
        await eventually(lambda: nothing_waits(runtime, b"k"))
    assert calls == []
    [failed] = runtime.failed_topics["items"].sent
    assert (failed.key, failed.value) == (b"k", None)
    assert (failed.headers[h.REASON], failed.headers[h.ATTEMPT]) == (b"payload-missing", b"1")
    assert (failed.headers[h.ERROR_CLASS], failed.headers[h.ERROR_MESSAGE]) == (
        b"rebound.errors.RetryableError",
        b"not yet",
    )
