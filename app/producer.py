"""Faust's aiokafka producer, whose flush waits for the records it holds when called, not for an empty buffer.

Plugged in through Faust's own seams: the app makes its producer with its transport's ``create_producer``
(``App._new_producer``), whose ``Producer`` class ``ReboundTransport`` (``app/consumer.py``) sets to this one.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, cast

from faust.transport.drivers import aiokafka as driver
from faust.types.tuples import FutureMessage, PendingMessage


class _HandOver:
    """The channel of :meth:`ReboundProducer.flush`'s mark: the producer buffer "publishes" the mark through it when
    the mark's turn comes, which only says that every record before it has been handed to aiokafka."""

    async def publish_message(self, fut: FutureMessage, wait: bool = False) -> FutureMessage:
        if not fut.done():
            fut.set_result(cast(Any, None))
        return fut


_HAND_OVER = _HandOver()


class ReboundProducer(driver.Producer):
    """The app's producer: Faust's, but for :meth:`flush`."""

    async def flush(self) -> None:
        """Wait until the records this producer holds now are acknowledged (or have failed): not for an empty buffer.

        Faust flushes its producer before every commit outside a transaction (``Consumer._commit_offsets``), after a
        revocation's wait for the streams and at the app's stop (``App._producer_flush``). Its flush is the buffer's
        (``ProducerBuffer.flush_atmost(None)``), which hands records over to aiokafka until the buffer is empty: under
        a steady flow of table writes it seldom is, and commits ran 10 to 30 s in chaos runs ("Timer commit is
        overlapping"; after an eviction the next owner read again from there). Here a mark goes into the buffer
        behind what it holds. The buffer's one task hands its records to aiokafka's producer one at a time, in order,
        so once the mark's turn comes every record before it, the one the task was holding included, is in aiokafka's
        producer, whose ``flush()`` then waits for the batches it holds (sent or not) to be acknowledged or to fail,
        as in Faust's flush. Records written after the mark are not waited for: a commit's offsets were taken before
        its flush, and by the revocation's and the stop's flushes the streams are drained (at the stop, Faust's
        ``_stop_consumer`` has stopped the fetcher, waited for the streams and stopped the tables), so what comes later belongs to no offset those wait for; Faust's flush,
        which ends once it finds the buffer empty, did not wait for it either.

        Faust's own flush runs instead in a transaction (Faust's exactly-once guarantee, which Rebound does not set:
        only it flushes the transactions' producers), for a buffer that is not running (or stops or crashes before
        the mark's turn), and for one that hands its records to a producer thread (Faust's ``producer_threaded``,
        which Rebound does not set).

        Known edge: if something stops the buffer while the mark is the only record queued behind the one its task
        holds, the buffer's own ``on_stop`` (which checks its size at once) fails with "Cannot flush: Producer not
        Running" before the flush takes its mark back out, and its parent logs the error. A graceful shutdown never
        gets there: the app's stop flushes before it stops its services (the producer among them), and nothing in
        Rebound stops the producer itself. Every offset Rebound acknowledges already waits for its own changelog
        writes (``RetryStore``'s confirmations), so the mark is a second guard, kept for writes a future path might
        leave unconfirmed."""
        buffer: Any = self.buffer  # ProducerBuffer: its private names used here are in tests/contract/inventory.py
        if self.app.in_transaction or buffer.state != "running" or self.app.conf.producer_threaded:
            await super().flush()
            return
        mark = FutureMessage(PendingMessage(cast(Any, _HAND_OVER), None, None, None, None, None, None, None, None))
        self.send_soon(mark)
        ended = [asyncio.ensure_future(event.wait()) for event in (buffer._stopped, buffer._crashed)]
        try:
            await asyncio.wait([mark, *ended], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in ended:
                waiter.cancel()
            if not mark.done():  # cancelled, or the buffer ended first: the mark must not stay behind in it
                with contextlib.suppress(ValueError):
                    buffer.pending._queue.remove(mark)
                mark.cancel()
        if mark.cancelled():
            await super().flush()
            return
        sender = self._producer  # aiokafka's producer: None before this producer's start made it
        if sender is not None:
            await sender.flush()
