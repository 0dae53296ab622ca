"""Where each partition's reading stands, so a record is never skipped without the broker confirming it is not there.

Faust's consumer takes any jump in offsets for a compacted-topic gap and commits across it. On Rebound's topics a jump
is far more often Faust's own doing: a fetched batch abandoned when the flow stops or the generation changes, a
message whose hand-off to the stream was cancelled, a read offset written back after a seek. The records in between
were fetched and dropped, and committing across them loses them (seen in chaos runs: hundreds of offsets per
hand-over). So a jump is first read again from the expected offset; only when a batch fetched after that seek jumps
the same way does the broker really hold nothing there (transaction markers, compaction, retention), and the range
becomes a gap that may be committed across. A range the broker's own answer showed empty (``broker_gap``: the offsets
aiokafka stepped over while decoding one fetched partition, transaction markers and aborted transactions) is taken at
once: no record handed over can have been dropped there, so it costs no second read.

Pure bookkeeping, no Faust: the consumer asks ``check`` for each record and reports seeks, deliveries and revocations.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field

MAX_BROKER_GAPS = 256
"""Broker-confirmed empty ranges kept per partition (the newest; those below the commit floor go first): a few per
batch at most, one per transaction marker, and only those ahead of reading matter."""


class Verdict(enum.Enum):
    DELIVER = "deliver"
    """The expected record."""
    UNPOSITIONED = "unpositioned"
    """Nothing says where reading starts (assigned, not yet sought): find the group's committed offset, seek there and
    drop this one. Taking the first record fetched as the start lost records in chaos runs: the fetcher can be past
    records dropped during recovery, and committing from there passes over them."""
    STALE = "stale"
    """Read before (a batch from before a seek, or the rest of a batch already being read again): drop it."""
    READ_AGAIN = "read-again"
    """Records are missing before this one: seek back to ``next_offset`` and drop this one."""
    CONFIRMED_GAP = "confirmed-gap"
    """Read again and still missing, or shown empty by the broker's answer (:meth:`ReadCursors.broker_gap`): the
    broker holds nothing in between; deliver, the range may be committed over."""


@dataclass
class _Cursor:
    next_offset: int | None = None
    commit_floor: int | None = None
    """Where committing may start when Faust does not know the committed offset: always a position the broker gave
    (a seek to the committed offset or the log's start, or a commit that went through), never a record's offset."""
    epoch: int = 0
    read_again_in_batch: int | None = None
    read_again_from: int | None = None
    fetcher_ahead_seen: tuple[int, int] | None = None
    broker_gaps: list[tuple[int, int]] = field(default_factory=list)
    """Sorted, disjoint, inclusive ranges the broker's answers showed empty (``ReadCursors.broker_gap``)."""


class ReadCursors:
    """One cursor per partition whose records must all be seen, in order, before their offsets are committed."""

    def __init__(self) -> None:
        self._cursors: dict[Hashable, _Cursor] = {}
        self.records_read_again = 0
        self.gaps_confirmed = 0
        self.broker_gaps_taken = 0
        """Jumps taken without reading again, because the broker's own answer showed the range empty."""

    def positioned(self, tp: Hashable, offset: int | None) -> None:
        """The consumer was sought to ``offset`` (``None``: unknown); whatever was in flight is from before."""
        cursor = self._cursors.setdefault(tp, _Cursor())
        cursor.next_offset = offset
        cursor.commit_floor = offset
        cursor.epoch += 1
        cursor.read_again_in_batch = cursor.read_again_from = None
        cursor.fetcher_ahead_seen = None

    def forget(self, tp: Hashable) -> None:
        """The partition was revoked: a later assignment starts from a seek."""
        cursor = self._cursors.pop(tp, None)
        if cursor is not None:
            # a delivery still awaiting must not count against a new cursor for the same partition
            self._cursors[tp] = _Cursor(epoch=cursor.epoch + 1)

    def check(self, tp: Hashable, offset: int, batch: int) -> Verdict:
        cursor = self._cursors.get(tp)
        if cursor is None or cursor.next_offset is None:
            return Verdict.UNPOSITIONED
        if offset == cursor.next_offset:
            return Verdict.DELIVER
        if offset < cursor.next_offset:
            return Verdict.STALE
        if _covers(cursor.broker_gaps, cursor.next_offset, offset - 1):
            self.broker_gaps_taken += 1
            return Verdict.CONFIRMED_GAP
        if cursor.read_again_from == cursor.next_offset and cursor.read_again_in_batch is not None:
            if batch == cursor.read_again_in_batch:
                return Verdict.STALE
            return Verdict.CONFIRMED_GAP
        return Verdict.READ_AGAIN

    def read_again(self, tp: Hashable, batch: int) -> int:
        """Note the seek back made for ``batch`` and answer where it goes."""
        cursor = self._cursors[tp]
        assert cursor.next_offset is not None  # check() answers READ_AGAIN only with a known position
        cursor.read_again_in_batch = batch
        cursor.read_again_from = cursor.next_offset
        self.records_read_again += 1
        return cursor.next_offset

    def fetcher_ahead(
        self, tp: Hashable, position: int | None, *, batches_whole: bool
    ) -> tuple[Verdict, int, int] | None:
        """What to do when the fetcher, between batches, is past records never handed over (None: it is not).

        Faust stops yielding a batch when the flow stops or the generation changes; usually a seek to the committed
        offsets follows, but a partition's last records dropped that way would otherwise wait for the next record
        (whose jump reads them again) or the next rebalance. ``(READ_AGAIN, next, position)``: seek back to ``next``.
        The same distance found again after that seek is the broker's (aiokafka steps over a transaction's control
        record at the end of a partition): ``(CONFIRMED_GAP, first, last)``, and the cursor moves to ``position``,
        but only if every batch since that seek was yielded whole (``batches_whole``): a batch cut short by the flow
        stopping or the generation changing drops records the same way. A distance the broker's answer showed empty
        (:meth:`broker_gap`) is a ``CONFIRMED_GAP`` at once.
        """
        cursor = self._cursors.get(tp)
        if cursor is None or cursor.next_offset is None or position is None or position <= cursor.next_offset:
            return None
        first = cursor.next_offset
        shown_empty = _covers(cursor.broker_gaps, first, position - 1)  # a marker at the end, not a batch cut short
        if shown_empty:
            self.broker_gaps_taken += 1
        if shown_empty or (batches_whole and cursor.fetcher_ahead_seen == (first, position)):
            cursor.fetcher_ahead_seen = None
            cursor.next_offset = position
            cursor.read_again_in_batch = cursor.read_again_from = None
            self.gaps_confirmed += 1
            return Verdict.CONFIRMED_GAP, first, position - 1
        cursor.fetcher_ahead_seen = (first, position)
        cursor.read_again_in_batch = cursor.read_again_from = None
        self.records_read_again += 1
        return Verdict.READ_AGAIN, first, position

    def committed(self, tp: Hashable, offset: int) -> None:
        """A commit went through: committing may start there even when Faust forgets it (revocation)."""
        cursor = self._cursors.get(tp)
        if cursor is not None:
            cursor.commit_floor = offset
            cursor.broker_gaps = [(first, last) for first, last in cursor.broker_gaps if last >= offset]

    def shown_empty(self, tp: Hashable, first: int, last: int) -> bool:
        """Whether the broker's answers showed ``first`` to ``last`` empty (see :meth:`broker_gap`)."""
        cursor = self._cursors.get(tp)
        return cursor is not None and _covers(cursor.broker_gaps, first, last)

    def broker_gap(self, tp: Hashable, first: int, last: int) -> None:
        """The broker's answer for ``tp`` held no record to hand over from ``first`` to ``last`` (inclusive): offsets
        aiokafka stepped over while decoding one fetched partition (control batches, aborted transactions). A jump over
        such a range is taken without reading again; kept across seeks (it stays true), dropped at revocation."""
        if last < first:
            return
        cursor = self._cursors.setdefault(tp, _Cursor())
        cursor.broker_gaps = _merged([*cursor.broker_gaps, (first, last)])[-MAX_BROKER_GAPS:]

    def gap(self, tp: Hashable, offset: int) -> tuple[int, int]:
        """The confirmed missing range before ``offset``, inclusive bounds."""
        cursor = self._cursors[tp]
        assert cursor.next_offset is not None
        self.gaps_confirmed += 1
        return cursor.next_offset, offset - 1

    def epoch(self, tp: Hashable) -> int:
        cursor = self._cursors.get(tp)
        return cursor.epoch if cursor is not None else 0

    def delivered(self, tp: Hashable, offset: int, epoch: int) -> bool:
        """The stream took ``offset``; ignored (False) when a seek or revocation came while it was handed over."""
        cursor = self._cursors.setdefault(tp, _Cursor())
        if cursor.epoch != epoch:
            return False
        cursor.next_offset = offset + 1
        cursor.read_again_in_batch = cursor.read_again_from = None
        cursor.fetcher_ahead_seen = None
        return True

    def not_handed_over(self, tp: Hashable) -> None:
        """A record of ``tp`` was fetched but its hand-over failed (the stream queues cleared under it, the flow
        stopped): that says nothing about what the broker holds.

        Reading again is armed by a jump, and a second read that jumps the same way confirms a gap: a failed hand-over
        of the expected record in between would look just like it (the record read, then "missing" again), and the gap
        would be committed over, the record never run. So the evidence gathered so far is dropped, and a gap needs two
        more reads of the broker's answer that both skip the offset. Where commits may start (``commit_floor``) and
        where reading stands (``next_offset``) stay: the record is read again from there.
        """
        cursor = self._cursors.get(tp)
        if cursor is not None:
            cursor.read_again_in_batch = cursor.read_again_from = None
            cursor.fetcher_ahead_seen = None

    def next_offset(self, tp: Hashable) -> int | None:
        cursor = self._cursors.get(tp)
        return cursor.next_offset if cursor is not None else None

    def commit_floor(self, tp: Hashable) -> int | None:
        cursor = self._cursors.get(tp)
        return cursor.commit_floor if cursor is not None else None


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Inclusive ranges sorted and joined where they overlap or touch (an aborted batch and its marker are one)."""
    merged: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged


def _covers(ranges: list[tuple[int, int]], first: int, last: int) -> bool:
    """Whether one of the merged ``ranges`` holds all of ``first`` to ``last``."""
    return any(start <= first and last <= end for start, end in ranges)
