"""Which partitions this worker actively owns: the only ones it may release from, write the state of, or send the
outcome of a message of. The one place that decides it: :func:`owned_partitions` and :func:`owns` agree."""

from __future__ import annotations

from faust.types import TP

from agents.runtime import Runtime


def owned_partitions(runtime: Runtime) -> frozenset[int]:
    """The release topic's partitions actively assigned here (co-partitioned with the tables and the main topics).

    Faust's table iteration includes standby partitions: acting on one of those would release what another worker
    owns.
    """
    name = runtime.release_topic.get_topic_name()
    return frozenset(tp.partition for tp in runtime.app.assignor.assigned_actives() if tp.topic == name)


def owns(runtime: Runtime, partition: int) -> bool:
    """Whether ``partition`` is one of :func:`owned_partitions`, in one set lookup (every settle asks, and
    :func:`owned_partitions` builds the set of every assigned topic partition first)."""
    return bool(runtime.app.assignor.is_active(TP(runtime.release_topic.get_topic_name(), partition)))
