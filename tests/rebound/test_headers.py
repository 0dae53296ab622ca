"""The rebound.* headers: written once per hop, bounded, UTF-8 decimal; read strictly."""

from __future__ import annotations

from collections import Counter

import pytest

from rebound import headers as h
from rebound.errors import InvalidRetryHeadersError

MAIN_TOPICS = ("items", "orders")
USER = [("trace-id", b"abc"), ("content-type", b"application/json")]


@pytest.fixture
def provenance(make_provenance):
    return make_provenance(topic="items", partition=3, offset=1234, timestamp_ms=999, first_received_at_ms=1_000)


def build_retry(provenance, own=USER, **overrides):
    args = {
        "provenance": provenance,
        "group": "rebound",
        "attempt": 2,
        "due_at_ms": 301_000,
        "error_class": "app.errors.RetryableError",
        "error_message": "item 7 not there yet",
    }
    args.update(overrides)
    return h.retry_headers(own, **args)


def build_failed(provenance, own=USER, **overrides):
    args = {
        "provenance": provenance,
        "group": "rebound",
        "attempt": 6,
        "reason": "exhausted",
        "error_class": "app.errors.RetryableError",
        "error_message": "gave up",
    }
    args.update(overrides)
    return h.failed_headers(own, **args)


def rebound_names(pairs) -> Counter[str]:
    return Counter(name for name, _ in pairs if name.startswith(h.PREFIX))


def test_retry_headers_values(provenance) -> None:
    pairs = build_retry(provenance)
    values = dict(pairs)
    assert values[h.ORIGINAL_TOPIC] == b"items"
    assert values[h.ORIGINAL_PARTITION] == b"3"
    assert values[h.ORIGINAL_OFFSET] == b"1234"
    assert values[h.ORIGINAL_TIMESTAMP] == b"999"
    assert values[h.FIRST_RECEIVED_AT] == b"1000"
    assert values[h.GROUP] == b"rebound"
    assert values[h.ATTEMPT] == b"2"
    assert values[h.DUE_AT] == b"301000"
    assert values[h.ERROR_CLASS] == b"app.errors.RetryableError"
    assert values[h.ERROR_MESSAGE] == b"item 7 not there yet"
    assert h.REASON not in values
    assert h.ERROR_TRACE not in values
    assert pairs[: len(USER)] == USER  # user headers first, untouched and in order


def test_header_names_match_the_contract() -> None:
    assert [h.ATTEMPT, h.DUE_AT, h.FIRST_RECEIVED_AT, h.ORIGINAL_TOPIC] == [
        "rebound.attempt",
        "rebound.due-at",
        "rebound.first-received-at",
        "rebound.original-topic",
    ]
    assert [h.ORIGINAL_PARTITION, h.ORIGINAL_OFFSET, h.ORIGINAL_TIMESTAMP, h.GROUP] == [
        "rebound.original-partition",
        "rebound.original-offset",
        "rebound.original-timestamp",
        "rebound.group",
    ]
    assert [h.ERROR_CLASS, h.ERROR_MESSAGE, h.REASON] == [
        "rebound.error-class",
        "rebound.error-message",
        "rebound.reason",
    ]


def test_numeric_values_are_utf8_decimal_strings(make_provenance) -> None:
    big = make_provenance(partition=0, offset=2**62, timestamp_ms=1_700_000_000_123, first_received_at_ms=1)
    values = dict(build_retry(big, due_at_ms=1_700_000_300_123))
    for name in (h.ORIGINAL_PARTITION, h.ORIGINAL_OFFSET, h.ORIGINAL_TIMESTAMP, h.FIRST_RECEIVED_AT, h.DUE_AT):
        raw = values[name]
        assert raw.isdigit()
        assert raw.decode("utf-8") == str(int(raw))
    assert values[h.ORIGINAL_OFFSET] == str(2**62).encode()
    assert values[h.DUE_AT] == b"1700000300123"


def test_each_rebound_header_set_once_across_hops(provenance) -> None:
    hop1 = build_retry(provenance, attempt=1, due_at_ms=301_000)
    hop2 = build_retry(provenance, own=hop1, attempt=2, due_at_ms=601_000, error_message="second")
    hop3 = build_failed(provenance, own=hop2, attempt=3)
    for pairs in (hop1, hop2):
        counts = rebound_names(pairs)
        assert set(counts.values()) == {1}
        assert len(counts) == 10
    counts = rebound_names(hop3)
    assert set(counts.values()) == {1}
    assert h.REASON in counts
    assert h.DUE_AT not in counts  # the failed record has no due time, even though the input carried one
    assert dict(hop2)[h.ATTEMPT] == b"2"
    assert dict(hop2)[h.DUE_AT] == b"601000"
    assert dict(hop2)[h.ERROR_MESSAGE] == b"second"
    assert dict(hop3)[h.ATTEMPT] == b"3"
    # user headers survive every hop exactly once
    for pairs in (hop1, hop2, hop3):
        assert [pair for pair in pairs if not pair[0].startswith(h.PREFIX)] == USER


