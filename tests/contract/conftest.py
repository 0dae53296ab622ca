"""The fixtures of an app built but not started (tests/app_under_test.py): ``runtime``, its subscribed ``consumer``,
and ``handed_over``."""

from __future__ import annotations

from tests.app_under_test import consumer, handed_over, runtime

__all__ = ["consumer", "handed_over", "runtime"]
