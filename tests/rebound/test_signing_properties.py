"""Property tests of the signed re-publish headers: genuine records verify, any single-byte change is refused.

The signing scheme is being extended (from the provenance headers, the attempt and the tier to also the value, the
user's headers and an expiry). These properties hold for both: ``sign``/``verify`` below pass the value, the expiry
and the verifier's clock only when the public functions take them, and the properties about what only the extended
scheme covers are skipped under the narrow one.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rebound import headers as h
from rebound import signing
from rebound.errors import InvalidRetryHeadersError
from rebound.signing import SIGNATURE, TIER, signed_republish_headers, verify_republished

_SIGN_PARAMETERS = inspect.signature(signed_republish_headers).parameters
_VERIFY_PARAMETERS = inspect.signature(verify_republished).parameters
COVERS_CONTENT = "value" in _SIGN_PARAMETERS  # the value and the user's headers are signed
EXPIRES_AT: str | None = getattr(signing, "EXPIRES_AT", None) if "expires_at_ms" in _SIGN_PARAMETERS else None

# The headers whose bytes the narrow scheme vouches for (the extended one covers every header).
SIGNED = (
    h.ORIGINAL_TOPIC,
    h.ORIGINAL_PARTITION,
    h.ORIGINAL_OFFSET,
    h.ORIGINAL_TIMESTAMP,
    h.FIRST_RECEIVED_AT,
    h.GROUP,
    h.ATTEMPT,
    TIER,
    SIGNATURE,
    *([EXPIRES_AT] if EXPIRES_AT else []),
)
INT64 = 2**63 - 1
NOW_MS = 1_700_000_000_000
MAIN_TOPICS = ("items", "orders", "pay.retry.x")

# A secret comes from the environment; lone surrogates are what Python makes of non-UTF-8 bytes there, and only the
# never-raises property below draws them.
secrets = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40)
any_secrets = st.lists(st.one_of(st.characters(), st.sampled_from(["\ud800", "\udcff"])), max_size=40).map("".join)
keys = st.one_of(st.none(), st.binary(max_size=64))
values = st.one_of(st.none(), st.binary(max_size=256))
groups = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=60)
tiers = st.one_of(
    st.sampled_from(["5m", "30m", "1h", "1500ms"]), st.text(st.characters(exclude_categories=("Cs",)), min_size=1)
)


def _first_of_each_rebound_name(pairs: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    # A repeated rebound.* header on input is covered by the header properties; here it would only repeat that.
    seen: set[str] = set()
    kept = []
    for name, value in pairs:
        if name.startswith(h.PREFIX):
            if name in seen:
                continue
            seen.add(name)
        kept.append((name, value))
    return kept


own_headers = st.lists(
    st.tuples(
        st.one_of(st.text(max_size=20), st.sampled_from([h.REDRIVE_COUNT, h.ATTEMPT, SIGNATURE, TIER, "trace-id"])),
        st.binary(max_size=32),
    ),
    max_size=6,
).map(_first_of_each_rebound_name)


@st.composite
def records(draw: Any) -> dict[str, Any]:
    """Everything one re-published record is signed over, and what the verifying worker is configured with."""
    return {
        "own": draw(own_headers),
        "key": draw(keys),
        "value": draw(values),
        "provenance": h.Provenance(
            topic=draw(st.sampled_from(MAIN_TOPICS)),
            partition=draw(st.integers(0, 2**31 - 1)),
            offset=draw(st.integers(0, INT64)),
            timestamp_ms=draw(st.integers(0, INT64)),
            first_received_at_ms=draw(st.integers(0, INT64)),
        ),
        "group": draw(groups),
        "attempt": draw(st.integers(1, 10_000)),
        "tier": draw(tiers),
        "secret": draw(secrets),
        "expires_at_ms": NOW_MS + draw(st.integers(0, 30 * 86_400_000)),
    }


def sign(record: dict[str, Any]) -> list[tuple[str, bytes]]:
    extra = {name: record[name] for name in ("value", "expires_at_ms") if name in _SIGN_PARAMETERS}
    return signed_republish_headers(
        list(record["own"]),
        key=record["key"],
        provenance=record["provenance"],
        group=record["group"],
        attempt=record["attempt"],
        tier=record["tier"],
        secret=record["secret"],
        **extra,
    )


def verify(pairs: list[tuple[str, bytes]], record: dict[str, Any], **overrides: Any) -> Any:
    args = {
        "key": record["key"],
        "value": record["value"],
        "secret": record["secret"],
        "main_topics": MAIN_TOPICS,
        "group": record["group"],
        "now_ms": NOW_MS,
    }
    args.update(overrides)
    return verify_republished(pairs, **{name: arg for name, arg in args.items() if name in _VERIFY_PARAMETERS})


def one_byte_changes(raw: bytes, draw: Any) -> bytes:
    """``raw`` with exactly one byte flipped, inserted or removed."""
    how = draw(st.sampled_from(["flip", "insert", "delete"] if raw else ["insert"]))
    if how == "insert":
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at:]
    at = draw(st.integers(0, len(raw) - 1))
    if how == "delete":
        return raw[:at] + raw[at + 1 :]
    return raw[:at] + bytes([raw[at] ^ draw(st.integers(1, 255))]) + raw[at + 1 :]


def covered(pairs: list[tuple[str, bytes]]) -> list[int]:
    """Positions of the headers the scheme vouches for."""
    return [i for i, (name, _) in enumerate(pairs) if COVERS_CONTENT or name in SIGNED]


@given(record=records())
def test_a_signed_record_verifies_to_what_was_signed(record: dict[str, Any]) -> None:
    pairs = sign(record)
    assert verify(pairs, record) == (record["provenance"], record["attempt"], record["tier"])
    names = [name for name, _ in pairs if name.startswith(h.PREFIX)]
    assert len(names) == len(set(names))
    assert all(name in names for name in SIGNED)
    # The user's own headers are still first and in order.
    users = [(n, v) for n, v in record["own"] if not n.startswith(h.PREFIX)]
    assert [(n, v) for n, v in pairs if not n.startswith(h.PREFIX)] == users


@given(record=records(), data=st.data())
def test_any_single_byte_change_of_a_signed_header_value_is_refused(record: dict[str, Any], data: Any) -> None:
    pairs = sign(record)
    index = data.draw(st.sampled_from(covered(pairs)))
    name, value = pairs[index]
    tampered = list(pairs)
    tampered[index] = (name, one_byte_changes(value, data.draw))
    assert verify(tampered, record) is None, f"{name}: {value!r} -> {tampered[index][1]!r} still verifies"


@given(record=records(), data=st.data())
def test_any_single_byte_change_of_a_signed_header_name_is_refused(record: dict[str, Any], data: Any) -> None:
    pairs = sign(record)
    index = data.draw(st.sampled_from(covered(pairs)))
    name, value = pairs[index]
    changed = one_byte_changes(name.encode("utf-8"), data.draw).decode("utf-8", errors="replace")
    tampered = list(pairs)
    tampered[index] = (changed, value)
    assert verify(tampered, record) is None, f"{name!r} renamed {changed!r} still verifies"


@given(record=records(), data=st.data())
def test_any_single_byte_change_of_the_key_is_refused(record: dict[str, Any], data: Any) -> None:
    pairs = sign(record)
    key = record["key"]
    other = b"" if key is None else one_byte_changes(key, data.draw)
    assert verify(pairs, record, key=other) is None
    if key is not None:
        assert verify(pairs, record, key=None) is None


@pytest.mark.skipif(not COVERS_CONTENT, reason="the narrow scheme does not sign the value")
@given(record=records(), data=st.data())
def test_any_single_byte_change_of_the_value_is_refused(record: dict[str, Any], data: Any) -> None:
    pairs = sign(record)
    value = record["value"]
    other = b"" if value is None else one_byte_changes(value, data.draw)
    assert verify(pairs, record, value=other) is None
    if value is not None:
        assert verify(pairs, record, value=None) is None


@pytest.mark.skipif(not COVERS_CONTENT, reason="the narrow scheme does not sign the user's headers")
@given(record=records(), name=st.text(max_size=12), value=st.binary(max_size=12), position=st.integers(0, 30))
def test_a_header_added_after_signing_is_refused(
    record: dict[str, Any], name: str, value: bytes, position: int
) -> None:
    pairs = sign(record)
    pairs.insert(min(position, len(pairs)), (name, value))
    assert verify(pairs, record) is None


@given(record=records(), name=st.sampled_from(SIGNED), position=st.integers(0, 30))
def test_a_repeated_signed_header_is_refused(record: dict[str, Any], name: str, position: int) -> None:
    pairs = sign(record)
    value = dict(pairs)[name]
    pairs.insert(min(position, len(pairs)), (name, value))  # even the same value, twice, is not what was signed
    assert verify(pairs, record) is None


@given(record=records(), name=st.sampled_from(SIGNED))
def test_a_missing_signed_header_is_refused(record: dict[str, Any], name: str) -> None:
    pairs = [(n, v) for n, v in sign(record) if n != name]
    assert verify(pairs, record) is None


@pytest.mark.skipif(EXPIRES_AT is None, reason="the narrow scheme has no expiry")
@given(record=records(), early=st.integers(0, 86_400_000), late=st.integers(1, 2**40))
def test_a_signature_is_trusted_until_it_expires_and_never_after(record: dict[str, Any], early: int, late: int) -> None:
    pairs = sign(record)
    expected = (record["provenance"], record["attempt"], record["tier"])
    assert verify(pairs, record, now_ms=record["expires_at_ms"] - early) == expected
    assert verify(pairs, record, now_ms=record["expires_at_ms"] + late) is None


@given(record=records(), other=secrets, group=groups)
def test_another_secret_group_or_topic_list_does_not_verify(record: dict[str, Any], other: str, group: str) -> None:
    pairs = sign(record)
    if other != record["secret"]:
        assert verify(pairs, record, secret=other) is None
    if group != record["group"]:
        assert verify(pairs, record, group=group) is None
    assert verify(pairs, record, secret="") is None
    unconfigured = [topic for topic in MAIN_TOPICS if topic != record["provenance"].topic]
    assert verify(pairs, record, main_topics=unconfigured) is None


@given(record=records())
def test_signing_without_a_secret_is_refused(record: dict[str, Any]) -> None:
    with pytest.raises(InvalidRetryHeadersError):
        sign({**record, "secret": ""})


carried_pairs = st.lists(
    st.tuples(st.one_of(st.sampled_from([*SIGNED, h.DUE_AT]), st.text(max_size=12)), st.binary(max_size=24)),
    max_size=12,
    unique_by=lambda pair: pair[0],  # a repeated name is refused before anything else: keep them apart
)


@given(pairs=carried_pairs, key=keys, value=values, secret=secrets, group=groups)
def test_verify_never_raises_on_anything_a_main_topic_can_carry(
    pairs: list[tuple[str, bytes]], key: bytes | None, value: bytes | None, secret: str, group: str
) -> None:
    """The main agent calls verify on every record before its own error handling: it must answer, never raise."""
    record = {"key": key, "value": value, "secret": secret, "group": group}
    result = verify(pairs, record)
    assert result is None or (result[0].topic in MAIN_TOPICS and result[1] >= 1)


@given(
    pairs=carried_pairs.map(lambda pairs: [*[p for p in pairs if p[0] != SIGNATURE], (SIGNATURE, b"0" * 64)]),
    secret=st.builds(lambda a, b: a + "\udcff" + b, secrets, st.text(max_size=4)),
)
def test_verify_never_raises_whatever_the_configured_secret(pairs: list[tuple[str, bytes]], secret: str) -> None:
    """REBOUND_HEADER_SECRET=$'\\xff...' reaches Python as a lone surrogate; settings accept it today."""
    assert verify(pairs, {"key": b"k", "value": b"v", "secret": secret, "group": "g"}) is None
