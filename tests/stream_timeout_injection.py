"""A short Faust ``stream_processing_timeout`` for integration tests of Faust's livelock detector.

Loaded as the worker's handler (``REBOUND_HANDLER=tests.stream_timeout_injection:handle``; calls behave as
:mod:`tests.scripted_handler`'s). At import it wraps :func:`app.factory.create_faust_app` (``build`` calls it after
loading the handler): the app it makes gets ``stream_processing_timeout`` = ``$STREAM_PROCESSING_TIMEOUT_S`` seconds
instead of Rebound's 60 s or more. That setting is the threshold of Faust's livelock detector
(``AIOKafkaConsumerThread.verify_event_path``, run every 2.5 ``REBOUND_COMMIT_INTERVAL``): a partition with records not
fetched yet whose stream took no event for that long is logged at ERROR, "Stream stopped processing, or is slow". So a
pause of a few seconds is long to it. Everything else is the real worker on the real broker.
"""

from __future__ import annotations

import os
from typing import Any

import app.factory
from tests.scripted_handler import handle

__all__ = ["handle"]

TIMEOUT_S = float(os.environ.get("STREAM_PROCESSING_TIMEOUT_S", "0"))

_create_faust_app = app.factory.create_faust_app


def _short_timeout(*args: Any, **kwargs: Any) -> Any:
    faust_app = _create_faust_app(*args, **kwargs)
    if TIMEOUT_S > 0:
        faust_app.conf.stream_processing_timeout = TIMEOUT_S
    return faust_app


app.factory.create_faust_app = _short_timeout
