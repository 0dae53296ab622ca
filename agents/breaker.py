"""The circuit breaker on the worker: a gate in front of every handler call, and what opening and closing do.

The decisions are :class:`rebound.breaker.CircuitBreaker`'s. Here they are carried out: while the breaker is open
the main topics are not fetched (the consumer pauses their partitions between batches, a rebalance included), the
release timer sends no release requests, and a call that reaches the gate anyway (already fetched, or a release
already requested) waits there, in its dispatcher lane, without running. At each probe time one call is let
through; if none is waiting, the release timer sends one due release, or, with nothing due, the main topics are
fetched again until one record arrives to be the probe.

Only a call whose failure would not end its message's policy is let through as the probe (a release on its last
attempt stays parked instead of waiting at the gate), and the time the breaker held a message does not count against
its policy's total duration: an outage is nobody's message's fault.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from agents.attempt import failure_would_retry
from agents.livelock import restart_stream_clocks
from agents.runtime import Runtime
from rebound.breaker import Admission, BreakerState, CircuitBreaker, Transition, call_outcome
from rebound.ordering import HELD_ATTEMPT
from rebound.routing import Classification
from rebound.schedule import Slot

log = logging.getLogger(__name__)

BREAKER_REASON = "breaker"
"""The consumer's hold reason for the open breaker (its default; the operator's pause is ``pause``)."""


class LeftTheGate(asyncio.CancelledError):
    """A call waiting at the open breaker when the flow stopped: cut short like a cancelled one (not acknowledged,
    read again by the partition's next reader)."""


@dataclass
class BreakerGate:
    """Admission to handler calls, shared by every agent of the worker."""

    runtime: Runtime
    breaker: CircuitBreaker
    waiting: int = 0
    could_probe: int = 0
    """Calls waiting at the gate that may be the probe."""
    main_fetched_for_probe: bool = False
    release_probe_sent_at: int | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def release_probe(self, now_ms: int) -> tuple[int, Slot] | None:
        """The due release to send as the probe, if a probe is wanted from the releases; the timer sends it."""
        self.tick()
        if not self.wants_release_probe():
            return None
        found = self.runtime.schedule.first_due(now_ms, self._may_probe)
        if found is not None:
            self.release_probe_sent_at = now_ms
        return found

    def _may_probe(self, slot: Slot) -> bool:
        """A slot whose failure would not end its policy: the same test the release applies before it runs (a
        release that fails it is deferred, and would be picked again and again)."""
        if slot.attempt == HELD_ATTEMPT:
            return True
        if slot.attempt >= self.runtime.policy.max_retries:
            return False
        if self.runtime.policy.max_duration_ms is None:
            return True
        entry = self.runtime.store.entry(slot.table_key, slot.origin)
        return entry is not None and failure_would_retry(
            self.runtime, entry.provenance.topic, entry.attempt, entry.provenance.first_received_at_ms
        )

    def wants_release_probe(self) -> bool:
        """A probe is due and no call waits at the gate to be it: one due release may be sent to be the probe."""
        now = self.runtime.clock()
        if self.could_probe or (self.release_probe_sent_at is not None and now - self.release_probe_sent_at < 10_000):
            return False  # (a release sent to be the probe may find its message gone: another is sent after 10 s)
        snapshot = self.breaker.snapshot(now)
        if snapshot["state"] == BreakerState.CLOSED or snapshot["probe_in_flight"]:
            return False
        next_probe = snapshot["next_probe_at_ms"]
        return next_probe is None or now >= next_probe

    async def enter(self, *, can_probe: bool = True) -> bool:
        """Wait until this call may run; True if it runs as the breaker's probe.

        A call whose failure would end its message's policy (its last attempt, or its total duration spent) never
        probes, so probing never dead-letters a message. When the flow stops (a rebalance, a shutdown) every waiting
        call leaves at once as cut short (:class:`LeftTheGate`): its record is read again by the partition's next
        reader, and the revocation does not wait for an outage to end.
        """
        while True:
            now = self.runtime.clock()
            if not self.breaker.is_open:
                return False
            if not self._flow_active():
                raise LeftTheGate("the flow stopped while the circuit breaker was open")
            was_open = self.breaker.state is BreakerState.OPEN
            admission = self.breaker.admit(now) if can_probe else Admission.WAIT
            if admission is Admission.PASS:
                return False
            if admission is Admission.PROBE:
                self.runtime.counters["breaker.probes"] += 1
                self.release_probe_sent_at = None
                if self.main_fetched_for_probe:  # the probe has come: the main topics are held again
                    self.main_fetched_for_probe = False
                    self._hold_main_topics()
                moved = self.breaker.last_transition
                if was_open and moved is not None and moved.to_state is BreakerState.HALF_OPEN:
                    # At INFO, not WARNING as the other transitions: it comes with every probe of an outage.
                    log.info(
                        "circuit breaker %s -> %s: %s; probe call let through",
                        moved.from_state,
                        moved.to_state,
                        moved.reason,
                    )
                else:  # half-open already (the last probe was abandoned: a rebalance, a shutdown)
                    log.info("circuit breaker: probe call let through")
                return True
            # Wake for the probe time while open; in half-open (a probe in flight) only its outcome wakes anyone.
            next_probe = self.breaker.snapshot(now).get("next_probe_at_ms")
            timeout = None
            if can_probe and self.breaker.state is BreakerState.OPEN and next_probe is not None:
                timeout = max(0.0, (next_probe - now) / 1000) + 0.001
            changed = self._changed
            self.waiting += 1
            self.could_probe += can_probe
            try:
                await asyncio.wait_for(changed.wait(), timeout)
            except TimeoutError:
                pass
            finally:
                self.waiting -= 1
                self.could_probe -= can_probe

    def flow_stopped(self) -> None:
        """Faust stopped the flow: wake every waiting call, so it leaves (see :meth:`enter`)."""
        self._wake()

    def _flow_active(self) -> bool:
        consumer = getattr(self.runtime.app, "consumer", None)
        return bool(getattr(consumer, "flow_active", True))

    def record(self, classification: Classification | None, *, probe: bool) -> None:
        """The call's outcome: None for a success, else how its failure was classified (see
        :func:`rebound.breaker.call_outcome`)."""
        transition = self.breaker.record(call_outcome(classification), self.runtime.clock(), probe=probe)
        if transition is not None:
            self._moved(transition)
        elif probe:  # an ignored probe (a permanent failure): still half-open, the next call probes at once
            self._wake()

    def abandoned(self) -> None:
        """A probe ended without an outcome (cancelled by a rebalance or a shutdown): the next call probes."""
        self.breaker.probe_abandoned(self.runtime.clock())
        self._wake()

    def tick(self) -> None:
        """Called by the release timer: at the probe time, wake the calls waiting to be the probe; with a probe due
        and nothing to be it, fetch the main topics again."""
        if self.could_probe and self.breaker.is_open:
            snapshot = self.breaker.snapshot(self.runtime.clock())
            next_probe = snapshot["next_probe_at_ms"]
            if not snapshot["probe_in_flight"] and (next_probe is None or self.runtime.clock() >= next_probe):
                self._wake()
        if (
            self.breaker.is_open
            and not self.could_probe
            and not self.main_fetched_for_probe
            and self.wants_release_probe()
            and self.runtime.schedule.first_due(self.runtime.clock(), self._may_probe) is None
        ):
            self.main_fetched_for_probe = True
            self._release_main_topics()
            log.info("circuit breaker: fetching the main topics until a record comes to be the probe")

    def held_ms(self, since_ms: int) -> int:
        """How long the breaker held consumption since ``since_ms`` (a message's first receipt)."""
        return self.breaker.held_ms(since_ms, self.runtime.clock())

    def _moved(self, transition: Transition) -> None:
        log.warning("circuit breaker %s -> %s: %s", transition.from_state, transition.to_state, transition.reason)
        self.runtime.counters[f"breaker.{transition.to_state}"] += 1
        if transition.to_state is BreakerState.OPEN and transition.from_state is BreakerState.CLOSED:
            self._hold_main_topics()
        elif transition.to_state is BreakerState.OPEN:
            if self.main_fetched_for_probe:
                self.main_fetched_for_probe = False
                self._hold_main_topics()
        elif transition.to_state is BreakerState.CLOSED:
            self.main_fetched_for_probe = False
            periods = self.breaker.open_periods
            if periods and periods[-1][1] is not None:
                opened, closed = periods[-1][0], periods[-1][1]
                moved = self.runtime.schedule.postpone_held(opened_at_ms=opened, closed_at_ms=closed)
                log.info("circuit breaker closed: %d parked due times moved by the time it was open", moved)
            self.runtime.pacer.ramp_from(transition.at_ms)  # (REBOUND_RELEASE_RAMP: releases climb to their rate)
            self._release_main_topics()
            self.runtime.release_wakeup.set()
        self._wake()

    def _wake(self) -> None:
        self.release_probe_sent_at = None
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _hold_main_topics(self) -> None:
        consumer = getattr(self.runtime.app, "consumer", None)
        if consumer is not None and hasattr(consumer, "hold_topics"):
            consumer.hold_topics(frozenset(self.runtime.settings.topics), reason=BREAKER_REASON)

    def _release_main_topics(self) -> None:
        consumer = getattr(self.runtime.app, "consumer", None)
        if consumer is not None and hasattr(consumer, "release_topics"):
            held = getattr(consumer, "holds", {}).get(BREAKER_REASON, frozenset())
            consumer.release_topics(reason=BREAKER_REASON, still_paused=frozenset(self.runtime.dispatcher.core.paused))
            restart_stream_clocks(self.runtime.app, consumer, held)  # (the time open is not a stream standing still)
