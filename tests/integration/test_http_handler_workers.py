"""The HTTP push handler end to end: real ``faust -A app worker`` processes on the embedded broker POST each event to
a real HTTP service on a loopback port (an aiohttp server in a thread of the test process, scripted by the record's
value), and the outcomes, retries, ``Retry-After``, ``Idempotency-Key``, key order, start-up refusal and readiness
are read back from the topics, the service's own log of requests, and the worker's ``/ready``.

Most cases share one worker (``REBOUND_ORDERING=key``, retry sequence ``1s,2s``); the service that is down at start
and the SIGKILL redelivery need workers of their own.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from demo.embedded_broker import free_port
from demo.harness import Record, Worker, produce
from demo.reference_service import record_headers
from rebound import headers as h
from tests.integration.conftest import Deployment, attempts_by_key, failed_records

pytestmark = pytest.mark.broker
TERMINAL = {"succeeded", "dead", "expired"}
RETRYABLE = "rebound.http_errors.HttpRetryableStatus"


@dataclass
class Call:
    at: float  # wall clock, seconds
    headers: dict[str, str]
    body: bytes
    script_id: str | None


@dataclass
class ScriptedService:
    """Answers each POST as its body says: ``{"id": ..., "answers": [{"status": 503, "retry_after": "3",
    "sleep": 0.5}, ...]}``, the n-th call of one ``Idempotency-Key`` getting the n-th answer (the last one repeats).
    A body that is not such a script gets 200. Every request is recorded before it is answered."""

    port: int = field(default_factory=free_port)
    calls: list[Call] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _runner: web.AppRunner | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/events"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            script = json.loads(body)
        except ValueError:
            script = None
        script = script if isinstance(script, dict) else {}
        key = request.headers.get("Idempotency-Key")
        seen = sum(1 for call in self.calls if call.headers.get("Idempotency-Key") == key)
        self.calls.append(Call(time.time(), dict(request.headers), body, script.get("id")))
        answers = script.get("answers") or [{"status": 200}]
        answer = answers[min(seen, len(answers) - 1)]
        if answer.get("sleep"):
            await asyncio.sleep(answer["sleep"])
        headers = {"Retry-After": str(answer["retry_after"])} if "retry_after" in answer else {}
        return web.Response(status=answer.get("status", 200), text=answer.get("text", ""), headers=headers)

    def start(self) -> ScriptedService:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_post("/events", self._handle)
            self._runner = web.AppRunner(app)
            loop.run_until_complete(self._runner.setup())
            loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="scripted-service", daemon=True)
        self._thread.start()
        assert ready.wait(10), "the scripted service did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def calls_of(self, script_id: str) -> list[Call]:
        return [call for call in list(self.calls) if call.script_id == script_id]


def script(script_id: str, *answers: dict[str, Any]) -> bytes:
    return json.dumps({"id": script_id, "answers": list(answers)}).encode()


def get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def start_worker(deployment: Deployment, url: str, name: str = "w1") -> Worker:
    """A worker whose handler is ``url`` (the deployment's own default is the scripted Python handler)."""
    env = {**deployment.worker_env(deployment.root / f"data-{name}"), "REBOUND_HANDLER": url}
    worker = Worker(env, deployment.root / f"{name}.log").start()
    deployment.workers.append(worker)
    return worker


def terminal(seen: list[Record], keys: set[str]) -> bool:
    by_key = attempts_by_key(seen)
    return all(key in by_key and by_key[key][-1]["outcome"] in TERMINAL for key in keys)


@pytest.fixture
def service() -> Iterator[ScriptedService]:
    started = ScriptedService().start()
    yield started
    started.stop()


# --------------------------------------------------------------------------------------- one worker, many cases


# Kafka keeps every header, repeated names included, in the producer's order: a null, an empty and binary values.
REPEATED_HEADERS: list[tuple[str, bytes | None]] = [
    ("dup", b"\x00\xff"),
    ("nil", None),
    ("dup", b""),
    ("other", b"x"),
    ("dup", b"\xfe"),
    ("nil", None),
]


@dataclass
class Shared:
    deployment: Deployment
    service: ScriptedService
    seen: list[Record]


@pytest.fixture(scope="module")
def shared(deploy: Any) -> Iterator[Shared]:
    service = ScriptedService().start()
    deployment: Deployment = deploy(
        partitions=2,
        REBOUND_HTTP_TOKEN="test-token",
        REBOUND_RETRY_SEQUENCE="1s,2s",
        REBOUND_HANDLER_TIMEOUT="2s",  # the request's own timeout: 1.8 s
        REBOUND_ORDERING="key",
    )
    records = [
        (b"ok", script("ok", {"status": 200}), [("trace-id", b"\x00\x01")]),
        (b"missing", script("missing", {"status": 404, "text": "no such item"}), []),
        (b"flaky", script("flaky", {"status": 500, "text": "database restarting"}, {"status": 204}), []),
        (b"slow", script("slow", {"sleep": 4.0}, {"status": 200}), []),
        (b"busy", script("busy", {"status": 503, "retry_after": 3, "text": "queue full"}, {"status": 200}), []),
        (b"ordered", script("m1", {"status": 500}, {"status": 200}), []),
        (b"ordered", script("m2", {"status": 200}), []),
        (b"ordered", script("m3", {"status": 200}), []),
        (b"null-value", None, [("nul", None)]),
        (b"repeated", script("repeated", {"status": 500}, {"status": 200}), REPEATED_HEADERS),
    ]
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, records))  # type: ignore[arg-type]
    start_worker(deployment, service.url)
    keys = {"ok", "missing", "flaky", "slow", "busy", "ordered", "null-value", "repeated"}

    def done(seen: list[Record]) -> bool:
        return (
            terminal(seen, keys)
            and sum(1 for e in attempts_by_key(seen)["ordered"] if e["outcome"] == "succeeded") == 3
        )

    seen = deployment.collect(done, timeout=90)
    yield Shared(deployment, service, seen)
    service.stop()


