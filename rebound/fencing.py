"""Writer epochs: a changelog record from a worker that no longer owns its partition is ignored on replay.

A worker frozen long enough to be evicted (SIGSTOP, a long GC pause, a VM migration) still holds changelog records in
its producer's buffer; when it runs again they are sent, and they land after the new owner's writes of the same keys.
The broker fences the old worker's offset commits (UnknownMemberId) but not its produced records, so the state of a
key rolled back to an older version when the partition next moved (seen in chaos runs: retries never run, entries
whose payload had been deleted). Kafka's own answer, transactions, is not available on every broker Rebound runs on.

So every owner of a table partition claims an epoch when its recovery completes: one more than the highest epoch in
the partition's changelog so far, written as a marker record before it writes anything else, and every record it
writes carries its epoch in a header. Replaying a changelog keeps the highest marker epoch seen and skips any record
whose epoch is lower: written by an owner that had already been superseded when its record landed. Records without
the header (written before epochs existed) are always applied.

The epoch is derived from the log itself, not from the group's generation (which starts again when a group's metadata
expires) nor from a clock (which can differ between workers). Pure bookkeeping, no Faust.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from rebound.headers import WRITER_EPOCH

EPOCH_KEY_PREFIX = b"\x00~writer-epoch~"
"""Table keys of the markers. A null-key entry is ``\\x00topic/partition/offset`` and ``~`` is not allowed in topic
names; a payload key starts with its table key's 4-byte length, far beyond any record size for these bytes."""

MAX_EPOCH_DIGITS = 20


def epoch_key(partition: int) -> bytes:
    """The marker's key in ``partition``: one per partition, so a store holding several partitions keeps them apart."""
    return EPOCH_KEY_PREFIX + str(partition).encode()


def replay_point_key(partition: int) -> bytes:
    """A local-only key (never in the changelog): where a replay of the partition resumes, and the epoch there."""
    return EPOCH_KEY_PREFIX + b"point~" + str(partition).encode()


def encode_replay_point(offset: int, epoch: int) -> bytes:
    """``offset epoch``: after reading the changelog through ``offset``, the highest marker read was ``epoch``."""
    return f"{offset} {epoch}".encode()


def decode_replay_point(raw: bytes | None) -> tuple[int, int] | None:
    if raw is None:
        return None
    parts = raw.split(b" ")
    if len(parts) != 2:
        return None
    offset, epoch = decode_decimal(parts[0]), decode_decimal(parts[1])
    return (offset, epoch) if offset is not None and epoch is not None else None


def is_epoch_key(key: bytes | None) -> bool:
    return key is not None and key.startswith(EPOCH_KEY_PREFIX)


def encode_decimal(number: int) -> bytes:
    return str(number).encode()


def decode_decimal(raw: bytes | None) -> int | None:
    """A UTF-8 decimal, or None for anything else (absent, malformed, negative, too long)."""
    if raw is None or not raw or len(raw) > MAX_EPOCH_DIGITS or not raw.isdigit():
        return None
    return int(raw)


encode_epoch = encode_decimal
decode_epoch = decode_decimal


def record_epoch(headers: Iterable[tuple[str, bytes | None]] | Mapping[str, bytes | None] | None) -> int | None:
    """The writer epoch a changelog record carries, None if it carries none (or one that does not parse)."""
    if not headers:
        return None
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    for name, value in pairs:
        if name == WRITER_EPOCH:
            return decode_epoch(value)
    return None


@dataclass
class PartitionReplay:
    """Where one changelog partition's replay stands."""

    epoch: int = 0
    """The highest marker epoch applied so far."""
    overruled: dict[bytes, int] = field(default_factory=dict)
    """Keys whose last record read was skipped, with that record's offset."""

    def keep(self, key: bytes | None, value: bytes | None, epoch: int | None, offset: int) -> bool:
        """Whether the record at ``offset`` is applied.

        A marker raises the epoch; one below it (an evicted owner's own claim, landed late) is skipped, so the marker
        a store holds is always the highest its replay read, and a replay resumed from that store starts right.
        """
        if is_epoch_key(key):
            marker = decode_epoch(value)
            if marker is None or marker < self.epoch:
                return False
            self.epoch = marker
            return True
        if key is None:
            return True
        if epoch is not None and epoch < self.epoch:
            self.overruled[key] = offset
            return False
        self.overruled.pop(key, None)
        return True


GENERATION_BITS = 32
GENERATION_MASK = (1 << GENERATION_BITS) - 1


def next_claim(current: int | None, generation: int) -> int:
    """The epoch a new owner claims: a round above every epoch its replay saw, then its group generation.

    Two claimants that read the same log (a worker frozen after reading, resumed before its eviction shows) claim the
    same round; the group generation, higher for the owner the group chose last, tells them apart in whatever order
    their records land. A generation that starts again (a group whose metadata expired) never matters: its round is
    above every round in the log.
    """
    round_ = (current or 0) >> GENERATION_BITS
    return ((round_ + 1) << GENERATION_BITS) | (max(generation, 0) & GENERATION_MASK)


def describe_epoch(epoch: int | None) -> str:
    """For logs: ``round.generation``."""
    if epoch is None:
        return "none"
    return f"{epoch >> GENERATION_BITS}.{epoch & GENERATION_MASK}"
