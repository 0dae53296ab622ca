"""Record batches as no well-behaved client writes them (a corrupt CRC, an unknown codec), and a raw produce of one.

aiokafka's producer only writes valid batches, so these are built with its own ``DefaultRecordBatchBuilder`` and
then changed: a flipped byte after the CRC (the broker does not check it on the embedded broker, Tansu; real Kafka
does, so there such batches come from a broken disk or a buggy proxy), or the codec bits of the attributes set to a
value Kafka does not define, with the CRC made right again (Tansu refuses those on produce: error -1).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from aiokafka.client import AIOKafkaClient
from aiokafka.errors import for_code
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.record.util import calc_crc32c
from aiokafka.structs import TopicPartition

CRC_OFFSET = struct.calcsize(">qiib")  # base offset, length, partition leader epoch, magic
ATTRIBUTES_OFFSET = struct.calcsize(">qiibI")


def builder_of(compression_type: int = 0, *, transactional: bool = False) -> DefaultRecordBatchBuilder:
    """aiokafka's builder of one v2 batch; a transactional batch is producer 7's, epoch 0."""
    return DefaultRecordBatchBuilder(
        magic=2,
        compression_type=compression_type,
        is_transactional=int(transactional),
        producer_id=7 if transactional else -1,
        producer_epoch=0 if transactional else -1,
        base_sequence=-1,
        batch_size=1 << 20,
    )


def batch(
    records: Sequence[tuple[bytes | None, bytes | None]], *, compression_type: int = 0, timestamp: int | None = None
) -> bytearray:
    """A valid v2 batch of ``(key, value)`` records, uncompressed unless ``compression_type`` says (offsets from 0:
    the broker assigns real ones, :func:`at` sets one as a fetch answer has it)."""
    builder = builder_of(compression_type)
    for offset, (key, value) in enumerate(records):
        builder.append(offset, timestamp=timestamp, key=key, value=value, headers=[])
    return bytearray(builder.build())


def at(base_offset: int, data: bytes | bytearray) -> bytes:
    """The batch with the base offset the broker would have given it (not covered by the CRC)."""
    moved = bytearray(data)
    struct.pack_into(">q", moved, 0, base_offset)
    return bytes(moved)


def with_bad_crc(data: bytearray) -> bytes:
    """The batch with its last byte flipped: its CRC no longer matches, everything else (the header) is intact."""
    changed = bytearray(data)
    changed[-1] ^= 0xFF
    return bytes(changed)


def with_crc_fixed(data: bytearray) -> bytes:
    """The batch with a CRC that matches its (changed) bytes: it passes the check and fails later, in decoding."""
    struct.pack_into(">I", data, CRC_OFFSET, calc_crc32c(bytes(data[ATTRIBUTES_OFFSET:])))
    return bytes(data)


def control_batch(records: Sequence[tuple[bytes, bytes]] = ()) -> bytearray:
    """A transaction's control batch of producer 7 holding ``(key, value)`` records (timestamp 1, offsets from 0);
    its CRC is made right by :func:`with_crc_fixed`, after any further change."""
    builder = builder_of(transactional=True)
    for offset, (key, value) in enumerate(records):
        builder.append(offset, timestamp=1, key=key, value=value, headers=[])
    data = bytearray(builder.build())
    (attributes,) = struct.unpack_from(">h", data, ATTRIBUTES_OFFSET)
    struct.pack_into(">h", data, ATTRIBUTES_OFFSET, attributes | 0x20)  # the control bit
    return data


def with_codec(data: bytearray, codec: int) -> bytes:
    """The batch with the codec bits of its attributes set to ``codec`` (5, 6, 7: none that Kafka defines) and a
    CRC that matches again: it passes the CRC check and fails only at decompression."""
    changed = bytearray(data)
    (attributes,) = struct.unpack_from(">h", changed, ATTRIBUTES_OFFSET)
    struct.pack_into(">h", changed, ATTRIBUTES_OFFSET, (attributes & ~0x07) | codec)
    return with_crc_fixed(changed)


def with_header_name_not_utf8(records: Sequence[tuple[bytes | None, bytes | None]]) -> bytes:
    """A valid batch whose first record carries a header named by the byte 0xFF, CRC right: Kafka stores header
    names as bytes and librdkafka, sarama and franz-go let a producer write any; aiokafka decodes them as UTF-8."""
    builder = builder_of()
    for offset, (key, value) in enumerate(records):
        builder.append(offset, timestamp=None, key=key, value=value, headers=[("Q", b"x")] if offset == 0 else [])
    changed = bytearray(builder.build())
    # After the 61-byte batch header (its timestamps and CRC could hold any two bytes): the header count (zigzag 1),
    # the name's length (zigzag 1), the name, the value's length and value; the name's byte becomes 0xFF.
    changed[changed.index(b"\x02\x02Q\x02x", 61) + 2] = 0xFF
    return with_crc_fixed(changed)


async def produce_raw(bootstrap: str, topic: str, partition: int, data: bytes) -> int:
    """Send one record batch as it is, in a ProduceRequest to the partition's leader; answer its base offset."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        await client._wait_on_metadata(topic)
        leader = client.cluster.leader_for_partition(TopicPartition(topic, partition))
        request = ProduceRequest(
            transactional_id=None, required_acks=-1, timeout=10_000, topics=[(topic, [(partition, data)])]
        )
        response = await client.send(leader, request)
    finally:
        await client.close()
    ((_, partitions),) = response.topics
    ((_, error_code, offset, *_),) = partitions
    if error_code:
        raise for_code(error_code)(f"produce of a raw batch to {topic}[{partition}] refused")
    return int(offset)


CODECS = {0: "none", 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}


async def stored_codecs(bootstrap: str, topic: str, partition: int) -> list[tuple[int, str]]:
    """``(base offset, codec)`` of every batch the broker holds for the partition, read from a raw fetch without
    decompressing anything: what a producer's ``compression_type`` really put on the log."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    found: list[tuple[int, str]] = []
    try:
        await client._wait_on_metadata(topic)
        leader = client.cluster.leader_for_partition(TopicPartition(topic, partition))
        offset = 0
        while True:
            request = FetchRequest(100, 1, 1 << 24, 0, [(topic, [(partition, offset, 1 << 24)])])
            response = await client.send(leader, request)
            ((_, partitions),) = response.topics
            ((_, error_code, _highwater, *rest),) = partitions
            if error_code:
                raise for_code(error_code)(f"raw fetch of {topic}[{partition}] at {offset}")
            records = MemoryRecords(rest[-1])
            before = len(found)
            while records.has_next():
                stored = records.next_batch()
                found.append((stored.base_offset, CODECS.get(stored.compression_type, str(stored.compression_type))))
                offset = stored.next_offset
            if len(found) == before:
                return found
    finally:
        await client.close()
