"""Writer epochs: what a replay keeps, whatever order the owners' records landed in."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rebound.fencing import (
    PartitionReplay,
    decode_epoch,
    describe_epoch,
    encode_epoch,
    epoch_key,
    is_epoch_key,
    next_claim,
    record_epoch,
)
from rebound.headers import WRITER_EPOCH


def test_a_write_landing_after_a_newer_claim_is_skipped_and_remembered() -> None:
    """The chaos run's rollback: the new owner (epoch 2) wrote k, then the evicted owner's buffered write (1) landed."""
    replay = PartitionReplay()
    assert replay.keep(epoch_key(3), encode_epoch(1), 1, offset=0)
    assert replay.keep(b"k", b"old owner", 1, offset=1)
    assert replay.keep(epoch_key(3), encode_epoch(2), 2, offset=2)
    assert replay.keep(b"k", b"new owner", 2, offset=3)
    assert not replay.keep(b"k", b"late", 1, offset=4)
    assert replay.overruled == {b"k": 4}
    assert replay.keep(b"k", b"new owner again", 2, offset=5)
    assert replay.overruled == {}


def test_records_without_an_epoch_are_always_applied() -> None:
    """Written before epochs existed (an upgrade), or by a worker that had claimed nothing."""
    replay = PartitionReplay(epoch=7)
    assert replay.keep(b"k", b"v", None, offset=0)


def test_a_late_marker_never_lowers_the_epoch() -> None:
    replay = PartitionReplay()
    replay.keep(epoch_key(0), encode_epoch(5), 5, offset=0)
    assert not replay.keep(epoch_key(0), encode_epoch(4), 4, offset=1)  # the evicted owner's own claim, landed late
    assert replay.epoch == 5
    assert not replay.keep(b"k", b"v", 4, offset=2)


def test_a_claim_is_a_round_above_everything_seen_then_the_generation() -> None:
    assert describe_epoch(next_claim(None, 3)) == "1.3"
    assert describe_epoch(next_claim(next_claim(None, 3), 9)) == "2.9"
    assert describe_epoch(next_claim(next_claim(None, 9), 3)) == "2.3"  # a generation that started again


def test_of_two_claims_of_one_round_the_later_generation_wins_in_either_order() -> None:
    """A worker frozen after reading the log claims the same round as the owner chosen while it was frozen."""
    seen = next_claim(None, 1)
    frozen, chosen = next_claim(seen, 4), next_claim(seen, 5)
    for first, second in ((frozen, chosen), (chosen, frozen)):
        replay = PartitionReplay(epoch=seen)
        replay.keep(epoch_key(0), encode_epoch(first), first, offset=0)
        replay.keep(epoch_key(0), encode_epoch(second), second, offset=1)
        assert replay.keep(b"k", b"chosen", chosen, offset=2)
        assert not replay.keep(b"k", b"frozen", frozen, offset=3)


def test_marker_keys_cannot_be_table_keys_of_messages() -> None:
    assert is_epoch_key(epoch_key(12))
    assert not is_epoch_key(b"\x00topic/1/2")  # a null-key message's table key
    assert not is_epoch_key(b"~writer-epoch~1")
    assert not is_epoch_key(None)


def test_the_header_is_a_utf8_decimal_and_anything_else_counts_as_none() -> None:
    assert record_epoch([(WRITER_EPOCH, b"12")]) == 12
    assert record_epoch({WRITER_EPOCH: b"12"}) == 12
    for bad in (b"", b"-1", b"1.5", b"\xff", b"9" * 21):
        assert record_epoch([(WRITER_EPOCH, bad)]) is None
    assert record_epoch(None) is None
    assert decode_epoch(encode_epoch(2**63)) == 2**63


# An owner: (epoch, records it writes in order). Records of an owner land in its order, but an owner evicted before
# the next claim may have some of its records land anywhere after that claim (the late writes).
owners = st.lists(st.lists(st.sampled_from([b"a", b"b", b"c"]), min_size=0, max_size=4), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(writes=owners, data=st.data())
def test_the_replayed_state_is_what_each_owner_saw_when_it_wrote(
    writes: list[list[bytes]], data: st.DataObject
) -> None:
    """Every key ends with the value its last *legitimate* writer gave it, wherever late records land."""
    log: list[tuple[bytes, bytes, int]] = []
    truth: dict[bytes, bytes] = {}
    late: list[tuple[bytes, bytes, int]] = []
    for epoch, keys in enumerate(writes, start=1):
        log.append((epoch_key(0), encode_epoch(epoch), epoch))
        log.extend(late)  # the previous owner's buffered writes land after this owner's claim
        late = []
        on_time = data.draw(st.integers(0, len(keys)), label="written before eviction")
        for index, key in enumerate(keys):
            record = (key, f"{epoch}:{index}".encode(), epoch)
            if index < on_time or epoch == len(writes):
                log.append(record)
                truth[key] = record[1]
            else:
                late.append(record)
        # the next owner (if any) claims; records of this owner not yet landed land later, interleaved
    replay = PartitionReplay()
    state: dict[bytes, bytes] = {}
    for offset, (key, value, epoch) in enumerate(log):
        if replay.keep(key, value, epoch, offset) and not is_epoch_key(key):
            state[key] = value
    assert state == truth
