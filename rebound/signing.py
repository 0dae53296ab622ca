"""Signed retry headers for the re-publish release mode.

In that mode a due message goes back to its main topic, where anyone could also write ``rebound.*`` headers. The main
agent trusts a record's attempt and provenance only if ``rebound.signature`` is a valid HMAC (shared secret
``REBOUND_HEADER_SECRET``) over the key, the value and all the headers, and its ``rebound.signature-expires-at`` has
not passed (``REBOUND_REPUBLISH_TTL`` after it was signed); anything else is a fresh first delivery.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from rebound import headers as h
from rebound.errors import InvalidRetryHeadersError

SIGNATURE = "rebound.signature"
TIER = "rebound.tier"
EXPIRES_AT = "rebound.signature-expires-at"
# The signature itself, and the null-value marker transport adds after signing (the value it stands for is signed).
_UNSIGNED = frozenset({SIGNATURE, h.NULL_VALUE})
_NULL_LENGTH = b"\xff\xff\xff\xff"


def _digest(pairs: Iterable[h.Header], key: bytes | None, value: bytes | None, secret: str) -> bytes:
    """HMAC over the key, the value and every header in order (the signature itself aside).

    Everything is tagged and length-prefixed, so a null and an empty key or value sign differently and no two
    header lists can run together. Covering the value and the user's headers means a signed record cannot be
    re-used with other content; covering the expiry means it cannot be replayed for ever. A null header value signs
    as length ``0xFFFFFFFF`` with no bytes, which no real value has, so it never signs like an empty one.
    """
    mac = hmac.new(secret.encode("utf-8", "surrogateescape"), digestmod=hashlib.sha256)
    for field in (key, value):
        mac.update(b"\x00" if field is None else b"\x01" + len(field).to_bytes(4, "big") + field)
    for name, header_value in pairs:
        if name in _UNSIGNED:
            continue
        encoded = name.encode("utf-8")
        mac.update(len(encoded).to_bytes(4, "big") + encoded)
        mac.update(_NULL_LENGTH if header_value is None else len(header_value).to_bytes(4, "big") + header_value)
    return mac.hexdigest().encode("ascii")


def signed_republish_headers(
    own: list[h.Header],
    *,
    key: bytes | None,
    value: bytes | None,
    provenance: h.Provenance,
    group: str,
    attempt: int,
    tier: str,
    secret: str,
    expires_at_ms: int,
) -> list[h.Header]:
    if not secret:
        raise InvalidRetryHeadersError("re-publish mode needs REBOUND_HEADER_SECRET to sign its headers")
    pairs = [
        *h.without_rebound_headers(own),
        *h.provenance_headers(provenance, group),
        (h.ATTEMPT, h.decimal(attempt)),
        (TIER, tier.encode("utf-8")),
        (EXPIRES_AT, h.decimal(expires_at_ms)),
    ]
    return [*pairs, (SIGNATURE, _digest(pairs, key, value, secret))]


def verify_republished(
    pairs: Iterable[h.Header],
    *,
    key: bytes | None,
    value: bytes | None,
    secret: str,
    main_topics: Iterable[str],
    group: str,
    now_ms: int,
) -> tuple[h.Provenance, int, str] | None:
    """Provenance, attempt and tier of a genuine, unexpired re-published record; None for anything else."""
    if not secret:
        return None
    pairs = list(pairs)  # read more than once below
    try:
        values = h.last_values(pairs)
    except InvalidRetryHeadersError:
        return None
    signature = values.get(SIGNATURE)
    if signature is None or not hmac.compare_digest(signature, _digest(pairs, key, value, secret)):
        return None
    expires = values.get(EXPIRES_AT) or b""
    if not expires.isdigit() or len(expires) > h.MAX_DECIMAL_DIGITS or int(expires) < now_ms:
        return None
    try:
        parsed = h.parse_retry_headers(
            [*pairs, (h.DUE_AT, values.get(h.FIRST_RECEIVED_AT) or b"")] if h.DUE_AT not in values else pairs,
            main_topics=main_topics,
        )
    except InvalidRetryHeadersError:
        return None
    if parsed.group != group:
        return None
    return parsed.provenance, parsed.attempt, (values.get(TIER) or b"").decode("utf-8", errors="replace")
