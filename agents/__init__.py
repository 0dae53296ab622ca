"""Rebound's agents: the main agent (first tries), one agent per tier (parking), the release agent and timer, the
admin agent (operator commands) and the status timer and reader (cluster-wide backlog)."""

from __future__ import annotations

from agents.admin import register_admin_agent
from agents.main import register_main_agent
from agents.release import register_release_agent, register_release_timer
from agents.runtime import Runtime
from agents.status import register_status
from agents.tier import register_tier_agent


def register_agents(runtime: Runtime) -> None:
    runtime.agents["main"] = register_main_agent(runtime)
    for topic_name in runtime.tier_topics:
        runtime.agents[topic_name] = register_tier_agent(runtime, topic_name)
    runtime.agents["release"] = register_release_agent(runtime)
    register_release_timer(runtime)
    runtime.agents["admin"] = register_admin_agent(runtime)
    register_status(runtime)