def outcomes(shared: Shared, key: str) -> list[tuple[int, str | None, str, str | None]]:
    return [
        (event["attempt"], event["tier"], event["outcome"], event.get("error_class"))
        for event in attempts_by_key(shared.seen)[key]
    ]


def test_a_2xx_succeeds_with_the_body_and_headers_as_documented(shared: Shared) -> None:
    assert outcomes(shared, "ok") == [(0, None, "succeeded", None)]
    [call] = shared.service.calls_of("ok")
    assert call.body == script("ok", {"status": 200})
    assert call.headers["Authorization"] == "Bearer test-token"
    assert base64.b64decode(call.headers["Rebound-Key"]) == b"ok"
    assert record_headers(call.headers["Rebound-Header-List"]) == [("trace-id", b"\x00\x01")]
    topic, partition, offset = (call.headers[f"Rebound-{n}"] for n in ("Topic", "Partition", "Offset"))
    assert topic == shared.deployment.topic
    assert call.headers["Idempotency-Key"] == f"{shared.deployment.app_id}:{topic}:{partition}:{offset}"
    assert call.headers["Rebound-Attempt"] == "0" and "Rebound-Tier" not in call.headers


def test_a_null_value_and_a_null_header_are_marked(shared: Shared) -> None:
    assert outcomes(shared, "null-value") == [(0, None, "succeeded", None)]
    [call] = [c for c in shared.service.calls if c.headers.get("Rebound-Value-Null") == "1"]
    assert call.body == b""
    assert record_headers(call.headers["Rebound-Header-List"]) == [("nul", None)]


def test_repeated_header_names_arrive_in_order_on_the_first_try_and_the_retry(shared: Shared) -> None:
    """Through the key-ordered worker: the retry's headers come back from the parked state as they were sent."""
    assert outcomes(shared, "repeated") == [(0, None, "scheduled", RETRYABLE), (1, "1s", "succeeded", None)]
    first, retry = shared.service.calls_of("repeated")
    assert record_headers(first.headers["Rebound-Header-List"]) == REPEATED_HEADERS
    assert record_headers(retry.headers["Rebound-Header-List"]) == REPEATED_HEADERS


def test_a_permanent_status_dead_letters_at_once_with_the_bodys_first_bytes(shared: Shared) -> None:
    assert outcomes(shared, "missing") == [(0, None, "dead", "rebound.http_errors.HttpPermanentStatus")]
    [record] = [r for r in failed_records(shared.seen) if r.key == b"missing"]
    assert record.headers[h.REASON] == b"permanent"
    assert record.headers[h.ERROR_MESSAGE] == b"HTTP 404 Not Found: no such item"
    assert record.value == script("missing", {"status": 404, "text": "no such item"})


