"""A null header value (legal in Kafka) is kept null, never turned into ``b""``, wherever Rebound reads, stores,
signs or replays headers; state written before it was kept (``b""`` then) reads back as it was written."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agents.records import header_pairs
from rebound import headers as h
from rebound.errors import InvalidRetryHeadersError
from rebound.records import estimated_record_bytes
from rebound.replay import outgoing_headers, plan_replay
from rebound.signing import signed_republish_headers, verify_republished
from rebound.state import PendingMessage, encode_payload

NULL_AND_EMPTY: tuple[h.Header, ...] = (("nil", None), ("empty", b""), ("nil", None))


def test_faust_headers_keep_a_null_value_as_none() -> None:
    # Faust hands an agent aiokafka's tuple of pairs (None for a null value), or a mapping on other paths.
    assert header_pairs((("nil", None), ("empty", b""))) == [("nil", None), ("empty", b"")]
    assert header_pairs({"nil": None, b"raw": b"x"}) == [("nil", None), ("raw", b"x")]


def test_a_null_header_value_survives_the_payload_round_trip(make_pending) -> None:
    entry = make_pending(headers=NULL_AND_EMPTY)
    stripped = replace(entry, key=None, value=None, headers=(), has_payload=False)
    assert stripped.with_payload(entry.encode_payload()).headers == NULL_AND_EMPTY
    assert PendingMessage.from_entry(entry.encode_entry(), with_payload=True).headers == NULL_AND_EMPTY
    assert PendingMessage.from_dict(entry.to_dict(with_payload=True)).headers == NULL_AND_EMPTY


def test_state_written_before_null_values_were_kept_reads_back_as_written(make_pending) -> None:
    # The old reader turned a null into b"" before storing it: such a payload holds b"" and stays b"".
    old = encode_payload(b"k", b"v", [("nil", b""), ("empty", b"")])
    entry = replace(make_pending(), has_payload=False)
    assert entry.with_payload(old).headers == (("nil", b""), ("empty", b""))
    # The framing is the old one: a null value takes the absent length a null key or value always had.
    assert encode_payload(None, None, [("nil", None)]).endswith(b"\x00\x03nil" + b"\xff\xff\xff\xff")
    assert encode_payload(None, None, [("nil", b"")]).endswith(b"\x00\x03nil" + b"\x00\x00\x00\x00")


def test_a_null_header_value_is_sized_as_kafka_writes_it() -> None:
    # Length -1, one varint byte, like an empty value's length 0 but without content.
    assert estimated_record_bytes(b"k", b"v", [("n", None)]) == estimated_record_bytes(b"k", b"v", [("n", b"")])
    assert estimated_record_bytes(b"k", b"v", [("n", None)]) < estimated_record_bytes(b"k", b"v", [("n", b"x")])


def test_retry_and_failed_headers_keep_a_user_null_value(make_provenance) -> None:
    provenance = make_provenance()
    forward = h.retry_headers(
        NULL_AND_EMPTY,
        provenance=provenance,
        group="g",
        attempt=1,
        due_at_ms=provenance.first_received_at_ms + 5,
        error_class="E",
        error_message="m",
    )
    assert h.without_rebound_headers(forward) == list(NULL_AND_EMPTY)
    assert h.parse_retry_headers(forward, main_topics=["items"]).attempt == 1
    failed = h.failed_headers(
        forward, provenance=provenance, group="g", attempt=1, reason="exhausted", error_class="E", error_message="m"
    )
    assert h.without_rebound_headers(failed) == list(NULL_AND_EMPTY)


def test_a_null_rebound_header_is_invalid_not_empty(make_provenance) -> None:
    provenance = make_provenance()
    forward = h.retry_headers(
        [],
        provenance=provenance,
        group="g",
        attempt=1,
        due_at_ms=provenance.first_received_at_ms,
        error_class="E",
        error_message="m",
    )
    nulled = [(name, None if name == h.ATTEMPT else value) for name, value in forward]
    with pytest.raises(InvalidRetryHeadersError, match=r"'rebound\.attempt' is null"):
        h.parse_retry_headers(nulled, main_topics=["items"])


def test_a_null_header_value_signs_unlike_an_empty_one(make_provenance) -> None:
    provenance = make_provenance(topic="items")

    def signed(own: list[h.Header]) -> list[h.Header]:
        return signed_republish_headers(
            own,
            key=b"k",
            value=b"v",
            provenance=provenance,
            group="g",
            attempt=1,
            tier="5m",
            secret="s",
            expires_at_ms=2**40,
        )

    def verifies(pairs: list[h.Header]) -> bool:
        found = verify_republished(pairs, key=b"k", value=b"v", secret="s", main_topics=["items"], group="g", now_ms=1)
        return found is not None

    with_null = signed([("nil", None)])
    assert verifies(with_null)
    as_empty = [("nil", b"") if name == "nil" else (name, value) for name, value in with_null]
    assert not verifies(as_empty)  # a null turned empty on the way is a different record
    with_empty = signed([("nil", b"")])
    assert verifies(with_empty)
    assert dict(with_empty)["rebound.signature"] != dict(with_null)["rebound.signature"]


def test_a_replayed_dead_letter_keeps_a_null_header_value(make_provenance) -> None:
    assert outgoing_headers([("nil", None), (h.REASON, b"x")], 0) == [("nil", None), (h.REDRIVE_COUNT, b"1")]
    provenance = make_provenance(topic="items")
    failed = h.failed_headers(
        list(NULL_AND_EMPTY),
        provenance=provenance,
        group="g",
        attempt=0,
        reason="permanent",
        error_class="E",
        error_message="m",
    )
    plan = plan_replay(failed_topic="items.failed", main_topic="items", key=b"k", value=b"v", headers=failed)
    assert plan.headers == [*NULL_AND_EMPTY, (h.REDRIVE_COUNT, b"1")]
