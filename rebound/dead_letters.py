"""What a dead letter looks like, decided before it is sent: the record itself, or smaller stand-ins that still fit.

A dead letter must never be dropped for being too large: that would lose the message. Each stand-in keeps the
provenance headers (topic, partition, offset of the original), so the original can still be found on its main topic.
Transport tries them in order and moves to the next one only if the broker itself refuses a record as too large
(its ``max.message.bytes`` can be smaller than the producer's limit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rebound.headers import Header, Provenance, failed_headers
from rebound.records import OutgoingRecord
from rebound.routing import Reason

LEFT_OUT_MESSAGE_CHARS = 1024
SHORT_MESSAGE_CHARS = 128


@dataclass(frozen=True, slots=True)
class DeadLetterRecord:
    """One way to send a dead letter, with the reason and message it carries."""

    record: OutgoingRecord
    reason: str
    error_message: str


def dead_letter_records(
    *,
    key: bytes | None,
    value: bytes | None,
    own_headers: Sequence[Header],
    provenance: Provenance,
    group: str,
    attempt: int,
    reason: str,
    error_class: str,
    error_message: str,
    trace: str | None,
    limit: int,
) -> list[DeadLetterRecord]:
    """The dead letter and its stand-ins that fit ``limit`` bytes, most complete first; never empty.

    In order: byte-exact with the error trace; without the trace; with the error message cut short, then left out; then, as ``too-large``, without
    the value; without the record's own headers; without the key. The last one is small enough for any limit
    Rebound accepts (``REBOUND_PRODUCER_MAX_REQUEST_BYTES`` is at least 1 KiB), so it is always kept.
    """

    def build(
        why: str, message: str, *, with_trace: bool, with_value: bool, with_headers: bool, with_key: bool
    ) -> DeadLetterRecord:
        headers = failed_headers(
            own_headers if with_headers else [],
            provenance=provenance,
            group=group,
            attempt=attempt,
            reason=why,
            error_class=error_class,
            error_message=message,
            trace=trace if with_trace else None,
        )
        record = OutgoingRecord(key if with_key else None, value if with_value else None, tuple(headers))
        return DeadLetterRecord(record, why, message)

    size = "null" if value is None else f"{len(value)} bytes"
    left_out = f"value of {size} left out; was {reason}: {error_class}: {error_message}"[:LEFT_OUT_MESSAGE_CHARS]
    too_large = str(Reason.TOO_LARGE)
    short = error_message[:SHORT_MESSAGE_CHARS]
    candidates = [
        build(reason, error_message, with_trace=True, with_value=True, with_headers=True, with_key=True),
        build(reason, error_message, with_trace=False, with_value=True, with_headers=True, with_key=True),
        build(reason, short, with_trace=False, with_value=True, with_headers=True, with_key=True),
        build(reason, "", with_trace=False, with_value=True, with_headers=True, with_key=True),
        build(too_large, left_out, with_trace=False, with_value=False, with_headers=True, with_key=True),
        build(too_large, left_out, with_trace=False, with_value=False, with_headers=False, with_key=True),
        build(too_large, left_out[:256], with_trace=False, with_value=False, with_headers=False, with_key=False),
    ]
    fitting = [candidate for candidate in candidates[:-1] if candidate.record.fits(limit)]
    return [*fitting, candidates[-1]]