def test_a_retryable_status_is_retried_with_the_same_idempotency_key(shared: Shared) -> None:
    assert outcomes(shared, "flaky") == [(0, None, "scheduled", RETRYABLE), (1, "1s", "succeeded", None)]
    first, retry = shared.service.calls_of("flaky")
    assert first.headers["Idempotency-Key"] == retry.headers["Idempotency-Key"]
    assert (retry.headers["Rebound-Attempt"], retry.headers["Rebound-Tier"]) == ("1", "1s")
    assert retry.at - first.at >= 1.0
    [event] = [e for e in attempts_by_key(shared.seen)["flaky"] if e["outcome"] == "scheduled"]
    assert event["error_message"] == "HTTP 500 Internal Server Error: database restarting"


def test_a_service_slower_than_the_request_timeout_is_retried(shared: Shared) -> None:
    assert outcomes(shared, "slow") == [
        (0, None, "scheduled", "rebound.http_errors.HttpTimeout"),
        (1, "1s", "succeeded", None),
    ]
    [event] = [e for e in attempts_by_key(shared.seen)["slow"] if e["outcome"] == "scheduled"]
    assert "within 1.8s" in event["error_message"]  # the request's own timeout, not Rebound's HandlerTimeout


def test_retry_after_is_honoured_beyond_the_tier_delay(shared: Shared) -> None:
    assert outcomes(shared, "busy") == [
        (0, None, "scheduled", "rebound.http_errors.HttpOverloaded"),
        (1, "1s", "succeeded", None),
    ]
    [event] = [e for e in attempts_by_key(shared.seen)["busy"] if e["outcome"] == "scheduled"]
    first, retry = shared.service.calls_of("busy")
    assert retry.at - first.at >= 3.0, "released before its Retry-After (the tier's delay is 1 s)"
    assert event["due_at"] - int(first.at * 1000) >= 3000


def test_key_order_is_held_behind_a_retry(shared: Shared) -> None:
    order = [call.script_id for call in shared.service.calls if call.script_id in ("m1", "m2", "m3")]
    assert order == ["m1", "m1", "m2", "m3"]


def test_the_service_is_reachable_and_the_worker_ready(shared: Shared) -> None:
    worker = shared.deployment.workers[0]
    status, body = get(f"http://127.0.0.1:{worker.web_port}/ready")
    assert body["handler"]["reachable"] is True and body["handler"]["url"] == shared.service.url
    assert status == 200, body


def test_a_stopping_worker_closes_its_session(shared: Shared) -> None:
    """Last of the shared worker's tests: SIGTERM, and the session is closed by the app's service at the stop."""
    worker = shared.deployment.workers[0]
    assert worker.stop(timeout=30) == 0
    assert "rebound: HTTP handler session closed" in worker.log_text()
    assert "test-token" not in worker.log_text()


# ------------------------------------------------------------------------------------------ workers of their own


def test_a_service_down_at_start_is_not_a_start_up_error(deploy: Any) -> None:
    """The worker starts, its calls fail retryably (connection refused); the first error shows in ``/ready`` at once,
    which says 503 once the calls have failed to connect for 10 s, with ``/health`` 200 (no restart loop); when the
    service comes up the retry succeeds and the worker is ready."""
    service = ScriptedService()  # not started: nothing listens on its port
    deployment: Deployment = deploy(partitions=1, REBOUND_RETRY_SEQUENCE=",".join(["1s"] * 20))
    worker = start_worker(deployment, service.url)
    asyncio.run(produce(deployment.broker.bootstrap, deployment.topic, [(b"early", script("early"), [])]))
    deployment.collect(lambda seen: "early" in attempts_by_key(seen), timeout=60)
    status, body = get(f"http://127.0.0.1:{worker.web_port}/ready")
    assert body["handler"]["connection_errors_in_a_row"] >= 1, body  # one error is shown at once
    assert "ClientConnectorError" in body["handler"]["last_connection_error"]
    assert (status == 200) == (body["handler"]["unreachable_for_s"] < 10), body
    deadline = time.monotonic() + 45
    while status != 503 and time.monotonic() < deadline:
        time.sleep(0.5)
        status, body = get(f"http://127.0.0.1:{worker.web_port}/ready")
    assert status == 503 and body["handler"]["reachable"] is False, body
    assert body["handler"]["unreachable_for_s"] >= 10
    assert get(f"http://127.0.0.1:{worker.web_port}/health")[0] == 200
    assert not worker.crashed
    service.start()
    try:
        seen = deployment.collect(lambda seen: terminal(seen, {"early"}), timeout=60)
    finally:
        service.stop()
    events = attempts_by_key(seen)["early"]
    assert events[0]["outcome"] == "scheduled"
    assert events[0]["error_class"] == "rebound.http_errors.HttpConnectionError"
    assert events[-1]["outcome"] == "succeeded"
    assert get(f"http://127.0.0.1:{worker.web_port}/ready")[1]["handler"]["reachable"] is True


