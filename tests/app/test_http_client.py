"""The push handler's own HTTP/1.1 client (``app/http_client.py``) through the handler, against servers scripted byte by
byte: body framings, kept and closed connections, the resend's rule, malformed answers, the pool's bound, TLS, and the
request's bytes next to what aiohttp sent."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import app.http_client
from app.handlers import handler_readiness, load_handler
from app.http_handler import HttpHandler
from app.views import ready_answer
from rebound.errors import RetryableError
from rebound.event import RetryEvent
from rebound.http_errors import (
    HttpConnectionError,
    HttpOverloaded,
    HttpProtocolError,
    HttpRetryableStatus,
    HttpTimeout,
)
from rebound.routing import error_class_name
from rebound.settings import load_settings

NO_CONTENT = b"HTTP/1.1 204 No Content\r\n\r\n"
HANG = object()


def event(offset: int = 17, **overrides: Any) -> RetryEvent:
    fields: dict[str, Any] = {
        "key": b"item-1",
        "value": b'{"id": 1}\x00\xff',
        "headers": {"trace": b"t-1"},
        "topic": "items",
        "partition": 2,
        "offset": offset,
        "attempt": 0,
        "timestamp_ms": 1000,
        "first_received_at_ms": 2000,
    }
    fields.update(overrides)
    return RetryEvent(**fields)


@pytest.fixture
async def handlers() -> AsyncIterator[Callable[..., HttpHandler]]:
    made: list[HttpHandler] = []

    def make(url: str, **settings: Any) -> HttpHandler:
        handler = load_handler(url, load_settings(handler=url, app_id="shop", **settings))
        assert isinstance(handler, HttpHandler)
        made.append(handler)
        return handler

    yield make
    for handler in made:
        await handler.aclose()


@dataclass
class Raw:
    """A TCP server answering each request as ``script(request_number_on_this_connection, connection_number)`` says:
    the bytes to write, or a list of pieces written one at a time with a pause (a float: a pause of that long;
    ``HANG``: no more, until the client closes; ``b""`` last: close), ``None`` to close at once."""

    script: Callable[[int, int], Any]
    url: str = ""
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed_by_client: list[int] = field(default_factory=list)

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        served = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError as exc:
                    if not exc.partial:
                        self.closed_by_client.append(number)
                    return
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                self.requests.append(head + await reader.readexactly(length))
                served += 1
                answer = self.script(served, number)
                if answer is None:
                    return
                for piece in answer if isinstance(answer, list) else [answer]:
                    if piece is HANG:
                        if not await reader.read():
                            self.closed_by_client.append(number)
                        return
                    if isinstance(piece, float):
                        await asyncio.sleep(piece)
                        continue
                    writer.write(piece)
                    await writer.drain()
                    if isinstance(answer, list):
                        await asyncio.sleep(0.001)
                if isinstance(answer, list) and answer and answer[-1] == b"":
                    return  # a close-delimited body ends with the connection
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def raw() -> AsyncIterator[Callable[[Callable[[int, int], Any]], Awaitable[Raw]]]:
    servers: list[asyncio.AbstractServer] = []

    async def start(script: Callable[[int, int], Any], ssl_context: ssl.SSLContext | None = None) -> Raw:
        service = Raw(script)
        server = await asyncio.start_server(service.accept, "127.0.0.1", 0, ssl=ssl_context)
        servers.append(server)
        scheme = "https" if ssl_context else "http"
        service.url = f"{scheme}://127.0.0.1:{server.sockets[0].getsockname()[1]}/events"
        return service

    yield start
    for server in servers:
        server.close()


def ready_status(handler: HttpHandler) -> int:
    return ready_answer(
        rebalancing=False, has_partitions=True, pause_state_known=True, handler=handler_readiness(handler)
    )[1]


async def test_a_chunked_error_body_gives_its_first_bytes_and_keeps_the_connection(raw: Any, handlers: Any) -> None:
    chunked = (
        b"HTTP/1.1 500 Internal Server Error\r\nTransfer-Encoding: chunked\r\nRetry-After: 4\r\n\r\n"
        b"6\r\ndb is \r\n8;ext=1\r\nrestarti\r\n2\r\nng\r\n0\r\nX-Trailer: yes\r\n\r\n"
    )
    service = await raw(lambda n, c: chunked)
    handler = handlers(service.url)
    for offset in range(3):
        with pytest.raises(HttpRetryableStatus, match=r"HTTP 500 Internal Server Error: db is restarting$") as raised:
            await handler(event(offset))
        assert raised.value.retry_after_s == 4
    assert service.connections == 1


async def test_a_close_delimited_body_is_read_to_the_close_and_the_next_call_connects_again(
    raw: Any, handlers: Any
) -> None:
    service = await raw(lambda n, c: [b"HTTP/1.1 503 Service Unavailable\r\n\r\n", b"try ", b"later", b""])
    handler = handlers(service.url)
    for offset in range(2):
        with pytest.raises(HttpOverloaded, match=r"HTTP 503 Service Unavailable: try later$"):
            await handler(event(offset))
    assert service.connections == 2


async def test_connection_close_is_honoured_without_a_resend(
    raw: Any, handlers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="app.http_handler")
    answers = {1: b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", 2: NO_CONTENT}

    def script(n: int, c: int) -> Any:
        return answers[1] if c == 1 else answers[2]

    service = await raw(script)
    handler = handlers(service.url)
    await handler(event(1))
    await handler(event(2))
    await handler(event(3))
    assert service.connections == 2 and len(service.requests) == 3
    assert "once more" not in caplog.text, "a Connection: close was not honoured: the next call found it closed"
    assert handler.session is not None and handler.session.open_connections == 1


async def test_a_connection_the_service_closes_while_idle_is_dropped_before_the_next_call(
    raw: Any, handlers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Node's keep-alive timeout (5 s): the service closes an idle connection; the pool sees the close as it arrives
    and the next call opens a new connection, without writing to the closed one and sending again."""
    caplog.set_level(logging.DEBUG, logger="app.http_handler")
    service = await raw(lambda n, c: [NO_CONTENT, 0.05, b""])  # answer, then close 50 ms later
    handler = handlers(service.url)
    await handler(event(1))
    async with asyncio.timeout(5):
        while service.connections < 1 or handler.session is None or handler.session.open_connections:
            await asyncio.sleep(0.01)
    assert handler.session.idle_connections == 0
    await handler(event(2))
    assert service.connections == 2 and len(service.requests) == 2
    assert "once more" not in caplog.text


