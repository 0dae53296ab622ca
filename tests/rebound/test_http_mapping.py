"""The HTTP push handler's pure rules: the handler URL, the request headers, the status mapping, ``Retry-After``."""

from __future__ import annotations

import base64
import datetime
import email.utils
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rebound import http_mapping as m
from rebound.errors import ConfigurationError, PermanentError
from rebound.event import RetryEvent
from rebound.http_errors import HttpHeadersTooLarge
from rebound.settings import load_settings

NOW_MS = 1_700_000_000_000


def event(**overrides: object) -> RetryEvent:
    fields: dict[str, object] = {
        "key": b"\x00k\xff",
        "value": b"body",
        "headers": {},
        "topic": "items",
        "partition": 3,
        "offset": 42,
        "attempt": 0,
        "timestamp_ms": 1234,
        "first_received_at_ms": 5678,
        "tier": None,
    }
    fields.update(overrides)
    return RetryEvent(**fields)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------------ the URL


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/events",
        "https://svc.example/x?a=1",
        "HTTPS://H/",
        "https://svc.ns.svc.cluster.local./x",
        "http://[::1]:8080/",
    ],
)
def test_http_and_https_urls_are_handler_urls(url: str) -> None:
    assert m.looks_like_url(url)
    assert m.check_handler_url(f" {url} ") == url


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("ftp://host/x", "scheme 'ftp' is not supported"),
        ("grpc://host:9000", "scheme 'grpc' is not supported"),
        ("https://", "names no host"),
        ("https:/host/x", "names no host"),
        ("http://host:99999/", "not a valid URL"),
        ("http://host:port/", "not a valid URL"),
        ("http://ho st/", "whitespace"),
        ("https://user:secret@host/", "credentials in the URL"),
        ("http://host/#frag", "fragment"),
        ("http://" + "a" * 64 + ".example/", "host name"),
        ("http://svc..example/", "host name"),
    ],
)
def test_a_malformed_url_or_another_scheme_is_refused_with_one_line(url: str, fragment: str) -> None:
    assert m.looks_like_url(url)
    with pytest.raises(ConfigurationError, match="REBOUND_HANDLER") as refused:
        load_settings(handler=url)
    assert fragment in str(refused.value)
    assert "\n" not in str(refused.value)
    assert "secret" not in str(refused.value)


def test_a_module_path_is_not_taken_for_a_url() -> None:
    assert not m.looks_like_url("mycompany.items:handle")
    assert load_settings(handler="mycompany.items:handle").http_handler is False
    assert load_settings(handler="http://h/x").http_handler is True


def test_logs_never_show_the_query() -> None:
    assert m.url_for_logs("https://h:1/p/q?api_key=s3cret") == "https://h:1/p/q"


# --------------------------------------------------------------------------------------------------- the headers


def test_request_headers_of_a_first_try() -> None:
    headers = m.request_headers(event(headers={"trace": b"\x01\x02", "empty": b"", "nul": None}), group="orders")
    assert headers == {
        "Content-Type": "application/octet-stream",
        "Idempotency-Key": "orders:items:3:42",
        "Rebound-Topic": "items",
        "Rebound-Partition": "3",
        "Rebound-Offset": "42",
        "Rebound-Timestamp": "1234",
        "Rebound-Attempt": "0",
        "Rebound-First-Received-At": "5678",
        "Rebound-Key": base64.b64encode(b"\x00k\xff").decode(),
        "Rebound-Header-List": '[["trace","AQI="],["empty",""],["nul",null]]',
    }


def test_a_retry_names_its_tier_and_keeps_the_idempotency_key() -> None:
    first = m.request_headers(event(), group="g")
    retry = m.request_headers(event(attempt=2, tier="5m"), group="g")
    assert retry["Rebound-Tier"] == "5m" and retry["Rebound-Attempt"] == "2"
    assert retry["Idempotency-Key"] == first["Idempotency-Key"]


def test_null_key_and_null_value_are_marked() -> None:
    headers = m.request_headers(event(key=None, value=None), group="g")
    assert "Rebound-Key" not in headers
    assert headers["Rebound-Key-Null"] == "1" and headers["Rebound-Value-Null"] == "1"
    empty = m.request_headers(event(key=b"", value=b""), group="g")
    assert empty["Rebound-Key"] == "" and "Rebound-Key-Null" not in empty and "Rebound-Value-Null" not in empty


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "é\u2603", "\x00\r\n", ""]) | st.text(max_size=20),
            st.none() | st.binary(max_size=40),
        ),
        max_size=8,
    ),
    st.one_of(st.none(), st.binary(max_size=40)),
)
def test_key_and_record_headers_round_trip_and_are_ascii(
    pairs: list[tuple[str, bytes | None]], key: bytes | None
) -> None:
    """Any names (repeated, empty, non-ASCII, control characters) and any bytes come back as sent, in order."""
    encoded = m.request_headers(event(headers=dict(pairs), header_list=tuple(pairs), key=key), group="g")
    for name, value in encoded.items():
        assert name.isascii() and value.isascii()
        assert "\r" not in value and "\n" not in value
    assert m.decode_record_headers(encoded["Rebound-Header-List"]) == pairs
    if key is None:
        assert "Rebound-Key" not in encoded
    else:
        assert base64.b64decode(encoded["Rebound-Key"], validate=True) == key


