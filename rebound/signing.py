"""Signed retry headers for the re-publish release mode.

In that mode a due message goes back to its main topic, where anyone could also write ``rebound.*`` headers. The main
agent trusts a record's attempt and provenance only if ``rebound.signature`` is a valid HMAC (shared secret
``REBOUND_HEADER_SECRET``) over them; anything else is a fresh first delivery.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from rebound import headers as h
from rebound.errors import InvalidRetryHeadersError

SIGNATURE = "rebound.signature"
TIER = "rebound.tier"
_SIGNED = (
    h.ORIGINAL_TOPIC,
    h.ORIGINAL_PARTITION,
    h.ORIGINAL_OFFSET,
    h.ORIGINAL_TIMESTAMP,
    h.FIRST_RECEIVED_AT,
    h.GROUP,
    h.ATTEMPT,
    TIER,
)


def _digest(values: dict[str, bytes], key: bytes | None, secret: str) -> bytes:
    mac = hmac.new(secret.encode("utf-8"), digestmod=hashlib.sha256)
    # A null key and every byte key must sign differently, so the key is tagged and length-prefixed.
    if key is None:
        mac.update(b"\x00")
    else:
        mac.update(b"\x01" + len(key).to_bytes(4, "big") + key)
    for name in _SIGNED:
        value = values.get(name, b"")
        mac.update(len(value).to_bytes(4, "big") + value)
    return mac.hexdigest().encode("ascii")


def signed_republish_headers(
    own: list[tuple[str, bytes]],
    *,
    key: bytes | None,
    provenance: h.Provenance,
    group: str,
    attempt: int,
    tier: str,
    secret: str,
) -> list[tuple[str, bytes]]:
    if not secret:
        raise InvalidRetryHeadersError("re-publish mode needs REBOUND_HEADER_SECRET to sign its headers")
    pairs = [
        *h.without_rebound_headers(own),
        *h.provenance_headers(provenance, group),
        (h.ATTEMPT, h.decimal(attempt)),
        (TIER, tier.encode("utf-8")),
    ]
    return [*pairs, (SIGNATURE, _digest(dict(pairs), key, secret))]


def verify_republished(
    pairs: Iterable[tuple[str, bytes]], *, key: bytes | None, secret: str, main_topics: Iterable[str], group: str
) -> tuple[h.Provenance, int, str] | None:
    """Provenance, attempt and tier of a genuine re-published record; None for anything unsigned or forged."""
    if not secret:
        return None
    pairs = list(pairs)  # read more than once below
    try:
        values = h.last_values(pairs)
    except InvalidRetryHeadersError:
        return None
    signature = values.get(SIGNATURE)
    if signature is None or not hmac.compare_digest(signature, _digest(values, key, secret)):
        return None
    try:
        parsed = h.parse_retry_headers(
            [*pairs, (h.DUE_AT, values.get(h.FIRST_RECEIVED_AT, b""))] if h.DUE_AT not in values else pairs,
            main_topics=main_topics,
        )
    except InvalidRetryHeadersError:
        return None
    if parsed.group != group:
        return None
    return parsed.provenance, parsed.attempt, values.get(TIER, b"").decode("utf-8", errors="replace")