async def test_a_response_split_across_many_writes_is_read_whole(raw: Any, handlers: Any) -> None:
    response = b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 9\r\nContent-Length: 12\r\n\r\nslow down!!!"
    service = await raw(lambda n, c: [response[i : i + 3] for i in range(0, len(response), 3)])
    handler = handlers(service.url)
    for offset in range(2):
        with pytest.raises(HttpOverloaded, match=r"HTTP 429 Too Many Requests: slow down!!!$") as raised:
            await handler(event(offset))
        assert raised.value.retry_after_s == 9
    assert service.connections == 1


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 2000 Nope\r\n\r\n",
        b"HTTP/2 200\r\n\r\n",
        b"\x15\x03\x01\x00\x02\x02\x50",  # a TLS server's alert: http:// sent to a TLS port
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    ],
)
async def test_a_malformed_answer_is_a_protocol_error_retryable_and_not_sent_again(
    raw: Any, handlers: Any, answer: bytes
) -> None:
    service = await raw(lambda n, c: [answer, b""])
    handler = handlers(f"{service.url}?key=SECRET")
    with pytest.raises(HttpProtocolError) as raised:
        await handler(event())
    assert isinstance(raised.value, HttpConnectionError) and isinstance(raised.value, RetryableError)
    assert error_class_name(raised.value) == "rebound.http_errors.HttpProtocolError"
    message = str(raised.value)
    assert "MalformedResponse" in message and "SECRET" not in message and "/events" in message
    assert len(service.requests) == 1, "a request the service answered was sent again"
    assert handler.readiness()["connection_errors_in_a_row"] == 1  # counted as before: no HTTP service there


async def test_a_connection_lost_after_part_of_the_head_is_not_sent_again(raw: Any, handlers: Any) -> None:
    service = await raw(lambda n, c: [b"HTTP/1.1 20", b""])
    handler = handlers(service.url)
    with pytest.raises(HttpConnectionError, match="ServerDisconnectedError"):
        await handler(event())
    assert len(service.requests) == 1 and service.connections == 1


