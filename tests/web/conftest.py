"""Web tests reuse the agent-test fixtures (runtime with recording topics, fake clock)."""

from __future__ import annotations

from tests.agents.conftest import clock, make_runtime

__all__ = ["clock", "make_runtime"]
