"""Per-key retry state kept in the changelog-backed tables, and the pure operations on it.

Each parked message is one record of its own in the payload table (its metadata, then its bytes, raw), keyed by the
key's namespace plus the message's origin; the key's state record is a small index (how many are parked, running
totals, key-ordered mode's block and held origins). Parking, releasing or settling one message therefore writes one
entry and the index, whatever the key's backlog: the earlier layout listed every parked message's metadata in the
key's state, so the n-th park of a key rewrote n entries (1,000 parks on one key wrote 269 MB of changelog). A state
read for one message loads only that message's entry (:attr:`KeyState.loaded`); states written by the earlier layout
(version 2, with the list) are still read and written as they are until the key drains; its next state is new.

An entry is identified by its original record (topic, partition, offset), so parking is idempotent: a redelivered
tier record, or a duplicate written after a crash, never creates a second entry, and a later attempt of the same
message replaces the earlier one.

A message has one lifecycle (attempt 0, 1, ... to one end). Between its parks the key's index remembers it
(:class:`Mark`): its retry on its way to a tier (*forwarded*), and, for a bounded time, its end (*ended*). A main
record delivered again (a crash or a rebalance before its offset was committed) whose origin is parked, forwarded or
ended is a redelivery and does not start over (:func:`redelivery`); a tier record of an ended origin, or of an older
attempt than the one on its way, is a duplicate and does not run the retry again (:func:`tier_duplicate`).
"""

from __future__ import annotations

import base64
import json
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from rebound.attempts import Outcome
from rebound.headers import Header, Provenance

STATE_VERSION = 3
LEGACY_STATE_VERSION = 2
HELD_TIER = "held"
"""The ``tier`` of a held message (key-ordered mode): it has not failed yet."""


_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
"""What ``json.dumps(..., separators=(",", ":"), ensure_ascii=False)`` uses, made once: ``dumps`` with arguments
builds a new encoder per call, and an index or entry is encoded for every mark, park and settle."""


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


NULL_KEY_MARK = b"\x00"
ESCAPE_MARK = b"\x01"


def null_table_key(provenance: Provenance) -> bytes:
    """The table key of a null-keyed record: a key of its own, from its origin, marked by a leading NUL byte."""
    return null_key_of(provenance.topic, provenance.partition, provenance.offset)


def null_key_of(topic: str, partition: int, offset: int) -> bytes:
    return NULL_KEY_MARK + f"{topic}/{partition}/{offset}".encode()


def table_key(key: bytes | None, provenance: Provenance) -> bytes:
    """The state-table key of a message.

    Null-keyed records have no identity to share state with, so each one gets a key of its own (:func:`null_table_key`).
    A real key that itself starts with NUL (or with the escape byte 0x01) is escaped with a leading 0x01, so no real
    key can ever be taken for a null key; every other key is stored as it is, as in earlier versions.
    """
    if key is None:
        return null_table_key(provenance)
    return escaped_key(key)


def escaped_key(key: bytes) -> bytes:
    """The table key of a real (non-null) key: as it is, unless it could be taken for a null or an escaped key."""
    if key[:1] in (NULL_KEY_MARK, ESCAPE_MARK):
        return ESCAPE_MARK + key
    return key


def legacy_table_key(table_key: bytes) -> bytes | None:
    """The raw key under which versions before the escaping stored an escaped key's state; None if not escaped."""
    if table_key[:1] == ESCAPE_MARK and table_key[1:2] in (NULL_KEY_MARK, ESCAPE_MARK):
        return table_key[1:]
    return None


def message_key_of(table_key: bytes, provenance: Provenance) -> bytes | None:
    """The record key of the message from ``provenance`` stored under ``table_key``: the inverse of :func:`table_key`.

    Only the exact null key of that origin means "no key": a real key starting with NUL (stored raw by earlier
    versions, or escaped now) keeps its bytes.
    """
    if table_key == null_table_key(provenance):
        return None
    return legacy_table_key(table_key) or table_key


def payload_key(table_key: bytes, origin: str) -> bytes:
    """The key's own namespace plus the origin: a record claiming another key's origin can never touch its bytes."""
    return len(table_key).to_bytes(4, "big") + table_key + origin.encode("utf-8")


