"""Operator actions on a key's parked messages, applied inside a stream iteration.

A web request cannot change the table (Faust takes the changelog partition from the current event), so the admin
views send a command to ``<app id>.admin``, partition ``p`` = the key's table partition. That topic is co-partitioned
with the table, so its partition ``p`` is consumed by the admin agent on the worker that owns the key's state. The
agent applies the command, logs it, and hands the result back to the waiting request (same worker) through an
in-memory future.

Actions:

- ``dead-letter``: every pending message of the key goes to its ``<main>.failed`` topic with reason ``admin`` (the
  original key, value and headers, byte-exact), then leaves the table.
- ``unblock`` (key-ordered mode): the key stops waiting for its blocking message (one kept blocking after it was
  dead-lettered, when ``REBOUND_ORDERING_DEAD_LETTER_BLOCKS`` is on, or any other); its held messages run at once, in
  order, unless a retry of the key is still parked: that one keeps them waiting until it settles (``dead-letter``
  moves it on).
- ``retry-now``: an explicit operator override of the due time: every pending message of the key that is not due yet
  becomes due now and is released by the next timer tick. This is the one way a message runs before the due time its
  policy gave it; it is logged, and the attempt keeps its number.

A message the release agent is running at that very moment finishes its run (the agents are separate streams); the
admin action covers what is parked when it is applied.

An operator's command is checked as the agents' own sends and writes are (``agents.ownership.still_owns``: the
session lease, then ownership): after its key's lock is taken (a release may hold it for a whole handler call),
before each dead letter, and before the write that follows them. A worker the group may have evicted meanwhile
would otherwise end messages its partition's new owner has released and run (a fork), or send its dead letters
again; refused, the result says so (``warning``) and the command is left to the new owner (the admin record, its
commit fenced, is read there again) or to the operator. A command stopped by an error answers ``error`` with what it
did before it (a ``dead-letter``: the ones sent, ``not_sent``, and what became of the key's state), as one refused
partway does; the audit log line says it too.

The pause state of the main topics has its own topic, ``<app id>.control`` (``agents/control.py``). A pause record
found here (where an earlier version wrote it) is skipped, logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from agents.attempt import dead_letter_entry
from agents.control import register_control
from agents.ordering import record_outcome, schedule_held
from agents.ownership import current_generation, still_owns, taken_in
from agents.runtime import Runtime
from agents.topics import raw_topic
from rebound.admin import dead_lettered, retry_now
from rebound.attempts import Outcome
from rebound.commands import AdminCommand
from rebound.display import logged_key, utc_time
from rebound.ordering import unblock
from rebound.pause import CONTROL_KEY
from rebound.routing import Reason
from rebound.schedule import Slot
from rebound.state import KeyState, PendingMessage, entry_digest, legacy_table_key
from rebound.topics import admin_topic, control_topic

log = logging.getLogger(__name__)


@dataclass
class AdminChannel:
    """Sends commands and waits for the admin agent's answer (the agent runs on the worker owning the partition)."""

    runtime: Runtime
    topic: Any
    waiters: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)

    async def submit(
        self, action: str, key: bytes, partition: int, *, requested_by: str = "", timeout: float = 10.0
    ) -> tuple[str, dict[str, Any] | None]:
        """Send the command; returns its id and the result, or None if it did not come within ``timeout``."""
        command = AdminCommand(uuid.uuid4().hex, action, key, requested_by, self.runtime.clock())
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiters[command.command_id] = future
        try:
            sent = await self.topic.send(key=key, value=command.to_json(), partition=partition)
            await sent
            try:
                return command.command_id, await asyncio.wait_for(asyncio.shield(future), timeout)
            except TimeoutError:
                return command.command_id, None
        finally:
            self.waiters.pop(command.command_id, None)

    def resolve(self, command_id: str, result: dict[str, Any]) -> None:
        future = self.waiters.get(command_id)
        if future is not None and not future.done():
            future.set_result(result)


def admin_channel(runtime: Runtime) -> AdminChannel:
    channel = runtime.admin_channel
    if channel is None:
        raise RuntimeError("the admin agent is not registered: admin commands have no channel")
    return channel


