"""The records Rebound sends itself to make a worker act: release requests and admin commands.

Both travel on internal topics to the partition of the message's table key (keyed by it, but for a batch of
release requests, whose elements name their keys: :class:`ReleaseBatch`), so they reach the worker that owns that
partition of the state table: release requests from the release timer to the release agent (``<app id>.release``), admin
commands from a web request to the admin agent (``<app id>.admin``). Their JSON is read by whichever version of
Rebound the owning worker runs, so it changes only compatibly. The other formats live beside these: the retry
headers in ``rebound/headers.py``, the state table's values in ``rebound/state.py``, the pause records in
``rebound/pause.py``, the status summaries in ``rebound/summary.py``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rebound.records import plain_record_bytes

ACTIONS = ("dead-letter", "retry-now", "unblock")
"""The per-key admin actions (``POST /retry/admin/keys/{key}/<action>``)."""

UNREADABLE = (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError)
"""What reading a release record or element, or an admin command, can raise on bad input, and nothing else:
``json.loads`` (``ValueError``, its ``UnicodeDecodeError`` included, for bad JSON or bytes; ``TypeError`` for a value
that is not bytes; ``RecursionError`` for deep nesting), a field missing or of the wrong type (``KeyError``,
``AttributeError``, ``TypeError``), ``int()`` (``ValueError``; ``OverflowError`` for an infinite number such as
``1e999``) and ``base64.b64decode`` (``binascii.Error``, a ``ValueError``). Each is a malformed record, logged and
skipped."""


@dataclass(frozen=True)
class ReleaseRequest:
    """Run ``attempt`` of the parked message ``origin`` if it is still parked and due (the release agent checks)."""

    origin: str
    attempt: int
    number: int | None = None
    """The send's number on its partition (``ReleaseSchedule.received``), ``n`` on the wire; None for none."""

    def to_json(self) -> bytes:
        request: dict[str, Any] = {"origin": self.origin, "attempt": self.attempt}
        if self.number is not None:
            request["n"] = self.number
        return json.dumps(request).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ReleaseRequest:
        """Raises ``ValueError`` for anything but a request (whatever it was: :data:`UNREADABLE`): the agent logs it
        and goes on."""
        try:
            return cls.from_parsed(json.loads(raw))
        except UNREADABLE as exc:
            raise ValueError(f"not a release request: {exc!r}") from exc

    @classmethod
    def from_parsed(cls, request: Any) -> ReleaseRequest:
        """From the JSON object of one request; raises one of :data:`UNREADABLE`."""
        number = request.get("n")
        return cls(str(request["origin"]), int(request["attempt"]), None if number is None else int(number))


@dataclass(frozen=True)
class ReleaseBatch:
    """Several release requests of one partition in one record (``REBOUND_RELEASE_BATCH``): each element names its
    table key, since the record's own key can be only one of them (it is the first element's, and means nothing).

    On the wire: ``{"releases": [{"key": <base64 table key>, "origin": ..., "attempt": ..., "n": ...}, ...]}``. A
    tick's due requests of one partition travel this way up to the setting's number per record; one alone travels as
    a single :class:`ReleaseRequest`, as every request did before batches, and every worker still reads those.

    A rolling upgrade: a worker from before batches reads a batch record as a malformed request (no ``origin``): it
    logs "ignoring malformed release request", acknowledges it and releases nothing of it. Nothing is lost: a
    request is only a trigger, the entries stay parked in the table, and a batch record reaches an older worker only
    when a newer one sent it to a partition the older one now owns, whose schedule that worker rebuilt from the table
    on assignment and whose requests it sends itself, one per record. (The sender reads its own partitions: a worker
    sends batches only to partitions it owns.)
    """

    requests: tuple[tuple[bytes, ReleaseRequest], ...]
    """``(table key, request)`` in send order."""
    malformed: tuple[str, ...] = ()
    """Why each element that could not be read was left out (read, never written): the others still run, and the
    schedule sends again what it never hears of."""

    def to_json(self) -> bytes:
        return batch_json([element_json(key, request) for key, request in self.requests])

    @classmethod
    def from_parsed(cls, releases: object) -> ReleaseBatch:
        if not isinstance(releases, list) or not releases:
            raise ValueError("not a release batch: 'releases' is not a non-empty list")
        requests: list[tuple[bytes, ReleaseRequest]] = []
        malformed: list[str] = []
        for index, element in enumerate(releases):
            try:
                key = base64.b64decode(element["key"], validate=True)
                request = ReleaseRequest.from_parsed(element)
            except UNREADABLE as exc:
                malformed.append(f"element {index}: {exc!r}")
                continue
            requests.append((key, request))
        return cls(tuple(requests), tuple(malformed))


def element_json(key: bytes, request: ReleaseRequest) -> bytes:
    """One element of a :class:`ReleaseBatch` on the wire."""
    element: dict[str, Any] = {
        "key": base64.b64encode(key).decode("ascii"),
        "origin": request.origin,
        "attempt": request.attempt,
    }
    if request.number is not None:
        element["n"] = request.number
    return json.dumps(element).encode()


_BATCH_HEAD, _BATCH_SEPARATOR, _BATCH_TAIL = b'{"releases": [', b", ", b"]}"


