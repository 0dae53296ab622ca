"""A worker-side trigger for integration tests: the worker's Faust app subscribes to one more topic while a call runs.

Loaded as the worker's handler (``REBOUND_HANDLER=tests.resubscribe_injection:handle``; calls behave as
:mod:`tests.scripted_handler`'s). A record whose script says ``{"resubscribe": true}`` adds the topic
``$RESUBSCRIBE_TOPIC`` to the app's topics (Faust's conductor, ``app.topics.add``) on its first call, before the
script runs (a ``sleep`` keeps the call running): the conductor subscribes the consumer again, which is what Faust
does when code added to a worker iterates a topic of its own after the start. At import the conductor's wait before
a resubscription (``Conductor._resubscribe_sleep_lock_seconds``, 45 s) is cut to one second. Everything else is the
real worker on the real broker.
"""

from __future__ import annotations

import json
import logging
import os

from faust.transport.conductor import Conductor

from rebound.event import RetryEvent
from tests.scripted_handler import handle as scripted_handle

__all__ = ["handle"]

log = logging.getLogger(__name__)

TOPIC = os.environ.get("RESUBSCRIBE_TOPIC", "")
# Faust's private name: renamed, the worker would wait the full 45 s and the test time out without saying why.
if not hasattr(Conductor, "_resubscribe_sleep_lock_seconds"):
    raise AttributeError("faust's Conductor has no _resubscribe_sleep_lock_seconds any more: see its _subscriber")
Conductor._resubscribe_sleep_lock_seconds = 1.0


async def handle(event: RetryEvent) -> None:
    if event.attempt == 0 and json.loads(event.value or b"{}").get("resubscribe"):
        from app import get_runtime

        app = get_runtime().app
        log.warning("resubscribe-injection: adding topic %s to the app's topics", TOPIC)
        app.topics.add(app.topic(TOPIC))
    await scripted_handle(event)
