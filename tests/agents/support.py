"""Helpers that more than one agent test module uses: tier records' headers, changelog writes held until the test
acknowledges them, every agent's test context open for a whole test (:class:`Agents`) with the scripted handler's
calls (the ``calls`` fixture: a module that wants it imports it) and a main record's first delivery and redelivery;
handlers whose calls end as a test says (:func:`per_call`, :func:`scripted`), the offsets acknowledged
(:func:`record_acks`), and what befalls the worker while a confirmed write is on its way (:func:`at_each_confirm`,
:class:`StaleLease`, :func:`stale_lease`, :func:`stop_during_each_send`, :func:`revoke`), with a first try and a release
run through it (:func:`run_first_try`, :func:`park_one_due`, :func:`request_its_release`), a record through the 1s
tier's agent (:func:`put_on_tier`, its park broken by :func:`unparkable`), and an operator's dead-letter of what
:func:`park_two_due` parked (:func:`operators_dead_letter`)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import faust.events
import pytest

import agents.ordering
import agents.tier
from agents import release as release_module
from agents.admin import admin_channel
from agents.runtime import Runtime
from rebound import headers as h
from rebound.commands import AdminCommand, ReleaseBatch, ReleaseRequest, read_release_record
from rebound.errors import PermanentError, RetryableError
from rebound.event import RetryEvent
from rebound.state import KeyState
from tests.agents.conftest import FakeClock, eventually
from tests.scripted_handler import CALLS_ENV


def tier_headers(clock: Any, *, attempt: int = 1, due_in_ms: int = 1000, **overrides: bytes) -> list[tuple[str, bytes]]:
    """A tier record's headers as a worker writes them (``items`` partition 0, offset 7), due ``due_in_ms`` after the
    clock's now; ``overrides`` replace headers by name."""
    provenance = h.Provenance("items", 0, 7, clock.now_ms - 10, clock.now_ms - 5)
    pairs = h.retry_headers(
        [("trace-id", b"abc")],
        provenance=provenance,
        group="agent-test",
        attempt=attempt,
        due_at_ms=clock.now_ms + due_in_ms,
        error_class="rebound.errors.RetryableError",
        error_message="not yet",
    )
    replaced = dict(pairs)
    replaced.update(overrides)
    return list(replaced.items())


class HeldChangelog:
    """A changelog topic's ``send_soon`` whose records are acknowledged only when the test says so."""

    def __init__(self, timeline: list[tuple[str, Any]]) -> None:
        self.timeline = timeline
        self.pending: list[tuple[bytes, Any]] = []

    def send_soon(self, *, key: Any, value: Any, partition: Any, **_: Any) -> Any:
        future: Any = asyncio.get_running_loop().create_future()
        future.message = SimpleNamespace(partition=0 if partition is None else partition)
        self.pending.append((key, future))
        self.timeline.append(("written", (key, value)))
        return future

    def acknowledge_all(self) -> int:
        pending, self.pending = self.pending, []
        for key, future in pending:
            self.timeline.append(("durable", key))
            future.set_result(None)
        return len(pending)


