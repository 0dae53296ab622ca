"""What an HTTP push handler's call raises, one class per outcome: the ``rebound.error-class`` header, the metric
labels and the pipeline see these seven names, never a status code, a URL or a body (bounded cardinality).

They subclass Rebound's own :class:`RetryableError` / :class:`PermanentError`, which decide for themselves: the status
lists (``REBOUND_HTTP_RETRYABLE_STATUSES``, ``REBOUND_HTTP_PERMANENT_STATUSES``) classify HTTP outcomes, and
``REBOUND_PERMANENT_ERRORS`` / ``REBOUND_RETRYABLE_ERRORS`` do not apply to them. The status is in the message
(``HTTP 503 Service Unavailable: <body>``) and on the exception (``status``).
"""

from __future__ import annotations

from rebound.errors import OverloadError, PermanentError, RetryableError


class HttpRetryableStatus(RetryableError):
    """The service answered a retryable status (``REBOUND_HTTP_RETRYABLE_STATUSES``: 408, 425, 5xx but 503, ...)."""

    def __init__(self, message: str, *, status: int, retry_after_s: float | None = None) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.status = status


class HttpOverloaded(OverloadError):
    """The service answered 429 or 503 (and the lists make it retryable): a drop for adaptive concurrency."""

    def __init__(self, message: str, *, status: int, retry_after_s: float | None = None) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.status = status


class HttpPermanentStatus(PermanentError):
    """The service answered a permanent status (``REBOUND_HTTP_PERMANENT_STATUSES``: 4xx but 408, 425, 429)."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class HttpHeadersTooLarge(PermanentError):
    """The record's headers make a request header section larger than ``REBOUND_HTTP_MAX_HEADER_BYTES``: refused
    before any I/O. Servers cap the section (Node 16 KiB, nginx 8 KiB) and answer 400 or 431, or just reset the
    connection, which would look like an unreachable service; the same record fails the same way on every retry."""

    def __init__(self, message: str, *, size_bytes: int, limit_bytes: int) -> None:
        super().__init__(message)
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes


class HttpTimeout(RetryableError):
    """No complete answer within the request timeout (a little shorter than ``REBOUND_HANDLER_TIMEOUT``)."""


class HttpConnectionError(RetryableError):
    """The service could not be reached or dropped the connection: refused, reset, DNS, TLS handshake."""


class HttpProtocolError(HttpConnectionError):
    """The service's answer is not HTTP/1.x: a malformed status line or header line, a header section over 64 KiB,
    contradicting ``Content-Length`` values, broken chunked framing. Retryable (a service mid-deploy, a wrong port
    that answers something else), and counted by ``/ready`` as a connection error, as before it had a class of its
    own; a subclass of :class:`HttpConnectionError`, so code catching that still catches it."""


HTTP_ERROR_CLASSES: tuple[type[Exception], ...] = (
    HttpRetryableStatus,
    HttpOverloaded,
    HttpPermanentStatus,
    HttpHeadersTooLarge,
    HttpTimeout,
    HttpConnectionError,
    HttpProtocolError,
)
