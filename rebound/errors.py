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
    """A transient failure (dependency down, row not there yet): try again later."""


class PermanentError(HandlerError):
    """A failure that retrying cannot fix (bad data, constraint violation): dead-letter at once."""


class UndecodableError(PermanentError):
    """The record's bytes cannot be decoded; dead-lettered byte-exact with reason ``undecodable``."""


class InvalidRetryHeadersError(ReboundError):
    """A retry-tier record carries missing, malformed or forged ``rebound.*`` headers."""


class KeyBacklogFullError(ReboundError):
    """A key already has the most parked messages allowed; more would make its state too large to store."""


class UnsendableRecordError(ReboundError):
    """The client refused a record for what it is, not for the state of the cluster: sending it again cannot help."""


class RecordTooLargeError(UnsendableRecordError):
    """A record (with Rebound's headers) exceeds what the producer or broker accepts; sending it again cannot help."""
