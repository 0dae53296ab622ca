"""One root exception for everything Rebound raises, so callers can catch the product's errors in one place."""


class ReboundError(Exception):
    """Root of Rebound's own exceptions."""


class ConfigurationError(ReboundError):
    """A setting is invalid; the message names the environment variable."""


class BrokerStartError(ReboundError):
    """The embedded broker could not be started."""


class HandlerError(ReboundError):
    """Base of the errors a handler raises to say how its failure should be treated."""


class RetryableError(HandlerError):
    """A transient failure (dependency down, row not there yet): try again later.

    ``retry_after_s``, when given, is the earliest the failed message may be tried again, in seconds from now (an HTTP
    ``Retry-After``): the retry is never released before it, even when its tier's delay is shorter.
    """

    def __init__(self, *args: object, retry_after_s: float | None = None) -> None:
        super().__init__(*args)
        self.retry_after_s = retry_after_s


class OverloadError(RetryableError):
    """The handler's service refused the call for load (HTTP 429 or 503, a queue full): retryable, and counted as a
    drop by adaptive concurrency (``REBOUND_CONCURRENCY=auto``), which lowers the calls in flight."""


class PermanentError(HandlerError):
    """A failure that retrying cannot fix (bad data, constraint violation): dead-letter at once."""


class UndecodableError(PermanentError):
    """The record's bytes cannot be decoded; dead-lettered byte-exact with reason ``undecodable``."""


class HandlerTimeout(ReboundError):
    """The handler ran past ``REBOUND_HANDLER_TIMEOUT`` and was cancelled: Rebound's verdict, never the handler's own.

    A class of its own so the two cannot be confused: a ``TimeoutError`` the handler raises (``asyncio.timeout``, an
    HTTP client's timeout) is classified by ``REBOUND_PERMANENT_ERRORS`` / ``REBOUND_RETRYABLE_ERRORS`` like any other
    exception and reported with its own message, while this one is retryable unless ``HandlerTimeout`` itself is
    listed as permanent. It deliberately does not subclass ``TimeoutError``: listing ``TimeoutError`` as permanent
    says something about the handler's dependencies, not about a handler that hung, and code that catches
    ``TimeoutError`` must not catch Rebound's verdict by accident. Its ``rebound.error-class`` header (and metric
    label) is ``rebound.errors.HandlerTimeout``.
    """


class InvalidRetryHeadersError(ReboundError):
    """A retry-tier record carries missing, malformed or forged ``rebound.*`` headers."""


class KeyBacklogFullError(ReboundError):
    """A key already has the most parked messages allowed; more would make its state too large to store."""


class UnsendableRecordError(ReboundError):
    """The client refused a record for what it is, not for the state of the cluster: sending it again cannot help."""


class RecordTooLargeError(UnsendableRecordError):
    """A record (with Rebound's headers) exceeds what the producer or broker accepts; sending it again cannot help."""
