"""The HTTP push handler: ``REBOUND_HANDLER=https://host/path`` POSTs each event to a service, in any language.

The request format, the status mapping and ``Retry-After`` are pure rules in :mod:`rebound.http_mapping`; the error
classes in :mod:`rebound.http_errors`; this module does the I/O. The calls go through Rebound's own HTTP/1.1 client
(:class:`app.http_client.Http1Pool`: a pool of kept-alive connections on asyncio protocols, one write per request),
created at the first call (inside the worker's event loop, which does not exist yet when the handler is loaded) and
closed when the worker stops (:func:`app.handlers.attach_handler` registers :meth:`HttpHandler.aclose` as a service
of the app: mode stops an app's services after the app's own ``on_stop``, which has stopped the consumer and drained
the handler calls). The pool keeps at most the worker's in-flight limit of connections open and never queues a call:
``REBOUND_CONCURRENCY`` bounds the calls in flight, and a second limit here would queue calls inside their timeout.
The idle probe of ``/ready`` connects with an ``aiohttp`` connector (:meth:`HttpHandler.probe`).

Each request's own timeout is a little shorter than ``REBOUND_HANDLER_TIMEOUT`` (:func:`request_timeout_s`), exact, so
a slow service fails as :class:`~rebound.http_errors.HttpTimeout` with the request's own account rather than as
Rebound's ``HandlerTimeout`` cancelling it. A POST that loses its connection before a byte of the response arrived (a
kept-alive connection the service closed as the request arrived) is sent once more on a fresh connection within the
same deadline: the ``Idempotency-Key`` makes this safe. Bodies are read to their end, up to :data:`BODY_DRAIN_BYTES`,
so the connection is reused. What the headers share is worked out once (:class:`~rebound.http_mapping.RequestHeaders`,
:class:`~rebound.http1.RequestHead`), not on every call.
The bearer token is read once and kept out of every repr and log line; the URL's query (it may hold a key of the
service's own) is kept out of every message and view.
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import yarl

from app.http_client import (
    ClientError,
    ConnectTimedOut,
    Http1Pool,
    Lost,
    ProtocolViolation,
    ResponseTimedOut,
)
from rebound.errors import ConfigurationError
from rebound.event import RetryEvent
from rebound.http1 import RequestHead
from rebound.http_errors import (
    HttpConnectionError,
    HttpOverloaded,
    HttpPermanentStatus,
    HttpProtocolError,
    HttpRetryableStatus,
    HttpTimeout,
)
from rebound.http_mapping import (
    DEFAULT_MAX_HEADER_BYTES,
    ERROR_BODY_BYTES,
    RequestHeaders,
    StatusMapping,
    StatusOutcome,
    check_handler_url,
    parse_retry_after,
    status_message,
    url_for_logs,
)
from rebound.settings import Settings, reveal

log = logging.getLogger(__name__)

BODY_DRAIN_BYTES = 65_536
"""A response body is read (and dropped, but for an error's first bytes) up to this much, so its connection goes back
to the pool; the rest of a longer one is not waited for: its connection is closed instead."""
UNREACHABLE_AFTER_S = 10.0
"""``/ready`` answers 503 once every call (or probe) that finished for this long failed to connect, with no answer in
between: one refused or reset call (a service instance restarting) does not take the worker out of its endpoints."""
PROBE_WHEN_IDLE_S = 5.0
"""``/ready``, asked when neither a call nor a probe has finished for this long, starts one probe (a connection, no
request): without it the state would be only as fresh as the last call, and a worker with no traffic would never see
its service go down, nor, worse, come back (it would stay out of its endpoints until the next message)."""
USER_AGENT = "rebound"
ACCEPT_ENCODING = "identity"
"""Bodies are not decompressed (only an error's first bytes are read, for its message): none is asked for."""
DEFAULT_MAX_CONNECTIONS = 64
"""The pool's bound when the configuration names none: ``REBOUND_CONCURRENCY``'s default."""


def request_timeout_s(handler_timeout_s: float) -> float:
    """A little shorter than the handler timeout: a tenth of it, at most one second, shorter."""
    return handler_timeout_s - min(1.0, handler_timeout_s / 10)


@dataclass(frozen=True, slots=True)
class HttpHandlerConfig:
    url: str
    group: str
    request_timeout_s: float
    statuses: StatusMapping
    verify_tls: bool = True
    ca_file: str = ""
    token: str = field(default="", repr=False)
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    """The most connections kept open: the worker's in-flight limit (``REBOUND_CONCURRENCY``, its maximum under
    ``auto``)."""

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpHandlerConfig:
        if settings.handler is None:
            raise ConfigurationError("REBOUND_HANDLER is not set")
        return cls(
            url=check_handler_url(settings.handler),
            group=settings.app_id,
            request_timeout_s=request_timeout_s(settings.handler_timeout_s),
            statuses=settings.http_status_mapping,
            verify_tls=settings.http_verify_tls,
            ca_file=settings.http_ca_file.strip(),
            token=reveal(settings.http_token),
            max_header_bytes=settings.http_max_header_bytes,
            max_connections=settings.most_in_flight,
        )


@dataclass(slots=True)
class Reachability:
    """What the calls and probes so far say about the service, for ``/ready``: a service that every call or probe
    finishing for :data:`UNREACHABLE_AFTER_S` could not reach (refused, reset, DNS, TLS, no connection in time), with
    no answer or connection in between, makes the worker not ready: no traffic should be sent its way, and a
    supervisor must not restart it (``/health`` stays 200). One such call among answers is a blip (a service instance
    restarting) and leaves the worker ready; it is shown all the same. Before the first call or probe nothing is
    known, and the worker is ready."""

    clock: Callable[[], float] = time.monotonic
    calls: int = 0
    last_outcome: str | None = None
    last_at_ms: int | None = None
    probes: int = 0
    last_probe: str | None = None
    last_probe_at_ms: int | None = None
    last_evidence_at: float | None = None
    connection_errors_in_a_row: int = 0
    last_connection_error: str | None = None
    first_error_at: float = 0.0
    last_error_at: float = 0.0

    def record(self, outcome: str, *, connection_error: str | None = None) -> None:
        """One call's outcome: any answer, whatever its status, ends a run of connection errors."""
        self.calls += 1
        self.last_outcome = outcome
        self.last_at_ms = int(time.time() * 1000)
        self._evidence(connection_error)

    def record_probe(self, connection_error: str | None) -> None:
        """One probe's result: a connection made (DNS, TCP and TLS for ``https``) ends a run of connection errors as
        an answer does; one that failed continues it, as a call's would."""
        self.probes += 1
        self.last_probe = "connected" if connection_error is None else "connection-error"
        self.last_probe_at_ms = int(time.time() * 1000)
        self._evidence(connection_error)

    @property
    def idle_s(self) -> float | None:
        """Since the latest call or probe finished; None before the first."""
        return None if self.last_evidence_at is None else self.clock() - self.last_evidence_at

    def _evidence(self, connection_error: str | None) -> None:
        now = self.last_evidence_at = self.clock()
        if connection_error is None:
            self.connection_errors_in_a_row = 0
            return
        if self.connection_errors_in_a_row == 0:
            self.first_error_at = now
        self.connection_errors_in_a_row += 1
        self.last_error_at = now
        self.last_connection_error = connection_error

    @property
    def unreachable_for_s(self) -> float:
        """How long the current run of connection errors has lasted, from its first to its latest call."""
        if self.connection_errors_in_a_row == 0:
            return 0.0
        return round(self.last_error_at - self.first_error_at, 3)

    @property
    def reachable(self) -> bool | None:
        if self.calls == 0 and self.probes == 0:
            return None
        return self.connection_errors_in_a_row == 0 or self.unreachable_for_s < UNREACHABLE_AFTER_S


class HttpHandler:
    """An async callable taking one event, like a Python handler: returns on 2xx, raises the outcome's error class."""

    def __init__(self, config: HttpHandlerConfig) -> None:
        self.config = config
        self._ssl = _ssl_option(config)
        self._authorization = f"Bearer {config.token}" if config.token else None
        self._headers = RequestHeaders(
            group=config.group, authorization=self._authorization, max_bytes=config.max_header_bytes
        )
        url = yarl.URL(config.url)
        self._https = url.scheme.lower() == "https"
        self._tls = _client_tls(self._ssl) if self._https else None
        self._host = url.raw_host or ""
        self._port = url.port or (443 if self._https else 80)
        self._head = RequestHead(
            target=url.raw_path_qs,
            host=url.host_port_subcomponent or self._host,
            fixed={"User-Agent": USER_AGENT},
            trailing={"Accept": "*/*", "Accept-Encoding": ACCEPT_ENCODING},
        )
        self._timeout = self._timeout_of(config.request_timeout_s)
        self._connect_timeout_s = self._timeout.connect or 0.0
        self._client: Http1Pool | None = None
        self._fresh_session: aiohttp.ClientSession | None = None
        """The probe's: an aiohttp session whose connector never pools a connection."""
        self._closed = False
        self._shown_url = url_for_logs(config.url)
        self._query_forms = _query_forms(config.url)
        self.reachability = Reachability()
        self.probe_when_idle_s: float | None = PROBE_WHEN_IDLE_S
        """None: ``/ready`` never probes (the state is then only as fresh as the last call)."""
        self._probe: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"HttpHandler({self._shown_url!r}, token={'set' if self._authorization else 'unset'})"

    @property
    def session(self) -> Http1Pool | None:
        """The calls' connection pool, None before the first call and after :meth:`aclose`."""
        return self._client

    @staticmethod
    def _timeout_of(total_s: float) -> aiohttp.ClientTimeout:
        """``total_s`` exactly (no rounding up to a whole second), and a connection not made a little before it ends
        as a connection error (unreachable, for /ready), not as the timeout of a slow answer. The calls read
        ``connect`` from it; the probe's aiohttp connector reads all of it."""
        return aiohttp.ClientTimeout(total=total_s, connect=round(total_s * 0.95, 3), ceil_threshold=math.inf)

    def _open_client(self) -> Http1Pool:
        if self._closed:
            raise HttpConnectionError("the worker is stopping: its HTTP session is closed")
        if self._client is None:
            self._client = Http1Pool(
                host=self._host,
                port=self._port,
                tls=self._tls,
                max_connections=self.config.max_connections,
                keep_body=ERROR_BODY_BYTES,
                body_limit=BODY_DRAIN_BYTES,
                shown_tls=("default" if self.config.verify_tls else "False") if self._https else "default",
            )
        return self._client

    def _open_fresh_session(self) -> aiohttp.ClientSession:
        """The probe's aiohttp session: every connection new, none kept."""
        if self._closed:
            raise HttpConnectionError("the worker is stopping: its HTTP session is closed")
        if self._fresh_session is None:
            self._fresh_session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=0, ssl=self._tls or self._ssl, force_close=True, timeout_ceil_threshold=math.inf
                ),
                timeout=self._timeout,
            )
        return self._fresh_session

    async def __call__(self, event: RetryEvent) -> None:
        headers = self._headers.of(event)
        body = event.value or b""
        request = self._head.build(headers, len(body)) + body
        client = self._open_client()
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline = now + self.config.request_timeout_s
        connect_timeout_s = self._connect_timeout_s
        try:
            try:
                response = await client.post(request, deadline=deadline, connect_by=now + connect_timeout_s)
            except Lost as exc:
                # Lost before a byte of the response: a kept-alive connection the service closed as the request
                # arrived. Not a failed connect, which a second try at once would not change; not a partial answer,
                # which says the service saw the request.
                now = loop.time()
                remaining = round(deadline - now, 3)
                if not exc.nothing_received or remaining <= 0:
                    raise
                log.debug("rebound: %s on a pooled connection; sending once more on a fresh one", exc.kind)
                connect_timeout_s = round(remaining * 0.95, 3)
                response = await self._open_client().post(
                    request, deadline=deadline, connect_by=now + connect_timeout_s, fresh=True
                )
        except ConnectTimedOut as exc:  # no connection within the timeout: not reached at all
            text = f"no connection within {connect_timeout_s:g}s"
            self.reachability.record("connection-error", connection_error=text)
            raise HttpConnectionError(f"{self._shown_url}: {text}") from exc
        except ResponseTimedOut:
            self.reachability.record("timeout")
            raise HttpTimeout(f"no answer from {self._shown_url} within {self.config.request_timeout_s:g}s") from None
        except ClientError as exc:
            text = self._scrubbed(str(exc))
            self.reachability.record("connection-error", connection_error=text)
            error = HttpProtocolError if isinstance(exc, ProtocolViolation) else HttpConnectionError
            raise error(f"{self._shown_url}: {text}") from None
        status = response.status
        outcome = self.config.statuses.outcome(status)
        self.reachability.record(str(outcome))
        if outcome is StatusOutcome.SUCCEEDED:
            return
        message = status_message(status, response.reason, response.body)
        if outcome is StatusOutcome.PERMANENT:
            raise HttpPermanentStatus(message, status=status)
        retry_after = parse_retry_after(response.retry_after, now_ms=int(time.time() * 1000))
        if outcome is StatusOutcome.OVERLOADED:
            raise HttpOverloaded(message, status=status, retry_after_s=retry_after)
        raise HttpRetryableStatus(message, status=status, retry_after_s=retry_after)

    def _scrubbed(self, text: str) -> str:
        """``text`` without the configured URL's query, in any of the forms a library may print it."""
        for query in self._query_forms:
            text = text.replace(f"?{query}", "").replace(query, "<query>")
        return text

    def _probe_if_idle(self) -> None:
        """Start one probe when nothing has been learnt for :attr:`probe_when_idle_s` (none before the first call
        or probe either), unless one is running. Called by ``/ready``, so a worker nobody asks makes no connection of
        its own, and the probe's result shows at the next ``/ready``."""
        if self._closed or self.probe_when_idle_s is None or (self._probe is not None and not self._probe.done()):
            return
        idle = self.reachability.idle_s
        if idle is not None and idle < self.probe_when_idle_s:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside the worker's loop (a test, a script): nothing to run a probe on
            return
        self._probe = loop.create_task(self.probe(), name="rebound-http-probe")

    async def probe(self) -> None:
        """Open one new connection to the service (DNS, TCP, and the TLS handshake for ``https``, with the calls' TLS
        context and server name) within a call's connect timeout, send nothing and close it: a service never sees a
        request that is not a delivery, and the check covers what the 503 rule counts, connection errors. It is made
        by an aiohttp connector of its own (``force_close``: it never pools this connection, which the next POST could
        find stale), whose error names the calls' client shares. Recorded in :attr:`reachability`, as a probe;
        whatever ends it but a cancellation is a failed one."""
        try:
            session = self._open_fresh_session()
        except HttpConnectionError:  # stopping
            return
        connector = session.connector
        assert connector is not None
        # Only what the connector reads: the URL's scheme, host and port, and ``ssl=True``, "the connector's own".
        request = aiohttp.ClientRequest("GET", yarl.URL(self.config.url), loop=asyncio.get_running_loop())
        try:
            connection = await connector.connect(request, [], self._timeout)
        except TimeoutError:  # the connector's own deadline: ``timeout.connect``, exactly (no rounding up)
            self.reachability.record_probe(f"probe: no connection within {self._connect_timeout_s:g}s")
        except aiohttp.ClientError as exc:  # refused, DNS, TLS (the calls' words for them)
            self.reachability.record_probe(self._scrubbed(f"probe: {_describe(exc)}"))
        except Exception as exc:  # e.g. UnicodeError from a host name IDNA refuses: no connection all the same
            self.reachability.record_probe(self._scrubbed(f"probe: {type(exc).__name__}: {exc}"))
        else:
            connection.close()  # close(), not release(): never into a pool
            self.reachability.record_probe(None)

    async def aclose(self) -> None:
        """Close the pooled connections; a call after this fails retryably (the worker is stopping). A probe in flight
        is cancelled and waited for; a cancellation of this call itself goes through, the sessions closed all the
        same."""
        self._closed = True
        try:
            if self._probe is not None and not self._probe.done():
                self._probe.cancel()
                await asyncio.wait({self._probe})  # (never raises the probe's CancelledError: only the caller's)
        finally:
            client, session = self._client, self._fresh_session
            self._client = self._fresh_session = None
            if client is not None:
                client.close()
            if session is not None and not session.closed:
                await session.close()
        log.info("rebound: HTTP handler session closed (%d calls)", self.reachability.calls)

    def readiness(self) -> dict[str, Any]:
        """The service's reachability as ``/ready`` shows it; starts a probe when the state is stale."""
        self._probe_if_idle()
        state = self.reachability
        view: dict[str, Any] = {
            "kind": "http",
            "url": self._shown_url,
            "reachable": state.reachable,
            "calls": state.calls,
            "last_outcome": state.last_outcome,
            "last_at_ms": state.last_at_ms,
            "connection_errors_in_a_row": state.connection_errors_in_a_row,
            "probes": state.probes,
            "last_probe": state.last_probe,
            "last_probe_at_ms": state.last_probe_at_ms,
        }
        if state.connection_errors_in_a_row:
            view["last_connection_error"] = state.last_connection_error
            view["unreachable_for_s"] = state.unreachable_for_s
            view["unreachable_after_s"] = UNREACHABLE_AFTER_S
        return view


