"""Names, encoding and validation of the ``rebound.*`` record headers.

Every header is written once per hop (the previous hop's values are replaced, never appended) and every value is a
UTF-8 decimal string or bounded UTF-8 text, so that any Kafka tool can read them. Reading is strict: a tier record
whose headers are missing, malformed or inconsistent is not trusted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rebound.errors import InvalidRetryHeadersError

PREFIX = "rebound."
ATTEMPT = "rebound.attempt"
DUE_AT = "rebound.due-at"
FIRST_RECEIVED_AT = "rebound.first-received-at"
ORIGINAL_TOPIC = "rebound.original-topic"
ORIGINAL_PARTITION = "rebound.original-partition"
ORIGINAL_OFFSET = "rebound.original-offset"
ORIGINAL_TIMESTAMP = "rebound.original-timestamp"
GROUP = "rebound.group"
ERROR_CLASS = "rebound.error-class"
ERROR_MESSAGE = "rebound.error-message"
ERROR_TRACE = "rebound.error-trace"
REASON = "rebound.reason"
REDRIVE_COUNT = "rebound.redrive-count"
NULL_VALUE = "rebound.null-value"
WRITER_EPOCH = "rebound.writer-epoch"
"""On changelog records only: the epoch its writer claimed for the partition (``rebound/fencing.py``)."""

# Every tier record carries these (parse_retry_headers refuses it otherwise); the error ones are optional.
REQUIRED_RETRY_HEADERS = (
    ORIGINAL_TOPIC,
    ORIGINAL_PARTITION,
    ORIGINAL_OFFSET,
    ORIGINAL_TIMESTAMP,
    FIRST_RECEIVED_AT,
    GROUP,
    ATTEMPT,
    DUE_AT,
)
OPTIONAL_RETRY_HEADERS = (ERROR_CLASS, ERROR_MESSAGE)

MAX_ERROR_MESSAGE_BYTES = 1024
MAX_ERROR_TRACE_BYTES = 4096
MAX_ERROR_CLASS_BYTES = 256
MAX_DECIMAL_DIGITS = 20

Header = tuple[str, bytes | None]
"""One record header. Its value may be null: legal in Kafka (Java producers send it) and kept null on every hop, since
"byte-exact" includes telling a null value from an empty one."""
HeaderPairs = Iterable[Header]


def truncate_utf8(text: str, limit: int) -> bytes:
    """Cut ``text`` to at most ``limit`` bytes without splitting a multi-byte character."""
    encoded = text.encode("utf-8", errors="replace")
    if len(encoded) <= limit:
        return encoded
    return encoded[:limit].decode("utf-8", errors="ignore").encode("utf-8")


def decimal(value: int) -> bytes:
    return str(int(value)).encode("ascii")


@dataclass(frozen=True, slots=True)
class Provenance:
    """Where a message first came from; carried unchanged through every tier to the failed topic."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    first_received_at_ms: int


@dataclass(frozen=True, slots=True)
class RetryHeaders:
    """The validated ``rebound.*`` headers of a tier record."""

    provenance: Provenance
    attempt: int
    due_at_ms: int
    group: str
    error_class: str
    error_message: str


# Set by the redrive job, not by a hop: it must reach the failed topic again, or a redriven record that fails again
# would look never-redriven and its redrive cap would never bite. Untrusted on input, it can only lower the cap.
CARRIED = frozenset({REDRIVE_COUNT})


def without_rebound_headers(headers: HeaderPairs) -> list[Header]:
    """The record's own headers, and the carried ones once each (the last value, as Kafka's ``lastHeader`` reads).

    Ours are replaced on every hop, never appended twice: a carried header that arrived repeated would otherwise be
    written twice, and Rebound's own tier record would then be refused by its own parser.
    """
    pairs = list(headers)
    last_carried = {name: index for index, (name, _) in enumerate(pairs) if name in CARRIED}
    return [
        (name, value)
        for index, (name, value) in enumerate(pairs)
        if not name.startswith(PREFIX) or last_carried.get(name) == index
    ]


def restore_null_value(value: bytes | None, headers: HeaderPairs) -> bytes | None:
    """The value a record stood for: ``None`` where Rebound had to send ``b""`` for it (see ``NULL_VALUE``).

    Kafka clients refuse a record whose key and value are both null, so Rebound sends such a message on with an empty
    value and ``rebound.null-value: 1``; readers turn it back into ``None`` before anything else sees it.
    """
    if value == b"" and any(name == NULL_VALUE and marker == b"1" for name, marker in headers):
        return None
    return value


def error_headers(error_class: str, error_message: str, trace: str | None = None) -> list[tuple[str, bytes]]:
    pairs = [
        (ERROR_CLASS, truncate_utf8(error_class, MAX_ERROR_CLASS_BYTES)),
        (ERROR_MESSAGE, truncate_utf8(error_message, MAX_ERROR_MESSAGE_BYTES)),
    ]
    if trace:
        # Keep the end of the trace: the innermost frames say where it failed.
        encoded = trace.encode("utf-8", errors="replace")[-MAX_ERROR_TRACE_BYTES:]
        pairs.append((ERROR_TRACE, encoded.decode("utf-8", errors="ignore").encode("utf-8")))
    return pairs


