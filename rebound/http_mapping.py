"""The HTTP push handler's pure parts: the handler URL, the request headers, the status mapping and ``Retry-After``.

``REBOUND_HANDLER=https://host/path`` makes Rebound a consumer proxy: each event is POSTed to that URL
(``app/http_handler.py`` does the I/O). What a service receives and how its answer is read is decided here, without
I/O, so every rule is unit-tested and the request format is written down once (docs/push-handlers.md):

- the body is the record's value, bytes unchanged; a null value is an empty body and ``Rebound-Value-Null: 1``;
- the key is ``Rebound-Key`` in standard base64 (padded); a null key is no ``Rebound-Key`` and ``Rebound-Key-Null: 1``;
- the record's own headers are one ``Rebound-Header-List`` header, a JSON array (ASCII only) of ``[name, base64
  value]`` pairs in the record's order, ``null`` for a header sent with a null value: Kafka header names may hold any
  character (HTTP header names may not), and a name may come more than once (a JSON object would keep one);
- topic, partition, offset, timestamp, attempt, tier and first receipt as ``Rebound-*`` text;
- ``Idempotency-Key`` is ``<group>:<topic>:<partition>:<offset>`` of the original record: the same on every delivery
  and every retry of one record, also after a crash redelivers it.

Each outcome raises one exception class of its own (:mod:`rebound.http_errors`), so the ``rebound.error-class``
header, the metric labels and the pipeline see seven names at most, never a status code or a URL.
"""

from __future__ import annotations

import base64
import datetime
import email.utils
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import urlsplit

from rebound.errors import ConfigurationError
from rebound.event import RetryEvent
from rebound.http_errors import HttpHeadersTooLarge

HANDLER_URL_SCHEMES = ("http", "https")
CONTENT_TYPE = "application/octet-stream"

KEY = "Rebound-Key"
KEY_NULL = "Rebound-Key-Null"
VALUE_NULL = "Rebound-Value-Null"
HEADERS = "Rebound-Header-List"
TOPIC = "Rebound-Topic"
PARTITION = "Rebound-Partition"
OFFSET = "Rebound-Offset"
TIMESTAMP = "Rebound-Timestamp"
ATTEMPT = "Rebound-Attempt"
TIER = "Rebound-Tier"
FIRST_RECEIVED_AT = "Rebound-First-Received-At"
IDEMPOTENCY_KEY = "Idempotency-Key"

ERROR_BODY_BYTES = 256
"""How much of a failed response's body becomes the error message (``rebound.error-message`` keeps 1 KiB)."""

DEFAULT_MAX_HEADER_BYTES = 8192
"""``REBOUND_HTTP_MAX_HEADER_BYTES``: the largest request header section sent (nginx's default buffer is 8 KiB)."""

DEFAULT_RETRYABLE_STATUSES = "408,425,429,5xx"
DEFAULT_PERMANENT_STATUSES = "3xx,4xx"
OVERLOAD_STATUSES = frozenset({429, 503})
"""Statuses that say the service is refusing calls for load: counted as drops by adaptive concurrency."""


def looks_like_url(spec: str) -> bool:
    """Whether ``REBOUND_HANDLER`` is meant as a URL (then checked as one) rather than ``package.module:callable``."""
    text = spec.strip().lower()
    return "://" in text or text.startswith(("http:", "https:"))


