"""The read cursors: a record is never passed over unless the broker was asked again and holds nothing there."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from rebound.read_cursors import ReadCursors, Verdict

TP = ("items", 1)


def test_the_expected_record_is_delivered_and_moves_the_cursor() -> None:
    cursors = ReadCursors()
    cursors.positioned(TP, 94)
    assert cursors.check(TP, 94, batch=1) is Verdict.DELIVER
    assert cursors.delivered(TP, 94, cursors.epoch(TP))
    assert cursors.next_offset(TP) == 95


def test_a_jump_is_read_again_and_the_rest_of_its_batch_dropped() -> None:
    """The hand-over seen in chaos runs: 94 handled, then 106: 95 to 105 were fetched and dropped by Faust."""
    cursors = ReadCursors()
    cursors.positioned(TP, 94)
    cursors.delivered(TP, 94, cursors.epoch(TP))
    assert cursors.check(TP, 106, batch=1) is Verdict.READ_AGAIN
    assert cursors.read_again(TP, batch=1) == 95
    assert cursors.check(TP, 107, batch=1) is Verdict.STALE
    assert cursors.check(TP, 95, batch=2) is Verdict.DELIVER
    assert cursors.records_read_again == 1


def test_a_jump_seen_again_after_reading_again_is_a_confirmed_gap() -> None:
    """Transaction markers, compaction or retention: the broker answers the same jump from the same offset."""
    cursors = ReadCursors()
    cursors.positioned(TP, 10)
    assert cursors.check(TP, 12, batch=1) is Verdict.READ_AGAIN
    cursors.read_again(TP, batch=1)
    assert cursors.check(TP, 12, batch=2) is Verdict.CONFIRMED_GAP
    assert cursors.gap(TP, 12) == (10, 11)
    assert cursors.delivered(TP, 12, cursors.epoch(TP))
    assert cursors.check(TP, 13, batch=2) is Verdict.DELIVER


def test_a_fetcher_past_records_never_handed_over_is_sought_back() -> None:
    """The partition's last records dropped by Faust: no later record would ever show the jump."""
    cursors = ReadCursors()
    cursors.positioned(TP, 20)
    cursors.delivered(TP, 20, cursors.epoch(TP))
    assert cursors.fetcher_ahead(TP, 21, batches_whole=True) is None
    assert cursors.fetcher_ahead(TP, 25, batches_whole=True) == (Verdict.READ_AGAIN, 21, 25)
    assert cursors.fetcher_ahead(TP, None, batches_whole=True) is None  # position being reset by the fetcher


def test_a_fetcher_ahead_by_the_same_distance_after_reading_again_is_a_confirmed_gap() -> None:
    """aiokafka steps over a transaction's control record at a partition's end: no record will ever show it."""
    cursors = ReadCursors()
    cursors.positioned(TP, 20)
    assert cursors.fetcher_ahead(TP, 21, batches_whole=True) == (Verdict.READ_AGAIN, 20, 21)
    assert cursors.fetcher_ahead(TP, 21, batches_whole=False) == (Verdict.READ_AGAIN, 20, 21)  # a batch was cut
    assert cursors.fetcher_ahead(TP, 21, batches_whole=True) == (Verdict.CONFIRMED_GAP, 20, 20)
    assert cursors.next_offset(TP) == 21
    assert cursors.fetcher_ahead(TP, 21, batches_whole=True) is None


def test_records_before_the_cursor_are_stale() -> None:
    cursors = ReadCursors()
    cursors.positioned(TP, 50)
    assert cursors.check(TP, 49, batch=1) is Verdict.STALE


def test_a_delivery_overtaken_by_a_seek_does_not_move_the_cursor() -> None:
    """Faust wrote the read offset of a message still being handed over after the recovery's seek (stale write)."""
    cursors = ReadCursors()
    cursors.positioned(TP, 100)
    epoch = cursors.epoch(TP)
    cursors.positioned(TP, 95)  # rebalance: seek to committed while offset 105 was being handed over
    assert not cursors.delivered(TP, 105, epoch)
    assert cursors.next_offset(TP) == 95


