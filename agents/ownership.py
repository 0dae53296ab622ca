"""Which partitions this worker actively owns: the only ones it may release from, write the state of, or send the
outcome of a message of. The one place that decides it: :func:`owned_partitions` and :func:`owns` agree, and
:func:`still_owns` is the check after an await (the session lease, then :func:`owns`).

Faust's assignor keeps the last assignment until the next one (only ``on_assignment`` sets it): neither a revocation
nor an eviction clears it. A worker the group evicted (stopped past its session timeout and woken) still found its
old partitions there, and handler calls that were waiting on a changelog confirm sent their dead letter or next retry
while the partition was another worker's (issue 22, chaos run e-keyrandom1: 4 forks). So while the consumer says the
group evicted this worker (:class:`Membership`), it owns nothing, whatever the assignor still lists; likewise from
the end of a revocation (its drain and commit done) until the next assignment, when the group may already have given
the partitions away.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

from faust.types import TP

from agents.dispatcher import LeaseLapsed, work_of_generation
from agents.runtime import Runtime


class Membership(Protocol):
    """What ownership reads of the consumer (``ReboundConsumer`` in ``app/consumer.py``): whether the group evicted
    this worker (aiokafka blanked its member id), and whether a revocation has ended with no assignment since. A
    consumer without them is taken as neither."""

    @property
    def evicted(self) -> bool: ...

    @property
    def between_assignments(self) -> bool: ...


def owns_nothing(runtime: Runtime) -> bool:
    """Whether this worker owns no partition, whatever the assignor lists: the group evicted it, or a revocation's
    callback has returned (its drain and commit done) and the next assignment has not come yet. Faust and aiokafka
    rebalance eagerly: every revocation takes every partition, so nothing is kept through that window."""
    consumer: Membership | None = getattr(runtime.app, "consumer", None)
    return bool(getattr(consumer, "evicted", False) or getattr(consumer, "between_assignments", False))


def owned_partitions(runtime: Runtime) -> frozenset[int]:
    """The release topic's partitions actively assigned here (co-partitioned with the tables and the main topics);
    none while it owns nothing (:func:`owns_nothing`).

    Faust's table iteration includes standby partitions: acting on one of those would release what another worker
    owns.
    """
    if owns_nothing(runtime):
        return frozenset()
    name = runtime.release_topic.get_topic_name()
    return frozenset(tp.partition for tp in runtime.app.assignor.assigned_actives() if tp.topic == name)


def owns(runtime: Runtime, partition: int) -> bool:
    """Whether ``partition`` is one of :func:`owned_partitions`, in one set lookup (every settle asks, and
    :func:`owned_partitions` builds the set of every assigned topic partition first)."""
    if owns_nothing(runtime):
        return False
    return bool(runtime.app.assignor.is_active(TP(runtime.release_topic.get_topic_name(), partition)))


async def lease_held(runtime: Runtime) -> bool:
    """Whether the group may still count this worker in (:meth:`Dispatcher.lease_gate`), asked before ownership: a
    worker woken past its session timeout usually reads its changelog confirm's answer before the heartbeat's that
    tells it it was evicted (aiokafka blanks the member id only then), so ownership alone would still say owned.
    Fresh, one clock read; stale, the heartbeat's word is awaited (False: the revocation of the caller's generation
    came first, see :func:`taken_in`). A coordinator silent for the lease's ``max_wait_s`` answers True, as for a
    handler call (at-least-once)."""
    try:
        await runtime.dispatcher.lease_gate()
    except LeaseLapsed:
        return False
    return True


async def still_owns(runtime: Runtime, partition: int) -> bool:
    """The one rule before a send, or a write of what a run decided, that follows an await: ``partition`` is owned
    (:func:`owns`: not owned now, it is not waited for), the session lease holds (:func:`lease_held`, awaited), and
    ``partition`` is still owned (asked again after the wait, which a revocation may have ended). A check that must
    not await (a read already made under the lease) asks :func:`owns`."""
    return owns(runtime, partition) and await lease_held(runtime) and owns(runtime, partition)


def current_generation(runtime: Runtime) -> int:
    """The dispatcher's generation now: one more at each flow stop (a revocation's first step, or a shutdown's)."""
    return runtime.dispatcher.core.generation


@contextlib.contextmanager
def taken_in(generation: int) -> Iterator[None]:
    """Run the code of a record that reached a task which is no dispatched work (a tier lane's group, an operator's
    command) as the dispatcher runs a work's: as of the ``generation`` it was taken in (:func:`current_generation` then).
    Its lease waits then end at the flow stop that ends that generation, even one that came before the wait began;
    with the generation of the wait's start, a revocation already under way (Faust waits for this record before it
    commits) was not seen, and the wait lasted the lease's ``max_wait_s`` (a session timeout), holding the
    rebalance."""
    token = work_of_generation(generation)
    try:
        yield
    finally:
        token.var.reset(token)