def check_handler_url(spec: str, *, variable: str = "REBOUND_HANDLER") -> str:
    """The handler URL, stripped, or a :class:`ConfigurationError` saying what is wrong with it in one line.

    Refused: another scheme than http or https, no host, a host name no resolver takes (an empty label, one over 63
    characters), a port that is not a number, whitespace, a fragment, and credentials in the URL (they would be logged with it: ``REBOUND_HTTP_TOKEN`` carries a bearer token instead).
    """
    text = spec.strip()
    shown = text[:80]
    how = f"set {variable}=https://host[:port]/path (or http://)"
    if any(character.isspace() or ord(character) < 32 for character in text):
        raise ConfigurationError(f"{variable}={shown!r} is not a valid URL: it contains whitespace; {how}")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ConfigurationError(f"{variable}={shown!r} is not a valid URL ({exc}); {how}") from None
    if parts.scheme.lower() not in HANDLER_URL_SCHEMES:
        raise ConfigurationError(
            f"{variable}={shown!r}: scheme {parts.scheme!r} is not supported; a handler URL is http:// or https://"
        )
    if not parts.hostname:
        raise ConfigurationError(f"{variable}={shown!r} is not a valid URL: it names no host; {how}")
    if parts.username is not None or parts.password is not None:
        raise ConfigurationError(
            f"{variable}: credentials in the URL are refused (they would be logged); set REBOUND_HTTP_TOKEN instead"
        )
    if parts.fragment or text.endswith("#"):
        raise ConfigurationError(f"{variable}={shown!r}: a URL fragment ('#...') is never sent; remove it")
    if port == 0:
        raise ConfigurationError(f"{variable}={shown!r} is not a valid URL: port 0; {how}")
    if not parts.netloc.startswith("["):  # (an IPv6 literal has no labels)
        try:  # what the resolver will do with it: a label empty or over 63 characters fails every call
            parts.hostname.rstrip(".").encode("idna")
        except UnicodeError as exc:
            raise ConfigurationError(f"{variable}={shown!r}: the host name cannot be resolved ({exc}); {how}") from None
    return text


def url_for_logs(url: str) -> str:
    """The URL without its query (which may carry a key of the service's own): what logs and views show."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def encode_bytes(value: bytes) -> str:
    """Standard base64 with padding (RFC 4648 section 4): ``Buffer.from(text, 'base64')`` in Node."""
    return base64.b64encode(value).decode("ascii")


def idempotency_key(group: str, topic: str, partition: int, offset: int) -> str:
    """The same for every delivery and retry of one original record: its group (the app id), topic, partition and
    offset, which a redelivery after a crash and every retry carry unchanged. Topic names and the app id are
    restricted to ``[A-Za-z0-9._-]``, so ``:`` separates the parts unambiguously."""
    return f"{group}:{topic}:{partition}:{offset}"


def request_headers(
    event: RetryEvent,
    *,
    group: str,
    authorization: str | None = None,
    max_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> dict[str, str]:
    """The HTTP request headers for one delivery of ``event``, ``Authorization`` included when given.

    A header section over ``max_bytes`` raises :class:`HttpHeadersTooLarge` (permanent) here, before any I/O: a
    server's answer to it (400, 431, or a reset that looks like an unreachable service) would not say why."""
    return RequestHeaders(group=group, authorization=authorization, max_bytes=max_bytes).of(event)


class RequestHeaders:
    """:func:`request_headers` with what is the same for every call worked out once: the handler builds one at
    start-up and calls :meth:`of` per delivery (the headers are built on the hot path of every call)."""

    __slots__ = ("_authorization", "_fixed_size", "_key_prefix", "_max_bytes")

    def __init__(self, *, group: str, authorization: str | None = None, max_bytes: int = DEFAULT_MAX_HEADER_BYTES):
        self._key_prefix = f"{group}:"
        self._authorization = authorization
        self._max_bytes = max_bytes
        self._fixed_size = header_section_bytes(
            {"Content-Type": CONTENT_TYPE} | ({} if authorization is None else {"Authorization": authorization})
        )

    def of(self, event: RetryEvent) -> dict[str, str]:
        topic = event.topic
        partition = str(event.partition)
        offset = str(event.offset)
        record_headers = event.header_list or event.headers
        headers = {
            "Content-Type": CONTENT_TYPE,
            IDEMPOTENCY_KEY: f"{self._key_prefix}{topic}:{partition}:{offset}",
            TOPIC: topic,
            PARTITION: partition,
            OFFSET: offset,
            TIMESTAMP: str(event.timestamp_ms),
            ATTEMPT: str(event.attempt),
            FIRST_RECEIVED_AT: str(event.first_received_at_ms),
            HEADERS: encode_record_headers(
                record_headers.items() if isinstance(record_headers, Mapping) else record_headers
            )
            if record_headers
            else "[]",
        }
        if event.tier is not None:
            headers[TIER] = event.tier
        if event.key is None:
            headers[KEY_NULL] = "1"
        else:
            headers[KEY] = encode_bytes(event.key)
        if event.value is None:
            headers[VALUE_NULL] = "1"
        if self._authorization is not None:
            headers["Authorization"] = self._authorization
        size = self._fixed_size + _variable_section_bytes(headers)
        if size > self._max_bytes:
            raise HttpHeadersTooLarge(
                f"the request's header section would be {size} bytes ({HEADERS} {len(headers[HEADERS])}, "
                f"{KEY} {len(headers.get(KEY, ''))}), more than REBOUND_HTTP_MAX_HEADER_BYTES={self._max_bytes}: the "
                "record's headers or key are too large to send",
                size_bytes=size,
                limit_bytes=self._max_bytes,
            )
        return headers