async def test_a_2xx_body_slower_than_the_timeout_is_a_success_and_its_connection_closed(
    raw: Any, handlers: Any
) -> None:
    service = await raw(lambda n, c: [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234", HANG])
    handler = handlers(service.url, handler_timeout="1s")
    loop = asyncio.get_running_loop()
    started = loop.time()
    await handler(event())
    assert 0.85 <= loop.time() - started < 1.5
    assert handler.session is not None and handler.session.idle_connections == 0


async def test_no_status_within_the_timeout_is_a_timeout_and_the_connection_is_not_reused(
    raw: Any, handlers: Any
) -> None:
    service = await raw(lambda n, c: [HANG] if c == 1 else NO_CONTENT)
    handler = handlers(service.url, handler_timeout="1s")
    with pytest.raises(HttpTimeout, match=r"within 0\.9s"):
        await handler(event(1))
    await handler(event(2))
    assert service.connections == 2
    assert ready_status(handler) == 200


async def test_interim_1xx_answers_are_skipped(raw: Any, handlers: Any) -> None:
    service = await raw(lambda n, c: b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\n\r\n" + NO_CONTENT)
    handler = handlers(service.url)
    await handler(event(1))
    await handler(event(2))
    assert service.connections == 1


async def test_the_pool_keeps_at_most_the_in_flight_limit_open(raw: Any, handlers: Any) -> None:
    service = await raw(lambda n, c: [0.05, NO_CONTENT])
    handler = handlers(service.url, concurrency=3)
    assert handler.config.max_connections == 3
    await asyncio.gather(*(handler(event(offset)) for offset in range(8)))  # more than the limit: never queued
    assert service.connections == 8
    assert handler.session is not None and handler.session.open_connections <= 3
    await asyncio.gather(*(handler(event(offset)) for offset in range(3)))
    assert service.connections == 8, "the kept connections were not reused"
    auto = handlers(service.url, concurrency="auto", concurrency_max=40)
    assert auto.config.max_connections == 40


async def test_an_idle_connection_is_closed_after_the_keep_alive_time(
    raw: Any, handlers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app.http_client, "KEEPALIVE_S", 0.2)
    service = await raw(lambda n, c: NO_CONTENT)
    handler = handlers(service.url)
    await handler(event(1))
    async with asyncio.timeout(5):
        while service.closed_by_client != [1]:
            await asyncio.sleep(0.02)
    assert handler.session is not None and handler.session.open_connections == 0
    await handler(event(2))
    assert service.connections == 2


async def test_a_cancelled_call_closes_its_connection(raw: Any, handlers: Any) -> None:
    service = await raw(lambda n, c: [HANG] if c == 1 else NO_CONTENT)
    handler = handlers(service.url)
    call = asyncio.create_task(handler(event(1)))
    async with asyncio.timeout(5):
        while not service.requests:
            await asyncio.sleep(0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    async with asyncio.timeout(5):
        while service.closed_by_client != [1]:
            await asyncio.sleep(0.02)
    await handler(event(2))
    assert service.connections == 2


async def test_the_request_is_the_one_aiohttp_sent_but_for_accept_encoding(raw: Any, handlers: Any) -> None:
    """The same request line (the URL's path and query as yarl normalises them), Host, header names, order and
    values (UTF-8, a non-ASCII tier's too) as the aiohttp session sent; ``Accept-Encoding: identity`` instead of
    ``gzip, deflate``, as nothing is decompressed."""
    service = await raw(lambda n, c: NO_CONTENT)
    url = f"{service.url}?a=1%2F&b=%C3%A9&c=%20"
    handler = handlers(url, http_token="tok")
    sent = event(tier="\u00e9t\u00e9")
    await handler(sent)
    headers = handler._headers.of(sent)
    async with (
        aiohttp.ClientSession(headers={"User-Agent": "rebound"}, auto_decompress=False) as session,
        session.post(url, data=sent.value, headers=headers, allow_redirects=False) as response,
    ):
        assert response.status == 204
    ours, theirs = service.requests
    assert ours == theirs.replace(b"Accept-Encoding: gzip, deflate\r\n", b"Accept-Encoding: identity\r\n")


async def test_tls_with_a_self_signed_certificate_keeps_its_connection_and_is_refused_unverified(
    raw: Any, handlers: Any, certificate: tuple[Path, Path]
) -> None:
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(*certificate)
    service = await raw(
        lambda n, c: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", server_context
    )
    trusting = handlers(service.url, http_ca_file=str(certificate[0]))
    for offset in range(3):
        await trusting(event(offset))
    assert service.connections == 1
    unverified = handlers(service.url, http_verify_tls="false")
    await unverified(event())
    default = handlers(service.url)
    with pytest.raises(HttpConnectionError, match=r"ClientConnectorCertificateError: .*CERTIFICATE_VERIFY_FAILED"):
        await default(event())
    assert service.connections == 2 and len(service.requests) == 4  # (a failed handshake is no connection served)


async def test_a_timed_out_call_whose_body_the_service_never_reads_releases_its_socket(
    handlers: Any,
) -> None:
    """A service alive but not reading (its receive buffer full): the call times out, and its connection, closed
    as "state unknown", must let go of its socket; ``transport.close()`` waits for the write buffer to drain first,
    which never happens, so every such call leaks a socket (abort() would not)."""
    accepted: list[asyncio.StreamWriter] = []

    async def never_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await asyncio.sleep(3600)

    server = await asyncio.start_server(never_read, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    made: list[app.http_client._Connection] = []
    real = app.http_client.Http1Pool._connect

    async def recording(self: Any, loop: Any, connect_by: float) -> Any:
        connection = await real(self, loop, connect_by)
        made.append(connection)
        return connection

    app.http_client.Http1Pool._connect = recording  # type: ignore[method-assign]
    try:
        handler = handlers(f"http://127.0.0.1:{port}/events", handler_timeout="1s")
        with pytest.raises(HttpTimeout):
            await handler(event(value=b"x" * (32 * 1024 * 1024)))
        await asyncio.sleep(1.0)
        (connection,) = made
        transport = connection.transport
        assert transport is not None and transport.is_closing()
        assert transport.get_extra_info("socket").fileno() == -1, (
            f"socket still open 1 s after the timeout, {transport.get_write_buffer_size()} bytes unsent"
        )
    finally:
        app.http_client.Http1Pool._connect = real  # type: ignore[method-assign]
        for writer in accepted:
            writer.transport.abort()
        server.close()
