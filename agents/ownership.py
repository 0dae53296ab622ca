"""Which partitions this worker actively owns: the only ones it may release from, write the state of, or send the
outcome of a message of. The one place that decides it: :func:`owned_partitions` and :func:`owns` agree.

Faust's assignor keeps the last assignment until the next one (only ``on_assignment`` sets it): neither a revocation
nor an eviction clears it. A worker the group evicted (stopped past its session timeout and woken) still found its
old partitions there, and handler calls that were waiting on a changelog confirm sent their dead letter or next retry
while the partition was another worker's (issue 22, chaos run e-keyrandom1: 4 forks). So while the consumer says the
group evicted this worker (:class:`Membership`), it owns nothing, whatever the assignor still lists.
"""

from __future__ import annotations

from typing import Protocol

from faust.types import TP

from agents.runtime import Runtime


class Membership(Protocol):
    """What ownership reads of the consumer (``ReboundConsumer`` in ``app/consumer.py``): whether the group evicted
    this worker (aiokafka blanked its member id). A consumer without it is never taken as evicted."""

    @property
    def evicted(self) -> bool: ...


def evicted(runtime: Runtime) -> bool:
    """Whether the group evicted this worker: it then owns no partition until its next assignment."""
    consumer: Membership | None = getattr(runtime.app, "consumer", None)
    return bool(getattr(consumer, "evicted", False))


def owned_partitions(runtime: Runtime) -> frozenset[int]:
    """The release topic's partitions actively assigned here (co-partitioned with the tables and the main topics);
    none while this worker is evicted.

    Faust's table iteration includes standby partitions: acting on one of those would release what another worker
    owns.
    """
    if evicted(runtime):
        return frozenset()
    name = runtime.release_topic.get_topic_name()
    return frozenset(tp.partition for tp in runtime.app.assignor.assigned_actives() if tp.topic == name)


def owns(runtime: Runtime, partition: int) -> bool:
    """Whether ``partition`` is one of :func:`owned_partitions`, in one set lookup (every settle asks, and
    :func:`owned_partitions` builds the set of every assigned topic partition first)."""
    if evicted(runtime):
        return False
    return bool(runtime.app.assignor.is_active(TP(runtime.release_topic.get_topic_name(), partition)))
