"""Errors a handler raises to classify its failure (``app.errors.RetryableError`` / ``PermanentError``).

They live in the Faust-free core (:mod:`rebound.errors`) so the routing logic and its tests never import Faust.
"""

from rebound.errors import (
    ConfigurationError,
    HandlerError,
    InvalidRetryHeadersError,
    PermanentError,
    ReboundError,
    RetryableError,
    UndecodableError,
)

__all__ = [
    "ConfigurationError",
    "HandlerError",
    "InvalidRetryHeadersError",
    "PermanentError",
    "ReboundError",
    "RetryableError",
    "UndecodableError",
]
