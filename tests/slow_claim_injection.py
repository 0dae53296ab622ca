"""A worker-side delay for integration tests: a claim's marker held back after the recovery stopped reading.

Loaded as the worker's handler (``REBOUND_HANDLER=tests.slow_claim_injection:handle``; calls behave as
:mod:`tests.scripted_handler`'s). At import it wraps :meth:`tables.fencing.TableFence._send_acknowledged`: a claim's
records (its marker first) are sent ``$SLOW_CLAIM_S`` seconds later, after the line ``slow claim: holding``. Between
the end of a recovery (Faust has paused the changelog partitions) and the marker there is always such a moment, a few
milliseconds here, more on a loaded machine; widened, a test's late writes land in it for certain, where no fetch of
the recovery reads them. Everything else is the real worker on the real broker.
The wrapped name is held to the fence's by ``tests/tables/test_table_fencing.py`` (the fast tier): renamed, or a
claim no longer sent through it, that test fails.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from rebound.fencing import is_epoch_key
from tables.fencing import TableFence
from tests.scripted_handler import handle

__all__ = ["handle"]

log = logging.getLogger(__name__)

HOLD_S = float(os.environ.get("SLOW_CLAIM_S", "0"))

_send_acknowledged = TableFence._send_acknowledged


async def _held(self: TableFence, records: list[tuple[int, bytes, bytes | None]], generation: int) -> Any:
    if HOLD_S > 0 and records and is_epoch_key(records[0][1]):
        log.warning("slow claim: holding the claim of %s for %.1f s", self.table.name, HOLD_S)
        await asyncio.sleep(HOLD_S)
    return await _send_acknowledged(self, records, generation)


TableFence._send_acknowledged = _held  # type: ignore[method-assign]
