"""The HTTP push handler against a real aiohttp server on a loopback port: what the service receives, how each answer
(or its absence) becomes an outcome, the pooled session, TLS and the token kept out of sight."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import email.utils
import json
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from app.handlers import handler_readiness, load_handler
from app.http_handler import BODY_DRAIN_BYTES, PROBE_WHEN_IDLE_S, UNREACHABLE_AFTER_S, HttpHandler, request_timeout_s
from app.views import ready_answer
from demo.reference_service import ReferenceService, ServiceSettings
from rebound.errors import ConfigurationError, OverloadError, PermanentError, RetryableError
from rebound.event import RetryEvent
from rebound.http_errors import (
    HttpConnectionError,
    HttpHeadersTooLarge,
    HttpOverloaded,
    HttpPermanentStatus,
    HttpRetryableStatus,
    HttpTimeout,
)
from rebound.routing import ErrorClassifier, error_class_name
from rebound.settings import load_settings
from tests.app.conftest import TEST_HOST

Reply = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Service:
    """A scripted service: records each request, answers with ``reply``."""

    reply: Reply
    requests: list[dict[str, Any]] = field(default_factory=list)
    peers: list[Any] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append({"headers": dict(request.headers), "body": await request.read(), "path": request.path})
        self.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        return await self.reply(request)


async def ok(request: web.Request) -> web.StreamResponse:
    return web.Response(status=204)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[Service]]]:
    runners: list[web.AppRunner] = []

    async def start(reply: Reply = ok, ssl_context: ssl.SSLContext | None = None) -> Service:
        service = Service(reply)
        app = web.Application()
        app.router.add_post("/events", service.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        service.url = f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}/events"
        return service

    yield start
    for runner in runners:
        await runner.cleanup()


def event(**overrides: Any) -> RetryEvent:
    fields: dict[str, Any] = {
        "key": b"item-1",
        "value": b'{"id": 1}\x00\xff',
        "headers": {"trace": b"t-1", "nul": None},
        "topic": "items",
        "partition": 2,
        "offset": 17,
        "attempt": 0,
        "timestamp_ms": 1000,
        "first_received_at_ms": 2000,
    }
    fields.update(overrides)
    return RetryEvent(**fields)


def handler_for(url: str, **settings: Any) -> HttpHandler:
    made = load_handler(url, load_settings(handler=url, app_id="shop", **settings))
    assert isinstance(made, HttpHandler)
    return made


@pytest.fixture
async def handlers() -> AsyncIterator[list[HttpHandler]]:
    made: list[HttpHandler] = []
    yield made
    for handler in made:
        await handler.aclose()


@pytest.fixture
def clocked(handlers: list[HttpHandler]) -> Callable[..., tuple[HttpHandler, FakeMonotonic]]:
    """``clocked(url, **settings)``: a handler closed after the test, its reachability on a clock the test moves."""

    def make(url: str, **settings: Any) -> tuple[HttpHandler, FakeMonotonic]:
        handler = handler_for(url, **settings)
        handlers.append(handler)
        clock = handler.reachability.clock = FakeMonotonic()
        return handler, clock

    return make


async def test_each_event_is_posted_with_its_body_unchanged_and_documented_headers(serve: Any, handlers: Any) -> None:
    service = await serve()
    handler = handler_for(service.url, http_token="s3cret-token")
    handlers.append(handler)
    assert handler.session is None  # created in the worker's loop, at the first call
    await handler(event())
    await handler(event(attempt=1, tier="1s", key=None, value=None, headers={}))
    first, retry = service.requests
    assert first["body"] == b'{"id": 1}\x00\xff'
    headers = first["headers"]
    assert headers["Content-Type"] == "application/octet-stream"
    assert headers["Authorization"] == "Bearer s3cret-token"
    assert headers["Idempotency-Key"] == "shop:items:2:17"
    assert base64.b64decode(headers["Rebound-Key"]) == b"item-1"
    assert json.loads(headers["Rebound-Header-List"]) == [["trace", base64.b64encode(b"t-1").decode()], ["nul", None]]
    assert (headers["Rebound-Topic"], headers["Rebound-Partition"], headers["Rebound-Offset"]) == ("items", "2", "17")
    assert (headers["Rebound-Attempt"], headers["Rebound-Timestamp"], headers["Rebound-First-Received-At"]) == (
        "0",
        "1000",
        "2000",
    )
    assert "Rebound-Tier" not in headers and "Rebound-Value-Null" not in headers
    assert retry["body"] == b""
    assert retry["headers"]["Rebound-Value-Null"] == "1" and retry["headers"]["Rebound-Key-Null"] == "1"
    assert retry["headers"]["Rebound-Tier"] == "1s" and retry["headers"]["Rebound-Attempt"] == "1"
    assert retry["headers"]["Idempotency-Key"] == headers["Idempotency-Key"]
    assert service.peers[0] == service.peers[1], "the second call did not reuse the kept-alive connection"
    assert handler.readiness()["reachable"] is True


async def test_the_token_never_appears_in_a_repr_or_a_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG")
    handler = handler_for("http://127.0.0.1:9/x?api_key=k3y", http_token="s3cret-token")
    assert "bearer token set" in caplog.text and "s3cret-token" not in caplog.text and "k3y" not in caplog.text
    settings = load_settings(handler="http://127.0.0.1:9/x?api_key=k3y", http_token="s3cret-token")
    for text in (repr(handler), repr(handler.config), repr(settings), str(settings.model_dump())):
        assert "s3cret-token" not in text
    assert "token=set" in repr(handler)


def answer(status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> Reply:
    async def reply(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, body=body, headers=headers or {})

    return reply


@pytest.mark.parametrize(
    ("status", "error", "parent"),
    [
        (400, HttpPermanentStatus, PermanentError),
        (404, HttpPermanentStatus, PermanentError),
        (408, HttpRetryableStatus, RetryableError),
        (425, HttpRetryableStatus, RetryableError),
        (429, HttpOverloaded, OverloadError),
        (500, HttpRetryableStatus, RetryableError),
        (503, HttpOverloaded, OverloadError),
        (302, HttpPermanentStatus, PermanentError),
        (307, HttpPermanentStatus, PermanentError),
    ],
)
async def test_statuses_map_to_one_error_class_each(
    serve: Any, handlers: Any, status: int, error: type[Exception], parent: type[Exception]
) -> None:
    service = await serve(answer(status, b"the service says why\n" + b"x" * 1000, {"Location": "/elsewhere"}))
    handler = handler_for(service.url)
    handlers.append(handler)
    with pytest.raises(error) as raised:
        await handler(event())
    assert isinstance(raised.value, parent)
    assert raised.value.status == status  # type: ignore[attr-defined]
    message = str(raised.value)
    assert message.startswith(f"HTTP {status} ") and "the service says why x" in message
    assert len(message.encode()) < 300
    assert error_class_name(raised.value) == f"rebound.http_errors.{error.__name__}"
    # Rebound's own classes decide for themselves: REBOUND_PERMANENT_ERRORS cannot turn a 503 permanent.
    listed = ErrorClassifier(permanent_names=frozenset({"Exception", "RetryableError", "OverloadError"}))
    assert listed.classify(raised.value).value == ("permanent" if parent is PermanentError else "retryable")
    assert len(service.requests) == 1, "a redirect was followed"
    assert handler.readiness()["reachable"] is True  # an answer, whatever its status, is a reachable service


async def test_retry_after_seconds_and_http_date_on_429_and_503(serve: Any, handlers: Any) -> None:
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=120)
    replies = iter(
        [
            answer(503, headers={"Retry-After": "7"}),
            answer(429, headers={"Retry-After": email.utils.format_datetime(later, usegmt=True)}),
        ]
    )

    async def reply(request: web.Request) -> web.StreamResponse:
        return await next(replies)(request)

    service = await serve(reply)
    handler = handler_for(service.url)
    handlers.append(handler)
    with pytest.raises(HttpOverloaded) as seconds:
        await handler(event())
    assert seconds.value.retry_after_s == 7
    with pytest.raises(HttpOverloaded) as date:
        await handler(event())
    assert date.value.retry_after_s is not None and 115 <= date.value.retry_after_s <= 121


async def test_the_status_lists_are_configurable(serve: Any, handlers: Any) -> None:
    service = await serve(answer(409))
    handler = handler_for(service.url, http_retryable_statuses="409,5xx")
    handlers.append(handler)
    with pytest.raises(HttpRetryableStatus):
        await handler(event())


async def test_a_slow_service_fails_on_the_requests_own_timeout_before_the_handler_timeout(
    serve: Any, handlers: Any
) -> None:
    async def slow(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(3)
        return web.Response(status=200)

    service = await serve(slow)
    handler = handler_for(service.url, handler_timeout="1s")
    handlers.append(handler)
    assert handler.config.request_timeout_s == request_timeout_s(1.0) == 0.9
    started = asyncio.get_running_loop().time()
    with pytest.raises(HttpTimeout, match=r"within 0\.9s"):
        await handler(event())
    assert 0.8 <= asyncio.get_running_loop().time() - started < 1.5
    assert handler.readiness()["reachable"] is True


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ready(handler: HttpHandler) -> tuple[dict[str, Any], int]:
    return ready_answer(
        rebalancing=False, has_partitions=True, pause_state_known=True, handler=handler_readiness(handler)
    )


async def test_a_service_that_is_down_fails_retryably_and_readiness_says_so_once_persistent(
    serve: Any, clocked: Any
) -> None:
    url = f"http://127.0.0.1:{closed_port()}/events"
    handler, clock = clocked(url)
    handler.probe_when_idle_s = None  # the calls' own rule; the probes of an idle worker are tested below
    body, status = ready(handler)
    assert status == 200 and body["handler"]["reachable"] is None  # nothing known before the first call
    with pytest.raises(HttpConnectionError, match=r"127\.0\.0\.1"):
        await handler(event())
    body, status = ready(handler)
    assert status == 200, "one connection error is not an unreachable service"
    assert body["handler"]["reachable"] is True and body["handler"]["connection_errors_in_a_row"] == 1
    assert "Connect" in body["handler"]["last_connection_error"]  # shown at once all the same
    clock.now += UNREACHABLE_AFTER_S - 0.1
    with pytest.raises(HttpConnectionError):
        await handler(event())
    assert ready(handler)[1] == 200
    clock.now += 0.1  # every call for UNREACHABLE_AFTER_S failed to connect: persistent
    with pytest.raises(HttpConnectionError):
        await handler(event())
    body, status = ready(handler)
    assert status == 503 and body["ready"] is False
    assert body["handler"]["reachable"] is False and body["handler"]["connection_errors_in_a_row"] == 3
    assert body["handler"]["unreachable_for_s"] == UNREACHABLE_AFTER_S


async def test_readiness_recovers_at_the_first_answer(serve: Any, clocked: Any) -> None:
    service = await serve()
    handler, clock = clocked(service.url)
    handler.reachability.record("connection-error", connection_error="ClientConnectorError: refused")
    clock.now += UNREACHABLE_AFTER_S
    handler.reachability.record("connection-error", connection_error="ClientConnectorError: refused")
    assert handler.readiness()["reachable"] is False
    await handler(event())
    assert handler.readiness()["reachable"] is True
    clock.now += UNREACHABLE_AFTER_S  # a new run of errors starts its own count
    handler.reachability.record("connection-error", connection_error="ClientConnectorError: refused")
    assert handler.readiness()["reachable"] is True


async def test_one_transient_disconnect_among_answers_does_not_flip_readiness(serve: Any, handlers: Any) -> None:
    calls = 0

    async def flaky(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls in (3, 4):  # an instance restarting mid-request: the retry on a fresh connection is dropped too
            assert request.transport is not None
            request.transport.abort()
        return web.Response(status=204)

    service = await serve(flaky)
    handler = handler_for(service.url)
    handlers.append(handler)
    await handler(event(offset=1))
    await handler(event(offset=2))
    with pytest.raises(HttpConnectionError):
        await handler(event(offset=3))
    body, status = ready(handler)
    assert status == 200 and body["handler"]["connection_errors_in_a_row"] == 1


@dataclass
class Restartable:
    """An HTTP service on a fixed port that can be stopped and started again, as a service's deployment is."""

    port: int = field(default_factory=closed_port)
    requests: int = 0
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/events"

    async def start(self) -> None:
        async def handle(request: web.Request) -> web.StreamResponse:
            self.requests += 1
            return web.Response(status=204)

        app = web.Application()
        app.router.add_route("*", "/{path:.*}", handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.fixture
async def restartable() -> AsyncIterator[Restartable]:
    service = Restartable()
    yield service
    await service.stop()


async def ready_after_probe(handler: HttpHandler) -> tuple[dict[str, Any], int]:
    """``/ready`` twice around the probe the first one started: the probe's result shows at the next ``/ready``."""
    ready(handler)
    assert handler._probe is not None, "no probe was started"
    await handler._probe
    return ready(handler)


async def test_with_no_calls_readiness_probes_and_sees_the_service_go_down_and_come_back(
    restartable: Restartable, clocked: Any
) -> None:
    await restartable.start()
    handler, clock = clocked(restartable.url)

    body, status = ready(handler)  # nothing known yet: ready, and a probe starts
    assert status == 200 and body["handler"]["reachable"] is None
    await handler._probe  # type: ignore[misc]
    body, status = ready(handler)
    assert status == 200 and body["handler"]["reachable"] is True
    assert (body["handler"]["probes"], body["handler"]["calls"], body["handler"]["last_probe"]) == (1, 0, "connected")
    assert handler._probe.done()  # type: ignore[union-attr]  # fresh: asking again starts no other probe

    await restartable.stop()  # down while nothing is sent its way
    clock.now += PROBE_WHEN_IDLE_S
    body, status = await ready_after_probe(handler)
    assert status == 200, "one failed probe is not an unreachable service"
    assert body["handler"]["connection_errors_in_a_row"] == 1 and "probe: " in body["handler"]["last_connection_error"]
    clock.now += UNREACHABLE_AFTER_S
    body, status = await ready_after_probe(handler)
    assert status == 503 and body["handler"]["reachable"] is False
    assert body["handler"]["unreachable_for_s"] == UNREACHABLE_AFTER_S

    await restartable.start()  # back, still with no traffic: the next probe makes the worker ready again
    clock.now += PROBE_WHEN_IDLE_S
    body, status = await ready_after_probe(handler)
    assert status == 200 and body["handler"]["reachable"] is True and body["handler"]["connection_errors_in_a_row"] == 0
    assert body["handler"]["probes"] == 4 and body["handler"]["calls"] == 0
    assert restartable.requests == 0, "a probe sent a request: the service saw something that is not a delivery"


async def test_calls_keep_readiness_fresh_without_probes(serve: Any, clocked: Any) -> None:
    service = await serve()
    handler, clock = clocked(service.url)
    await handler(event())
    clock.now += PROBE_WHEN_IDLE_S - 0.1
    assert ready(handler)[0]["handler"]["probes"] == 0 and handler._probe is None
    clock.now += 0.1  # idle for PROBE_WHEN_IDLE_S: now a probe
    await ready_after_probe(handler)
    assert handler.reachability.probes == 1 and len(service.requests) == 1


async def test_an_answer_after_a_failed_probe_ends_the_run(restartable: Restartable, clocked: Any) -> None:
    """Calls and probes count alike: a down service seen by a probe is up again at the first call answered."""
    handler, clock = clocked(restartable.url)
    await ready_after_probe(handler)
    clock.now += UNREACHABLE_AFTER_S
    with pytest.raises(HttpConnectionError):
        await handler(event())
    assert ready(handler)[1] == 503
    await restartable.start()
    await handler(event())
    assert ready(handler)[1] == 200


async def test_a_probe_checks_tls_as_calls_do(tls_handlers: Any) -> None:
    service, trusting, unverified, default = tls_handlers
    for handler in (trusting, unverified, default):
        await handler.probe()
    assert trusting.reachability.last_probe == unverified.reachability.last_probe == "connected"
    assert default.reachability.last_probe == "connection-error"
    assert "CERTIFICATE_VERIFY_FAILED" in (default.reachability.last_connection_error or "")
    assert service.requests == []


@pytest.fixture
async def resolve_test_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """:data:`TEST_HOST`, with or without its final dot, resolves to 127.0.0.1 on the test's loop (aiohttp's resolver
    and asyncio's connections both ask ``loop.getaddrinfo``)."""
    loop = asyncio.get_running_loop()
    resolve = loop.getaddrinfo

    async def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host.rstrip(".") == TEST_HOST:
            host = "127.0.0.1"
        return await resolve(host, port, *args, **kwargs)

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)