@dataclass(frozen=True, slots=True)
class Intent:
    """What the release of ``attempt`` decided to send, written on its entry and confirmed before the send.

    A worker killed after the send and before the settle was durable leaves the entry parked: its release request is
    read again, and running the handler again could decide otherwise (a non-deterministic handler: dead-lettered
    and then succeeded, or dead-lettered at ``attempt`` while the retry it sent runs). The intent says what was
    (maybe) sent, so the request sends the same again instead (:func:`sent_intent`): at-least-once, one end.

    A dead letter (``dead``) names its failed ``topic``, ``reason`` and the error; a retry names its tier ``topic``
    and ``tier``, its number ``next_attempt`` and ``due_at_ms``, and the error its headers carry. Sent again, a
    dead letter has no stack trace header (the trace is not stored).
    """

    attempt: int
    dead: bool
    topic: str
    reason: str
    error_class: str
    error_message: str
    tier: str = ""
    next_attempt: int = 0
    due_at_ms: int = 0

    @property
    def outcome(self) -> Outcome:
        """The outcome the release settles with once it is sent."""
        if not self.dead:
            return Outcome.SCHEDULED
        return Outcome.EXPIRED if self.reason == "expired" else Outcome.DEAD

    def to_dict(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "dead": self.dead,
            "topic": self.topic,
            "reason": self.reason,
            "error_class": self.error_class,
            "error_message": self.error_message,
            "tier": self.tier,
            "next_attempt": self.next_attempt,
            "due_at_ms": self.due_at_ms,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Intent:
        return cls(
            attempt=int(data["attempt"]),
            dead=bool(data["dead"]),
            topic=str(data["topic"]),
            reason=str(data.get("reason", "")),
            error_class=str(data.get("error_class", "")),
            error_message=str(data.get("error_message", "")),
            tier=str(data.get("tier", "")),
            next_attempt=int(data.get("next_attempt", 0)),
            due_at_ms=int(data.get("due_at_ms", 0)),
        )


@dataclass(frozen=True, slots=True)
class PendingMessage:
    """A parked message: everything needed to run the handler again without reading any topic."""

    origin: str
    key: bytes | None
    value: bytes | None
    headers: tuple[Header, ...]
    """The record's own headers as they came, a null value as ``None`` (state written before null values were kept
    holds ``b""`` for them: it reads back as it was written)."""
    provenance: Provenance
    attempt: int
    tier: str
    tier_topic: str
    partition: int
    due_at_ms: int
    parked_at_ms: int
    error_class: str
    error_message: str
    value_size: int | None = None
    has_payload: bool = True
    intent: Intent | None = None
    """What its release decided to send (:class:`Intent`), from before that send until the settle removes the entry."""

    @staticmethod
    def origin_of(provenance: Provenance) -> str:
        return f"{provenance.topic}/{provenance.partition}/{provenance.offset}"

    def to_dict(self, *, with_payload: bool = False) -> dict[str, Any]:
        """Metadata only, unless ``with_payload`` (used by tests and tools, never for the table).

        Built field by field, in the fields' order (what ``dataclasses.asdict`` gave, so the stored JSON is the same
        bytes): ``asdict`` deep-copies every field recursively, and this runs for every park, settle and entry
        compared in :meth:`RetryStore.save`.
        """
        provenance = self.provenance
        data: dict[str, Any] = {"origin": self.origin}
        if with_payload:
            data["key"] = _b64(self.key)
            data["value"] = _b64(self.value)
            data["headers"] = [[name, _b64(value)] for name, value in self.headers]
        data["provenance"] = {
            "topic": provenance.topic,
            "partition": provenance.partition,
            "offset": provenance.offset,
            "timestamp_ms": provenance.timestamp_ms,
            "first_received_at_ms": provenance.first_received_at_ms,
        }
        data["attempt"] = self.attempt
        data["tier"] = self.tier
        data["tier_topic"] = self.tier_topic
        data["partition"] = self.partition
        data["due_at_ms"] = self.due_at_ms
        data["parked_at_ms"] = self.parked_at_ms
        data["error_class"] = self.error_class
        data["error_message"] = self.error_message
        data["value_size"] = self.value_size
        if self.intent is not None:  # (only then: an entry without one is stored as before, byte for byte)
            data["intent"] = self.intent.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PendingMessage:
        with_payload = "value" in data
        return cls(
            origin=data["origin"],
            key=_unb64(data.get("key")),
            value=_unb64(data.get("value")),
            headers=tuple((name, _unb64(value)) for name, value in data.get("headers", ())),
            provenance=Provenance(**data["provenance"]),
            attempt=data["attempt"],
            tier=data["tier"],
            tier_topic=data["tier_topic"],
            partition=data["partition"],
            due_at_ms=data["due_at_ms"],
            parked_at_ms=data["parked_at_ms"],
            error_class=data["error_class"],
            error_message=data["error_message"],
            value_size=data.get("value_size"),
            has_payload=with_payload,
            intent=Intent.from_dict(data["intent"]) if data.get("intent") else None,
        )

    def encode_payload(self) -> bytes:
        return encode_payload(self.key, self.value, self.headers)

    def encode_entry(self, stored_payload: bytes | None = None) -> bytes:
        """A parked message's record in the payload table: its metadata, then its bytes as :meth:`encode_payload`.

        ``stored_payload`` is the payload part already stored for this origin, kept as it is when only the metadata
        changes (an entry loaded without its bytes); with neither, the record says the bytes are missing.
        """
        meta = _COMPACT.encode(self.to_dict()).encode("utf-8")
        payload = self.encode_payload() if self.has_payload else (stored_payload or b"")
        return _ENTRY_MAGIC + struct.pack(">I", len(meta)) + meta + payload

    @classmethod
    def from_entry(cls, raw: bytes, *, with_payload: bool = False) -> PendingMessage:
        """A parked message read back from its record (:meth:`encode_entry`), with its bytes if asked for."""
        meta, payload = split_entry(raw)
        entry = cls.from_dict(json.loads(meta))
        return entry.with_payload(payload) if with_payload and payload else entry

    def dead_letter_bytes(self, table_key: bytes) -> tuple[bytes | None, bytes | None, list[Header]]:
        """Key, value and headers to dead-letter this entry with: its own bytes, or, with its payload lost, its key
        (from the table key) and nothing else, so the dead letter still says what was dropped."""
        if self.has_payload:
            return self.key, self.value, list(self.headers)
        return message_key_of(table_key, self.provenance), None, []

    @classmethod
    def held_stub(cls, origin: str) -> PendingMessage:
        """A held message as its key's state lists it: only its origin (its metadata lives with its bytes, so a key
        holding many messages keeps a small state: holding one more rewrites a list of origins, not of entries)."""
        topic, partition, offset = origin.rsplit("/", 2)
        provenance = Provenance(topic, int(partition), int(offset), 0, 0)
        return cls(
            origin=origin,
            key=None,
            value=None,
            headers=(),
            provenance=provenance,
            attempt=0,
            tier=HELD_TIER,
            tier_topic="",
            partition=int(partition),
            due_at_ms=0,
            parked_at_ms=0,
            error_class="",
            error_message="",
            has_payload=False,
        )

    def encode_held(self) -> bytes:
        """A held message's record in the payload table: its metadata, then its bytes as :meth:`encode_payload`."""
        meta = {
            "timestamp_ms": self.provenance.timestamp_ms,
            "first_received_at_ms": self.provenance.first_received_at_ms,
            "parked_at_ms": self.parked_at_ms,
            "value_size": self.value_size,
            "error_message": self.error_message,
        }
        encoded = _COMPACT.encode(meta).encode("utf-8")
        return _HELD_MAGIC + struct.pack(">I", len(encoded)) + encoded + self.encode_payload()

    def with_held_payload(self, raw: bytes) -> PendingMessage:
        """This held entry with its metadata and bytes read back (a record written before the metadata moved there
        holds the bytes only: the state had the metadata then)."""
        if not raw.startswith(_HELD_MAGIC):
            return self.with_payload(raw)
        (size,) = struct.unpack_from(">I", raw, len(_HELD_MAGIC))
        start = len(_HELD_MAGIC) + 4
        meta = json.loads(raw[start : start + size])
        provenance = replace(
            self.provenance,
            timestamp_ms=int(meta.get("timestamp_ms", 0)),
            first_received_at_ms=int(meta.get("first_received_at_ms", 0)),
        )
        entry = replace(
            self,
            provenance=provenance,
            parked_at_ms=int(meta.get("parked_at_ms", 0)),
            due_at_ms=int(meta.get("parked_at_ms", 0)),
            value_size=meta.get("value_size"),
            error_message=str(meta.get("error_message", "")),
        )
        return entry.with_payload(raw[start + size :])

    def with_payload(self, raw: bytes) -> PendingMessage:
        """This entry with the bytes read back from the payload table."""
        if not raw.startswith(_PAYLOAD_MAGIC):
            raise ValueError("not a Rebound payload record")
        view, position = memoryview(raw), len(_PAYLOAD_MAGIC)
        key, position = _unframe(view, position)
        value, position = _unframe(view, position)
        (count,) = struct.unpack_from(">I", view, position)
        position += 4
        headers: list[Header] = []
        for _ in range(count):
            (size,) = struct.unpack_from(">H", view, position)
            name = bytes(view[position + 2 : position + 2 + size]).decode("utf-8")
            header_value, position = _unframe(view, position + 2 + size)
            headers.append((name, header_value))  # a null value was framed as absent: it comes back None
        return replace(self, key=key, value=value, headers=tuple(headers), has_payload=True)


def encode_payload(key: bytes | None, value: bytes | None, headers: Sequence[Header]) -> bytes:
    """A message's bytes, framed without any encoding overhead: the payload is as large as the original."""
    parts = [_PAYLOAD_MAGIC, _frame(key), _frame(value), struct.pack(">I", len(headers))]
    for name, value_bytes in headers:
        encoded = name.encode("utf-8")
        parts += [struct.pack(">H", len(encoded)), encoded, _frame(value_bytes)]
    return b"".join(parts)


_PAYLOAD_MAGIC = b"RBP1"
_HELD_MAGIC = b"RBH1"
_ENTRY_MAGIC = b"RBE1"


_FIRST_RECEIVED = re.compile(rb'"first_received_at_ms":(-?\d+)')
_TIER_TOPIC = re.compile(rb'"tier_topic":"([A-Za-z0-9._-]*)"')


def survey_fields(raw: bytes) -> tuple[str, int] | None:
    """An entry record's tier topic and first receipt, read without decoding it (the survey of a million parked
    messages reads only these two): searched in the metadata part only, whose JSON is written by
    :meth:`PendingMessage.encode_entry` (compact, topic names of ``[A-Za-z0-9._-]``). None if it is not an entry
    record or the fields are not found (then decode it)."""
    if not raw.startswith(_ENTRY_MAGIC):
        return None
    (size,) = struct.unpack_from(">I", raw, len(_ENTRY_MAGIC))
    start = len(_ENTRY_MAGIC) + 4
    first = _FIRST_RECEIVED.search(raw, start, start + size)
    topic = _TIER_TOPIC.search(raw, start, start + size)
    if first is None or topic is None:
        return None
    return topic.group(1).decode("ascii"), int(first.group(1))


def is_entry_record(raw: bytes) -> bool:
    """A parked message's own record (metadata and bytes), as opposed to a held one or a version 2 payload."""
    return raw.startswith(_ENTRY_MAGIC)


def split_entry(raw: bytes) -> tuple[bytes, bytes]:
    """An entry record's metadata (JSON) and payload parts; a version 2 payload record is all payload."""
    if not raw.startswith(_ENTRY_MAGIC):
        return b"{}", raw
    (size,) = struct.unpack_from(">I", raw, len(_ENTRY_MAGIC))
    start = len(_ENTRY_MAGIC) + 4
    return raw[start : start + size], raw[start + size :]


_ABSENT = 0xFFFFFFFF


def _frame(data: bytes | None) -> bytes:
    if data is None:
        return struct.pack(">I", _ABSENT)
    return struct.pack(">I", len(data)) + data


def _unframe(view: memoryview, position: int) -> tuple[bytes | None, int]:
    (size,) = struct.unpack_from(">I", view, position)
    position += 4
    if size == _ABSENT:
        return None, position
    return bytes(view[position : position + size]), position + size


@dataclass(frozen=True, slots=True)
class Mark:
    """What a key's index remembers of one of its messages that is not parked right now.

    *Forwarded*: retry ``attempt`` was sent to its tier and is not parked yet (it is still on the tier topic). *Ended*:
    the message ended (succeeded after a retry, or dead-lettered) with ``attempt``. *Sending* (``sending``): retry
    ``attempt`` is about to be sent, written and confirmed before the send, because a crash between the send's
    acknowledgement and the *forwarded* mark would otherwise leave a retry on the tier topic that nothing knows of;
    it refuses nothing by itself (the send may never have happened), but a redelivery that then ends the message is
    remembered as *ended*, so that retry, if it was sent, is refused when it arrives (:func:`redelivery`).
    ``record_ms`` is the original record's timestamp and ``digest`` a CRC-32 of its key and value
    (:func:`record_digest`): a record with the same origin and another timestamp or other bytes is another record (a
    topic deleted and created again starts its offsets over; a mirror refilling it may keep the timestamps, and
    records with no timestamp all carry 0), so a mark never refuses it. ``digest`` None (not known where the mark
    was written or where a record is checked) compares equal to any. ``at_ms`` is when the mark was written: it is
    forgotten ``LifecycleMemory.keep_ms`` later, and refuses nothing after that.
    """

    origin: str
    attempt: int
    at_ms: int
    ended: bool
    record_ms: int
    sending: bool = False
    digest: int | None = None
    intent: Intent | None = None
    """*Dead-lettering*: the dead letter a main-topic run of ``attempt`` is about to send (its failed topic, reason
    and error as its headers carry them), written and confirmed before the send (:func:`with_dead_letter_intent`).
    Not an end yet (the send may never have happened): a record of it read again sends the same dead letter instead
    of running the handler (:attr:`Known.DEAD_LETTERING`), and its *ended* mark, written after the send, replaces it.
    Stored as an eighth item, which a worker without it ignores (it sees a retry mark of ``attempt``: the record
    runs, as before)."""

    def to_json(self) -> list[Any]:
        item = [self.origin, self.attempt, self.at_ms, int(self.ended), self.record_ms, int(self.sending), self.digest]
        if self.intent is not None:  # (only then: every other mark is stored as before, byte for byte)
            intent = self.intent
            item.append([intent.topic, intent.reason, intent.error_class, intent.error_message])
        return item

    @classmethod
    def from_json(cls, item: list[Any]) -> Mark:
        origin, attempt, at_ms, ended, record_ms, *rest = item
        sending = bool(rest[0]) if rest else False
        digest = int(rest[1]) if len(rest) > 1 and rest[1] is not None else None
        intent = None
        if len(rest) > 2 and rest[2]:
            topic, reason, error_class, error_message = rest[2]
            intent = Intent(int(attempt), True, str(topic), str(reason), str(error_class), str(error_message))
        return cls(str(origin), int(attempt), int(at_ms), bool(ended), int(record_ms), sending, digest, intent)

    @property
    def on_its_way(self) -> bool:
        """Whether the mark stands for a retry on its way to a tier, or about to be (*forwarded* or *sending*), rather
        than for an end or a dead letter about to be sent."""
        return not self.ended and self.intent is None

    def live(self, now_ms: int | None, memory: LifecycleMemory) -> bool:
        """Whether the mark still counts at ``now_ms`` (None: no clock given, it does): an expired mark not yet
        forgotten (a partition whose expiry heap has not come to it) must refuse nothing."""
        return now_ms is None or now_ms - self.at_ms < memory.keep_ms

    def names(self, provenance: Provenance, digest: int | None = None) -> bool:
        """Whether this mark is about the record ``provenance`` names (same origin, same record timestamp) whose
        key and value have ``digest`` (None: not known, not compared)."""
        if self.origin != PendingMessage.origin_of(provenance) or self.record_ms != provenance.timestamp_ms:
            return False
        return self.digest is None or digest is None or self.digest == digest


def record_digest(key: bytes | None, value: bytes | None) -> int:
    """A CRC-32 of a record's key and value (a null told apart from empty bytes): with its origin and timestamp,
    what names the record in a :class:`Mark`. About ten bytes of JSON per mark; computed for each main record the
    main agent takes (about 0.65 µs for a 1 KB record here, next to a handler call and Faust's own work per event)."""
    return zlib.crc32(_frame(value), zlib.crc32(_frame(key)))


def entry_digest(entry: PendingMessage) -> int | None:
    """The digest of a parked or held message, None if it was loaded without its bytes."""
    return record_digest(entry.key, entry.value) if entry.has_payload else None


@dataclass(frozen=True, slots=True)
class LifecycleMemory:
    """How long and how many marks a key remembers (``REBOUND_ENDED_MEMORY``, ``REBOUND_ENDED_MEMORY_PER_KEY``)."""

    keep_ms: int = 3_600_000
    per_key: int = 64


@dataclass(frozen=True, slots=True)
class KeyState:
    """The state of one key: its parked messages as far as they were loaded, plus the key's index.

    ``pending`` holds the parked messages that were read; ``others`` counts the parked ones that were not, and
    ``loaded`` names the origins whose presence is known (``None``: all of them, ``pending`` is complete). A state
    read for one message (``loaded == {origin}``) answers :meth:`find` for that origin only, and asking it about
    another is a programming error rather than a silent "not parked": that is what lets one park or settle cost the
    same whatever the key's backlog.
    """

    pending: tuple[PendingMessage, ...] = ()
    attempts: int = 0
    first_failure_ms: int | None = None
    last_error: str | None = None
    last_error_class: str | None = None
    released: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    held: tuple[PendingMessage, ...] = ()
    """Key-ordered mode: later messages of the key waiting, in arrival (offset) order, behind its blocking one."""
    blocked_by: str | None = None
    """Key-ordered mode: the origin of the message the key waits for, from its first failure until it settles."""
    blocked_dead: bool = False
    """The blocking message was dead-lettered and the key stays blocked (``REBOUND_ORDERING_DEAD_LETTER_BLOCKS``)."""
    others: int = 0
    """Parked messages of the key not in ``pending`` (not loaded)."""
    loaded: frozenset[str] | None = None
    """Origins whose entry (or its absence) was read; ``None``: every parked message is in ``pending``."""
    partition_hint: int | None = None
    """The partition the key's messages come from, as the index recorded it."""
    legacy: bool = False
    """Read from a version 2 state (every parked message's metadata listed in it): written back the same way, until
    the key drains (see :meth:`to_json`)."""
    marks: tuple[Mark, ...] = ()
    """Messages of the key forwarded to a tier and not parked yet, or ended recently (:class:`Mark`)."""

    @property
    def parked(self) -> int:
        """How many messages of the key are parked (loaded or not)."""
        return len(self.pending) + self.others

    @property
    def complete(self) -> bool:
        return self.loaded is None

    @property
    def next_due_ms(self) -> int | None:
        return min((entry.due_at_ms for entry in self.pending), default=None)

    @property
    def tier(self) -> str | None:
        due = self.next_due_ms
        return next((entry.tier for entry in self.pending if entry.due_at_ms == due), None)

    def find(self, origin: str) -> PendingMessage | None:
        if self.loaded is not None and origin not in self.loaded:
            raise LookupError(f"{origin} was not loaded with this state (loaded: {sorted(self.loaded)})")
        return next((entry for entry in self.pending if entry.origin == origin), None)

    def park(self, entry: PendingMessage) -> tuple[KeyState, bool]:
        """Add ``entry``; returns the new state and whether anything changed (False for a duplicate).

        The entry replaces the mark of its retry on its way (it has arrived): from now on the entry says where the
        message is. Whether the record is a duplicate of an ended message is :func:`tier_duplicate`'s to say first.
        """
        current = self.find(entry.origin)
        if current is not None and current.attempt >= entry.attempt:
            return self, False
        others = tuple(item for item in self.pending if item.origin != entry.origin)
        first = entry.provenance.first_received_at_ms
        return (
            replace(
                self,
                marks=tuple(mark for mark in self.marks if mark.origin != entry.origin),
                pending=(*others, entry),
                attempts=self.attempts + 1,
                first_failure_ms=first if self.first_failure_ms is None else min(self.first_failure_ms, first),
                last_error=entry.error_message,
                last_error_class=entry.error_class,
                partition_hint=entry.partition,
            ),
            True,
        )

    def settle(self, origin: str, attempt: int) -> tuple[KeyState, bool]:
        """Remove the entry released as ``attempt``; a newer attempt parked meanwhile is left alone."""
        current = self.find(origin)
        if current is None or current.attempt != attempt:
            return self, False
        remaining = tuple(item for item in self.pending if item.origin != origin)
        return replace(self, pending=remaining, released=self.released + 1), True

    def without(self, origins: set[str]) -> KeyState:
        """The state with these (loaded) parked messages removed, as an operator or a refused write takes them."""
        return replace(self, pending=tuple(entry for entry in self.pending if entry.origin not in origins))

    @property
    def is_idle(self) -> bool:
        """Nothing of the key is parked, held, blocking or remembered: its index record can go."""
        return not self.parked and not self.held and self.blocked_by is None and not self.marks

    def mark_of(self, origin: str) -> Mark | None:
        return next((mark for mark in self.marks if mark.origin == origin), None)

    @property
    def is_blocked(self) -> bool:
        """Key-ordered mode: the key waits for a message (or still holds messages that have not run)."""
        return self.blocked_by is not None or bool(self.held)

    @property
    def partition(self) -> int | None:
        """The partition the key's messages come from (they all do from one), None for an empty state."""
        for entry in (*self.held, *self.pending):
            return entry.partition
        if self.partition_hint is not None:
            return self.partition_hint
        if self.blocked_by is not None:
            try:
                return int(self.blocked_by.rsplit("/", 2)[1])
            except (IndexError, ValueError):
                return None
        return None

    def find_held(self, origin: str) -> PendingMessage | None:
        return next((entry for entry in self.held if entry.origin == origin), None)

    def to_json(self) -> bytes:
        """The key's index record: counts and totals, never the parked messages themselves (each has its record).

        A version 2 key is written as it was read, its list included, until it drains: converting it would give
        every listed message a record of its own in one write, and a message that fit the old layout by a few
        hundred bytes would no longer fit its record, failing the write of another message of the key.
        """
        payload: dict[str, Any] = {"v": STATE_VERSION, "parked": self.parked}
        if self.legacy:
            payload = {"v": LEGACY_STATE_VERSION, "pending": [entry.to_dict() for entry in self.pending]}
        payload |= {
            "attempts": self.attempts,
            "first_failure_ms": self.first_failure_ms,
            "last_error": self.last_error,
            "last_error_class": self.last_error_class,
            "released": self.released,
            "extra": self.extra,
        }
        if self.partition is not None and not self.legacy:
            payload["p"] = self.partition
        if self.held:
            payload["held"] = [entry.origin for entry in self.held]
        if self.blocked_by is not None:
            payload["blocked_by"] = self.blocked_by
            payload["blocked_dead"] = self.blocked_dead
        if self.marks:
            payload["m"] = [mark.to_json() for mark in self.marks]
        return _COMPACT.encode(payload).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes | None) -> KeyState:
        """The index as stored, with no parked message loaded (``loaded`` is empty); a version 2 state lists every
        parked message's metadata, so it is read complete (its bytes are still separate), and so is a missing one."""
        if not raw:
            return cls()  # no index: nothing of the key is parked, held or blocking
        data = json.loads(raw)
        common: dict[str, Any] = {
            "attempts": data.get("attempts", 0),
            "first_failure_ms": data.get("first_failure_ms"),
            "last_error": data.get("last_error"),
            "last_error_class": data.get("last_error_class"),
            "released": data.get("released", 0),
            "extra": data.get("extra", {}),
            "held": tuple(
                PendingMessage.held_stub(item) if isinstance(item, str) else PendingMessage.from_dict(item)
                for item in data.get("held", ())
            ),
            "blocked_by": data.get("blocked_by"),
            "blocked_dead": bool(data.get("blocked_dead", False)),
            "partition_hint": data.get("p"),
            "marks": tuple(Mark.from_json(item) for item in data.get("m", ())),
        }
        if "pending" in data:  # version 2: the list is the truth, and complete
            pending = tuple(PendingMessage.from_dict(item) for item in data["pending"])
            return cls(pending=pending, legacy=True, **common)
        parked = max(0, int(data.get("parked", 0)))
        return cls(others=parked, loaded=frozenset() if parked else None, **common)

    def summary(self, *, show_payloads: bool = False) -> dict[str, Any]:
        """What the status views show: counts and metadata, payloads only when switched on."""
        pending = [self._describe(entry, show_payloads) for entry in self.pending]
        summary: dict[str, Any] = {
            "pending": pending,
            "attempts": self.attempts,
            "first_failure": self.first_failure_ms,
            "next_due": self.next_due_ms,
            "tier": self.tier,
            "last_error": self.last_error,
            "last_error_class": self.last_error_class,
            "released": self.released,
            "blocked": self.blocked_by is not None or bool(self.held),
            "blocked_by": self.blocked_by,
            "blocked_by_dead_letter": self.blocked_dead,
            "held": [self._describe(entry, show_payloads) for entry in self.held],
        }
        return summary

    @staticmethod
    def _describe(entry: PendingMessage, show_payloads: bool) -> dict[str, Any]:
        item: dict[str, Any] = {
            "origin": entry.origin,
            "original_topic": entry.provenance.topic,
            "original_partition": entry.provenance.partition,
            "original_offset": entry.provenance.offset,
            "attempt": entry.attempt,
            "tier": entry.tier,
            "due_at": entry.due_at_ms,
            "first_received_at": entry.provenance.first_received_at_ms,
            "error_class": entry.error_class,
            "error_message": entry.error_message,
            "value_bytes": entry.value_size,
        }
        if show_payloads and entry.has_payload:
            item["value"] = None if entry.value is None else entry.value.decode("utf-8", errors="backslashreplace")
        return item


