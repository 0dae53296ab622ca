"""Records as real producers write them: batches compressed with each codec Kafka defines, through a real worker on
the embedded broker. aiokafka decodes gzip itself and snappy, lz4 and zstd with ``cramjam`` (installed through
``aiokafka[lz4,snappy,zstd]``); without it, one such batch stopped every partition of the worker (issue 22, item 0)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from demo.harness import Record
from rebound import headers as h
from tests.integration.conftest import Deployment, attempts_by_key, failed_records
from tests.raw_batches import stored_codecs

pytestmark = pytest.mark.broker

CODECS = ("gzip", "snappy", "lz4", "zstd")
PER_CODEC = 5
PLAIN = 20
RAW_HEADERS = [("trace-id", b"\x00\xff\xfe raw bytes"), ("empty", b"")]


def script(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def value_of(key: str) -> bytes:
    if key == "snappy-1":
        return script(succeed_on=1)  # through the retry tier once, then done
    if key == "lz4-2":
        return script(fail="always", note="dead-lettered byte-exact")  # retry tier, then the failed topic
    return script(succeed_on=0, key=key)


async def produce_compressed(bootstrap: str, topic: str) -> list[str]:
    """5 records per codec, each codec's records sent together so that they share batches, then 20 uncompressed
    ones; every record on both partitions (keyed). Answers the keys in the order sent."""
    keys: list[str] = []
    for codec in (*CODECS, None):
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, compression_type=codec, linger_ms=200, acks="all")
        await producer.start()
        try:
            count = PER_CODEC if codec else PLAIN
            names = [f"{codec or 'plain'}-{n}" for n in range(count)]
            sent = [
                await producer.send(topic, key=name.encode(), value=value_of(name), headers=list(RAW_HEADERS))
                for name in names
            ]
            await producer.flush()
            await asyncio.gather(*sent)
        finally:
            await producer.stop()
        keys += names
    return keys


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return 0, ""


def every_codec_stored(deployment: Deployment, partitions: int) -> set[str]:
    return {
        codec
        for partition in range(partitions)
        for _, codec in asyncio.run(stored_codecs(deployment.broker.bootstrap, deployment.topic, partition))
    }


def test_every_codec_reaches_the_handler_and_a_compressed_record_is_dead_lettered_byte_exact(deploy: Any) -> None:
    deployment: Deployment = deploy(partitions=2, REBOUND_RETRY_SEQUENCE="1s")
    keys = asyncio.run(produce_compressed(deployment.broker.bootstrap, deployment.topic))
    assert len(keys) == 40
    assert every_codec_stored(deployment, 2) == {*CODECS, "none"}  # the log really holds each codec's batches
    worker = deployment.start_worker()

    def settled(records: list[Record]) -> bool:
        events = attempts_by_key(records)
        done = {key for key, seen in events.items() if any(e["outcome"] in ("succeeded", "dead") for e in seen)}
        return done >= set(keys) and bool(failed_records(records))

    records = deployment.collect(settled, timeout=120)
    handled = {call["key"] for call in deployment.calls()}
    assert handled == set(keys)
    events = attempts_by_key(records)
    assert {key for key, seen in events.items() if seen[-1]["outcome"] == "succeeded"} == set(keys) - {"lz4-2"}
    assert [e["attempt"] for e in events["snappy-1"] if e["outcome"] == "succeeded"] == [1]
    assert [e["outcome"] for e in events["lz4-2"]][-1] == "dead"

    (dead,) = failed_records(records)
    assert dead.key == b"lz4-2" and dead.value == value_of("lz4-2")
    originals = [(name, value) for name, value in dead.raw_headers if not name.startswith("rebound.")]
    assert originals == RAW_HEADERS
    assert dead.headers[h.ORIGINAL_TOPIC] == deployment.topic.encode()
    assert "cannot be decoded" not in worker.log_text()
    assert "fetching failed" not in worker.log_text()


def test_without_cramjam_each_partition_stops_at_its_first_batch_needing_it_and_says_so(
    deploy: Any, tmp_path: Path
) -> None:
    """A worker installed without the codec libraries (cramjam hidden from its interpreter): what the issue saw was
    0 of 40 records handled, every fetch failing once a second. Now the gzip records before the first snappy (lz4, zstd)
    batch of each partition are handled, and each partition's stop is reported (``/ready``), nothing is passed over."""
    hidden = tmp_path / "no-cramjam"
    hidden.mkdir()
    (hidden / "cramjam.py").write_text('raise ImportError("cramjam hidden by the test")\n')
    deployment: Deployment = deploy(partitions=2, REBOUND_RETRY_SEQUENCE="1s", PYTHONPATH=str(hidden))
    keys = asyncio.run(produce_compressed(deployment.broker.bootstrap, deployment.topic))
    gzip_keys = {key for key in keys if key.startswith("gzip-")}
    worker = deployment.start_worker()

    deadline = time.monotonic() + 90
    stopped: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        assert not worker.crashed, worker.log_text()[-4000:]
        status, body = get(worker.web_port, "/ready")
        if status == 503 and "undecodable" in body:
            stopped = json.loads(body)["undecodable"]
            if len(stopped) == 2 and {call["key"] for call in deployment.calls()} >= gzip_keys:
                break
        time.sleep(0.3)
    assert {(s["topic"], s["partition"]) for s in stopped} == {(deployment.topic, 0), (deployment.topic, 1)}, (
        worker.log_text()[-4000:]
    )
    for stuck in stopped:
        batches = asyncio.run(stored_codecs(deployment.broker.bootstrap, deployment.topic, stuck["partition"]))
        first, codec = next((offset, codec) for offset, codec in batches if codec in ("snappy", "lz4", "zstd"))
        assert stuck["offset"] == first
        assert f"Libraries for {codec} compression codec not found" in stuck["error"]
    time.sleep(2)
    assert {call["key"] for call in deployment.calls()} == gzip_keys
    assert "fetching failed" not in worker.log_text()
