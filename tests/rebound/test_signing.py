"""HMAC-signed retry headers for the re-publish mode: genuine records verify, anything touched is a fresh delivery."""

from __future__ import annotations

import pytest

from rebound import headers as h
from rebound.errors import InvalidRetryHeadersError
from rebound.signing import EXPIRES_AT, SIGNATURE, TIER, signed_republish_headers, verify_republished

SECRET = "s3cret"
GROUP = "rebound"
TOPICS = ("items", "orders")
USER = [("trace-id", b"abc")]
VALUE = b'{"type": "UpdateItem"}'
NOW = 1_700_000_000_000
TTL = 60_000


@pytest.fixture
def provenance(make_provenance):
    return make_provenance(topic="items", partition=1, offset=500, timestamp_ms=900, first_received_at_ms=1_000)


def sign(provenance, *, key=b"item-1", value=VALUE, own=USER, attempt=2, tier="5m", secret=SECRET, group=GROUP):
    return signed_republish_headers(
        list(own),
        key=key,
        value=value,
        provenance=provenance,
        group=group,
        attempt=attempt,
        tier=tier,
        secret=secret,
        expires_at_ms=NOW + TTL,
    )


def verify(pairs, *, key=b"item-1", value=VALUE, secret=SECRET, topics=TOPICS, group=GROUP, now=NOW):
    return verify_republished(pairs, key=key, value=value, secret=secret, main_topics=topics, group=group, now_ms=now)


def replaced(pairs, name, value):
    return [(n, value if n == name else v) for n, v in pairs]


def test_signed_headers_verify(provenance) -> None:
    pairs = sign(provenance)
    assert verify(pairs) == (provenance, 2, "5m")
    assert pairs[: len(USER)] == USER
    values = dict(pairs)
    assert values[TIER] == b"5m"
    assert len(values[SIGNATURE]) == 64  # hex SHA-256
    assert values[SIGNATURE].decode("ascii") == values[SIGNATURE].decode("ascii").lower()


def test_null_key_signs_and_verifies(provenance) -> None:
    assert verify(sign(provenance, key=None), key=None) == (provenance, 2, "5m")


def test_signing_replaces_earlier_rebound_headers(provenance) -> None:
    first = sign(provenance, attempt=1)
    second = sign(provenance, own=first, attempt=2, tier="30m")
    names = [name for name, _ in second if name.startswith("rebound.")]
    assert len(names) == len(set(names))
    assert verify(second) == (provenance, 2, "30m")


def test_signing_without_secret_refused(provenance) -> None:
    with pytest.raises(InvalidRetryHeadersError, match="REBOUND_HEADER_SECRET"):
        sign(provenance, secret="")


def test_deterministic_signature(provenance) -> None:
    assert dict(sign(provenance))[SIGNATURE] == dict(sign(provenance))[SIGNATURE]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (h.ATTEMPT, b"1"),
        (h.ATTEMPT, b"3"),
        (h.ORIGINAL_TOPIC, b"orders"),  # a configured topic, so only the signature can catch it
        (h.ORIGINAL_PARTITION, b"0"),
        (h.ORIGINAL_OFFSET, b"501"),
        (h.ORIGINAL_TIMESTAMP, b"901"),
        (h.FIRST_RECEIVED_AT, b"999"),
        (h.GROUP, b"other"),
        (TIER, b"1h"),
        (EXPIRES_AT, str(NOW + 10 * TTL).encode()),
        ("trace-id", b"abd"),  # the user's own headers are covered too
    ],
)
def test_tampered_signed_header_rejected(provenance, name, value) -> None:
    assert verify(replaced(sign(provenance), name, value)) is None


def test_changed_key_rejected(provenance) -> None:
    pairs = sign(provenance, key=b"item-1")
    assert verify(pairs, key=b"item-2") is None
    assert verify(pairs, key=None) is None
    assert verify(pairs, key=b"") is None
    assert verify(sign(provenance, key=None), key=b"item-1") is None


def test_null_key_and_lookalike_key_do_not_share_a_signature(provenance) -> None:
    assert verify(sign(provenance, key=None), key=b"\x00<null>") is None


def test_signature_removed_rejected(provenance) -> None:
    pairs = [(n, v) for n, v in sign(provenance) if n != SIGNATURE]
    assert verify(pairs) is None


def test_signature_altered_rejected(provenance) -> None:
    pairs = sign(provenance)
    signature = dict(pairs)[SIGNATURE]
    flipped = (b"0" if signature[:1] != b"0" else b"1") + signature[1:]
    assert verify(replaced(pairs, SIGNATURE, flipped)) is None
    assert verify(replaced(pairs, SIGNATURE, signature.upper())) is None


def test_wrong_secret_rejected(provenance) -> None:
    assert verify(sign(provenance, secret="other")) is None
    assert verify(sign(provenance), secret="other") is None
    assert verify(sign(provenance), secret="") is None


def test_wrong_group_rejected(provenance) -> None:
    # signed by another group sharing the secret: genuine signature, but not ours
    pairs = sign(provenance, group="other-group")
    assert verify(pairs, group="other-group") == (provenance, 2, "5m")
    assert verify(pairs, group=GROUP) is None


def test_unconfigured_topic_rejected_even_if_signed(make_provenance) -> None:
    provenance = make_provenance(topic="payments", first_received_at_ms=1_000)
    pairs = sign(provenance)
    assert verify(pairs, topics=("payments",)) == (provenance, 2, "5m")
    assert verify(pairs) is None


def test_duplicated_signed_header_rejected(provenance) -> None:
    pairs = sign(provenance)
    assert verify([*pairs, (h.ATTEMPT, b"2")]) is None
    assert verify([*pairs, (SIGNATURE, dict(pairs)[SIGNATURE])]) is None


def test_attempt_zero_never_trusted(provenance) -> None:
    assert verify(sign(provenance, attempt=0)) is None


def test_unsigned_retry_headers_are_not_trusted(provenance) -> None:
    forged = h.retry_headers(
        USER,
        provenance=provenance,
        group=GROUP,
        attempt=5,
        due_at_ms=2_000,
        error_class="x",
        error_message="y",
    )
    assert verify(forged) is None
    assert verify(USER) is None
    assert verify([]) is None


def test_header_added_after_signing_rejected(provenance) -> None:
    assert verify([*sign(provenance), ("added-later", b"1")]) is None


def test_changed_value_rejected(provenance) -> None:
    pairs = sign(provenance)
    assert verify(pairs, value=b'{"type": "DeleteItem"}') is None
    assert verify(pairs, value=None) is None
    assert verify(pairs, value=b"") is None
    assert verify(sign(provenance, value=None), value=None) == (provenance, 2, "5m")
    assert verify(sign(provenance, value=None), value=b"") is None


def test_signature_expires(provenance) -> None:
    pairs = sign(provenance)
    assert verify(pairs, now=NOW + TTL) == (provenance, 2, "5m")
    assert verify(pairs, now=NOW + TTL + 1) is None


def test_signed_record_cannot_be_replayed_with_a_later_expiry(provenance) -> None:
    later = replaced(sign(provenance), EXPIRES_AT, str(NOW + 100 * TTL).encode())
    assert verify(later, now=NOW + 2 * TTL) is None


def test_verify_accepts_a_one_shot_iterable(provenance) -> None:
    assert verify(iter(sign(provenance))) == (provenance, 2, "5m")
