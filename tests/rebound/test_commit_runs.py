"""The run of done offsets a commit moves over (``rebound/commit_runs.py``): gaps as intervals, never listed."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rebound.commit_runs import run_end


def listed_run_end(acked: list[int], gaps: list[tuple[int, int]], start: int) -> int:
    """The same answer with every gap listed offset by offset (what the consumer did before)."""
    done = set(acked)
    for begin, end in gaps:
        done.update(range(begin, end))
    offset = start
    while offset in done:
        offset += 1
    return offset


def test_a_gap_of_five_million_offsets_is_one_step() -> None:
    assert run_end([10, 5_000_020], [(11, 5_000_020)], 10) == (5_000_021, 2)


def test_the_run_stops_at_the_first_offset_neither_acknowledged_nor_in_a_gap() -> None:
    assert run_end([10, 11, 16, 20], [(12, 16), (17, 19)], 10) == (19, 3)


def test_a_run_can_start_with_a_gap() -> None:
    assert run_end([14], [(10, 14)], 10) == (15, 1)


@settings(max_examples=300)
@given(
    offsets=st.sets(st.integers(0, 60), min_size=1),
    raw_gaps=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 8)), max_size=6),
)
def test_the_same_end_as_listing_every_offset(offsets: set[int], raw_gaps: list[tuple[int, int]]) -> None:
    acked = sorted(offsets)
    gaps = sorted((begin, begin + length) for begin, length in raw_gaps)
    start = min([acked[0], *(begin for begin, _ in gaps)])
    end, taken = run_end(acked, gaps, start)
    assert end == listed_run_end(acked, gaps, start)
    assert taken == sum(1 for offset in acked if offset < end)