def test_an_event_built_without_its_header_list_sends_its_headers_mapping() -> None:
    """A ``RetryEvent`` made by hand (a test, a caller of the handler) may give ``headers`` only."""
    headers = m.request_headers(event(headers={"a": b"1", "n": None}), group="g")
    assert json.loads(headers["Rebound-Header-List"]) == [["a", "MQ=="], ["n", None]]
    assert json.loads(m.request_headers(event(), group="g")["Rebound-Header-List"]) == []


def test_repeated_header_names_keep_every_value_in_the_records_order() -> None:
    """Kafka allows a name more than once and keeps the order: the request carries every header as sent."""
    pairs = (("dup", b"1"), ("nil", None), ("dup", b"\x00\xff"), ("empty", b""), ("dup", b""), ("nil", None))
    headers = m.request_headers(event(headers=dict(pairs), header_list=pairs), group="g")
    assert m.decode_record_headers(headers[m.HEADERS]) == list(pairs)


def test_a_header_section_over_the_bound_is_refused_before_any_io_naming_its_size() -> None:
    big = {f"h{i}": b"z" * 1024 for i in range(200)}  # ~270 KB in one Rebound-Header-List line
    with pytest.raises(HttpHeadersTooLarge) as refused:
        m.request_headers(event(headers=big), group="g")
    assert isinstance(refused.value, PermanentError)
    message = str(refused.value)
    assert "REBOUND_HTTP_MAX_HEADER_BYTES=8192" in message and "Rebound-Header-List" in message
    size = int(message.split(" bytes", maxsplit=1)[0].rsplit(" ", 1)[1])
    assert size > 270_000
    assert refused.value.size_bytes == size and refused.value.limit_bytes == 8192


def test_the_header_bound_counts_the_whole_section_authorization_included() -> None:
    headers = m.request_headers(event(), group="g", authorization="Bearer t")
    size = m.header_section_bytes(headers)
    assert size == sum(len(f"{name}: {value}\r\n".encode()) for name, value in headers.items())
    assert headers["Authorization"] == "Bearer t"
    assert m.request_headers(event(), group="g", authorization="Bearer t", max_bytes=size) == headers
    with pytest.raises(HttpHeadersTooLarge, match=f"{size} bytes"):
        m.request_headers(event(), group="g", authorization="Bearer t", max_bytes=size - 1)
    with pytest.raises(HttpHeadersTooLarge, match=f"{size + 100} bytes"):
        m.request_headers(event(), group="g", authorization="Bearer t" + "t" * 100, max_bytes=size)


@given(
    tier=st.none() | st.text(min_size=1, max_size=12),
    token=st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FF), max_size=20),
    pairs=st.lists(st.tuples(st.text(max_size=8), st.none() | st.binary(max_size=20)), max_size=4),
)
def test_the_header_bound_counts_bytes_on_the_wire_whatever_the_text(
    tier: str | None, token: str, pairs: list[tuple[str, bytes | None]]
) -> None:
    """Prepared once per handler (``RequestHeaders``), the bound still counts each value's UTF-8 bytes: a tier or
    token outside ASCII included."""
    authorization = f"Bearer {token}" if token else None
    one = event(tier=tier, headers=dict(pairs), header_list=tuple(pairs))
    headers = m.request_headers(one, group="g", authorization=authorization, max_bytes=10**6)
    size = m.header_section_bytes(headers)
    prepared = m.RequestHeaders(group="g", authorization=authorization, max_bytes=size)
    assert prepared.of(one) == headers
    with pytest.raises(HttpHeadersTooLarge, match=f"would be {size} bytes"):
        m.RequestHeaders(group="g", authorization=authorization, max_bytes=size - 1).of(one)


def test_the_header_bound_is_a_setting() -> None:
    assert load_settings().http_max_header_bytes == m.DEFAULT_MAX_HEADER_BYTES == 8192
    assert load_settings(http_max_header_bytes=65536).http_max_header_bytes == 65536
    with pytest.raises(ConfigurationError, match="REBOUND_HTTP_MAX_HEADER_BYTES"):
        load_settings(http_max_header_bytes=100)


# ------------------------------------------------------------------------------------------------ status mapping

DEFAULT = m.DEFAULT_STATUS_MAPPING
S, R, OV, P = (
    m.StatusOutcome.SUCCEEDED,
    m.StatusOutcome.RETRYABLE,
    m.StatusOutcome.OVERLOADED,
    m.StatusOutcome.PERMANENT,
)


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, S), (201, S), (204, S), (299, S),
        (408, R), (425, R), (500, R), (502, R), (504, R), (599, R),
        (429, OV), (503, OV),
        (400, P), (401, P), (403, P), (404, P), (409, P), (422, P), (499, P),
        (100, R), (301, P), (302, P), (304, P), (307, P), (308, P),
    ],
)  # fmt: skip
def test_default_status_mapping(status: int, outcome: m.StatusOutcome) -> None:
    assert DEFAULT.outcome(status) is outcome


