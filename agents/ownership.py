"""Which partitions this worker actively owns: the only ones it may release from or write the state of."""

from __future__ import annotations

from agents.runtime import Runtime


def owned_partitions(runtime: Runtime) -> frozenset[int]:
    """The release topic's partitions actively assigned here (co-partitioned with the tables and the main topics).

    Faust's table iteration includes standby partitions: acting on one of those would release what another worker
    owns.
    """
    name = runtime.release_topic.get_topic_name()
    return frozenset(tp.partition for tp in runtime.app.assignor.assigned_actives() if tp.topic == name)