def test_a_delivery_overtaken_by_a_revocation_does_not_move_the_cursor() -> None:
    cursors = ReadCursors()
    cursors.positioned(TP, 100)
    epoch = cursors.epoch(TP)
    cursors.forget(TP)
    assert not cursors.delivered(TP, 100, epoch)
    assert cursors.next_offset(TP) is None


def test_an_unknown_position_delivers_nothing_and_never_becomes_a_commit_floor() -> None:
    """The chaos run that skipped 73 offsets: after a revocation the first record fetched (1341) was taken for the
    start, its offset became the commit floor, and the commit at the next revocation passed over 1268..1340."""
    cursors = ReadCursors()
    cursors.positioned(TP, 1200)
    cursors.forget(TP)
    assert cursors.check(TP, 1341, batch=1) is Verdict.UNPOSITIONED
    assert not cursors.delivered(TP, 1341, cursors.epoch(TP) - 1)
    assert cursors.commit_floor(TP) is None
    cursors.positioned(TP, 1268)
    assert cursors.check(TP, 1341, batch=2) is Verdict.READ_AGAIN
    assert cursors.commit_floor(TP) == 1268


def test_a_hand_over_that_failed_twice_is_read_again_not_taken_for_a_gap() -> None:
    """Review 4: 7's hand-over failed (a queue clear), 8 sent reading back to 7, and 7's hand-over failed again in the
    batch read after the seek. The broker never skipped 7; taken for a gap, it was committed over and never run."""
    cursors = ReadCursors()
    cursors.positioned(TP, 7)
    for batch in (1, 2, 3):
        assert cursors.check(TP, 7, batch=batch) is Verdict.DELIVER
        cursors.not_handed_over(TP)
        assert cursors.check(TP, 8, batch=batch) is Verdict.READ_AGAIN
        assert cursors.read_again(TP, batch=batch) == 7
    assert cursors.check(TP, 7, batch=4) is Verdict.DELIVER
    assert cursors.delivered(TP, 7, cursors.epoch(TP))
    assert cursors.gaps_confirmed == 0 and cursors.commit_floor(TP) == 7


def test_a_hand_over_that_failed_at_the_partition_s_end_is_not_taken_for_a_gap() -> None:
    """The same through the position check: 7, the partition's last record, fetched twice and handed over neither
    time; the fetcher twice at 8, in whole batches, is not the broker's answer skipping 7."""
    cursors = ReadCursors()
    cursors.positioned(TP, 7)
    for _ in range(3):
        assert cursors.fetcher_ahead(TP, 8, batches_whole=True) == (Verdict.READ_AGAIN, 7, 8)
        assert cursors.check(TP, 7, batch=1) is Verdict.DELIVER
        cursors.not_handed_over(TP)
    assert cursors.next_offset(TP) == 7 and cursors.gaps_confirmed == 0


def test_a_failed_hand_over_keeps_the_commit_floor_and_a_jump_read_twice_is_still_a_gap() -> None:
    cursors = ReadCursors()
    cursors.positioned(TP, 10)
    cursors.not_handed_over(TP)
    assert cursors.commit_floor(TP) == 10 and cursors.next_offset(TP) == 10
    assert cursors.check(TP, 12, batch=1) is Verdict.READ_AGAIN
    cursors.read_again(TP, batch=1)
    assert cursors.check(TP, 12, batch=2) is Verdict.CONFIRMED_GAP  # the broker skipped 10-11 twice
    cursors.not_handed_over(("other", 0))  # a partition with no cursor: nothing to forget


def test_positioning_sets_the_commit_floor() -> None:
    cursors = ReadCursors()
    cursors.positioned(TP, 40)
    cursors.delivered(TP, 40, cursors.epoch(TP))
    assert cursors.commit_floor(TP) == 40


