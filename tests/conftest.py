"""Session-wide fixtures: one real embedded broker for every integration test (never a mock)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

# The worker subprocesses and Spark's Python workers must run this interpreter, not whatever `python` is on PATH.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from rebound.embedded_broker import EmbeddedBroker, start_broker


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    running = start_broker()
    try:
        yield running
    finally:
        running.stop()