def on_their_way(state: KeyState, *, now_ms: int, memory: LifecycleMemory) -> list[dict[str, Any]]:
    """The key's messages whose retry is on its way to a tier, as the key view lists them: a *sending* or
    *forwarded* mark (:attr:`Mark.on_its_way`) still live at ``now_ms``, unless a parked entry of the same message
    at that attempt or a later one says where it is (it arrived). Such a message is alive though nothing of it is
    parked yet, for the moment between its send and its park. ``state`` should have its parked messages loaded
    (:meth:`KeyState.find` raises for an origin that was not). ``since_ms``: how long ago the mark was written."""
    found: list[dict[str, Any]] = []
    for mark in state.marks:
        if not mark.on_its_way or not mark.live(now_ms, memory):
            continue
        entry = state.find(mark.origin)
        if entry is not None and entry.attempt >= mark.attempt:
            continue
        topic, partition, offset = mark.origin.rsplit("/", 2)
        found.append(
            {
                "origin": mark.origin,
                "original_topic": topic,
                "original_partition": int(partition),
                "original_offset": int(offset),
                "attempt": mark.attempt,
                "state": "sending" if mark.sending else "forwarded",
                "since_ms": max(0, now_ms - mark.at_ms),
            }
        )
    return found


class Known(StrEnum):
    """Where a message's lifecycle already is, when a record of it arrives that would start it (or a retry) again."""

    PARKED = "parked"
    """Its retry waits in the state table."""
    FORWARDED = "forwarded"
    """Its retry was sent to its tier and is not parked yet."""
    ENDED = "ended"
    """It ended (succeeded on a retry, or dead-lettered) within the memory's time."""
    SENDING = "sending"
    """Its retry may have been sent (a *sending* mark, or key order's block on it): it runs again, not refused, but
    its end is remembered even if it succeeds on its first try (:func:`remembers_outcome`)."""
    DEAD_LETTERING = "dead_lettering"
    """Its dead letter may have been sent (a *dead-lettering* mark, :attr:`Mark.intent`): the handler does not run,
    the same dead letter is sent again (:func:`intended_dead_letter`) and its end remembered."""


