"""One Kafka client per Python worker, reused by the read tasks that run there (the JVM connector's consumer cache).

Spark reuses a Python worker process for task after task (``spark.python.worker.reuse``, on by default), so a
module-level cache lives as long as the worker: a task checks a :class:`KafkaReader` out, reads its offset range and
gives it back; the next task on that worker with the same bootstrap servers and client settings skips the connection,
the API-version handshake and the metadata fetch. As in the JVM connector's ``KafkaDataConsumer`` cache:

* a reader is used by one task at a time (a second concurrent checkout gets its own reader);
* a task that fails (or stops) mid-read closes its reader instead of returning it, because its fetch state is unknown;
* readers idle for longer than :data:`IDLE_TIMEOUT_S` are closed at the next checkout, at most
  :data:`MAX_IDLE_READERS` idle ones are kept, and every idle reader is closed when the worker exits normally
  (a worker Spark kills has its sockets closed by the operating system).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pipeline.kafka_source.client import KafkaReader

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 300.0
"""Like ``spark.kafka.consumer.cache.timeout`` (5 minutes)."""
MAX_IDLE_READERS = 16
"""Idle readers kept per worker; a worker runs one task at a time, so more than a few means many clusters/configs."""

PoolKey = tuple[str, tuple[tuple[str, str], ...]]


class Closable(Protocol):
    def close(self) -> None: ...


@dataclass
class PoolStats:
    """Counters of one worker's pool, for tests and logs: how many clients were really opened."""

    created: int = 0
    reused: int = 0
    discarded: int = 0
    expired: int = 0
    created_by_key: Counter[PoolKey] = field(default_factory=Counter)
    reused_by_key: Counter[PoolKey] = field(default_factory=Counter)


class ReaderPool:
    """Idle readers keyed by bootstrap servers and client settings; see the module docstring for the rules."""

    def __init__(
        self,
        factory: Callable[[str, Mapping[str, str]], Closable],
        *,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_idle: int = MAX_IDLE_READERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factory = factory
        self._idle_timeout_s = idle_timeout_s
        self._max_idle = max_idle
        self._clock = clock
        self._lock = threading.Lock()
        self._idle: list[tuple[PoolKey, Closable, float]] = []  # oldest first
        self.stats = PoolStats()

    @staticmethod
    def key(bootstrap: str, config: Mapping[str, str]) -> PoolKey:
        return bootstrap, tuple(sorted((str(k), str(v)) for k, v in config.items()))

    @contextlib.contextmanager
    def checkout(self, bootstrap: str, config: Mapping[str, str]) -> Iterator[Closable]:
        """A reader for the duration of the ``with`` block: returned on a clean exit, closed on any exception
        (including ``GeneratorExit`` when Spark stops consuming a partition early)."""
        key = self.key(bootstrap, config)
        reader = self._take(key)
        if reader is None:
            reader = self._factory(bootstrap, config)
            self.stats.created += 1
            self.stats.created_by_key[key] += 1
            log.info("pykafka: opened Kafka client #%d in this worker for %s", self.stats.created, bootstrap)
        else:
            self.stats.reused += 1
            self.stats.reused_by_key[key] += 1
        try:
            yield reader
        except BaseException:
            self.stats.discarded += 1
            _close_quietly(reader)
            raise
        self._give_back(key, reader)

    def _take(self, key: PoolKey) -> Closable | None:
        expired: list[Closable] = []
        found: Closable | None = None
        with self._lock:
            now = self._clock()
            kept = []
            for entry in self._idle:
                if now - entry[2] > self._idle_timeout_s:
                    expired.append(entry[1])
                else:
                    kept.append(entry)
            # the most recently returned reader first: its connections are the likeliest to be alive
            for i in range(len(kept) - 1, -1, -1):
                if kept[i][0] == key:
                    found = kept.pop(i)[1]
                    break
            self._idle = kept
            self.stats.expired += len(expired)
        for reader in expired:
            _close_quietly(reader)
        return found

    def _give_back(self, key: PoolKey, reader: Closable) -> None:
        with self._lock:
            self._idle.append((key, reader, self._clock()))
            overflow = self._idle[: max(0, len(self._idle) - self._max_idle)]
            self._idle = self._idle[len(overflow) :]
            self.stats.expired += len(overflow)
        for _, old, _ in overflow:
            _close_quietly(old)

    def idle_count(self) -> int:
        with self._lock:
            return len(self._idle)

    def close_all(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for _, reader, _ in idle:
            _close_quietly(reader)


def _close_quietly(reader: Closable) -> None:
    try:
        reader.close()
    except (Exception, asyncio.CancelledError):  # a broken client must not fail the task that merely drops it
        log.debug("pykafka: closing a pooled Kafka client failed", exc_info=True)


def _new_reader(bootstrap: str, config: Mapping[str, str]) -> KafkaReader:
    from pipeline.kafka_source.client import KafkaReader

    return KafkaReader(bootstrap, config)


READERS = ReaderPool(_new_reader)
"""This Python worker's pool (module state: it lives as long as the worker process)."""
atexit.register(READERS.close_all)


@contextlib.contextmanager
def pooled_reader(bootstrap: str, config: Mapping[str, str]) -> Iterator[KafkaReader]:
    """Check a :class:`KafkaReader` out of this worker's pool (typed wrapper of :meth:`ReaderPool.checkout`)."""
    from pipeline.kafka_source.client import KafkaReader

    with READERS.checkout(bootstrap, config) as reader:
        assert isinstance(reader, KafkaReader)
        yield reader