def hold_changelogs_and_record_acks(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[tuple[str, Any]], HeldChangelog]:
    """Both tables' changelog writes held until the test acknowledges them, and every event's ack recorded in the
    same timeline, so a test can say what was acknowledged before what became durable."""
    runtime.store.confirm_writes = True
    timeline: list[tuple[str, Any]] = []
    changelog = HeldChangelog(timeline)
    monkeypatch.setattr(runtime.store.states.changelog_topic, "send_soon", changelog.send_soon)
    monkeypatch.setattr(runtime.store.payloads.changelog_topic, "send_soon", changelog.send_soon)
    ack = faust.events.Event.ack

    def recording_ack(self: Any) -> Any:
        timeline.append(("acked", self.message.offset))
        return ack(self)

    monkeypatch.setattr(faust.events.Event, "ack", recording_ack)
    return timeline, changelog


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the scripted handler (``tests/scripted_handler.py``) writes its calls: read them with
    :func:`handler_calls`."""
    path = tmp_path / "calls.jsonl"
    monkeypatch.setenv(CALLS_ENV, str(path))
    return path


def handler_calls(path: Path) -> list[tuple[str, int, int]]:
    """(key, offset, attempt) of every handler call, in call order."""
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [(line["key"], line["offset"], line["attempt"]) for line in lines]


def state_of(runtime: Any, key: bytes) -> KeyState:
    return runtime.store.load(key, entries=True)


class Agents:
    """Every agent's test context, open for the whole test: a context opened again would number its offsets from 0,
    and the dispatcher takes an offset it acknowledged already for a second delivery."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Agents:
        names = ["main", "release", "admin", *self.runtime.tier_topics]
        self.contexts = {
            name: await self._stack.enter_async_context(self.runtime.agents[name].test_context()) for name in names
        }
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def main(self, value: bytes, key: bytes | None = b"k") -> None:
        await self.contexts["main"].put(value, key=key, partition=0)

    async def admin(self, command: AdminCommand) -> None:
        await self.contexts["admin"].put(command.to_json(), key=command.key, partition=0)

    async def park_tier_records(self, tier: str = "items.retry.1s") -> None:
        """Hand what the agents sent to a tier topic to that tier's agent, as the broker would."""
        topic = self.runtime.tier_topics[tier]
        sent, topic.sent = list(topic.sent), []
        for record in sent:
            await self.contexts[tier].put(
                record.value, key=record.key, headers=list(record.headers.items()), partition=0
            )

    async def release_due(self) -> None:
        """One timer tick, then the release agent handling every request the tick sent."""
        await release_module.release_due(self.runtime)
        sent, self.runtime.release_topic.sent = list(self.runtime.release_topic.sent), []
        for request in sent:
            await self.contexts["release"].put(request.value, key=request.key, partition=request.partition)


WRITTEN_AT = 1_700_000_000.0
"""The main records' timestamp (:func:`first`, :func:`redeliver`): a record read again is the same record, with the
same timestamp."""


async def first(agents: Agents, value: bytes, key: bytes = b"k") -> None:
    """A main record's first delivery (partition 0, the next offset)."""
    await agents.contexts["main"].put(value, key=key, partition=0, timestamp=WRITTEN_AT)


async def redeliver(agents: Agents, value: bytes, offset: int, key: bytes = b"k") -> None:
    """The main record at ``offset`` read again after a rebalance (its offset was not committed)."""
    agents.runtime.dispatcher.revoke()
    context = agents.contexts["main"]
    context.sent_offset = offset
    await context.put(value, key=key, partition=0, timestamp=WRITTEN_AT)


async def drain(agents: Agents, clock: Any, rounds: int = 12) -> None:
    """Let every retry run to its end: park what the tiers hold, release what is due, again and again."""
    for _ in range(rounds):
        clock.advance(2000)
        await agents.release_due()
        for tier in agents.runtime.tier_topics:
            await agents.park_tier_records(tier)


def stop_before_it_leaves_the_held_list(monkeypatch: pytest.MonkeyPatch, held: str) -> list[str]:
    """Key-ordered mode: the first removal of ``held`` from its key's held list raises (its worker stopped there,
    after the held message ran); later removals are real. Returns the origins it stopped at."""
    real_without_held = agents.ordering.without_held
    crashed: list[str] = []

    def crash_once(state: KeyState, origin: str) -> KeyState:
        if origin == held and not crashed:
            crashed.append(origin)
            raise RuntimeError("the worker stopped here")
        return real_without_held(state, origin)

    monkeypatch.setattr(agents.ordering, "without_held", crash_once)
    return crashed