def redelivery(
    state: KeyState,
    provenance: Provenance,
    attempt: int,
    *,
    now_ms: int | None = None,
    memory: LifecycleMemory = LifecycleMemory(),
    digest: int | None = None,
) -> Known | None:
    """Why a main-topic record of ``provenance``, taken as ``attempt``, must not run: it is a redelivery, and its
    lifecycle is already further along. None: run it.

    ``attempt`` is 0 for a first delivery, or the attempt a record re-published by this group carries: such a record
    runs while its own attempt is what is parked or forwarded (the release that re-published it may not have
    settled yet), never once a later attempt is on its way, or the message ended. ``state`` must have the origin's
    entry loaded (:meth:`KeyState.find`). A mark older than the memory's time at ``now_ms`` counts for nothing.

    :attr:`Known.SENDING` does not refuse the record: its retry may or may not have been sent (a crash between the
    mark and the send's acknowledgement), so it runs, and its end is remembered whatever it is.
    :attr:`Known.DEAD_LETTERING` does not run it either: its dead letter is sent again (:func:`intended_dead_letter`).
    """
    origin = PendingMessage.origin_of(provenance)
    entry = state.find(origin)
    if entry is not None and entry.attempt > attempt and entry.provenance.timestamp_ms == provenance.timestamp_ms:
        return Known.PARKED
    mark = state.mark_of(origin)
    if mark is None or not mark.names(provenance, digest) or not mark.live(now_ms, memory):
        return None
    if mark.intent is not None:  # (its dead letter is for the attempt it names: any other record of it is late)
        return Known.DEAD_LETTERING if mark.attempt == attempt else Known.ENDED
    if mark.ended:
        return Known.ENDED
    if mark.attempt <= attempt:
        return None
    return Known.SENDING if mark.sending else Known.FORWARDED


