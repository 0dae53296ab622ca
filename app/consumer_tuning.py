"""Consumer settings Faust does not expose.

faust-streaming hard-codes ``fetch_max_wait_ms=1500`` for its worker consumer. Real Kafka answers a fetch as soon as
any partition has data, so the value rarely matters there; the embedded broker answers a multi-partition fetch only
when the wait is over, which puts up to 1.5 s between a due time and the release. ``REBOUND_FETCH_MAX_WAIT_MS``
makes the wait a setting; the test harness uses 100 ms.
"""

from __future__ import annotations

from typing import Any

_fetch_max_wait_ms: int | None = None


def set_fetch_max_wait_ms(value: int) -> None:
    global _fetch_max_wait_ms  # noqa: PLW0603 - one consumer configuration per worker process
    _fetch_max_wait_ms = value
    from faust.transport.drivers import aiokafka as driver

    thread_class: Any = driver.AIOKafkaConsumerThread
    if getattr(thread_class, "_rebound_patched", False):
        return
    original = thread_class._create_worker_consumer

    def create_worker_consumer(self: Any, transport: Any) -> Any:
        consumer = original(self, transport)
        if _fetch_max_wait_ms is not None:
            consumer._fetch_max_wait_ms = _fetch_max_wait_ms  # read when the consumer starts its fetcher
        return consumer

    thread_class._create_worker_consumer = create_worker_consumer
    thread_class._rebound_patched = True
