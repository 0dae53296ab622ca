"""The push handler's own HTTP/1.1 client: POSTs to one origin over a pool of kept-alive connections.

Made for the handler's calls (``app/http_handler.py``) and nothing else: one origin (scheme, host, port), one method,
a body always sent whole with ``Content-Length``, no redirects, no proxies, no cookies, no decompression, no HTTP/2.
What it saves over ``aiohttp.ClientSession`` (measured in docs/benchmarks.md, ``http-overhead``) is per-request
machinery: each call is one ``transport.write`` of the request line, headers and body, one future the connection's
protocol completes when the response is in, and one timer for the call's deadline. The bytes are built and parsed by
the pure :mod:`rebound.http1`.

The pool: idle connections are kept on a stack (the most recently used first), one taken per call, never shared; a new
one is opened when none is idle, within the call's connect deadline. A connection goes back only when its response
ended where its framing said, with nothing after it, and the service did not say ``Connection: close``; one that the
service closes while idle is dropped from the pool as the close arrives (its protocol sees it), and one idle for
:data:`KEEPALIVE_S` is closed. At most ``max_connections`` (the worker's in-flight limit) are kept open: calls are
never queued here, a connection past the bound is closed instead of kept.

Errors carry the names aiohttp gave the same failures (``ClientConnectorError``, ``ServerDisconnectedError``, ...), so
error messages and ``/ready`` read as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from dataclasses import dataclass

from rebound.http1 import MalformedResponse, ResponseParser

KEEPALIVE_S = 15.0
"""An idle connection is closed after this long (aiohttp's default keep-alive timeout, which the handler had)."""
HAPPY_EYEBALLS_DELAY_S = 0.25
"""For a name with IPv6 and IPv4 addresses, the next address is tried after this long (RFC 8305; as aiohttp)."""


class ClientError(Exception):
    """A call that got no answer; ``kind`` is the name aiohttp gave the same failure."""

    kind = "ClientError"

    def __str__(self) -> str:
        text = super().__str__()
        return f"{self.kind}: {text}" if text else self.kind


class ConnectFailed(ClientError):
    """No connection: refused, unreachable, DNS, the TLS handshake or its certificate."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.kind = kind


class ConnectTimedOut(ClientError):
    """No connection within the connect deadline."""

    kind = "ConnectionTimeoutError"


class Lost(ClientError):
    """The connection ended before the response's status line and headers were in. ``nothing_received``: not a byte
    of the response arrived, the only case in which sending the request again can be right."""

    def __init__(self, kind: str, text: str, *, nothing_received: bool) -> None:
        super().__init__(text)
        self.kind = kind
        self.nothing_received = nothing_received


class ProtocolViolation(ClientError):
    """The service's answer is not HTTP/1.x (:class:`rebound.http1.MalformedResponse`)."""

    kind = "MalformedResponse"


class ResponseTimedOut(ClientError):
    """No status line and headers by the call's deadline."""

    kind = "TimeoutError"


@dataclass(frozen=True, slots=True)
class Response:
    """The status and what of the answer the handler reads; ``body`` is the body's first bytes."""

    status: int
    reason: str
    retry_after: str | None
    body: bytes


class _Connection(asyncio.Protocol):
    """One connection: idle in the pool (no parser) or carrying one call (its parser and the call's future)."""

    __slots__ = ("idle_since", "open", "parser", "pool", "transport", "waiter")

    def __init__(self, pool: Http1Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser: ResponseParser | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.open = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.open = True

    def data_received(self, data: bytes) -> None:
        parser, waiter = self.parser, self.waiter
        if parser is None or waiter is None or waiter.done():  # bytes while idle, or after the answer: not trusted
            self.close()
            return
        try:
            done = parser.feed(data)
        except MalformedResponse as exc:
            waiter.set_exception(ProtocolViolation(str(exc)))
            self.close()
            return
        if done:
            waiter.set_result(None)

    def eof_received(self) -> bool:
        self.open = False  # (not taken from the pool in the moment before connection_lost)
        return False  # the transport closes itself; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self.pool._lost(self)
        parser, waiter = self.parser, self.waiter
        if parser is None or waiter is None or waiter.done():
            return
        if parser.feed_eof():  # the head is in: the answer stands, whatever the body's state
            waiter.set_result(None)
        elif isinstance(exc, OSError):
            waiter.set_exception(Lost("ClientOSError", str(exc), nothing_received=parser.received == 0))
        else:
            waiter.set_exception(
                Lost("ServerDisconnectedError", "Server disconnected", nothing_received=parser.received == 0)
            )

    def deadline(self) -> None:
        """The call's deadline: the answer as it stands if its head is in, else a timeout; the connection is closed
        either way (its state is unknown)."""
        parser, waiter = self.parser, self.waiter
        if waiter is not None and not waiter.done():
            if parser is not None and parser.head_done:
                parser.feed_eof()
                waiter.set_result(None)
            else:
                waiter.set_exception(ResponseTimedOut())
        self.close()

    def close(self) -> None:
        """Close at once. A transport's ``close()`` waits until its write buffer is sent, which a service that has
        stopped reading never lets happen: the socket and the unsent body would stay for ever, so a connection with
        bytes still to send is aborted."""
        self.open = False
        self.pool._open.discard(self)  # (at once: a release right after this one counts it closed)
        if self.transport is not None:
            if self.transport.get_write_buffer_size():
                self.transport.abort()
            else:
                self.transport.close()


class Http1Pool:
    """POSTs to one origin (``host``, ``port``, TLS when ``tls`` is a context) on kept-alive connections."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        tls: ssl.SSLContext | None,
        max_connections: int,
        keep_body: int,
        body_limit: int,
        shown_tls: str = "default",
    ) -> None:
        self.host = host
        self.port = port
        self._tls = tls
        self._server_hostname = host.rstrip(".") if tls is not None else None  # a certificate names it without the dot
        self._connect_host = host[1:-1] if host.startswith("[") else host
        self._max = max(1, max_connections)
        self._keep_body = keep_body
        self._body_limit = body_limit
        self._shown_tls = shown_tls
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self.closed = False

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    async def post(self, request: bytes, *, deadline: float, connect_by: float, fresh: bool = False) -> Response:
        """Send ``request`` (its head and body, whole) and read the answer by the loop time ``deadline``: a pooled
        connection unless ``fresh`` or none is idle, then a new one opened by ``connect_by``. Raises a
        :class:`ClientError` when no answer came; an answer whose body was cut short or slow is an answer."""
        if self.closed:
            raise Lost("ClientConnectionError", "the pool is closed", nothing_received=True)
        loop = asyncio.get_running_loop()
        connection = None if fresh else self._take(loop.time())
        if connection is None:
            connection = await self._connect(loop, connect_by)
        parser = connection.parser = ResponseParser(keep=self._keep_body, limit=self._body_limit)
        waiter = connection.waiter = loop.create_future()
        assert connection.transport is not None
        timer = loop.call_at(deadline, connection.deadline)
        try:
            connection.transport.write(request)
            await waiter
        except BaseException:
            timer.cancel()
            connection.close()  # a call cancelled or failed mid-exchange: the connection's state is unknown
            raise
        timer.cancel()
        connection.parser = connection.waiter = None
        if parser.reusable and connection.open and not self.closed and len(self._open) <= self._max:
            connection.idle_since = loop.time()
            self._idle.append(connection)
            if self._sweeper is None:
                self._sweeper = loop.call_later(KEEPALIVE_S, self._sweep)
        else:
            connection.close()
        return Response(parser.status, parser.reason, parser.retry_after, parser.body)

    def _take(self, now: float) -> _Connection | None:
        idle = self._idle
        while idle:
            connection = idle.pop()
            if connection.open and now - connection.idle_since < KEEPALIVE_S:
                return connection
            connection.close()
        return None

    async def _connect(self, loop: asyncio.AbstractEventLoop, connect_by: float) -> _Connection:
        connection = _Connection(self)
        try:
            async with asyncio.timeout_at(connect_by):
                await loop.create_connection(
                    lambda: connection,
                    self._connect_host,
                    self.port,
                    ssl=self._tls,
                    server_hostname=self._server_hostname,
                    happy_eyeballs_delay=HAPPY_EYEBALLS_DELAY_S,
                )
        except TimeoutError:  # (before OSError: TimeoutError is one)
            connection.close()
            raise ConnectTimedOut() from None
        except ssl.SSLCertVerificationError as exc:
            raise self._connect_failed("ClientConnectorCertificateError", f"{type(exc).__name__}: {exc}") from None
        except ssl.SSLError as exc:
            raise self._connect_failed("ClientConnectorSSLError", str(exc)) from None
        except socket.gaierror as exc:
            raise self._connect_failed("ClientConnectorDNSError", exc.strerror or str(exc)) from None
        except (OSError, UnicodeError) as exc:  # refused, unreachable; a host name IDNA refuses
            raise self._connect_failed("ClientConnectorError", getattr(exc, "strerror", None) or str(exc)) from None
        if self.closed:  # closed while connecting
            connection.close()
            raise Lost("ClientConnectionError", "the pool is closed", nothing_received=True)
        self._open.add(connection)
        return connection

    def _connect_failed(self, kind: str, text: str) -> ConnectFailed:
        return ConnectFailed(kind, f"Cannot connect to host {self.host}:{self.port} ssl:{self._shown_tls} [{text}]")

    def _lost(self, connection: _Connection) -> None:
        self._open.discard(connection)
        if connection.parser is None:
            with contextlib.suppress(ValueError):
                self._idle.remove(connection)

    def _sweep(self) -> None:
        """Close what has been idle for :data:`KEEPALIVE_S`; again later while any stays idle."""
        self._sweeper = None
        if self.closed or not self._idle:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        kept = []
        for connection in self._idle:
            if connection.open and now - connection.idle_since < KEEPALIVE_S:
                kept.append(connection)
            else:
                connection.close()
        self._idle[:] = kept
        if kept:
            self._sweeper = loop.call_at(min(c.idle_since for c in kept) + KEEPALIVE_S, self._sweep)

    def close(self) -> None:
        """Close every connection, idle or carrying a call (whose call then fails); a call after this fails too."""
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for connection in (*self._idle, *self._open):
            connection.close()
        self._idle.clear()


__all__ = [
    "KEEPALIVE_S",
    "ClientError",
    "ConnectFailed",
    "ConnectTimedOut",
    "Http1Pool",
    "Lost",
    "ProtocolViolation",
    "Response",
    "ResponseTimedOut",
]