def poll_ready(worker: Worker, until: Any, timeout: float) -> tuple[int, dict[str, Any]]:
    """``/ready`` every half second until ``until(status, body)`` or ``timeout``; the last answer (0 and ``{}`` while
    the worker's web server is not up yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status, body = get(f"http://127.0.0.1:{worker.web_port}/ready")
        except (urllib.error.URLError, ConnectionError):
            status, body = 0, {}
        if until(status, body) or time.monotonic() >= deadline:
            return status, body
        time.sleep(0.5)


def test_an_idle_worker_sees_its_service_go_down_and_come_back(deploy: Any, service: ScriptedService) -> None:
    """No message at all: ``/ready`` probes the service (a connection, no request) once nothing has been learnt for
    5 s, so a service that goes down takes the worker out of its endpoints after 10 s of failed probes, and one that
    comes back brings it in again without waiting for a message."""
    deployment: Deployment = deploy(partitions=1)
    worker = start_worker(deployment, service.url)
    status, body = poll_ready(
        worker, lambda status, body: status == 200 and body.get("handler", {}).get("reachable") is True, 60
    )
    assert status == 200 and body["handler"]["probes"] >= 1 and body["handler"]["calls"] == 0, body
    service.stop()
    status, body = poll_ready(worker, lambda status, body: status == 503, 45)
    assert status == 503 and body["handler"]["reachable"] is False, body
    assert "probe: " in body["handler"]["last_connection_error"] and body["handler"]["unreachable_for_s"] >= 10
    service.start()
    status, body = poll_ready(worker, lambda status, body: status == 200, 30)
    assert status == 200 and body["handler"]["reachable"] is True, body
    assert body["handler"]["calls"] == 0 and service.calls == [], "a probe reached the service as a request"


def test_the_idempotency_key_survives_a_sigkill_redelivery(deploy: Any, service: ScriptedService) -> None:
    deployment: Deployment = deploy(partitions=1, REBOUND_RETRY_SEQUENCE="1s")
    first = start_worker(deployment, service.url, "first")
    asyncio.run(
        produce(
            deployment.broker.bootstrap,
            deployment.topic,
            [(b"killed", script("killed", {"status": 200, "sleep": 30}, {"status": 200}), [])],
        )
    )
    deadline = time.monotonic() + 60
    while not service.calls_of("killed"):
        assert time.monotonic() < deadline and not first.crashed, first.log_text()[-4000:]
        time.sleep(0.05)
    first.kill()  # SIGKILL during the call: the offset is not committed, the next worker gets the record again
    start_worker(deployment, service.url, "second")
    seen = deployment.collect(lambda seen: terminal(seen, {"killed"}), timeout=90)
    assert attempts_by_key(seen)["killed"][-1]["outcome"] == "succeeded"
    before, after = service.calls_of("killed")[:2]
    assert before.headers["Idempotency-Key"] == after.headers["Idempotency-Key"]
    assert after.headers["Rebound-Attempt"] == "0"  # a redelivery of the first try, not a retry


@pytest.mark.parametrize(
    ("url", "fragment"),
    [("https:/orders.internal/events", "not a valid URL"), ("grpc://orders.internal:9000", "scheme 'grpc'")],
)
def test_a_malformed_url_or_another_scheme_is_refused_at_start_up(deploy: Any, url: str, fragment: str) -> None:
    deployment: Deployment = deploy(partitions=1)
    env = {**deployment.worker_env(deployment.root / "data-refused"), "REBOUND_HANDLER": url}
    worker = Worker(env, deployment.root / "refused.log").start()
    assert worker.process is not None
    assert worker.process.wait(60) == 78
    lines = [line for line in worker.log_text().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("rebound: configuration error, not started: "), lines
    assert f"REBOUND_HANDLER={url!r}" in lines[0] and fragment in lines[0]