def provenance_headers(provenance: Provenance, group: str) -> list[tuple[str, bytes]]:
    return [
        (ORIGINAL_TOPIC, provenance.topic.encode("utf-8")),
        (ORIGINAL_PARTITION, decimal(provenance.partition)),
        (ORIGINAL_OFFSET, decimal(provenance.offset)),
        (ORIGINAL_TIMESTAMP, decimal(provenance.timestamp_ms)),
        (FIRST_RECEIVED_AT, decimal(provenance.first_received_at_ms)),
        (GROUP, group.encode("utf-8")),
    ]


def retry_headers(
    own_headers: HeaderPairs,
    *,
    provenance: Provenance,
    group: str,
    attempt: int,
    due_at_ms: int,
    error_class: str,
    error_message: str,
) -> list[Header]:
    """Headers of a record sent to a tier topic: the user's headers plus one fresh set of ours."""
    return [
        *without_rebound_headers(own_headers),
        *provenance_headers(provenance, group),
        (ATTEMPT, decimal(attempt)),
        (DUE_AT, decimal(due_at_ms)),
        *error_headers(error_class, error_message),
    ]


def failed_headers(
    own_headers: HeaderPairs,
    *,
    provenance: Provenance,
    group: str,
    attempt: int,
    reason: str,
    error_class: str,
    error_message: str,
    trace: str | None = None,
) -> list[Header]:
    """Headers of a record sent to the failed topic."""
    return [
        *without_rebound_headers(own_headers),
        *provenance_headers(provenance, group),
        (ATTEMPT, decimal(attempt)),
        (REASON, reason.encode("utf-8")),
        *error_headers(error_class, error_message, trace),
    ]


def last_values(headers: HeaderPairs) -> dict[str, bytes | None]:
    """Header name to value; a repeated ``rebound.*`` header is a forgery signal, so it is reported, not merged."""
    seen: dict[str, bytes | None] = {}
    for name, value in headers:
        if name.startswith(PREFIX) and name in seen:
            raise InvalidRetryHeadersError(f"header {name!r} appears more than once")
        seen[name] = value
    return seen


def _present(values: Mapping[str, bytes | None], name: str) -> bytes:
    """The value of a ``rebound.*`` header Rebound wrote; a null value is never one of those (Rebound writes text)."""
    if name not in values:
        raise InvalidRetryHeadersError(f"header {name!r} is missing")
    raw = values[name]
    if raw is None:
        raise InvalidRetryHeadersError(f"header {name!r} is null")
    return raw


def _text(values: Mapping[str, bytes | None], name: str, limit: int = 512) -> str:
    raw = _present(values, name)
    if len(raw) > limit:
        raise InvalidRetryHeadersError(f"header {name!r} is longer than {limit} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRetryHeadersError(f"header {name!r} is not UTF-8") from exc


def _decimal(values: Mapping[str, bytes | None], name: str, *, minimum: int = 0) -> int:
    raw = _present(values, name)
    if not raw or len(raw) > MAX_DECIMAL_DIGITS or not raw.isdigit():
        raise InvalidRetryHeadersError(f"header {name!r} is not a decimal number: {raw[:32]!r}")
    number = int(raw)
    if number < minimum:
        raise InvalidRetryHeadersError(f"header {name!r} is below {minimum}: {number}")
    return number


def parse_retry_headers(headers: HeaderPairs, *, main_topics: Iterable[str]) -> RetryHeaders:
    """Validate the headers of a tier record; raise :class:`InvalidRetryHeadersError` on anything off.

    The original topic is checked against the configured main topics, so a forged header can never make Rebound
    run a handler for, or redrive into, a topic it does not serve.
    """
    values = last_values(headers)
    topic = _text(values, ORIGINAL_TOPIC, limit=249)
    if topic not in set(main_topics):
        raise InvalidRetryHeadersError(f"original topic {topic!r} is not a configured main topic")
    first_received = _decimal(values, FIRST_RECEIVED_AT)
    return RetryHeaders(
        provenance=Provenance(
            topic=topic,
            partition=_decimal(values, ORIGINAL_PARTITION),
            offset=_decimal(values, ORIGINAL_OFFSET),
            timestamp_ms=_decimal(values, ORIGINAL_TIMESTAMP),
            first_received_at_ms=first_received,
        ),
        attempt=_decimal(values, ATTEMPT, minimum=1),
        due_at_ms=_decimal(values, DUE_AT, minimum=first_received),
        group=_text(values, GROUP, limit=249),
        error_class=_text(values, ERROR_CLASS, limit=MAX_ERROR_CLASS_BYTES) if ERROR_CLASS in values else "",
        error_message=(_text(values, ERROR_MESSAGE, limit=MAX_ERROR_MESSAGE_BYTES) if ERROR_MESSAGE in values else ""),
    )