def message_key(table_key: bytes) -> bytes:
    """The record key a command's table key stands for (``escaped_key`` undone), as the audit line names it."""
    return legacy_table_key(table_key) or table_key


def _describe(entry: Any) -> dict[str, Any]:
    return {
        "origin": entry.origin,
        "original_topic": entry.provenance.topic,
        "attempt": entry.attempt,
        "tier": entry.tier,
        "due_at": entry.due_at_ms,
    }


async def apply_command(runtime: Runtime, command: AdminCommand, partition: int) -> dict[str, Any]:
    """Carry out one command on the key's pending messages of ``partition``; returns what was done.

    The key's lock is held throughout, so a release of the same key finishes first (and its message is then gone)
    or starts after the command: a message never ends both released and dead-lettered by an operator.
    """
    result: dict[str, Any] = {
        "id": command.command_id,
        "action": command.action,
        "key": command.key.decode("utf-8", errors="backslashreplace"),
        "partition": partition,
        "messages": [],
    }
    try:
        async with runtime.key_locks.hold(command.key):
            return await _apply_command(runtime, command, partition, result)
    except Exception as exc:  # an agent never crashes; the operator sees the error, and what was done before it
        log.exception("admin %s of key %s failed", command.action, logged_key(message_key(command.key)))
        return _failed(result, exc)


async def _record_ends(
    runtime: Runtime, table_key: bytes, partition: int, entries: list[PendingMessage], digests: dict[str, int | None]
) -> KeyState | None:
    """Each dead-lettered message ends here: whatever the mode, what a block held still runs, and it is remembered
    as ended, so a copy of its retry still on a tier topic, or its main record read again, does not start it over.
    Each write follows a confirm (the entries' removal, or the previous one's): the lease and ownership are asked
    before it; refused, None and nothing more is written."""
    after = KeyState()
    for entry in {entry.origin: entry for entry in entries}.values():
        if not await still_owns(runtime, partition):
            return None
        remembered, digest = (entry.provenance, entry.attempt), digests.get(entry.origin)
        after = await record_outcome(
            runtime, table_key, entry.origin, Outcome.DEAD, remembered=remembered, digest=digest
        )
    return after


def _moved(result: dict[str, Any], warning: str) -> dict[str, Any]:
    result["count"] = len(result["messages"])
    result["warning"] = warning
    return result


def _sent_and_not(result: dict[str, Any]) -> str:
    """``after <n> of <m> dead letters; sent: ...; not sent: ...`` of a ``dead-letter`` stopped in its sends."""
    sent = [message["origin"] for message in result["messages"]]
    left = [message["origin"] for message in result["not_sent"]]
    return (
        f"after {len(sent)} of {len(sent) + len(left)} dead letters; sent: {', '.join(sent) or 'none'}; "
        f"not sent: {', '.join(left) or 'none'}"
    )


def _cut_short(result: dict[str, Any], left: list[PendingMessage]) -> dict[str, Any]:
    """A ``dead-letter`` refused after some of its sends (``messages``, the ones sent; ``not_sent``, the rest): the
    key's state is not written, so every one of them is still parked, on the partition's next owner, which releases
    them when due (those sent too: a message may end there a second time) unless the command is applied there."""
    result["not_sent"] = [_describe(entry) for entry in left]
    result["incomplete"] = True
    return _moved(
        result,
        f"partition revoked (or the session lease lapsed) {_sent_and_not(result)}. The key's state was not written: "
        "all of them are still parked, and the partition's new owner releases them when due, the ones sent too, "
        "unless it applies the command again (check the key there, and dead-letter it again)",
    )


def _failed(result: dict[str, Any], exc: Exception) -> dict[str, Any]:
    """A command stopped by an error (``error``): the answer keeps what was done before it. A ``dead-letter`` with
    ``not_sent`` stopped in its sends, before the key's state was written; without, after all of them."""
    result["error"] = repr(exc)
    result["count"] = len(result["messages"])
    if result["action"] != "dead-letter":
        return result
    if result["messages"]:
        result["incomplete"] = True
    if "not_sent" in result:
        result["warning"] = (
            f"stopped by the error {_sent_and_not(result)}. The key's state was not written: all of them are still "
            "parked here and are released when due, the ones sent too (dead-letter the key again)"
        )
    elif result["messages"]:
        result["warning"] = (
            f"stopped by the error after all {len(result['messages'])} dead letters were sent: the key's state may "
            "not be written, or not all of them remembered as ended (check the key, and dead-letter it again if they "
            "are still there)"
        )
    return result