def count_confirms(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every confirmed write of the store, as how many dead letters were sent to ``items``'s failed topic before it
    (0 first: confirmed before any send)."""
    confirms: list[int] = []
    confirm = runtime.store.confirm

    async def counted_confirm() -> None:
        confirms.append(len(runtime.failed_topics["items"].sent))
        await confirm()

    monkeypatch.setattr(runtime.store, "confirm", counted_confirm)
    return confirms


def seen_at_each_dead_letter(runtime: Runtime, monkeypatch: pytest.MonkeyPatch, read: Any) -> list[Any]:
    """What ``read()`` says as each dead letter is sent to ``items``'s failed topic (before the send)."""
    failed = runtime.failed_topics["items"]
    send = failed.send
    seen: list[Any] = []

    async def recording_send(**record: Any) -> Any:
        seen.append(read())
        return await send(**record)

    monkeypatch.setattr(failed, "send", recording_send)
    return seen


VALUE = b'{"any": 1}'
"""A main record's value (:func:`run_first_try`): what the handler gets matters not, only how its call ends."""
REQUEST = json.dumps({"origin": "items/0/7", "attempt": 1}).encode()
"""The release request of the retry :func:`park_one_due` parks (:func:`tier_headers`: ``items`` 0@7, attempt 1)."""


def per_call(runtime: Runtime, *outcomes: str) -> tuple[list[tuple[int, int]], list[Callable[[], Awaitable[None]]]]:
    """The n-th handler call fails permanently ("permanent"), retryably ("fail") or succeeds ("ok"), whatever its
    attempt (as the chaos run's random outcome does); calls past the list succeed. Returns the (offset, attempt) of
    each call, and a list where a test puts what the next call does before it decides (one hook per call)."""
    made: list[tuple[int, int]] = []
    hooks: list[Callable[[], Awaitable[None]]] = []

    async def handler(event: RetryEvent) -> None:
        made.append((event.offset, event.attempt))
        if hooks:
            await hooks.pop(0)()
        outcome = outcomes[len(made) - 1] if len(made) <= len(outcomes) else "ok"
        if outcome == "permanent":
            raise PermanentError("no " + "x" * 3000)  # longer than its header carries
        if outcome == "fail":
            raise RetryableError(f"call {len(made)} fails")

    runtime.handler = handler
    return made, hooks


def scripted(runtime: Runtime, *outcomes: Exception | None) -> list[int]:
    """The handler fails (or succeeds, None) as ``outcomes`` say, one per call; returns the attempts it ran."""
    calls: list[int] = []

    async def handler(event: RetryEvent) -> None:
        calls.append(event.attempt)
        outcome = outcomes[len(calls) - 1]
        if outcome is not None:
            raise outcome

    runtime.handler = handler
    return calls


def dead_letters(runtime: Runtime) -> list[tuple[bytes, bytes, bytes, bytes, bytes | None]]:
    return [
        (sent.headers[h.REASON], sent.headers[h.ATTEMPT], sent.headers[h.ERROR_CLASS], sent.headers[h.ERROR_MESSAGE],
         sent.value)
        for sent in runtime.failed_topics["items"].sent
    ]  # fmt: skip


def record_acks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The offsets Faust's ``Event.ack`` is called for from now on."""
    acked: list[int] = []
    ack = faust.events.Event.ack

    def recording_ack(self: Any) -> Any:
        acked.append(self.message.offset)
        return ack(self)

    monkeypatch.setattr(faust.events.Event, "ack", recording_ack)
    return acked


def at_each_confirm(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch, meanwhile: Callable[[], Awaitable[None] | None]
) -> None:
    """``meanwhile`` happens to the worker while each confirmed write from now on is on its way: it runs once the
    write's confirm has returned, before the caller goes on (a revocation, an eviction, a stop past the session
    timeout while the write before a send was in flight)."""
    confirm = runtime.store.confirm

    async def confirmed_and_meanwhile() -> None:
        await confirm()
        happened = meanwhile()
        if inspect.isawaitable(happened):
            await happened

    monkeypatch.setattr(runtime.store, "confirm", confirmed_and_meanwhile)


class StaleLease:
    """Fresh until armed; then stale, and its wait answers ``renewed`` (False: the heartbeat's answer is
    UnknownMemberId and the revocation ends the wait)."""

    def __init__(self, renewed: bool = False) -> None:
        self.stale = False
        self.renewed = renewed
        self.waits = 0

    def fresh(self) -> bool:
        return not self.stale

    async def wait(self, revoked: Any) -> bool:
        self.waits += 1
        return self.renewed


def stale_lease(runtime: Runtime) -> StaleLease:
    """The dispatcher's session lease replaced by a :class:`StaleLease` (fresh until a test arms it)."""
    lease = StaleLease()
    runtime.dispatcher.__dict__["session_lease"] = lease  # (a cached_property)
    return lease


def stop_during_each_send(topic: Any, monkeypatch: pytest.MonkeyPatch, lease: StaleLease) -> None:
    """Each record sent to ``topic`` (a failed topic, a tier topic) is acknowledged while the worker is stopped past
    its session timeout (``lease`` goes stale)."""
    send = topic.send

    async def stopped_during_the_send(*args: Any, **kwargs: Any) -> Any:
        result = await send(*args, **kwargs)
        lease.stale = True
        return result

    monkeypatch.setattr(topic, "send", stopped_during_the_send)


async def run_first_try(runtime: Runtime, monkeypatch: pytest.MonkeyPatch, outcome: str) -> tuple[list[Any], list[int]]:
    """One main record (:data:`VALUE`, offset 0) through every agent on partition 0 (adopted), its handler call ending
    as ``outcome`` says (:func:`per_call`); returns the calls made and the offsets acknowledged."""
    runtime.schedule.adopt(0, [])
    made, _ = per_call(runtime, outcome)
    acked = record_acks(monkeypatch)
    async with Agents(runtime) as agents:
        await first(agents, VALUE)
        await runtime.dispatcher.wait_idle()
    return made, acked


TIER = "items.retry.1s"


async def put_on_tier(runtime: Runtime, headers: list[tuple[str, bytes]]) -> None:
    """One record (:data:`VALUE`, key ``k``, ``headers``) through the 1s tier's agent on partition 0."""
    async with runtime.agents[TIER].test_context() as tier:
        await tier.put(VALUE, key=b"k", headers=headers, partition=0)


def unparkable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier agent's park raises from now on (a bug of ours): its record is refused as ``internal-error``."""

    def park(*_: Any) -> Any:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(agents.tier, "park", park)


async def park_one_due(runtime: Runtime, clock: FakeClock) -> None:
    """Partition 0 adopted, one message (key ``k``, ``items/0/7``: :func:`tier_headers`) parked by the 1s tier's
    agent, and its retry due."""
    runtime.schedule.adopt(0, [])
    await put_on_tier(runtime, tier_headers(clock))
    clock.advance(1000)


async def park_two_due(runtime: Runtime, clock: FakeClock) -> None:
    """Key ``k``: ``items/0/7`` and ``items/0/8`` parked by the 1s tier's agent on partition 0 (adopted), both due."""
    runtime.schedule.adopt(0, [])
    async with runtime.agents[TIER].test_context() as tier:
        for offset in (b"7", b"8"):
            headers = tier_headers(clock, **{h.ORIGINAL_OFFSET: offset})
            await tier.put(VALUE, key=b"k", headers=headers, partition=0)
    clock.advance(1000)


async def operators_dead_letter(runtime: Runtime) -> dict[str, Any]:
    """An operator's ``dead-letter`` of key ``k`` through the admin agent; its result."""
    channel = admin_channel(runtime)
    waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    channel.waiters["c1"] = waiter
    async with Agents(runtime) as agents:
        await agents.admin(AdminCommand("c1", "dead-letter", b"k", "test", 0))
        return await asyncio.wait_for(waiter, 5)


def revoke(runtime: Runtime) -> None:
    """This worker no longer owns any partition (as the assignor says after a rebalance took them)."""
    assignor = runtime.app.assignor
    assignor.assigned_actives = set  # type: ignore[method-assign]
    assignor.is_active = lambda tp: False  # type: ignore[method-assign]


async def request_its_release(runtime: Runtime, until: Callable[[], bool]) -> None:
    """The release agent handles :data:`REQUEST` for the retry :func:`park_one_due` parked, until ``until()``."""
    async with runtime.agents["release"].test_context() as releaser:
        await releaser.put(REQUEST, key=b"k", partition=0)
        await eventually(until)


def sent_releases(records: list[Any]) -> list[tuple[bytes, ReleaseRequest]]:
    """The release requests the recorded release topic records carry, ``(table key, request)`` in send order: a single
    request's record, or each element of a batch's (``REBOUND_RELEASE_BATCH``)."""
    releases: list[tuple[bytes, ReleaseRequest]] = []
    for record in records:
        read = read_release_record(record.value)
        releases.extend(read.requests if isinstance(read, ReleaseBatch) else [(record.key, read)])
    return releases
