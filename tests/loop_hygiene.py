"""Close the event loops that mode's ``ServiceThread`` creates for threads the tests never start.

Each Faust app a test builds gets a consumer, and the consumer's ``ServiceThread.__init__`` opens a new event loop
for its thread (an epoll descriptor and a socket pair) that only the thread's own stop closes. Tests that drive
agents through ``test_context()`` never start that thread, so every such app left three descriptors open: about
900 after ``tests/agents`` alone. Past 1,023 the descriptor numbers no longer fit ``select()``, which py4j's callback
server and PySpark's accumulator server use: a Spark test later in the same process then hung until its timeout
(this stopped CI). :func:`close_idle_thread_loops` runs after every test (``tests/conftest.py``).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterator
from typing import Any

from mode.threads import ServiceThread

_created: weakref.WeakSet[ServiceThread] = weakref.WeakSet()
_original_init = ServiceThread.__init__


def _recording_init(self: ServiceThread, *args: Any, **kwargs: Any) -> None:
    _original_init(self, *args, **kwargs)
    _created.add(self)


def install() -> None:
    """Record every ``ServiceThread`` built from now on (once per process)."""
    if ServiceThread.__init__ is not _recording_init:
        ServiceThread.__init__ = _recording_init  # type: ignore[method-assign]


def close_idle_thread_loops() -> int:
    """Close the thread loops of recorded services whose loop is neither running nor closed; return how many."""
    closed = 0
    for service in list(_created):
        loop: asyncio.AbstractEventLoop = service.thread_loop
        if not loop.is_running() and not loop.is_closed():
            loop.close()
            closed += 1
        _created.discard(service)
    return closed


def open_descriptors() -> int:
    """How many file descriptors this process has open (Linux)."""
    import os

    return len(os.listdir("/proc/self/fd"))


def each_test() -> Iterator[None]:
    install()
    yield
    close_idle_thread_loops()