async def _send_dead_letters(
    runtime: Runtime,
    command: AdminCommand,
    partition: int,
    entries: list[PendingMessage],
    digests: dict[str, int | None],
    result: dict[str, Any],
) -> None:
    """Each entry's dead letter, in order, each sent one added to ``result["messages"]`` as it is acknowledged;
    refused before one (after the previous send), the result is cut short (``not_sent``) and nothing more sent."""
    for index, listed in enumerate(entries):  # one message's bytes in memory at a time, however many the key has
        if result["messages"] and not await still_owns(runtime, partition):  # (after the previous send)
            _cut_short(result, entries[index:])
            return
        entry = runtime.store.with_payload(command.key, listed)
        digests[entry.origin] = entry_digest(entry)
        await dead_letter_entry(
            runtime,
            command.key,
            entry,
            Reason.ADMIN,
            attempt=entry.attempt,
            error_class=entry.error_class,
            error_message=f"dead-lettered by an operator; last error: {entry.error_message}",
        )
        result["messages"].append({**_describe(entry), "payload_missing": not entry.has_payload})


async def _apply_command(
    runtime: Runtime, command: AdminCommand, partition: int, result: dict[str, Any]
) -> dict[str, Any]:
    """Fills ``result`` as it goes (``messages``: the dead letters sent so far), so an error's answer says it too."""
    if not await still_owns(runtime, partition):  # (the key's lock awaited; asked before the read)
        return _moved(result, "partition not owned here (revoked, or the session lease lapsed): nothing done")
    now = runtime.clock()
    changed: frozenset[str] = frozenset()  # retry-now: the origins whose due time it moved
    state = runtime.store.load(command.key, entries=True)
    entries = [entry for entry in state.pending if entry.partition == partition]
    if command.action == "dead-letter":
        digests: dict[str, int | None] = {}  # what names each message in its ended mark (rebound.state.Mark)
        try:
            await _send_dead_letters(runtime, command, partition, entries, digests, result)
        except Exception:
            result["not_sent"] = [_describe(entry) for entry in entries[len(result["messages"]) :]]
            raise
        if "not_sent" in result:  # refused partway
            return result
        moved = {(entry.origin, entry.attempt) for entry in entries}
        if not await still_owns(runtime, partition):  # revoked while the dead letters were sent: not ours to write
            if entries:
                return _cut_short(result, [])
            return _moved(result, "partition revoked meanwhile (or the session lease lapsed): nothing done")
        current = runtime.store.load(command.key, entries=True)  # re-read: the sends awaited
        runtime.store.save(command.key, current, dead_lettered(current, moved))
        await runtime.store.confirm()
        runtime.counters["admin.dead_lettered"] += len(entries)
        after = await _record_ends(runtime, command.key, partition, entries, digests) if entries else current
        if after is None:
            result["incomplete"] = True
            return _moved(
                result,
                "partition revoked (or the session lease lapsed) after the dead letters were sent and the entries "
                "removed: not all are remembered as ended (a copy of a retry still on a tier topic, or a main record "
                "read again, may start one again on the new owner), and in key-ordered mode the key may stay blocked "
                "there (unblock it)",
            )
        if entries and schedule_held(runtime, command.key, partition, after):
            result["held_released"] = len(after.held)
    elif command.action == "unblock":
        current = runtime.store.load(command.key)
        after = unblock(current)
        result["was_blocked_by"] = current.blocked_by
        if after != current:
            runtime.store.save(command.key, current, after)
            await runtime.store.confirm()
            runtime.counters["admin.unblocked"] += 1
        result["held_released"] = len(after.held) if schedule_held(runtime, command.key, partition, after) else 0
    else:  # retry-now
        current = runtime.store.load(command.key, entries=True)
        after, changed = retry_now(current, partition=partition, now_ms=now)
        runtime.store.save(command.key, current, after)
        await runtime.store.confirm()
        result["messages"] = [
            {**_describe(entry), "due_at": now, "was_due_at": entry.due_at_ms}
            for entry in entries
            if entry.origin in changed
        ]
        result["already_due"] = len(entries) - len(changed)
        runtime.counters["admin.retry_now"] += len(changed)
    result["count"] = len(result["messages"])
    if entries and command.action != "unblock":
        moved_slots = [entry for entry in entries if command.action == "dead-letter" or entry.origin in changed]
        runtime.schedule.discard(partition, {(command.key, entry.origin, entry.attempt) for entry in moved_slots})
        if command.action == "retry-now":
            for entry in moved_slots:
                runtime.schedule.add(partition, Slot(now, command.key, entry.origin, entry.attempt, entry.tier))
        runtime.release_wakeup.set()
    return result