_FIXED_HEADERS = frozenset({"Content-Type", "Authorization"})


def _variable_section_bytes(headers: Mapping[str, str]) -> int:
    """:func:`header_section_bytes` of all but the fixed headers: the names are ASCII, and so (base64, JSON with
    ``ensure_ascii``, digits, topic and tier names) are the values but a tier name's, checked."""
    size = 0
    for name, value in headers.items():
        if name in _FIXED_HEADERS:
            continue
        size += len(name) + 4 + (len(value) if value.isascii() else len(value.encode()))
    return size


def header_section_bytes(headers: Mapping[str, str]) -> int:
    """The size of ``headers`` on the wire, ``Name: value\\r\\n`` each (the client adds Host, Content-Length and a
    few more short ones, under 200 bytes)."""
    return sum(len(name.encode()) + len(value.encode()) + 4 for name, value in headers.items())


def encode_record_headers(headers: Iterable[tuple[str, bytes | None]]) -> str:
    """The record's own headers as one JSON array, ASCII only: ``[name, base64 value]`` pairs in the record's order,
    repeated names kept, ``null`` for a null value. An array, not an object: Kafka allows a name more than once and
    keeps the order, which a JSON object (and most languages' parsers of one) would lose."""
    return json.dumps(
        [[name, None if value is None else encode_bytes(value)] for name, value in headers],
        ensure_ascii=True,
        separators=(",", ":"),
    )


def decode_record_headers(text: str) -> list[tuple[str, bytes | None]]:
    """The inverse of :func:`encode_record_headers`: what a service written in Python would do."""
    return [
        (name, None if value is None else base64.b64decode(value, validate=True)) for name, value in json.loads(text)
    ]


class StatusOutcome(StrEnum):
    SUCCEEDED = "succeeded"
    RETRYABLE = "retryable"
    OVERLOADED = "overloaded"
    PERMANENT = "permanent"


