"""Rebound's Faust-free core, and the handler API: what a handler receives and the errors that classify a failure.

from rebound import PermanentError, RetryableError, RetryEvent

async def handle(event: RetryEvent) -> None:
    ...
"""

from rebound.errors import HandlerTimeout, OverloadError, PermanentError, RetryableError, UndecodableError
from rebound.event import Handler, RetryEvent

__all__ = [
    "Handler",
    "HandlerTimeout",
    "OverloadError",
    "PermanentError",
    "RetryEvent",
    "RetryableError",
    "UndecodableError",
]