async def tls_service(serve: Any, certificate: Any) -> Service:
    cert_path, key_path = certificate
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert_path, key_path)
    return await serve(ssl_context=server_context)  # type: ignore[no-any-return]


@pytest.fixture
async def tls_handlers(
    serve: Any, handlers: list[HttpHandler], certificate: Any
) -> tuple[Service, HttpHandler, HttpHandler, HttpHandler]:
    """A service on TLS with the test's certificate, and three handlers for it: one trusting the certificate (its CA
    file), one not verifying, one verifying with the system's CAs (which do not know the certificate)."""
    service = await tls_service(serve, certificate)
    trusting = handler_for(service.url, http_ca_file=str(certificate[0]))
    unverified = handler_for(service.url, http_verify_tls="false")
    default = handler_for(service.url)
    handlers.extend([trusting, unverified, default])
    return service, trusting, unverified, default


async def test_a_probe_verifies_a_fully_qualified_name_as_a_call_does(
    serve: Any, handlers: Any, certificate: Any, resolve_test_host: None
) -> None:
    """``https://name.:port/``, a fully-qualified name with its final dot (as in Kubernetes' ``svc.cluster.local.``,
    to skip the search domains): a certificate names the host without the dot, and aiohttp checks it so. A probe
    that checked ``name.`` would fail where every call succeeds, and take an idle worker out of its endpoints."""
    service = await tls_service(serve, certificate)
    port = urlsplit(service.url).port
    handler = handler_for(f"https://{TEST_HOST}.:{port}/events", http_ca_file=str(certificate[0]))
    handlers.append(handler)
    await handler(event())
    await handler.probe()
    state = handler.reachability
    assert (state.last_probe, state.connection_errors_in_a_row) == ("connected", 0), state.last_connection_error