def test_stale_foreign_rebound_headers_are_dropped(provenance) -> None:
    own = [*USER, ("rebound.reason", b"permanent"), ("rebound.signature", b"x"), ("rebound.attempt", b"99")]
    pairs = build_retry(provenance, own=own, attempt=1)
    values = dict(pairs)
    assert h.REASON not in values
    assert "rebound.signature" not in values
    assert values[h.ATTEMPT] == b"1"
    assert rebound_names(pairs)[h.ATTEMPT] == 1


def test_failed_headers_values(provenance) -> None:
    pairs = build_failed(provenance, reason="permanent", trace="Traceback...\nValueError: bad")
    values = dict(pairs)
    assert values[h.REASON] == b"permanent"
    assert values[h.ATTEMPT] == b"6"
    assert values[h.ERROR_TRACE] == b"Traceback...\nValueError: bad"
    assert values[h.ORIGINAL_OFFSET] == b"1234"
    assert pairs[: len(USER)] == USER


def test_error_message_truncated_without_splitting_characters(provenance) -> None:
    values = dict(build_retry(provenance, error_message="é" * 2000))
    raw = values[h.ERROR_MESSAGE]
    assert len(raw) == h.MAX_ERROR_MESSAGE_BYTES == 1024
    assert raw.decode("utf-8") == "é" * 512
    # an odd offset would cut through the last "é": that partial character is dropped, not emitted
    odd = dict(build_retry(provenance, error_message="x" + "é" * 2000))[h.ERROR_MESSAGE]
    assert len(odd) == 1023
    assert odd.decode("utf-8") == "x" + "é" * 511


def test_short_error_message_kept_whole(provenance) -> None:
    message = "naïve ✓ " * 10
    assert dict(build_retry(provenance, error_message=message))[h.ERROR_MESSAGE] == message.encode()


def test_error_class_truncated(provenance) -> None:
    raw = dict(build_retry(provenance, error_class="A" * 1000))[h.ERROR_CLASS]
    assert raw == b"A" * h.MAX_ERROR_CLASS_BYTES


def test_trace_keeps_its_end_within_limit(provenance) -> None:
    trace = "é" * 3000 + "x"  # 6001 bytes: the last 4096 start in the middle of an "é"
    raw = dict(build_failed(provenance, trace=trace))[h.ERROR_TRACE]
    assert len(raw) <= h.MAX_ERROR_TRACE_BYTES == 4096
    assert len(raw) == 4095
    assert raw.decode("utf-8") == "é" * 2047 + "x"
    even = dict(build_failed(provenance, trace="é" * 3000))[h.ERROR_TRACE]
    assert even.decode("utf-8") == "é" * 2048


def test_truncate_utf8_helper() -> None:
    assert h.truncate_utf8("abc", 10) == b"abc"
    assert h.truncate_utf8("€€", 5) == "€".encode()  # 3-byte char: 5 bytes hold one whole, not 1.67
    assert h.truncate_utf8("€€", 2) == b""
    assert h.truncate_utf8("\ud800", 10) == b"?"  # a lone surrogate cannot fail a send


def test_parse_round_trip(provenance) -> None:
    parsed = h.parse_retry_headers(build_retry(provenance), main_topics=MAIN_TOPICS)
    assert parsed == h.RetryHeaders(
        provenance=provenance,
        attempt=2,
        due_at_ms=301_000,
        group="rebound",
        error_class="app.errors.RetryableError",
        error_message="item 7 not there yet",
    )


def test_parse_round_trip_after_several_hops(provenance) -> None:
    hop1 = build_retry(provenance, attempt=1, due_at_ms=5_000)
    hop2 = build_retry(provenance, own=hop1, attempt=2, due_at_ms=9_000, error_message="é" * 2000)
    parsed = h.parse_retry_headers(hop2, main_topics=MAIN_TOPICS)
    assert parsed.attempt == 2
    assert parsed.due_at_ms == 9_000
    assert parsed.provenance == provenance
    assert parsed.error_message == "é" * 512


def test_parse_error_fields_optional(provenance) -> None:
    pairs = [(n, v) for n, v in build_retry(provenance) if n not in {h.ERROR_CLASS, h.ERROR_MESSAGE}]
    parsed = h.parse_retry_headers(pairs, main_topics=MAIN_TOPICS)
    assert parsed.error_class == ""
    assert parsed.error_message == ""


def test_duplicate_user_headers_are_allowed(provenance) -> None:
    pairs = [("x", b"1"), ("x", b"2"), *build_retry(provenance, own=[])]
    assert h.parse_retry_headers(pairs, main_topics=MAIN_TOPICS).attempt == 2


def replaced(pairs, name, value):
    return [(n, value if n == name else v) for n, v in pairs]


REQUIRED = list(h.REQUIRED_RETRY_HEADERS)
NUMERIC = [h.ORIGINAL_PARTITION, h.ORIGINAL_OFFSET, h.ORIGINAL_TIMESTAMP, h.FIRST_RECEIVED_AT, h.ATTEMPT, h.DUE_AT]


