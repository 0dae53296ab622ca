"""Web tests reuse the agent-test fixtures (runtime with recording topics, fake clock, and ``put`` returning once the
event's work is done: the dispatcher and the tier agent's partition lanes run it in tasks of their own)."""

from __future__ import annotations

from tests.agents.conftest import clock, make_runtime, put_waits_for_the_dispatcher

__all__ = ["clock", "make_runtime", "put_waits_for_the_dispatcher"]
