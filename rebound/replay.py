"""Replaying one dead letter: which records may go back to their main topic, and with which headers.

The rules are the redrive job's (``pipeline/jobs/redrive.py``), for one record an operator names: the key and value
go back byte-exact, the user's own headers are kept in order, every ``rebound.*`` header is dropped (the main agent
sees a fresh message) and ``rebound.redrive-count`` is set to the previous count + 1. A record already redriven
``max_redrives`` times is refused, so a poison message cannot loop for ever. The target is the main topic the failed
topic belongs to, from the configuration; the record's ``rebound.original-topic`` header must name that same topic.

Refused, with a reason an operator can act on: a record that is not a Rebound dead letter, one of another consumer
group (``<main>.failed`` is shared by every Rebound app consuming ``<main>``, and a record sent back to ``<main>``
is processed again by every group: refused unless forced), one whose value was left out (reason ``too-large``: the
original is only on its main topic, at the offset its headers give), a tombstone, and one over the redrive cap. Pure (no Faust, no Kafka).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rebound import headers as h
from rebound.errors import InvalidRetryHeadersError
from rebound.routing import Reason

DEFAULT_MAX_REDRIVES = 3
"""The redrive job's ``--max-redrives`` default; a replay may set a lower cap, never a higher one."""

NOT_A_DEAD_LETTER = "not-a-dead-letter"
OTHER_GROUP = "other-group"
VALUE_LEFT_OUT = "value-left-out"
TOMBSTONE = "tombstone"
REDRIVE_CAP = "redrive-cap"


class ReplayRefused(Exception):
    """The record may not be replayed; ``code`` is one of the constants above."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def redrive_count(headers: Iterable[h.Header]) -> int:
    """The record's ``rebound.redrive-count`` (the last one, as Kafka's ``lastHeader`` reads); 0 when absent or not
    a decimal, as the redrive job's ``cast("int")`` reads it."""
    count = 0
    for name, value in headers:
        if name == h.REDRIVE_COUNT:
            text = (value or b"").strip()
            count = int(text) if text.isdigit() and len(text) <= h.MAX_DECIMAL_DIGITS else 0
    return count


def outgoing_headers(headers: Iterable[h.Header] | None, previous_count: int) -> list[h.Header]:
    """User headers kept in order, every ``rebound.*`` header dropped, the redrive count set to previous + 1."""
    own = [(name, value) for name, value in (headers or []) if not name.startswith(h.PREFIX)]
    return [*own, (h.REDRIVE_COUNT, str(previous_count + 1).encode("ascii"))]


def _text(values: Mapping[str, bytes | None], name: str) -> str | None:
    raw = values.get(name)
    return None if raw is None else raw.decode("utf-8", errors="backslashreplace")


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """What to send: the main topic, the original key and value, the outgoing headers; and what the record said."""

    target_topic: str
    target_partition: int | None
    key: bytes | None
    value: bytes
    headers: list[h.Header]
    redrive_count: int
    """The count the replayed record carries (previous + 1)."""
    reason: str
    original: dict[str, Any]


def plan_replay(
    *,
    failed_topic: str,
    main_topic: str,
    key: bytes | None,
    value: bytes | None,
    headers: Iterable[h.Header],
    max_redrives: int = DEFAULT_MAX_REDRIVES,
    partitions: int | None = None,
    group: str | None = None,
    force_other_group: bool = False,
) -> ReplayPlan:
    """Decide one replay of a record read from ``failed_topic`` (the failed topic of ``main_topic``); raises
    :class:`ReplayRefused`.

    The replayed record goes to the original partition when its headers name one the topic has (``partitions``):
    where the key's other records are, whatever partitioner produced them. With ``group`` (this app's consumer group),
    a record whose ``rebound.group`` names another group is refused (``other-group``) unless ``force_other_group``;
    a record without that header is not refused for it.
    """
    pairs = list(headers)
    try:
        values = h.last_values(pairs)
    except InvalidRetryHeadersError as exc:
        raise ReplayRefused(NOT_A_DEAD_LETTER, f"not a Rebound dead letter: {exc}") from exc
    reason = _text(values, h.REASON)
    original_topic = _text(values, h.ORIGINAL_TOPIC)
    if reason is None or original_topic is None:
        missing = h.REASON if reason is None else h.ORIGINAL_TOPIC
        raise ReplayRefused(NOT_A_DEAD_LETTER, f"not a Rebound dead letter: it has no {missing} header")
    if original_topic != main_topic:
        raise ReplayRefused(
            NOT_A_DEAD_LETTER,
            f"not a dead letter of {main_topic!r}: its {h.ORIGINAL_TOPIC} is {original_topic!r} "
            f"(records of {failed_topic!r} go back to {main_topic!r} only)",
        )
    record_group = _text(values, h.GROUP)
    if group is not None and record_group is not None and record_group != group and not force_other_group:
        raise ReplayRefused(
            OTHER_GROUP,
            f"a dead letter of consumer group {record_group!r}, not of this app's {group!r}: {main_topic!r} is read by "
            "every group consuming it, so replaying it makes each of them process it again "
            "(force with ?force_other_group=true, or --force-other-group)",
        )
    value = h.restore_null_value(value, pairs)
    original_partition = _decimal_or_none(values.get(h.ORIGINAL_PARTITION))
    original: dict[str, Any] = {
        "topic": original_topic,
        "partition": original_partition,
        "offset": _decimal_or_none(values.get(h.ORIGINAL_OFFSET)),
        "group": record_group,
        "attempt": _decimal_or_none(values.get(h.ATTEMPT)),
        "error_class": _text(values, h.ERROR_CLASS),
    }
    if value is None and reason == str(Reason.TOO_LARGE):
        raise ReplayRefused(
            VALUE_LEFT_OUT,
            "the dead letter's value was left out (reason too-large): replay the original from "
            f"{original_topic} partition {original['partition']} offset {original['offset']} instead",
        )
    if value is None:
        raise ReplayRefused(TOMBSTONE, "the dead letter is a tombstone (null value): there is nothing to replay")
    previous = redrive_count(pairs)
    if previous >= max_redrives:
        raise ReplayRefused(
            REDRIVE_CAP,
            f"already redriven {previous} time(s); the cap is {max_redrives} (a poison message must not loop for ever)",
        )
    partition = original_partition
    if partitions is None or partition is None or partition >= partitions:
        partition = None
    return ReplayPlan(
        target_topic=main_topic,
        target_partition=partition,
        key=key,
        value=value,
        headers=outgoing_headers(pairs, previous),
        redrive_count=previous + 1,
        reason=reason,
        original=original,
    )


def _decimal_or_none(raw: bytes | None) -> int | None:
    if raw is None or not raw.isdigit() or len(raw) > h.MAX_DECIMAL_DIGITS:
        return None
    return int(raw)


def parse_max_redrives(text: str | None) -> int:
    """The ``max_redrives`` a request asks for: at most the default (a replay may only be stricter); raises
    ``ValueError`` with a message otherwise."""
    if text is None or text == "":
        return DEFAULT_MAX_REDRIVES
    if not text.isdigit():
        raise ValueError(f"max_redrives must be a whole number from 0 to {DEFAULT_MAX_REDRIVES}, not {text!r}")
    value = int(text)
    if value > DEFAULT_MAX_REDRIVES:
        raise ValueError(f"max_redrives may lower the cap of {DEFAULT_MAX_REDRIVES}, not raise it (asked {value})")
    return value
