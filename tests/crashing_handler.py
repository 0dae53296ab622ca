"""A handler that crashes the worker it runs in, the way a failing part of the worker does (``app.crash``, as
``tables/fencing.py`` does when it cannot claim its writer epochs): the stop that follows comes with no signal.

The first call crashes the worker and never ends, and leaves the file ``$CRASH_MARKER``; once the file exists, calls
go to the scripted handler (``tests/scripted_handler.py``), so the next worker runs what the crashed one left.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from rebound.event import RetryEvent
from tests.scripted_handler import handle as scripted_handle
from tests.scripted_handler import record_call

MARKER_ENV = "CRASH_MARKER"


async def handle(event: RetryEvent) -> None:
    marker = Path(os.environ[MARKER_ENV])
    if marker.exists():
        await scripted_handle(event)
        return
    record_call(event)
    marker.touch()
    from app import get_runtime

    await get_runtime().app.crash(RuntimeError("crashed by tests/crashing_handler.py"))
    await asyncio.sleep(3600)
