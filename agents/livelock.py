"""Faust's livelock detector and Rebound's holds of the main topics: time held is not time a stream stood still.

Faust's livelock detector (``AIOKafkaConsumerThread.verify_event_path``, every 2.5 commit intervals) logs at ERROR
"Stream stopped processing, or is slow" for a partition with records not fetched yet whose stream has taken no event
for ``stream_processing_timeout``; its clock is ``app.monitor.stream_inbound_time``, set each time a stream takes an
event (``StreamInboundTime`` in ``app/consumer.py``). Rebound's consumer leaves a held topic out of the check (an
operator's pause, ``agents/control.py``; the circuit breaker's hold, ``agents/breaker.py``), but a hold ends before the
resumed streams take their first record again (the fetch in flight finishes first, up to a second): a check in that
moment saw a stream idle since before the hold, and logged the ERROR after every long pause.

So ending a hold restarts the clocks of the partitions it gives back, as if their streams had just taken an event: a
stream that still takes nothing for ``stream_processing_timeout`` after the resume is reported as before.
"""

from __future__ import annotations

import logging
from time import monotonic
from typing import Any

from faust.exceptions import ConsumerNotStarted

log = logging.getLogger(__name__)


def restart_stream_clocks(app: Any, consumer: Any, released: frozenset[str]) -> None:
    """After a hold of the topics ``released`` ended in ``consumer``: restart the stream clocks of their partitions
    assigned here that no other reason holds now. Callers pass the topics the hold was on just before its release, none
    if it was not on (a resume read again restarts nothing: a stream stuck since the resume is reported when due).

    Partitions back-pressure still pauses are restarted too: a stream already stuck before the hold is reported one
    timeout after it ends, not at once (leaving them out brings the false alarm back when the dispatcher drains soon
    after). Best effort: it runs inside a resume and the breaker's close, which must not fail for a clock, so anything
    it raises is logged and dropped."""
    try:
        _restart(app, consumer, released)
    except Exception:
        log.warning("could not restart the stream clocks of %s after their hold", sorted(released), exc_info=True)


def _restart(app: Any, consumer: Any, released: frozenset[str]) -> None:
    given_back = released - consumer.held_topics
    if not given_back:
        return
    try:
        assigned = consumer.assignment()
    except ConsumerNotStarted:  # nothing assigned, no clock to restart
        return
    inbound = app.monitor.stream_inbound_time
    now = monotonic()
    for tp in assigned:
        if tp.topic in given_back:
            inbound[tp] = now
