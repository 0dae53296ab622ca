"""A worker-side fault for integration tests: one main record lost on its way to the dispatcher, then read again.

Loaded as the worker's handler (``REBOUND_HANDLER=tests.reread_injection:handle``; calls behave as
:mod:`tests.scripted_handler`'s). At import it wraps :meth:`agents.dispatcher.Dispatcher.offer`: the first hand-over of
main-topic offset ``$REREAD_LOSE`` never reaches the dispatcher (as when Faust clears a stream queue while resuming
the flow: the consumer counted it as handed over, nothing will acknowledge it), and once offset ``$REREAD_AFTER``
was taken, the consumer is asked to read the partition again from the lost offset, through the same request its
read-again guard makes (``_reposition``, carried out before the next fetch). With ``$REREAD_ON_CALL`` set, it is
asked only once the handler's first call for offset ``$REREAD_AFTER`` ran (so that record has started, and may be
retrying, when the lost one comes again). Everything else is the real worker on the real broker.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from agents.dispatcher import Dispatcher, Run
from rebound.event import RetryEvent
from tests.scripted_handler import handle as scripted_handle

__all__ = ["handle"]

log = logging.getLogger(__name__)

LOSE = int(os.environ.get("REREAD_LOSE", "-1"))
AFTER = int(os.environ.get("REREAD_AFTER", "-1"))
ON_CALL = bool(os.environ.get("REREAD_ON_CALL"))
TOPICS = set(os.environ.get("REBOUND_MAIN_TOPICS", "").split(","))


class _Injection:
    lost: Any = None
    read_again: bool = False
    consumer: Any = None


def _read_again(tp: Any) -> None:
    _Injection.read_again = True
    log.warning("reread-injection: reading %s again from %d", tp, LOSE)
    _Injection.consumer._reposition[tp] = LOSE


async def handle(event: RetryEvent) -> None:
    """The scripted handler; with ``$REREAD_ON_CALL``, its first call for offset ``$REREAD_AFTER`` (the lost
    record's partition) asks for the read again, then behaves as scripted."""
    lost = _Injection.lost
    if ON_CALL and event.offset == AFTER and event.attempt == 0 and lost is not None and not _Injection.read_again:
        _read_again(lost.tp)
    await scripted_handle(event)


_original_offer = Dispatcher.offer


def _offer(self: Dispatcher, event: Any, lane: Any, run: Run) -> None:
    message = event.message
    _Injection.consumer = self.app.consumer
    if message.topic in TOPICS and message.offset == LOSE and _Injection.lost is None:
        _Injection.lost = message
        log.warning("reread-injection: %s@%d lost on its way to the dispatcher", message.tp, message.offset)
        self.app.consumer.abandon(message)  # nothing will acknowledge it: the consumer lets it go
        return
    _original_offer(self, event, lane, run)
    if (
        not ON_CALL
        and message.topic in TOPICS
        and message.offset == AFTER
        and _Injection.lost is not None
        and not _Injection.read_again
    ):
        _read_again(message.tp)


Dispatcher.offer = _offer  # type: ignore[method-assign]