def batch_json(elements: list[bytes]) -> bytes:
    """A batch record's value from its elements' JSON (:func:`element_json`): ``json.dumps`` of the whole, byte for
    byte, so its length is known from theirs (:func:`release_records`)."""
    return _BATCH_HEAD + _BATCH_SEPARATOR.join(elements) + _BATCH_TAIL


RELEASE_BATCH_BYTES = 100_000
"""The most bytes a batch record takes in a produce request (its key, value and framing), whatever
``REBOUND_RELEASE_BATCH`` allows (table keys can be long); less with a small ``REBOUND_PRODUCER_MAX_REQUEST_BYTES``
(:func:`release_record_bytes`)."""


def release_record_bytes(producer_max_request_bytes: int) -> int:
    """The most bytes a batch record of release requests may take: :data:`RELEASE_BATCH_BYTES`, or half the largest
    record the producer sends (``REBOUND_PRODUCER_MAX_REQUEST_BYTES``, at least 1024) if that is less.

    The size is counted with the producer's own upper bound (:func:`rebound.records.estimated_record_bytes`), so the
    half is not for the estimate: it keeps a batch as far from the limit as the largest record a parked message's key
    can be in (its payload's changelog record carries its key twice), and a release topic made before the setting was
    raised still takes it. A record the producer refuses would never be sent, nor would its requests ever be (they
    are grouped again the same way)."""
    return min(RELEASE_BATCH_BYTES, producer_max_request_bytes // 2)


def release_records(
    requests: Iterable[tuple[int, bytes, ReleaseRequest]], most: int, max_bytes: int = RELEASE_BATCH_BYTES
) -> list[tuple[int, bytes, bytes]]:
    """The records that carry ``requests`` (``(partition, table key, request)``, each partition's in send order), as
    ``(partition, record key, value)``: each run of one partition's requests up to ``most`` to a record, in order,
    and a record of several at most ``max_bytes`` in a produce request (:func:`release_record_bytes`: its key, the
    first element's table key, counted with its value and framing). A record of one request is a
    :class:`ReleaseRequest`'s, keyed by its table key, as before batches (also one too large to share a record: it goes
    alone, as it did before batches); one of several is a :class:`ReleaseBatch`, keyed by its first element's table
    key."""
    records: list[tuple[int, bytes, bytes]] = []
    group: list[tuple[bytes, ReleaseRequest]] = []
    elements: list[bytes] = []
    group_partition, value_bytes = -1, 0

    def close() -> None:
        if len(group) == 1:
            key, request = group[0]
            records.append((group_partition, key, request.to_json()))
        elif group:
            records.append((group_partition, group[0][0], batch_json(elements)))
        group.clear()
        elements.clear()

    if most == 1:
        return [(partition, key, request.to_json()) for partition, key, request in requests]
    for partition, key, request in requests:
        element = element_json(key, request)
        if partition != group_partition or len(group) >= most:
            close()
        elif plain_record_bytes(len(group[0][0]), value_bytes + len(_BATCH_SEPARATOR) + len(element)) > max_bytes:
            close()  # (a first element too large for a batch with any other goes alone: a single request's record)
        if group:
            value_bytes += len(_BATCH_SEPARATOR) + len(element)
        else:
            group_partition, value_bytes = partition, len(_BATCH_HEAD) + len(element) + len(_BATCH_TAIL)
        group.append((key, request))
        elements.append(element)
    close()
    return records


def read_release_record(raw: bytes) -> ReleaseRequest | ReleaseBatch:
    """A release topic record's value, either form, read once. Raises ``ValueError`` for anything else, whatever
    reading it raised (:data:`UNREADABLE`; the agent logs it and goes on); a batch with unreadable elements keeps the
    others (:attr:`ReleaseBatch.malformed`)."""
    try:
        parsed = json.loads(raw)
        if isinstance(parsed, dict) and "releases" in parsed:
            return ReleaseBatch.from_parsed(parsed["releases"])
        return ReleaseRequest.from_parsed(parsed)
    except UNREADABLE as exc:
        raise ValueError(f"not a release request: {exc!r}") from exc


@dataclass(frozen=True)
class AdminCommand:
    """An operator's action on one key, with the id its answer is matched by."""

    command_id: str
    action: str
    key: bytes
    requested_by: str = ""
    requested_at: int = 0

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "id": self.command_id,
                "action": self.action,
                "key": base64.b64encode(self.key).decode("ascii"),
                "requested_by": self.requested_by,
                "requested_at": self.requested_at,
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> AdminCommand:
        """Raises ``ValueError`` for anything but a command (whatever reading it raised: :data:`UNREADABLE`), or one
        of an action not in :data:`ACTIONS`: the admin agent logs it and goes on."""
        try:
            data = json.loads(raw)
            command = cls(
                command_id=str(data["id"]),
                action=str(data["action"]),
                key=base64.b64decode(data["key"]),
                requested_by=str(data.get("requested_by", "")),
                requested_at=int(data.get("requested_at", 0)),
            )
        except UNREADABLE as exc:
            raise ValueError(f"not an admin command: {exc!r}") from exc
        if command.action not in ACTIONS:
            raise ValueError(f"unknown admin action {command.action!r}")
        return command
