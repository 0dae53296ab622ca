"""A service written in Node (services/node-handler/server.js) behind a real worker on the embedded broker.

The proof that a push handler serves any language: messages produced to the main topic reach the Node service
as POSTs in the documented request format (binary key, value and record headers decoded by Node itself), a 503 with
``Retry-After`` and a 500 are retried, a 422 is dead-lettered, and every delivery of one record carries the same
``Idempotency-Key``. Everything is checked from what the Node service recorded and from the attempts and failed
topics, never from inside the worker.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from demo.harness import Record, Worker, produce
from rebound import headers as h
from rebound.http_errors import HttpOverloaded, HttpPermanentStatus, HttpRetryableStatus
from tests.integration.conftest import Deployment, attempts_by_key, failed_records

SERVER = Path(__file__).resolve().parents[2] / "services" / "node-handler" / "server.js"
TERMINAL = {"succeeded", "dead", "expired"}
RETRY_AFTER_S = 3  # longer than the 1 s tier, so the wait can only come from the header

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not on PATH: the Node service cannot run")


def class_name(cls: type[Exception]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def b64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


class NodeService:
    def __init__(self, log: Path) -> None:
        assert NODE is not None
        self.log = log.open("wb")
        self.process = subprocess.Popen(
            [NODE, str(SERVER), "--port", "0"], stdout=subprocess.PIPE, stderr=self.log, start_new_session=True
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise AssertionError(f"the Node service did not start: {log.read_text(errors='replace')}")
        self.port = int(json.loads(line)["listening"])
        self.url = f"http://127.0.0.1:{self.port}"

    def calls(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/calls", timeout=10) as response:
            calls: list[dict[str, Any]] = json.loads(response.read())
            return calls

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeService]:
    service = NodeService(tmp_path_factory.mktemp("node") / "node.log")
    try:
        yield service
    finally:
        service.stop()


def script(**fields: object) -> bytes:
    return json.dumps(fields).encode()


BINARY_KEY = b"bin-\x00\xff\xfe"
BINARY_HEADER = b"\x00\x01\xfe\xff"
# Kafka keeps every header of a record, repeated names included, in the producer's order: so must the request.
REPEATED_HEADERS: list[tuple[str, bytes | None]] = [
    ("dup", b"first"),
    ("nil", None),
    ("dup", b"\x00\xff"),
    ("empty", b""),
    ("dup", b"third"),
    ("nil", None),
]
# A header with a null value (legal in Kafka; aiokafka writes it as Java does) must reach the service as null.
RECORDS: list[tuple[bytes | None, bytes | None, list[tuple[str, Any]]]] = [
    (b"ok", script(), [("trace-id", b"t-1")]),
    (None, script(), [("nil", None), ("plain", b"v")]),
    (BINARY_KEY, b"\x89PNG\r\n\x1a\n\x00\xff", [("blob", BINARY_HEADER)]),
    (b"overloaded-once", script(fail_until=1, fail_status=503, retry_after=str(RETRY_AFTER_S)), []),
    (b"fails-twice", script(fail_until=2, fail_status=500), []),
    (b"refused", script(status=422), []),
    (b"null-value", None, []),
    (b"repeated", script(fail_until=1, fail_status=500), REPEATED_HEADERS),
]


@pytest.fixture(scope="module")
def flow(deploy: Any, node: NodeService) -> tuple[Deployment, list[Record], list[dict[str, Any]]]:
    deployment: Deployment = deploy(REBOUND_RETRY_SEQUENCE="1s,1s,1s")
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, RECORDS))
    env = deployment.worker_env(deployment.root / "data-node")
    env["REBOUND_HANDLER"] = f"{node.url}/events"
    worker = Worker(env, deployment.root / "node-worker.log").start()
    deployment.workers.append(worker)

    def done(seen: list[Record]) -> bool:
        by_key = attempts_by_key(seen)
        keys = [None if key is None else key.decode("utf-8", "backslashreplace") for key, _, _ in RECORDS]
        return all(key in by_key and by_key[key][-1]["outcome"] in TERMINAL for key in keys)

    records = deployment.collect(done, timeout=120)
    return deployment, records, node.calls()


def calls_for(flow: Any, key: bytes) -> list[dict[str, Any]]:
    deployment: Deployment = flow[0]
    mine = [call for call in flow[2] if call["topic"] == deployment.topic and call["key"] == b64(key)]
    return sorted(mine, key=lambda call: call["attempt"])


def outcomes(flow: Any, key: str) -> list[tuple[int, str]]:
    return [(event["attempt"], event["outcome"]) for event in attempts_by_key(flow[1])[key]]


def test_a_success_arrives_once_with_the_documented_request(flow: Any) -> None:
    deployment: Deployment = flow[0]
    [call] = calls_for(flow, b"ok")
    event = attempts_by_key(flow[1])["ok"][0]
    assert outcomes(flow, "ok") == [(0, "succeeded")]
    assert call["path"] == "/events"
    assert call["status"] == 200
    assert call["attempt"] == 0
    assert call["tier"] is None
    assert (call["topic"], call["partition"], call["offset"]) == (
        deployment.topic,
        event["original_partition"],
        event["original_offset"],
    )
    assert call["first_received_at"] == str(event["first_received_at"])
    assert call["content_type"] == "application/octet-stream"
    assert call["authorization"] is None  # no token configured, none sent
    assert base64.b64decode(call["value"]) == script()
    assert call["headers"] == [["trace-id", b64(b"t-1")]]  # the record's own headers only, never Rebound's
    assert call["idempotency_key"] == f"{deployment.app_id}:{deployment.topic}:{call['partition']}:{call['offset']}"


def test_binary_key_value_and_header_reach_node_byte_exact(flow: Any) -> None:
    [call] = calls_for(flow, BINARY_KEY)
    assert call["status"] == 200
    assert call["key_null"] is False
    assert base64.b64decode(call["value"]) == b"\x89PNG\r\n\x1a\n\x00\xff"
    assert call["headers"] == [["blob", b64(BINARY_HEADER)]]


def test_a_null_key_and_a_null_header_value_are_marked(flow: Any) -> None:
    deployment: Deployment = flow[0]
    [call] = [c for c in flow[2] if c["topic"] == deployment.topic and c["key_null"]]
    assert call["key"] is None
    assert call["headers"] == [["nil", None], ["plain", b64(b"v")]]
    assert call["status"] == 200
    assert call["idempotency_key"] == f"{deployment.app_id}:{deployment.topic}:{call['partition']}:{call['offset']}"


def test_a_null_value_is_marked_not_sent_as_empty(flow: Any) -> None:
    [call] = calls_for(flow, b"null-value")
    assert call["value_null"] is True
    assert call["value"] == ""
    assert outcomes(flow, "null-value") == [(0, "succeeded")]


def test_a_503_with_retry_after_is_retried_no_sooner_than_it_asks(flow: Any) -> None:
    first, retry = calls_for(flow, b"overloaded-once")
    assert (first["status"], retry["status"]) == (503, 200)
    assert (first["attempt"], retry["attempt"]) == (0, 1)
    assert retry["tier"] == "1s"
    assert retry["received_at"] - first["answered_at"] >= RETRY_AFTER_S * 1000
    assert outcomes(flow, "overloaded-once") == [(0, "scheduled"), (1, "succeeded")]
    [scheduled] = [e for e in attempts_by_key(flow[1])["overloaded-once"] if e["outcome"] == "scheduled"]
    assert scheduled["error_class"] == class_name(HttpOverloaded)
    assert "503" in scheduled["error_message"]
    assert scheduled["due_at"] >= first["answered_at"] + RETRY_AFTER_S * 1000


def test_a_500_is_retried_through_the_tiers_with_one_idempotency_key(flow: Any) -> None:
    calls = calls_for(flow, b"fails-twice")
    assert [(call["attempt"], call["status"]) for call in calls] == [(0, 500), (1, 500), (2, 200)]
    assert [call["tier"] for call in calls] == [None, "1s", "1s"]
    assert len({call["idempotency_key"] for call in calls}) == 1
    assert len({(call["partition"], call["offset"]) for call in calls}) == 1  # the original record's place
    assert len({call["first_received_at"] for call in calls}) == 1
    assert outcomes(flow, "fails-twice") == [(0, "scheduled"), (1, "scheduled"), (2, "succeeded")]
    errors = {e["error_class"] for e in attempts_by_key(flow[1])["fails-twice"] if e["outcome"] == "scheduled"}
    assert errors == {class_name(HttpRetryableStatus)}


def test_a_422_is_dead_lettered_at_once_with_the_body_as_its_message(flow: Any) -> None:
    [call] = calls_for(flow, b"refused")
    assert call["status"] == 422
    assert outcomes(flow, "refused") == [(0, "dead")]
    [record] = [r for r in failed_records(flow[1]) if r.key == b"refused"]
    assert record.headers[h.REASON] == b"permanent"
    assert record.headers[h.ERROR_CLASS] == class_name(HttpPermanentStatus).encode()
    assert b"node-handler: status 422" in record.headers[h.ERROR_MESSAGE]
    assert record.value == script(status=422)


def test_every_record_reached_node_and_nothing_else_did(flow: Any) -> None:
    deployment: Deployment = flow[0]
    mine = [call for call in flow[2] if call["topic"] == deployment.topic]
    assert len(mine) == 1 + 1 + 1 + 2 + 3 + 1 + 1 + 2
    keys = {(call["partition"], call["offset"]): call["idempotency_key"] for call in mine}
    assert len(set(keys.values())) == len(RECORDS)  # one key per original record, different between records


def test_repeated_header_names_reach_node_in_order_with_nulls_and_bytes(flow: Any) -> None:
    """Decoded by Node into Buffers and read back: every value of a repeated name, nulls, empty and binary values, on
    the first try and on the retry released from the parked state."""
    first, retry = calls_for(flow, b"repeated")
    assert (first["status"], retry["status"]) == (500, 200)
    expected = [[name, None if value is None else b64(value)] for name, value in REPEATED_HEADERS]
    assert first["headers"] == expected
    assert retry["headers"] == expected


@pytest.mark.parametrize(
    ("header_list", "says"),
    [
        (None, "no Rebound-Header-List"),
        ("[[", "not JSON"),
        ('{"dup": "AP8="}', "not a JSON array"),  # the object of before: refused, not misread as names 0, 1, ...
        ('[["dup"]]', "not a [name, value] pair"),
        ('[[1, "AP8="]]', "not a [name, value] pair"),
        ('[["dup", 1]]', "not canonical base64"),
        ('[["dup", "AP8"]]', "not canonical base64"),  # unpadded: Buffer.from would decode it silently
        ('[["dup", "A P8="]]', "not canonical base64"),
    ],
)
def test_a_malformed_header_list_is_refused_with_a_400_that_says_why(
    node: NodeService, header_list: str | None, says: str
) -> None:
    """A request Node cannot decode is answered 400 naming the fault, whatever the value's script asks (here 200):
    a conformance service that answered it as a delivery would hide a broken sender. No broker is needed."""
    headers = {"Rebound-Attempt": "0", "Idempotency-Key": f"malformed:{header_list}"}
    if header_list is not None:
        headers["Rebound-Header-List"] = header_list
    request = urllib.request.Request(f"{node.url}/events", data=script(status=200), headers=headers, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    text = refused.value.read().decode()
    assert refused.value.code == 400 and "Rebound-Header-List" in text and says in text, text
    [call] = [call for call in node.calls() if call["idempotency_key"] == headers["Idempotency-Key"]]
    assert call["status"] == 400 and call["headers"] == {"error": text.split(": ", 1)[1]}