def tier_duplicate(
    state: KeyState,
    provenance: Provenance,
    attempt: int,
    *,
    now_ms: int | None = None,
    memory: LifecycleMemory = LifecycleMemory(),
    digest: int | None = None,
) -> Known | None:
    """Why a tier record of ``provenance`` for retry ``attempt`` must not be parked: the message ended already (a
    copy written twice, read after the first one's retry settled), or a later attempt of it is parked or on its way.
    None: park it. ``state`` must have the origin's entry loaded. A mark older than the memory's time at ``now_ms``
    counts for nothing."""
    origin = PendingMessage.origin_of(provenance)
    mark = state.mark_of(origin)
    if mark is not None and mark.names(provenance, digest) and mark.live(now_ms, memory):
        if mark.ended or mark.intent is not None:  # (a dead letter decided ends it, sent or sent again)
            return Known.ENDED
        if mark.attempt > attempt:
            return Known.FORWARDED
    entry = state.find(origin)
    if entry is not None and entry.attempt > attempt:
        return Known.PARKED
    return None


def with_intent(state: KeyState, origin: str, attempt: int, intent: Intent) -> KeyState:
    """``state`` with ``intent`` on the entry released as ``attempt`` (written and confirmed before the send it names);
    unchanged if that entry is not parked (settled, or a later attempt parked meanwhile) or already says so."""
    entry = state.find(origin)
    if entry is None or entry.attempt != attempt or entry.intent == intent:
        return state
    pending = tuple(replace(item, intent=intent) if item.origin == origin else item for item in state.pending)
    return replace(state, pending=pending)