async def test_a_probe_uses_the_calls_tls_context_and_builds_none_on_the_loop(
    serve: Any, handlers: Any, certificate: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verification with the system's CAs: the probe reaches the calls' verdict through the calls' own connector, in
    the same words, and builds no ``SSLContext`` of its own (each loads the CA store, a blocking ~15 ms on the
    worker's loop; aiohttp builds its two at import for that reason)."""
    service = await tls_service(serve, certificate)
    handler = handler_for(service.url)
    handlers.append(handler)
    built: list[object] = []
    create = ssl.create_default_context

    def counting(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        built.append(args)
        return create(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", counting)
    with pytest.raises(HttpConnectionError) as call:
        await handler(event())
    await handler.probe()
    assert built == []
    probe_error = handler.reachability.last_connection_error or ""
    call_kind = str(call.value).split(": ")[1]
    assert call_kind == "ClientConnectorCertificateError" and probe_error.startswith(f"probe: {call_kind}: ")
    assert handler.reachability.probes == 1 and service.requests == []


async def test_a_probe_sends_nothing_and_leaves_no_connection_open(raw_serve: Any, handlers: Any) -> None:
    """The probe's connection is closed at once, not kept (nor pooled, where the next POST could find it stale)."""
    seen: list[bytes] = []

    async def watch(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        seen.append(await reader.read())  # b"" at the client's close: not a byte was sent

    url, peers = await raw_serve(watch)
    handler = handler_for(url)
    handlers.append(handler)
    await handler.probe()
    async with asyncio.timeout(5):
        while not seen:
            await asyncio.sleep(0.01)
    assert (len(peers), seen, handler.reachability.last_probe) == (1, [b""], "connected")


async def test_a_probe_that_fails_unexpectedly_is_recorded_and_not_restarted_at_each_ready(
    clocked: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connect that raises neither an ``OSError`` nor a client error (IDNA's ``UnicodeError`` did, for a host label
    over 63 bytes, before such URLs were refused at start-up). The probe records it as it records a refused
    connection, rather than ending with an exception nobody retrieves and no result, which made every ``/ready``
    start another probe."""

    async def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UnicodeError("encoding with 'idna' codec failed")

    monkeypatch.setattr(aiohttp.BaseConnector, "connect", refuse)
    handler, _ = clocked("http://127.0.0.1:9/events")
    ready(handler)
    probe = handler._probe
    assert probe is not None
    await asyncio.wait({probe})
    assert probe.exception() is None
    state = handler.reachability
    assert (state.probes, state.last_probe) == (1, "connection-error")
    assert "UnicodeError" in (state.last_connection_error or "")
    ready(handler)
    assert handler._probe is probe, "a probe's failure was not recorded: /ready started another at once"


@contextlib.contextmanager
def hanging_port() -> Iterator[int]:
    """A port whose accept queue is full: a connection to it hangs until its timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = [socket.socket() for _ in range(4)]
        for filler in fillers:
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        try:
            yield port
        finally:
            for filler in fillers:
                filler.close()


async def test_stopping_keeps_its_own_cancellation_and_still_closes_the_sessions(handlers: Any) -> None:
    """``aclose`` cancelled while it waits for the probe it cancelled: the cancellation is its caller's, not the
    probe's, and must not be swallowed (a stop that times out would otherwise carry on as if not told)."""
    with hanging_port() as port:
        handler = handler_for(f"http://127.0.0.1:{port}/events", handler_timeout="30s")
        ready(handler)
        probe = handler._probe
        assert probe is not None
        await asyncio.sleep(0.1)
        session = handler._fresh_session
        closing = asyncio.create_task(handler.aclose())
        await asyncio.sleep(0)  # aclose has cancelled the probe and waits for it
        closing.cancel()
        await asyncio.wait({closing})
        assert closing.cancelled() and probe.cancelled()
        assert session is None or session.closed


async def test_a_probe_in_flight_is_cancelled_when_the_worker_stops(handlers: Any) -> None:
    with hanging_port() as port:  # the probe's connection hangs
        handler = handler_for(f"http://127.0.0.1:{port}/events", handler_timeout="30s")
        ready(handler)
        probe = handler._probe
        assert probe is not None
        await asyncio.sleep(0.1)
        assert not probe.done()
        await handler.aclose()
        assert probe.cancelled()
        ready(handler)
        assert handler._probe is probe, "a stopped handler started another probe"


async def test_repeated_header_names_round_trip_through_the_reference_service(handlers: Any) -> None:
    """The Python reference service decodes ``Rebound-Header-List`` on its own: every value of a repeated name, in
    order, nulls, empty and binary values come back as the record had them."""
    pairs = (
        ("dup", b"\x00\xff"),
        ("nil", None),
        ("dup", b""),
        ("\u00e9t\u00e9", b"\xfe"),
        ("dup", b"3"),
        ("nil", None),
    )
    service = ReferenceService(ServiceSettings(capacity=2, service_time_ms=0))
    url = await service.start()
    try:
        handler = handler_for(f"{url}/events")
        handlers.append(handler)
        await handler(event(headers=dict(pairs), header_list=pairs))
        stats = service.snapshot()
        assert stats["record_headers"] == {
            "shop:items:2:17": [
                [name, None if value is None else base64.b64encode(value).decode()] for name, value in pairs
            ]
        }
        assert stats["served"] == 1 and stats["malformed"] == 0
        old = {"Rebound-Header-List": '{"dup": "AP8="}'}  # a JSON object, as before: refused, not misread
        async with aiohttp.ClientSession() as session, session.post(f"{url}/events", headers=old) as response:
            assert response.status == 400
        assert service.snapshot()["malformed"] == 1
    finally:
        await service.stop()


async def test_the_session_is_closed_and_a_call_after_it_fails_retryably(serve: Any) -> None:
    service = await serve()
    handler = handler_for(service.url)
    await handler(event())
    session = handler.session
    assert session is not None and not session.closed
    await handler.aclose()
    assert session.closed and handler.session is None
    with pytest.raises(HttpConnectionError, match="stopping"):
        await handler(event())


def test_python_handlers_have_no_readiness_of_their_own() -> None:
    async def handle(event: RetryEvent) -> None:
        return None

    assert handler_readiness(handle) is None


def test_a_missing_ca_file_is_a_start_up_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="REBOUND_HTTP_CA_FILE"):
        handler_for("https://127.0.0.1:9/x", http_ca_file=str(tmp_path / "missing.pem"))


async def test_https_with_a_ca_file_verification_on_and_off(tls_handlers: Any) -> None:
    service, trusting, unverified, default = tls_handlers
    await trusting(event())
    await unverified(event())
    with pytest.raises(HttpConnectionError, match="certificate"):
        await default(event())
    assert len(service.requests) == 2


async def test_the_app_closes_the_session_when_it_stops(serve: Any) -> None:
    """``attach_handler`` makes the session's close a service of the Faust app: mode stops it with the app."""
    import faust

    from agents.services import Closing
    from app.handlers import attach_handler

    service = await serve()
    handler = handler_for(service.url)
    app = faust.App("http-handler-close-test", autodiscover=False, web_enabled=False)
    attach_handler(app, handler)
    [closing] = [extra for extra in app._extra_services if isinstance(extra, Closing)]  # type: ignore[attr-defined]
    await handler(event())
    session = handler.session
    assert session is not None and not session.closed
    await closing.on_stop()
    assert session.closed


async def test_a_service_that_never_accepts_the_connection_is_unreachable(handlers: Any) -> None:
    """A full accept queue: the kernel drops the handler's SYN, the connection never completes, and the request's
    timeout ends it as a connection error (the worker is not ready), not as a slow answer."""
    clock = FakeMonotonic()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        for _ in range(4):  # fill the accept queue; later connections are left hanging
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        await asyncio.sleep(0.2)
        handler = handler_for(f"http://127.0.0.1:{port}/events", handler_timeout="1s")
        handler.reachability.clock = clock
        handlers.append(handler)
        try:
            for _ in range(2):
                with pytest.raises(HttpConnectionError, match=r"no connection within 0\.855s"):
                    await handler(event())
                clock.now += UNREACHABLE_AFTER_S
        finally:
            for filler in fillers:
                filler.close()
    assert handler.readiness()["reachable"] is False


# ----------------------------------------------------------------------------------------- raw, misbehaving servers

OnConnection = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@pytest.fixture
async def raw_serve() -> AsyncIterator[Callable[[OnConnection], Awaitable[tuple[str, list[Any]]]]]:
    """A TCP server scripted byte by byte, for what an aiohttp server would not do; each connection is numbered."""
    servers: list[asyncio.AbstractServer] = []

    async def start(on_connection: OnConnection) -> tuple[str, list[Any]]:
        peers: list[Any] = []

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peers.append(writer.get_extra_info("peername"))
            try:
                await on_connection(reader, writer, len(peers))
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(accept, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/events", peers

    yield start
    for server in servers:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    await reader.readexactly(length)


async def test_the_request_timeout_is_not_rounded_up_to_a_whole_second(raw_serve: Any, handlers: Any) -> None:
    """aiohttp rounds a timeout of 5 s or more up to the next whole second of loop time unless told not to: 5.4 s
    could fire at 6 s, after Rebound's own HandlerTimeout."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await asyncio.sleep(30)

    url, _ = await raw_serve(silent)
    handler = handler_for(url, handler_timeout="6s")
    handlers.append(handler)
    loop = asyncio.get_running_loop()
    while (loop.time() + handler.config.request_timeout_s) % 1 > 0.05:  # worst case: deadline just past a second
        await asyncio.sleep(0.005)
    started = loop.time()
    with pytest.raises(HttpTimeout):
        await handler(event())
    assert handler.config.request_timeout_s == 5.4
    assert loop.time() - started < 5.6


async def test_a_post_on_a_stale_keep_alive_connection_is_sent_again_on_a_fresh_one(
    raw_serve: Any, handlers: Any
) -> None:
    """A service closing an idle connection as the next request arrives: aiohttp retries only idempotent methods
    itself. The Idempotency-Key makes sending the POST once more safe."""
    requests: list[int] = []

    async def one_request_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        requests.append(n)
        writer.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the next request arrives just as the idle timeout closes the connection

    url, peers = await raw_serve(one_request_then_close)
    handler = handler_for(url)
    handlers.append(handler)
    await handler(event(offset=1))
    await handler(event(offset=2))
    assert requests == [1, 2] and len(peers) == 2
    body, status = ready(handler)
    assert status == 200 and body["handler"]["connection_errors_in_a_row"] == 0


async def test_a_connection_dropped_before_any_status_is_sent_again_once_only(raw_serve: Any, handlers: Any) -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)

    url, peers = await raw_serve(drop)
    handler = handler_for(url)
    handlers.append(handler)
    with pytest.raises(HttpConnectionError, match="ServerDisconnectedError"):
        await handler(event())
    assert len(peers) == 2


async def test_the_second_send_stays_within_the_request_timeout(raw_serve: Any, handlers: Any) -> None:
    async def drop_late_then_hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        await asyncio.sleep(0.6 if n == 1 else 30)

    url, peers = await raw_serve(drop_late_then_hang)
    handler = handler_for(url, handler_timeout="1s")
    handlers.append(handler)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises((HttpTimeout, HttpConnectionError)):
        await handler(event())
    assert loop.time() - started < 0.95 and len(peers) == 2


async def test_error_bodies_are_drained_so_the_connection_is_kept(serve: Any, handlers: Any) -> None:
    service = await serve(answer(503, b"<html>" + b"x" * 5000 + b"</html>"))
    handler = handler_for(service.url)
    handlers.append(handler)
    for offset in range(20):
        with pytest.raises(HttpOverloaded, match="HTTP 503 Service Unavailable: <html>xxx"):
            await handler(event(offset=offset))
    assert len(set(service.peers)) == 1


async def test_a_chunked_2xx_body_is_read_to_its_end_so_the_connection_is_kept(serve: Any, handlers: Any) -> None:
    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200)
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(3):
            await response.write(b"y" * 2000)
            await asyncio.sleep(0.01)
        await response.write_eof()
        return response

    service = await serve(chunked)
    handler = handler_for(service.url)
    handlers.append(handler)
    for offset in range(10):
        await handler(event(offset=offset))
    assert len(set(service.peers)) == 1


async def test_a_short_2xx_body_already_in_keeps_the_connection(serve: Any, handlers: Any) -> None:
    service = await serve(answer(200, b"ok"))
    handler = handler_for(service.url)
    handlers.append(handler)
    for offset in range(10):
        await handler(event(offset=offset))
    assert len(service.requests) == 10 and len(set(service.peers)) == 1


async def test_a_body_past_the_drain_bound_closes_the_connection_and_keeps_the_outcome(
    serve: Any, handlers: Any
) -> None:
    huge = b"z" * (BODY_DRAIN_BYTES * 4)
    replies = iter([answer(200, huge), answer(500, huge), answer(204)])

    async def reply(request: web.Request) -> web.StreamResponse:
        return await next(replies)(request)

    service = await serve(reply)
    handler = handler_for(service.url)
    handlers.append(handler)
    await handler(event(offset=1))
    with pytest.raises(HttpRetryableStatus, match="HTTP 500 Internal Server Error: zzz"):
        await handler(event(offset=2))
    await handler(event(offset=3))
    assert len(set(service.peers)) == 3  # not drained past the bound: each closed its connection


async def test_a_2xx_with_a_truncated_body_is_a_success(raw_serve: Any, handlers: Any) -> None:
    async def truncated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        await writer.drain()

    url, peers = await raw_serve(truncated)
    handler = handler_for(url)
    handlers.append(handler)
    await handler(event())  # the service said 200: the body is ignored, so is its end
    assert len(peers) == 1 and handler.readiness()["connection_errors_in_a_row"] == 0


async def test_oversized_record_headers_fail_permanently_before_any_request(
    serve: Any, raw_serve: Any, handlers: Any
) -> None:
    service = await serve()
    handler = handler_for(service.url, http_token="t")
    handlers.append(handler)
    big = {f"h{i}": b"z" * 1024 for i in range(200)}
    with pytest.raises(HttpHeadersTooLarge, match="REBOUND_HTTP_MAX_HEADER_BYTES=8192"):
        await handler(event(headers=big))
    assert service.requests == [] and handler.readiness()["calls"] == 0

    async def reset_on_big_headers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.transport.abort()  # what some proxies do with a header section over their limit

    url, peers = await raw_serve(reset_on_big_headers)
    resetting = handler_for(url)
    handlers.append(resetting)
    with pytest.raises(HttpHeadersTooLarge):
        await resetting(event(headers=big))
    assert peers == [] and ready(resetting)[1] == 200
    some = {"trace": b"z" * 1500}  # 2 KB of Rebound-Header-List: under the default bound, over a lowered one
    await handler(event(headers=some))
    lowered = handler_for(service.url, http_max_header_bytes=1024)
    handlers.append(lowered)
    with pytest.raises(HttpHeadersTooLarge, match="REBOUND_HTTP_MAX_HEADER_BYTES=1024"):
        await lowered(event(headers=some))
    assert len(service.requests) == 1


async def test_a_retry_after_with_non_ascii_digits_is_ignored(serve: Any, handlers: Any) -> None:
    service = await serve(answer(503, headers={"Retry-After": "\u00b2"}))
    handler = handler_for(service.url)
    handlers.append(handler)
    with pytest.raises(HttpOverloaded) as raised:
        await handler(event())
    assert raised.value.retry_after_s is None


async def test_the_urls_query_never_reaches_an_error_message_or_readiness(raw_serve: Any, handlers: Any) -> None:
    async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 2000 Nope\r\n\r\n")
        await writer.drain()

    url, _ = await raw_serve(not_http)
    handler = handler_for(f"{url}?api_key=SECRET%2F123&x=1")
    handlers.append(handler)
    with pytest.raises(HttpConnectionError) as raised:
        await handler(event())
    message = str(raised.value)
    assert "SECRET" not in message and "api_key" not in message and "/events" in message
    assert "SECRET" not in json.dumps(handler.readiness()) and "api_key" not in json.dumps(handler.readiness())