def _ssl_option(config: HttpHandlerConfig) -> ssl.SSLContext | bool:
    """aiohttp's ``ssl`` argument: ``False`` skips verification, a context carries a CA file, ``True`` the defaults.

    The CA file is read here, when the handler is loaded: a missing or unreadable one stops the worker at start-up."""
    if not config.verify_tls:
        return False
    if not config.ca_file:
        return True
    try:
        return ssl.create_default_context(cafile=config.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(
            f"REBOUND_HTTP_CA_FILE={config.ca_file[:120]!r} cannot be read as PEM certificates ({exc}); name a CA "
            "bundle file the worker can read"
        ) from None


def _client_tls(option: ssl.SSLContext | bool) -> ssl.SSLContext:
    """The calls' TLS context for :func:`_ssl_option`'s value, built once, when the handler is loaded (loading the
    system's CAs blocks for milliseconds): the CA file's context itself, or one made as aiohttp makes its two, with
    verification (the system's CAs) or without."""
    if isinstance(option, ssl.SSLContext):
        return option
    if option:
        context = ssl.create_default_context()
    else:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        context.options |= ssl.OP_NO_COMPRESSION
    context.set_alpn_protocols(("http/1.1",))
    return context


def _describe(exc: aiohttp.ClientError) -> str:
    """The probe's exception's class and text; a response error's text names the request's URL, query included, so it
    is rebuilt from its parts."""
    text = f"{exc.status}, message={exc.message!r}" if isinstance(exc, aiohttp.ClientResponseError) else str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _query_forms(url: str) -> tuple[str, ...]:
    """The URL's query as configured, and as yarl (aiohttp's URL type) prints it, raw and decoded."""
    query = urlsplit(url).query
    if not query:
        return ()
    parsed = yarl.URL(url)
    forms = {query, parsed.raw_query_string, parsed.query_string}
    return tuple(sorted((form for form in forms if form), key=len, reverse=True))


def build_http_handler(settings: Settings) -> HttpHandler:
    handler = HttpHandler(HttpHandlerConfig.from_settings(settings))
    config = handler.config
    log.info(
        "rebound: HTTP push handler POSTs to %s (request timeout %gs, TLS verification %s%s, bearer token %s)",
        url_for_logs(config.url),
        config.request_timeout_s,
        "on" if config.verify_tls else "off",
        f", CA file {config.ca_file}" if config.ca_file and config.verify_tls else "",
        "set" if config.token else "unset",
    )
    return handler


__all__ = ["HttpHandler", "HttpHandlerConfig", "Reachability", "build_http_handler", "request_timeout_s"]