def sent_intent(entry: PendingMessage, attempt: int) -> Intent | None:
    """The outcome a release request for ``attempt`` must send again rather than run the handler: the intent its
    entry carries for that attempt (its release decided it, and may have sent it before its worker stopped and
    before its settle was durable). None: run it. An intent of another attempt counts for nothing (a later attempt
    parked replaces the entry, and with it the intent)."""
    intent = entry.intent
    if intent is None or intent.attempt != attempt or entry.attempt != attempt:
        return None
    return intent


def forget_expired(state: KeyState, now_ms: int, memory: LifecycleMemory) -> KeyState:
    """The state without the marks older than the memory keeps, and beyond its count per key without the oldest
    *ended* marks: a forwarded or sending mark is never dropped by count (it stands for a retry still on its way,
    which would otherwise start the message over or run again), only by time."""
    kept = tuple(mark for mark in state.marks if mark.live(now_ms, memory))
    excess = len(kept) - memory.per_key
    if excess > 0:
        ended = sorted((mark for mark in kept if mark.ended), key=lambda mark: mark.at_ms)
        dropped = set(ended[:excess])
        kept = tuple(mark for mark in kept if mark not in dropped)
    return state if kept == state.marks else replace(state, marks=kept)


def room_for_an_end(state: KeyState, now_ms: int, memory: LifecycleMemory) -> bool:
    """Whether one more *ended* mark fits the key's count without pushing out an older one (:func:`forget_expired`).

    A held message's first-try success is remembered only then: a key may hold up to ``max_held_per_key`` messages,
    and their ends, run one after another, would otherwise push out the ends before them, the end of the message
    that blocked them included, which refuses a retry of it still on its tier (an orphan) that would start a second
    lifecycle. Without room, the held success is not remembered, as before: a copy of its record read again runs
    again (at-least-once)."""
    return sum(1 for mark in state.marks if mark.live(now_ms, memory)) < memory.per_key


