"""Offsets for times that do not depend on the broker being right: check its answer, search when it is wrong.

Spark's ``startingTimestamp``/``endingTimestamp`` (and the by-partition variants) mean "the first offset whose record
timestamp is at or after *t*", which Kafka answers with ListOffsets by timestamp. Some Kafka-compatible brokers get
that wrong (the embedded Tansu broker answers offset 0 for every time), and a wrong start or end offset silently
reads the wrong records. So the answer is checked against the records themselves, and replaced by a binary search
over offsets (about log2(n) single-record fetches per partition) when it does not hold.

The functions here only see a ``fetch`` callable (the first record at or after an offset, below the partition's end),
so they are unit-tested with a list standing in for the log.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Stamp:
    """A record's offset and its timestamp (epoch milliseconds)."""

    offset: int
    timestamp: int


FirstRecordAt = Callable[[int], Stamp | None]
"""``fetch(offset)``: the first record with an offset at or above ``offset`` and below the end, or ``None``."""


@dataclass(frozen=True)
class Lookup:
    """The resolved offset for a time (``None``: no record at or after it) and whether the broker had it wrong."""

    offset: int | None
    corrected: bool


BACKWARD_PROBES = 24
"""How many fetches :func:`answer_holds` spends looking for the record before an answer across an offset gap."""


def answer_holds(target: int, answer: int | None, first: int, end: int, fetch: FirstRecordAt) -> bool:
    """Whether the broker's answer is the first offset of a record with ``timestamp >= target``.

    An offset holds when its record is at or after the time and the previous *record* is before the time (or there
    is none: the answer is the first record). The previous record is not always at ``answer - 1``: a transaction
    marker or a compacted-away record can sit there, so it is looked for backwards (see :func:`record_before`).
    Treating such a gap as "does not hold" would let the search override a right answer and, with out-of-order
    timestamps, find a later crossing and so skip records of the window. "No such record" holds when the last
    record is before the time. Only a search that runs out of probes counts as not holding.
    """
    if answer is None:
        if end <= first:
            return True
        conclusive, last = record_before(end, first, fetch)
        return conclusive and (last is None or last.timestamp < target)
    if answer < first or answer >= end:
        return False
    found = fetch(answer)
    if found is None or found.offset != answer or found.timestamp < target:
        return False
    if answer == first:
        return True
    conclusive, before = record_before(answer, first, fetch)
    return conclusive and (before is None or before.timestamp < target)


def record_before(offset: int, first: int, fetch: FirstRecordAt) -> tuple[bool, Stamp | None]:
    """The last record below ``offset`` (``None``: there is none from ``first`` on), found with at most
    :data:`BACKWARD_PROBES` fetches; the first value is ``False`` when they did not suffice.

    Probes step back by doubling distances until one lands on a record below ``offset``, then a binary search
    between that record and ``offset`` finds the last one, so a gap of g offsets costs about 2 log2(g) fetches.
    """
    fetches = 0
    step, known = 1, None  # known: a record below offset; low..offset holds no record above it yet unsearched
    high = offset
    while known is None:
        probe = max(first, offset - step)
        found = fetch(probe)
        fetches += 1
        if found is not None and found.offset < offset:
            known = found
        elif probe == first:
            return True, None
        else:
            high = probe  # nothing in [probe, offset) but the gap
            step *= 2
        if fetches >= BACKWARD_PROBES and known is None:
            return False, None
    # The last record below offset is in [known.offset, high): narrow down with first-record-at fetches.
    low = known.offset + 1
    while low < high:
        if fetches >= BACKWARD_PROBES:
            return False, None
        middle = (low + high) // 2
        found = fetch(middle)
        fetches += 1
        if found is not None and found.offset < high:
            known, low = found, found.offset + 1
        else:
            high = middle
    return True, known


def search(target: int, first: int, end: int, fetch: FirstRecordAt) -> int | None:
    """The offset of the first record with ``timestamp >= target`` in ``[first, end)``, by binary search.

    Exact when timestamps do not decrease along the offsets (CreateTime set by well-behaved producers, or
    LogAppendTime). With out-of-order timestamps it finds *a* boundary where the time is crossed, which is why the
    broker's answer is kept whenever it holds.
    """
    low, high = first, end
    found_at_high: Stamp | None = None
    while low < high:
        middle = (low + high) // 2
        found = fetch(middle)
        if found is None or found.timestamp >= target:
            high = middle
            found_at_high = found
        else:
            low = min(found.offset + 1, high)  # skips any gap after the record as well
    # low == high: the first record at or after it (found_at_high, None when high is the end) is the answer.
    return found_at_high.offset if found_at_high is not None else None


def offset_for_time(
    target: int,
    answer: int | None,
    first: int,
    end: int,
    fetch: FirstRecordAt,
    fetch_past_end: FirstRecordAt | None = None,
) -> Lookup:
    """The broker's answer when it holds, otherwise the searched one (``corrected`` when they differ).

    An answer at or past ``end`` names a record that arrived after the end offsets were taken (a time close to
    now). It is right, and resolves to ``end``, when ``fetch_past_end(answer)`` (a fetch not bounded by ``end``)
    finds that record at or after the time and no record below ``end`` is: the offsets of a batch or a stream's
    start must not go past the end offsets they were planned with, and the records from ``end`` on are read next.
    """
    if answer is not None and answer >= end and fetch_past_end is not None:
        late = fetch_past_end(answer)
        arrived_since = late is not None and late.offset == answer and late.timestamp >= target
        if arrived_since and answer_holds(target, None, first, end, fetch):
            return Lookup(end, corrected=False)
    if answer_holds(target, answer, first, end, fetch):
        return Lookup(answer, corrected=False)
    found = search(target, first, end, fetch)
    return Lookup(found, corrected=found != answer)
