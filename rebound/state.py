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
"""

from __future__ import annotations

import base64
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rebound.headers import Provenance

STATE_VERSION = 3
LEGACY_STATE_VERSION = 2
HELD_TIER = "held"
"""The ``tier`` of a held message (key-ordered mode): it has not failed yet."""


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


def table_key_of_text(key: str) -> bytes:
    """The table key of a key given as text (web views, admin commands); such keys are never null."""
    encoded = key.encode("utf-8")
    return ESCAPE_MARK + encoded if encoded[:1] in (NULL_KEY_MARK, ESCAPE_MARK) else encoded


def payload_key(table_key: bytes, origin: str) -> bytes:
    """The key's own namespace plus the origin: a record claiming another key's origin can never touch its bytes."""
    return len(table_key).to_bytes(4, "big") + table_key + origin.encode("utf-8")


@dataclass(frozen=True, slots=True)
class PendingMessage:
    """A parked message: everything needed to run the handler again without reading any topic."""

    origin: str
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
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

    @staticmethod
    def origin_of(provenance: Provenance) -> str:
        return f"{provenance.topic}/{provenance.partition}/{provenance.offset}"

    def to_dict(self, *, with_payload: bool = False) -> dict[str, Any]:
        """Metadata only, unless ``with_payload`` (used by tests and tools, never for the table)."""
        data = asdict(self)
        data.pop("has_payload")
        if with_payload:
            data["key"] = _b64(self.key)
            data["value"] = _b64(self.value)
            data["headers"] = [[name, _b64(value)] for name, value in self.headers]
        else:
            del data["key"], data["value"], data["headers"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PendingMessage:
        with_payload = "value" in data
        return cls(
            origin=data["origin"],
            key=_unb64(data.get("key")),
            value=_unb64(data.get("value")),
            headers=tuple((name, _unb64(value) or b"") for name, value in data.get("headers", ())),
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
        )

    def encode_payload(self) -> bytes:
        return encode_payload(self.key, self.value, self.headers)

    def encode_entry(self, stored_payload: bytes | None = None) -> bytes:
        """A parked message's record in the payload table: its metadata, then its bytes as :meth:`encode_payload`.

        ``stored_payload`` is the payload part already stored for this origin, kept as it is when only the metadata
        changes (an entry loaded without its bytes); with neither, the record says the bytes are missing.
        """
        meta = json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        payload = self.encode_payload() if self.has_payload else (stored_payload or b"")
        return _ENTRY_MAGIC + struct.pack(">I", len(meta)) + meta + payload

    @classmethod
    def from_entry(cls, raw: bytes, *, with_payload: bool = False) -> PendingMessage:
        """A parked message read back from its record (:meth:`encode_entry`), with its bytes if asked for."""
        meta, payload = split_entry(raw)
        entry = cls.from_dict(json.loads(meta))
        return entry.with_payload(payload) if with_payload and payload else entry

    def dead_letter_bytes(self, table_key: bytes) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
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
        encoded = json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
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
        headers = []
        for _ in range(count):
            (size,) = struct.unpack_from(">H", view, position)
            name = bytes(view[position + 2 : position + 2 + size]).decode("utf-8")
            header_value, position = _unframe(view, position + 2 + size)
            headers.append((name, header_value or b""))
        return replace(self, key=key, value=value, headers=tuple(headers), has_payload=True)


def encode_payload(key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]]) -> bytes:
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
        """Add ``entry``; returns the new state and whether anything changed (False for a duplicate)."""
        current = self.find(entry.origin)
        if current is not None and current.attempt >= entry.attempt:
            return self, False
        others = tuple(item for item in self.pending if item.origin != entry.origin)
        first = entry.provenance.first_received_at_ms
        return (
            replace(
                self,
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
        return not self.parked and not self.held and self.blocked_by is None

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
        return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

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