def expires_at(state: KeyState, memory: LifecycleMemory) -> int | None:
    """When the key's oldest mark is forgotten (None: it has none)."""
    if not state.marks:
        return None
    return min(mark.at_ms for mark in state.marks) + memory.keep_ms


def remember(
    state: KeyState,
    provenance: Provenance,
    *,
    attempt: int,
    ended: bool,
    partition: int,
    now_ms: int,
    memory: LifecycleMemory,
    sending: bool = False,
    digest: int | None = None,
    orphan: int | None = None,
) -> KeyState:
    """Remember that retry ``attempt`` of the message is about to be sent (``sending``), was sent to its tier
    (``ended=False``), or that the message ended with ``attempt`` (``ended=True``); expired marks go in the same
    write.

    ``orphan``: the retry a *sending* mark (or key order's block) said may be out, when the run that now ends the
    message ran because of it. If that retry was parked meanwhile, the end wins (:func:`without_orphan`).

    Nothing is remembered that the state already says better: a retry while this attempt's entry (or a later one)
    is parked (the entry is where the message is; a settle removes it first), an end while a later attempt is
    parked, a retry once a later attempt is on its way (a *sending* mark is replaced by the *forwarded* one of its
    attempt) or the message ended. An end is written even while its own attempt is parked (release mode
    ``republish``: the re-published record can run before the release that sent it settles; the settle then finds
    it ended). ``partition`` is the key's table partition, kept in the index for a key with nothing else in it.
    """
    origin = PendingMessage.origin_of(provenance)
    if ended:
        state = without_orphan(state, origin, orphan)
    entry = state.find(origin)
    current = state.mark_of(origin)
    if entry is not None and (entry.attempt > attempt or (entry.attempt == attempt and not ended)):
        return forget_expired(state, now_ms, memory)
    same = current is not None and current.names(provenance, digest) and current.live(now_ms, memory)
    if same and current is not None and (current.ended or (not ended and _says_as_much(current, attempt, sending))):
        return forget_expired(state, now_ms, memory)
    mark = Mark(origin, attempt, now_ms, ended, provenance.timestamp_ms, sending and not ended, digest)
    others = tuple(item for item in state.marks if item.origin != origin)
    after = replace(state, marks=(*others, mark), partition_hint=partition)
    return forget_expired(after, now_ms, memory)


