"""Rebound's agents: the main agent (first tries), one agent per tier (parking), the release agent and timer, the
admin agent (operator commands) and the status timer and reader (cluster-wide backlog), with the runtime they share
and what they build on (the dispatcher, the metrics, readers, services, topics).

The agents are imported when they are registered, not with the package: a module that needs one of their building
blocks (``agents.topics``, ``agents.readers``, the runtime) does not load every agent, and Faust with them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agents.runtime import Runtime


def register_agents(runtime: Runtime) -> None:
    from agents.admin import register_admin_agent
    from agents.main import register_main_agent
    from agents.release import register_release_agent, register_release_timer
    from agents.status import register_status
    from agents.tier import register_tier_agent

    runtime.agents["main"] = register_main_agent(runtime)
    for topic_name in runtime.tier_topics:
        runtime.agents[topic_name] = register_tier_agent(runtime, topic_name)
    runtime.agents["release"] = register_release_agent(runtime)
    register_release_timer(runtime)
    runtime.agents["admin"] = register_admin_agent(runtime)
    register_status(runtime)
    from agents.services import Closing, start_with

    # The failed calls' log: the summary pending when the worker stops is logged then (stopped after the agents).
    start_with(runtime.app, Closing("failed-call log", runtime.failure_log.flush))
