"""Where a partition's commits can go: the end of the run of offsets that are done, from the committed offset on.

An offset is done when its record was acknowledged, or when it lies in a confirmed gap (an offset range that holds no
record to hand over: a transaction's marker, an aborted transaction, a range read twice and found empty). Gaps stay
intervals here: an aborted transaction can span millions of offsets, and listing them one by one cost 0.6 s of the
event loop and 200 MB per commit attempt for five million.
"""

from __future__ import annotations

from collections.abc import Sequence


def run_end(acked: Sequence[int], gaps: Sequence[tuple[int, int]], start: int) -> tuple[int, int]:
    """The first offset from ``start`` on that is neither acknowledged nor in a gap, and how many of ``acked`` lie
    below it (they are committed with the run).

    ``acked`` is sorted, its first entry at or after ``start``; ``gaps`` are half-open ``(begin, end)`` ranges
    sorted by ``begin``, none beginning before ``start``. Time grows with the entries, not with the offsets a gap
    spans."""
    end = start
    taken = 0
    next_gap = 0
    while True:
        if taken < len(acked) and acked[taken] <= end:
            end = max(end, acked[taken] + 1)
            taken += 1
        elif next_gap < len(gaps) and gaps[next_gap][0] <= end:
            end = max(end, gaps[next_gap][1])
            next_gap += 1
        else:
            return end, taken