def test_redirects_are_permanent_by_default_and_configurable() -> None:
    """A 3xx is not followed (a POST is not re-sent elsewhere silently): a wrong URL fails fast, not after the whole
    retry sequence; a deployment that answers 307 while moving can list it as retryable."""
    assert m.DEFAULT_PERMANENT_STATUSES == "3xx,4xx"
    mapping = m.StatusMapping.parse("307,5xx", "3xx,4xx")
    assert (mapping.outcome(307), mapping.outcome(301)) == (R, P)
    assert load_settings().http_status_mapping.outcome(302) is P


def test_an_exact_status_beats_a_class_and_lists_are_configurable() -> None:
    mapping = m.StatusMapping.parse("409,5xx", "4xx,501,503")
    assert mapping.outcome(409) is R
    assert mapping.outcome(501) is P
    assert mapping.outcome(503) is P  # made permanent by the operator: no overload either
    assert mapping.outcome(500) is R
    assert mapping.outcome(429) is P


@pytest.mark.parametrize(
    ("retryable", "permanent", "fragment"),
    [
        ("5xx,abc", "4xx", "'abc' is not an HTTP status"),
        ("600", "4xx", "'600' is not an HTTP status"),
        ("5xx", "204", "a 2xx status always means success"),
        ("5xx", "2xx", "a 2xx status always means success"),
        ("404,5xx", "404", "both list 404"),
        ("4xx", "4xx", "both list 4xx"),
    ],
)
def test_bad_status_lists_are_refused_at_start_up(retryable: str, permanent: str, fragment: str) -> None:
    with pytest.raises(ConfigurationError, match="REBOUND_HTTP_") as refused:
        load_settings(http_retryable_statuses=retryable, http_permanent_statuses=permanent)
    assert fragment in str(refused.value)


# ------------------------------------------------------------------------------------------------- Retry-After


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("120", 120.0),
        (" 0 ", 0.0),
        (email.utils.formatdate(NOW_MS / 1000 + 90, usegmt=True), 90.0),
        (email.utils.formatdate(NOW_MS / 1000 - 90, usegmt=True), 0.0),
        ("Sun, 06 Nov 1994 08:49:37 GMT", 0.0),
        (None, None),
        ("", None),
        ("-5", None),
        ("1.5", None),
        ("soon", None),
        ("Sun, 06 Nov 1994 25:99:99 GMT", None),
        ("\u00b2", None),  # a superscript two: str.isdigit() says yes, int() refuses it
        ("\u0661\u0662", None),  # Arabic-Indic digits
        ("Sun Nov  6 08:49:37 1994", 0.0),  # asctime, which RFC 9110 section 5.6.7 requires recipients to accept
        ("Sunday, 06-Nov-94 08:49:37 GMT", 0.0),  # RFC 850, obsolete and accepted too
    ],
)
def test_retry_after_seconds_or_http_date(value: str | None, seconds: float | None) -> None:
    assert m.parse_retry_after(value, now_ms=NOW_MS) == seconds


def test_retry_after_in_asctime_is_read_as_gmt() -> None:
    later = datetime.datetime.fromtimestamp(NOW_MS / 1000 + 90, tz=datetime.UTC)
    asctime = f"{later:%a %b} {later.day:2d} {later:%H:%M:%S %Y}"
    assert m.parse_retry_after(asctime, now_ms=NOW_MS) == 90.0


@given(st.text(max_size=40))
def test_retry_after_never_raises(value: str) -> None:
    seconds = m.parse_retry_after(value, now_ms=NOW_MS)
    assert seconds is None or seconds >= 0


# --------------------------------------------------------------------------------------------------- the message


def test_the_error_message_is_the_bodys_first_bytes_on_one_line() -> None:
    assert m.status_message(503, "Service Unavailable", b"queue full\r\nretry later") == (
        "HTTP 503 Service Unavailable: queue full retry later"
    )
    assert m.status_message(404, None, b"") == "HTTP 404"
    long = "é" * 200  # 400 bytes: cut at 256 without half a character
    text = m.error_text(long.encode())
    assert text == "é" * 128
    assert m.error_text(b"\xff\xfebad") == "\ufffd\ufffdbad"


def test_the_header_bound_counts_every_value_of_a_repeated_name() -> None:
    """The bound measures what is sent: ten values of one name are ten values, though ``headers`` keeps one."""
    pairs = tuple(("dup", bytes([i]) * 600) for i in range(10))
    one = m.request_headers(event(headers=dict(pairs)), group="g")  # the mapping alone: one 600-byte value
    with pytest.raises(HttpHeadersTooLarge) as refused:
        m.request_headers(event(headers=dict(pairs), header_list=pairs), group="g")
    assert m.header_section_bytes(one) < 8192 < refused.value.size_bytes
    assert refused.value.size_bytes - m.header_section_bytes(one) == len('["dup",""],') * 9 + 800 * 9