@contextlib.contextmanager
def audit_line(what: str) -> Iterator[None]:
    """Around the building and logging of an admin action's audit line, which runs once the action is done: whatever
    it raises (a value no time or text shows, a logging filter or handler of the application's) must not become the
    action's error: the admin agent would stop with the answer never handed back, a view would answer 500 for an
    action that was done. The line is then lost, and one saying so logged if the logger allows."""
    try:
        yield
    except Exception:
        with contextlib.suppress(Exception):  # (the logger itself may be what raised)
            log.error("%s: its audit line could not be written", what, exc_info=True)


def log_action(command: AdminCommand, partition: int, result: dict[str, Any]) -> None:
    """The audit line of a command that ran; never raises (:func:`audit_line`). ``requested_at`` is the command's, as
    its writer gave it: ``?`` when absent (0), the number as it came when it is no time
    (:func:`rebound.display.utc_time`)."""
    with audit_line(f"admin action {command.action!r} (command {command.command_id!r})"):
        cut = ""
        if result.get("incomplete") or result.get("warning") or result.get("error"):
            left = result.get("not_sent")
            cut = "; NOT COMPLETE" + (f", not sent {[m['origin'] for m in left]}" if left is not None else "")
        log.warning(
            "admin action %s on key %s (partition %d, requested by %s at %s, command %s): %d message(s) %s%s",
            command.action,
            logged_key(message_key(command.key)),
            partition,
            command.requested_by or "?",
            utc_time(command.requested_at) if command.requested_at else "?",
            command.command_id,
            result.get("count", 0),
            [m["origin"] for m in result.get("messages", [])],
            cut,
        )


def register_admin_agent(runtime: Runtime) -> Any:
    topic = raw_topic(runtime.app, admin_topic(runtime.settings.app_id), partitions=runtime.partitions)
    runtime.admin_channel = AdminChannel(runtime, topic)
    register_control(runtime)
    old_pause_logged = False

    async def admin_agent(stream: Any) -> None:
        nonlocal old_pause_logged
        async for event in stream.events():
            taken = current_generation(runtime)  # its checks end at this generation's revocation (Faust waits for it)
            message = event.message
            if message.key == CONTROL_KEY:
                # A pause record of the earlier kind: the pause state now lives on <app id>.control (agents/control.py).
                if not old_pause_logged:
                    old_pause_logged = True
                    log.warning(
                        "ignoring a pause record on %s at %d@%d (written by an earlier version): the pause state is "
                        "on %s now; pause again if the main topics should be paused",
                        topic.get_topic_name(),
                        message.partition,
                        message.offset,
                        control_topic(runtime.settings.app_id),
                    )
                continue
            try:
                command = AdminCommand.from_json(message.value)
            except ValueError as exc:  # (whatever reading it raised: AdminCommand.from_json)
                log.error("ignoring malformed admin command at %d@%d: %s", message.partition, message.offset, exc)
                continue
            with taken_in(taken):
                result = await apply_command(runtime, command, message.partition)  # (an error is in its answer)
            log_action(command, message.partition, result)  # (never raises)
            with contextlib.suppress(KeyError):
                admin_channel(runtime).resolve(command.command_id, result)

    return runtime.app.agent(topic, name="rebound.admin", concurrency=1)(admin_agent)