@dataclass
class Partition:
    """A log with holes (offsets the broker never holds) read by a fetcher that hands out batches from a position."""

    offsets: list[int]
    position: int = 0
    delivered: list[int] = field(default_factory=list)
    gaps: list[tuple[int, int]] = field(default_factory=list)

    def fetch(self, size: int) -> list[int]:
        batch = [offset for offset in self.offsets if offset >= self.position][:size]
        if batch:
            self.position = batch[-1] + 1  # like aiokafka: the position moves past what was returned
        return batch


@st.composite
def logs(draw: st.DrawFn) -> list[int]:
    present = draw(st.lists(st.booleans(), min_size=1, max_size=60))
    return [offset for offset, here in enumerate(present) if here or offset == 0]


# each batch: (fetch size, records Faust hands over before abandoning the batch, last hand-over cancelled, a seek to
# the committed offset first, the index of a hand-over a queue clear makes fail while the batch goes on)
faust_misbehaviour = st.lists(
    st.tuples(st.integers(1, 8), st.integers(0, 8), st.booleans(), st.booleans(), st.none() | st.integers(0, 7)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(log=logs(), batches=faust_misbehaviour)
def test_whatever_faust_drops_every_record_is_delivered_in_order_and_gaps_hold_nothing(
    log: list[int], batches: list[tuple[int, int, bool, bool, int | None]]
) -> None:
    """A model of the drain loop: batches cut short, hand-overs cancelled, seeks back to the committed offset, and
    hand-overs a queue clear made fail while the rest of the batch is handed over (the conductor swallows the
    cancellation: no flow stop, the batch counts as whole)."""
    partition = Partition(offsets=log)
    cursors = ReadCursors()
    cursors.positioned(TP, 0)
    committed = 0
    batch_number = 0
    whole = True
    rest: list[tuple[int, int, bool, bool, int | None]] = [(8, 8, False, False, None)] * (len(log) + 2)
    for size, handed_over, cancel_last, rebalance, cleared in [*batches, *rest]:
        batch_number += 1
        # the drain loop compares positions between batches
        behind = cursors.fetcher_ahead(TP, partition.position, batches_whole=whole)
        whole = handed_over >= size and not cancel_last
        if behind is not None and behind[0] is Verdict.READ_AGAIN:
            partition.position = behind[1]
        elif behind is not None:
            partition.gaps.append(behind[1:])
        if rebalance:
            committed = partition.delivered[-1] + 1 if partition.delivered else committed
            partition.position = committed
            cursors.positioned(TP, committed)
        for index, offset in enumerate(partition.fetch(size)):
            if index >= handed_over:
                break  # Faust's getmany stops yielding (flow stopped, generation changed); the fetcher moved on
            verdict = cursors.check(TP, offset, batch_number)
            if verdict is Verdict.STALE:
                continue
            if verdict is Verdict.READ_AGAIN:
                partition.position = cursors.read_again(TP, batch_number)
                continue
            if verdict is Verdict.CONFIRMED_GAP:
                partition.gaps.append(cursors.gap(TP, offset))
            if cancel_last and index == handed_over - 1:
                cursors.not_handed_over(TP)
                break  # the flow stopped while this one was handed over: not delivered
            if index == cleared:
                cursors.not_handed_over(TP)
                continue  # the stream queues were cleared during this hand-over: not delivered, the batch goes on
            if cursors.delivered(TP, offset, cursors.epoch(TP)):
                partition.delivered.append(offset)
    delivered_once = sorted(set(partition.delivered))
    assert delivered_once == log
    # in order: each delivery is the next record or a re-read after a seek back, never a jump over a record
    for before, after in zip(partition.delivered, partition.delivered[1:], strict=False):
        following = [offset for offset in log if offset > before]
        assert after <= before or after == following[0]
    for first, last in partition.gaps:
        assert not [offset for offset in log if first <= offset <= last]