def without_orphan(state: KeyState, origin: str, orphan: int | None) -> KeyState:
    """``state`` without the parked entry of retry ``orphan`` of ``origin``, when the message ends otherwise.

    A record read again runs because a *sending* mark (or key order's block) says its retry may be out, and that
    retry is parked by the tier agent while the record runs (the park is not in the key's lane). The run then ends
    the message (a success, or a dead letter): without this, the end could not be remembered (a later attempt is
    parked) and the retry would run later, a second end. The end wins: the entry goes, its bytes with it, and the
    tier agent refuses any copy of that retry as ended; a release request for it finds nothing (stale). Only the
    attempt the mark named: a later one means that retry ran already, and its lifecycle went on.
    """
    if orphan is None:
        return state
    entry = state.find(origin)
    if entry is None or entry.attempt != orphan:
        return state
    return state.without({origin})


def with_dead_letter_intent(
    state: KeyState,
    provenance: Provenance,
    intent: Intent,
    *,
    partition: int,
    now_ms: int,
    memory: LifecycleMemory,
    digest: int | None = None,
    orphan: int | None = None,
) -> KeyState:
    """``state`` with a *dead-lettering* mark (:attr:`Mark.intent`): the dead letter a main-topic run of
    ``intent.attempt`` is about to send, written and confirmed before the send.

    A worker stopped after the broker acknowledged the dead letter and before the *ended* mark was durable left
    nothing that said so: the record was read again and the handler ran again (with a handler whose outcome is not
    a function of the attempt: dead-lettered, then succeeded). With it, the record read again sends the same dead
    letter (:func:`intended_dead_letter`): at worst twice on the failed topic, one end. Never an *ended* mark before
    the send (a crash in between would lose the message). Unchanged if the message ended already, or a later
    attempt of it is parked (that one says where it is), unless that is the ``orphan`` retry
    (:func:`without_orphan`). The intent keeps the error as its headers carry it; its *ended* mark replaces it.
    """
    origin = PendingMessage.origin_of(provenance)
    state = without_orphan(state, origin, orphan)
    entry = state.find(origin)
    if entry is not None and entry.attempt > intent.attempt:
        return forget_expired(state, now_ms, memory)
    kept = Intent(intent.attempt, True, intent.topic, intent.reason, intent.error_class, intent.error_message)
    current = state.mark_of(origin)
    same = current is not None and current.names(provenance, digest) and current.live(now_ms, memory)
    if same and current is not None and (current.ended or current.intent == kept):
        return forget_expired(state, now_ms, memory)
    mark = Mark(origin, intent.attempt, now_ms, False, provenance.timestamp_ms, False, digest, kept)
    others = tuple(item for item in state.marks if item.origin != origin)
    return forget_expired(replace(state, marks=(*others, mark), partition_hint=partition), now_ms, memory)


def intended_dead_letter(
    state: KeyState,
    provenance: Provenance,
    attempt: int,
    *,
    now_ms: int | None = None,
    memory: LifecycleMemory = LifecycleMemory(),
    digest: int | None = None,
) -> Intent | None:
    """The dead letter a record of ``provenance`` read again as ``attempt`` sends instead of running the handler
    (:attr:`Known.DEAD_LETTERING`); None if its state holds no such intent (then :func:`redelivery` decides)."""
    if redelivery(state, provenance, attempt, now_ms=now_ms, memory=memory, digest=digest) is not Known.DEAD_LETTERING:
        return None
    mark = state.mark_of(PendingMessage.origin_of(provenance))
    return None if mark is None else mark.intent


def _says_as_much(current: Mark, attempt: int, sending: bool) -> bool:
    """Whether the retry mark ``current`` already says what a retry mark for ``attempt`` would (a later attempt, or
    this one sent where this one is only about to be, or a dead letter decided)."""
    if current.intent is not None:
        return True
    if current.attempt != attempt:
        return current.attempt > attempt
    return sending or not current.sending


def after_settle(
    state: KeyState,
    origin: str,
    attempt: int,
    outcome: Outcome | None,
    *,
    now_ms: int,
    memory: LifecycleMemory,
    republished: bool = False,
    digest: int | None = None,
) -> KeyState:
    """Settle the entry released as ``attempt`` (:meth:`KeyState.settle`) and remember where the message went: its
    next retry on its way (``scheduled``), or its end; nothing if the entry was not settled (a newer attempt parked
    meanwhile, or settled already). A re-published message (release mode ``republish``) is remembered as on its way
    with this attempt, which its main-topic record carries, so that record still runs."""
    entry = state.find(origin)
    settled, changed = state.settle(origin, attempt)
    if not changed or entry is None or outcome is None:
        return settled
    if outcome is Outcome.SCHEDULED:
        forwarded, ended = attempt + 1, False
    elif republished and outcome is Outcome.SUCCEEDED:
        forwarded, ended = attempt, False
    else:
        forwarded, ended = attempt, True
    return remember(
        settled,
        entry.provenance,
        attempt=forwarded,
        ended=ended,
        partition=entry.partition,
        now_ms=now_ms,
        memory=memory,
        digest=digest if digest is not None else entry_digest(entry),
    )


def remembers_outcome(outcome: Outcome, attempt: int, *, maybe_sent: bool = False, was_held: bool = False) -> bool:
    """Whether a main-topic run's outcome is written down: a retry on its way or an end, not a first try's success
    (the healthy path writes nothing; a redelivered success runs again, at-least-once, and succeeds again with an
    idempotent handler), unless a retry of it may have been sent before (``maybe_sent``: a *sending* mark, or key
    order's block on it): then its success is an end that retry must find. A held message has not run.

    ``was_held``: the run was a held message's, once its turn came (key order). Its record's offset was acknowledged
    when it was held, long before it ran, and may still be uncommitted: a copy read again (a seek to the committed
    offset, or one queued on the key's lane) finds the key free and would run it again, so its end is remembered
    even on a first-try success, in the confirmed write that takes it off the held list, if the key's marks have room
    for it (:func:`room_for_an_end`: it must not push out an older end)."""
    if outcome is Outcome.HELD:
        return False
    return outcome is not Outcome.SUCCEEDED or attempt > 0 or maybe_sent or was_held