@pytest.mark.parametrize("name", REQUIRED)
def test_parse_rejects_missing_header(provenance, name) -> None:
    pairs = [(n, v) for n, v in build_retry(provenance) if n != name]
    with pytest.raises(InvalidRetryHeadersError, match="missing"):
        h.parse_retry_headers(pairs, main_topics=MAIN_TOPICS)


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("bad", [b"", b"-1", b"-5", b"12a", b" 12", b"1.5", b"0x10", b"1e3", "٣".encode(), b"9" * 21])
def test_parse_rejects_non_decimal(provenance, name, bad) -> None:
    with pytest.raises(InvalidRetryHeadersError, match=name):
        h.parse_retry_headers(replaced(build_retry(provenance), name, bad), main_topics=MAIN_TOPICS)


def test_parse_accepts_twenty_digits(provenance) -> None:
    pairs = replaced(build_retry(provenance), h.ORIGINAL_OFFSET, b"9" * 20)
    assert h.parse_retry_headers(pairs, main_topics=MAIN_TOPICS).provenance.offset == 10**20 - 1


def test_parse_rejects_attempt_zero(provenance) -> None:
    with pytest.raises(InvalidRetryHeadersError, match="below 1"):
        h.parse_retry_headers(replaced(build_retry(provenance), h.ATTEMPT, b"0"), main_topics=MAIN_TOPICS)


@pytest.mark.parametrize("name", [*REQUIRED, h.ERROR_CLASS, h.ERROR_MESSAGE])
def test_parse_rejects_duplicated_rebound_header(provenance, name) -> None:
    pairs = build_retry(provenance)
    pairs.append((name, dict(pairs)[name]))  # even an identical copy is a forgery signal
    with pytest.raises(InvalidRetryHeadersError, match="more than once"):
        h.parse_retry_headers(pairs, main_topics=MAIN_TOPICS)


@pytest.mark.parametrize("name", [h.ORIGINAL_TOPIC, h.GROUP, h.ERROR_CLASS, h.ERROR_MESSAGE])
def test_parse_rejects_non_utf8(provenance, name) -> None:
    with pytest.raises(InvalidRetryHeadersError, match="not UTF-8"):
        h.parse_retry_headers(replaced(build_retry(provenance), name, b"\xff\xfe"), main_topics=MAIN_TOPICS)


def test_parse_rejects_overlong_text(provenance) -> None:
    with pytest.raises(InvalidRetryHeadersError, match="longer than"):
        h.parse_retry_headers(replaced(build_retry(provenance), h.GROUP, b"g" * 250), main_topics=MAIN_TOPICS)
    with pytest.raises(InvalidRetryHeadersError, match="longer than"):
        h.parse_retry_headers(replaced(build_retry(provenance), h.ERROR_MESSAGE, b"m" * 1025), main_topics=MAIN_TOPICS)


@pytest.mark.parametrize("topic", [b"payments", b"items.retry.5m", b"items.failed", b"ITEMS", b""])
def test_parse_rejects_unconfigured_original_topic(provenance, topic) -> None:
    with pytest.raises(InvalidRetryHeadersError, match="not a configured main topic"):
        h.parse_retry_headers(replaced(build_retry(provenance), h.ORIGINAL_TOPIC, topic), main_topics=MAIN_TOPICS)


def test_parse_accepts_any_configured_main_topic(make_provenance) -> None:
    provenance = make_provenance(topic="orders", first_received_at_ms=1_000)
    parsed = h.parse_retry_headers(build_retry(provenance), main_topics=iter(MAIN_TOPICS))
    assert parsed.provenance.topic == "orders"


def test_parse_rejects_due_before_first_received(provenance) -> None:
    with pytest.raises(InvalidRetryHeadersError, match="below 1000"):
        h.parse_retry_headers(build_retry(provenance, due_at_ms=999), main_topics=MAIN_TOPICS)
    # due exactly at first receipt is the earliest valid value
    assert h.parse_retry_headers(build_retry(provenance, due_at_ms=1_000), main_topics=MAIN_TOPICS).due_at_ms == 1_000


def test_without_rebound_headers() -> None:
    pairs = [("a", b"1"), ("rebound.attempt", b"2"), ("reboundx", b"3"), ("Rebound.attempt", b"4")]
    assert h.without_rebound_headers(pairs) == [("a", b"1"), ("reboundx", b"3"), ("Rebound.attempt", b"4")]


def test_redrive_count_is_carried_through_every_hop_exactly_once() -> None:
    origin = h.Provenance("items", 0, 1, 1, 1)
    incoming = [("a", b"1"), (h.REDRIVE_COUNT, b"2"), (h.ATTEMPT, b"9")]
    retried = h.retry_headers(
        incoming, provenance=origin, group="g", attempt=1, due_at_ms=5, error_class="E", error_message="m"
    )
    failed = h.failed_headers(
        retried, provenance=origin, group="g", attempt=2, reason="exhausted", error_class="E", error_message="m"
    )
    for pairs in (retried, failed):
        assert [value for name, value in pairs if name == h.REDRIVE_COUNT] == [b"2"]
        assert [value for name, value in pairs if name == h.ATTEMPT] != [b"9"]
