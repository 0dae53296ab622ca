"""The fixtures of an app built but not started (tests/app_under_test.py) that the table tests take: ``runtime``
(the memory store) and ``rocksdb_runtime``."""

from __future__ import annotations

from tests.app_under_test import rocksdb_runtime, runtime

__all__ = ["rocksdb_runtime", "runtime"]