_STATUS_ENTRY = re.compile(r"([1-5])(?:xx|\d\d)", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class StatusList:
    """Exact statuses (``503``) and whole classes (``5xx``) of one outcome."""

    exact: frozenset[int]
    classes: frozenset[int]

    @classmethod
    def parse(cls, text: str, *, variable: str) -> StatusList:
        exact: set[int] = set()
        classes: set[int] = set()
        for part in (piece.strip() for piece in text.split(",")):
            if not part:
                continue
            if not _STATUS_ENTRY.fullmatch(part):
                raise ConfigurationError(
                    f"{variable}: {part[:20]!r} is not an HTTP status (100 to 599) or a class such as 5xx"
                )
            if part.lower().endswith("xx"):
                classes.add(int(part[0]))
            else:
                exact.add(int(part))
        if 2 in classes or any(200 <= status < 300 for status in exact):
            raise ConfigurationError(f"{variable}: a 2xx status always means success; remove it")
        return cls(frozenset(exact), frozenset(classes))

    def __contains__(self, status: object) -> bool:
        return isinstance(status, int) and (status in self.exact or status // 100 in self.classes)


@dataclass(frozen=True, slots=True)
class StatusMapping:
    """Which non-2xx statuses are retried and which dead-letter at once.

    An exact status beats a class (``408`` retryable beats ``4xx`` permanent); the same exact status or the same
    class in both lists is refused at start-up. A 3xx is permanent by default: redirects are not followed (a POST
    must not be re-sent elsewhere silently), and a wrong URL should fail fast rather than after the whole retry
    sequence. A status in neither list (a 1xx) is retryable, like an exception Rebound does not know.
    """

    retryable: StatusList
    permanent: StatusList

    @classmethod
    def parse(cls, retryable: str, permanent: str, *, prefix: str = "REBOUND_") -> StatusMapping:
        mapping = cls(
            StatusList.parse(retryable, variable=f"{prefix}HTTP_RETRYABLE_STATUSES"),
            StatusList.parse(permanent, variable=f"{prefix}HTTP_PERMANENT_STATUSES"),
        )
        both = sorted(
            [str(status) for status in mapping.retryable.exact & mapping.permanent.exact]
            + [f"{klass}xx" for klass in mapping.retryable.classes & mapping.permanent.classes]
        )
        if both:
            raise ConfigurationError(
                f"{prefix}HTTP_RETRYABLE_STATUSES and {prefix}HTTP_PERMANENT_STATUSES both list {', '.join(both)}; "
                "keep each in one of them"
            )
        return mapping

    def outcome(self, status: int) -> StatusOutcome:
        if 200 <= status < 300:
            return StatusOutcome.SUCCEEDED
        if status in self.retryable.exact:
            verdict = StatusOutcome.RETRYABLE
        elif status in self.permanent.exact or status // 100 in self.permanent.classes:
            verdict = StatusOutcome.PERMANENT
        else:  # in the retryable classes, or in neither list
            verdict = StatusOutcome.RETRYABLE
        if verdict is StatusOutcome.RETRYABLE and status in OVERLOAD_STATUSES:
            return StatusOutcome.OVERLOADED
        return verdict


DEFAULT_STATUS_MAPPING = StatusMapping.parse(DEFAULT_RETRYABLE_STATUSES, DEFAULT_PERMANENT_STATUSES)


_ASCTIME = re.compile(
    r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun) (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) ([ \d]\d) "
    r"(\d\d):(\d\d):(\d\d) (\d{4})"
)
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def parse_retry_after(value: str | None, *, now_ms: int) -> float | None:
    """``Retry-After`` as seconds from now (RFC 9110 section 10.2.3): a whole number of seconds or an HTTP date in
    any of the three formats a recipient must accept (section 5.6.7: IMF-fixdate, RFC 850, asctime; all GMT).

    A date in the past is 0; anything unreadable (a negative or fractional number, digits that are not ASCII, text)
    is ``None``, as if absent: a broken header must not make a retry wait, nor fail the call.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if text.isascii() and text.isdigit():
        return float(min(int(text), 10**9))
    when = _http_date(text)
    if when is None:
        return None
    seconds = when.timestamp() - now_ms / 1000
    return max(0.0, math.ceil(seconds)) if math.isfinite(seconds) else None


def _http_date(text: str) -> datetime.datetime | None:
    if not text.isascii() or not any(character.isalpha() for character in text):
        return None
    if match := _ASCTIME.fullmatch(text):  # "Sun Nov  6 08:49:37 1994": no zone, GMT by definition
        _, month, day, hour, minute, second, year = match.groups()
        try:
            return datetime.datetime(
                int(year), _MONTHS.index(month) + 1, int(day), int(hour), int(minute), int(second), tzinfo=datetime.UTC
            )
        except ValueError:
            return None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # "-0000" dates: IMF-fixdate and RFC 850 dates are always GMT
        return None
    return when


def error_text(body: bytes, *, limit: int = ERROR_BODY_BYTES) -> str:
    """The first ``limit`` bytes of a response body as one line of text: invalid UTF-8 replaced, a character cut in
    half dropped, control characters and runs of whitespace made single spaces."""
    text = body[:limit].decode("utf-8", errors="replace")
    if len(body) > limit and text.endswith("\ufffd"):
        text = text[:-1]
    return " ".join("".join(" " if ord(c) < 32 or ord(c) == 127 else c for c in text).split())


def status_message(status: int, reason: str | None, body: bytes) -> str:
    """``HTTP 503 Service Unavailable: <the body's first bytes>``."""
    head = f"HTTP {status}" + (f" {reason}" if reason else "")
    text = error_text(body)
    return f"{head}: {text}" if text else head
