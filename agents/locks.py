"""One asyncio lock per key, held only while in use.

The release agent and the admin agent are separate streams on the worker that owns a key's partition: without a
lock, an operator's dead-letter could run while the same message's release is still in its handler, and the message
would end twice (succeeded and dead-lettered). Holding the key's lock for the whole release or admin action
serialises them; the other agents only ever append to a key's state without awaiting in between.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field


@dataclass
class KeyLocks:
    _locks: dict[Hashable, tuple[asyncio.Lock, int]] = field(default_factory=dict)

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            _, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)
