"""Ranges the broker's own answer showed empty (transaction markers, aborted transactions) are jumped at once: a topic
written transactionally costs no second read per transaction, and nothing Faust dropped is ever taken for one."""

from __future__ import annotations

from rebound.read_cursors import MAX_BROKER_GAPS, ReadCursors, Verdict

TP = ("items", 0)


def delivered(cursors: ReadCursors, offset: int) -> None:
    assert cursors.delivered(TP, offset, cursors.epoch(TP))


def test_a_jump_over_a_marker_the_broker_showed_is_taken_without_reading_again() -> None:
    """Three records of a transaction (0-2), its commit marker (3), the next transaction's records (4-6)."""
    cursors = ReadCursors()
    cursors.positioned(TP, 0)
    for offset in range(3):
        assert cursors.check(TP, offset, batch=1) is Verdict.DELIVER
        delivered(cursors, offset)
    cursors.broker_gap(TP, 3, 3)  # reported while the fetch was decoded, before record 4 is handed over
    assert cursors.check(TP, 4, batch=1) is Verdict.CONFIRMED_GAP
    assert cursors.gap(TP, 4) == (3, 3)
    delivered(cursors, 4)
    assert cursors.records_read_again == 0
    assert cursors.broker_gaps_taken == 1


def test_an_aborted_transaction_and_its_marker_are_one_jump() -> None:
    """read_committed: aborted records 4-6 and the abort marker 7, reported as two ranges, are jumped as one."""
    cursors = ReadCursors()
    cursors.positioned(TP, 4)
    cursors.broker_gap(TP, 4, 6)
    cursors.broker_gap(TP, 7, 7)
    assert cursors.shown_empty(TP, 4, 7)
    assert cursors.check(TP, 8, batch=1) is Verdict.CONFIRMED_GAP
    assert cursors.gap(TP, 8) == (4, 7)
    assert cursors.records_read_again == 0


def test_a_jump_reaching_past_what_the_broker_showed_is_still_read_again() -> None:
    """Offsets 4 and 5 were handed over by aiokafka (not stepped over) and dropped by Faust: they must be read again."""
    cursors = ReadCursors()
    cursors.positioned(TP, 3)
    cursors.broker_gap(TP, 3, 3)
    assert cursors.check(TP, 6, batch=1) is Verdict.READ_AGAIN
    assert cursors.read_again(TP, batch=1) == 3
    assert not cursors.shown_empty(TP, 3, 5)


def test_a_marker_at_the_end_of_a_partition_is_taken_at_the_first_position_check() -> None:
    """Nothing follows the last commit marker: the fetcher is one past the cursor, and the broker showed why."""
    cursors = ReadCursors()
    cursors.positioned(TP, 0)
    for offset in range(3):
        delivered(cursors, offset)
    cursors.broker_gap(TP, 3, 3)
    # Even with a batch cut short since (the flow stopped): the range holds no record at all, so nothing was dropped.
    assert cursors.fetcher_ahead(TP, 4, batches_whole=False) == (Verdict.CONFIRMED_GAP, 3, 3)
    assert cursors.next_offset(TP) == 4
    assert cursors.records_read_again == 0


def test_what_the_broker_showed_stays_true_across_a_seek_back_and_goes_at_revocation() -> None:
    cursors = ReadCursors()
    cursors.positioned(TP, 0)
    cursors.broker_gap(TP, 3, 3)
    cursors.positioned(TP, 0)  # read again from the committed offset after a rebalance: the marker is still there
    for offset in range(3):
        delivered(cursors, offset)
    assert cursors.check(TP, 4, batch=2) is Verdict.CONFIRMED_GAP
    cursors.forget(TP)
    cursors.positioned(TP, 3)
    assert cursors.check(TP, 4, batch=3) is Verdict.READ_AGAIN  # a new assignment learns from its own fetches


def test_ranges_below_a_commit_are_dropped_and_their_number_is_bounded() -> None:
    cursors = ReadCursors()
    cursors.positioned(TP, 0)
    cursors.broker_gap(TP, 3, 3)
    cursors.broker_gap(TP, 7, 7)
    cursors.committed(TP, 5)
    assert not cursors.shown_empty(TP, 3, 3)
    assert cursors.shown_empty(TP, 7, 7)
    for marker in range(10, 10 + 4 * MAX_BROKER_GAPS, 4):
        cursors.broker_gap(TP, marker, marker)
    assert not cursors.shown_empty(TP, 7, 7)  # the oldest went first
    assert cursors.shown_empty(TP, 10 + 4 * (MAX_BROKER_GAPS - 1), 10 + 4 * (MAX_BROKER_GAPS - 1))


def test_an_empty_or_reversed_range_is_ignored() -> None:
    cursors = ReadCursors()
    cursors.positioned(TP, 0)
    cursors.broker_gap(TP, 5, 4)
    assert cursors.check(TP, 5, batch=1) is Verdict.READ_AGAIN
