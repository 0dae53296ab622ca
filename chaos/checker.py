"""The conservation checker: pure, so that every way it can fail is unit-tested on hand-made inputs.

In the spirit of Kafka's ``produce_consume_validate`` and Jepsen's lost-write checker, it joins what was produced
with what was observed from three independent places: the handler's own call log (success is a call that returned),
the ``<main>.failed`` topic (each record names its original by its provenance headers), and the due times announced
on the ``<app id>.attempts`` topic and in the ``rebound.due-at`` headers of tier records.

A message is identified by its provenance (topic, partition, offset), never by anything Rebound could rewrite; the id
inside the value is only cross-checked, so a call or dead letter carrying the wrong bytes is caught too.

A *fork* is a message that reached two different terminal states (succeeded and dead-lettered, or dead-lettered with
two reasons or attempts): two lifecycles of one message that ended differently. With the scripted handler both
lifecycles run the same attempts to the same end, so a fork shows only with ``--outcome random``; the lifecycles
themselves are counted either way (:meth:`_Checker.count_lifecycles`): a first try run again after the message had
left the main topic, and a retry run again after the message had ended.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chaos.calllog import Call
from chaos.scenario import RANDOM, SUCCEEDED, CallOutcome

Origin = tuple[str, int, int]
SAMPLE = 100
"""At most this many ids or items are listed per finding; the counts are always complete."""


@dataclass(frozen=True, slots=True)
class Produced:
    mid: str
    origin: Origin
    key: bytes | None
    value: bytes | None
    kind: str
    expected: str
    """``succeeded`` or the dead letter's expected ``rebound.reason``."""
    expected_attempt: int


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One record of the failed topic, with the original it names in its provenance headers."""

    origin: Origin | None
    reason: str | None
    attempt: int | None
    key: bytes | None
    value: bytes | None
    partition: int = 0
    offset: int = 0


@dataclass(frozen=True, slots=True)
class DueTime:
    """Retry number ``attempt`` of ``origin`` may not run before ``due_ms`` (from ``source``)."""

    origin: Origin
    attempt: int
    due_ms: int
    source: str


@dataclass
class CheckInputs:
    produced: Sequence[Produced]
    calls: Sequence[Call]
    dead_letters: Sequence[DeadLetter]
    due_times: Sequence[DueTime]
    succeeded_events: Sequence[tuple[Origin, int]] = ()
    """(origin, attempt) of the ``succeeded`` attempt events: only cross-checked, the call log decides."""
    main_log: Mapping[Origin, tuple[bytes | None, bytes | None]] | None = None
    """What the broker holds on the main topic (key, value per origin), if it was read back."""
    committed: Mapping[tuple[str, int], int] | None = None
    """The group's committed offset per (topic, partition) at the end, if known: it tells a skip from a wedge."""
    faults: Sequence[tuple[int, str]] = ()
    """(start ms, label) of every fault injected: each repeated call is put down to the last one before it."""
    fault_windows: Sequence[tuple[int, int, str]] = ()
    """(start ms, end ms, label) of every fault: stalls are measured from the end of the last fault before them.
    Empty (results written before fault ends were passed on): the starts in ``faults`` stand in for the ends."""
    key_ordered: bool = False
    """The workers ran with ``REBOUND_ORDERING=key``: each key's messages must start in offset order, each one only
    after the one before it settled."""


@dataclass
class CheckResult:
    messages: int
    by_kind: dict[str, int]
    calls: int
    calls_by_outcome: dict[str, int]
    terminal: dict[str, int]
    lost: list[dict[str, Any]] = field(default_factory=list)
    multi_terminal: list[dict[str, Any]] = field(default_factory=list)
    unexpected_terminal: list[dict[str, Any]] = field(default_factory=list)
    corrupt_dead_letters: list[dict[str, Any]] = field(default_factory=list)
    unknown_records: list[dict[str, Any]] = field(default_factory=list)
    id_mismatches: list[dict[str, Any]] = field(default_factory=list)
    not_in_log: list[dict[str, Any]] = field(default_factory=list)
    early: list[dict[str, Any]] = field(default_factory=list)
    unknown_due: list[dict[str, Any]] = field(default_factory=list)
    duplicate_extra_calls: int = 0
    duplicate_pairs: int = 0
    duplicate_max_calls: int = 0
    duplicate_examples: list[dict[str, Any]] = field(default_factory=list)
    duplicates_by_fault: list[dict[str, Any]] = field(default_factory=list)
    duplicate_dead_letters: list[dict[str, Any]] = field(default_factory=list)
    """Examples of a message that reached the same terminal state more than once (at-least-once redelivery)."""
    duplicate_dead_letter_count: int = 0
    lateness_ms: dict[str, float | int | None] = field(default_factory=dict)
    due_disagreements: int = 0
    missing_success_events: int = 0
    offset_jumps: list[dict[str, Any]] = field(default_factory=list)
    """Where a worker's first tries jumped over offsets nobody ever handled: the evidence behind skipped messages."""
    out_of_order: list[dict[str, Any]] = field(default_factory=list)
    """Key-ordered runs: a message first called before the message of its key before it had settled."""
    ordered_pairs: int = 0
    restarted_lifecycles: list[dict[str, Any]] = field(default_factory=list)
    """Messages whose first try ran again after an earlier one had sent them to a tier or the failed topic."""
    retries_after_end: list[dict[str, Any]] = field(default_factory=list)
    """Messages with a retry called after the message had ended (a duplicate tier record run again)."""
    stalls: dict[str, Any] = field(default_factory=dict)
    """Longest stall after a fault per stream (see :func:`stall_summary`); reported, not a pass/fail criterion."""

    @property
    def failures(self) -> list[str]:
        """Every violated guarantee, worded for the summary; empty means the run conserved every message."""
        checks = [
            ("lost", self.lost),
            ("forks (in more than one terminal state)", self.multi_terminal),
            ("ended in an unexpected terminal state", self.unexpected_terminal),
            ("dead letters not byte-exact", self.corrupt_dead_letters),
            ("calls or dead letters for messages never produced", self.unknown_records),
            ("calls whose bytes carry another message's id", self.id_mismatches),
            ("acknowledged records the broker does not hold at their offset", self.not_in_log),
            ("retries run before their due time", self.early),
            ("retries run without any known due time", self.unknown_due),
            ("messages run before the message of their key before them settled (key-ordered)", self.out_of_order),
        ]
        return [f"{len(items)} {what}" for what, items in checks if items]

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        def listing(items: list[dict[str, Any]]) -> dict[str, Any]:
            return {"count": len(items), "items": items[:SAMPLE]}

        multi = listing(self.multi_terminal)
        multi["by_kind"] = dict(Counter(item["kind"] for item in self.multi_terminal))
        lost = listing(self.lost)
        lost["by_kind"] = dict(Counter(item["kind_of_loss"] for item in self.lost))

        return {
            "passed": self.passed,
            "failures": self.failures,
            "messages": self.messages,
            "by_kind": self.by_kind,
            "terminal": self.terminal,
            "calls": self.calls,
            "calls_by_outcome": self.calls_by_outcome,
            "lost": lost,
            "multi_terminal": multi,
            "unexpected_terminal": listing(self.unexpected_terminal),
            "corrupt_dead_letters": listing(self.corrupt_dead_letters),
            "unknown_records": listing(self.unknown_records),
            "id_mismatches": listing(self.id_mismatches),
            "not_in_log": listing(self.not_in_log),
            "early": listing(self.early),
            "unknown_due": listing(self.unknown_due),
            "duplicates": {
                "extra_calls": self.duplicate_extra_calls,
                "pairs": self.duplicate_pairs,
                "max_calls_per_pair": self.duplicate_max_calls,
                "examples": self.duplicate_examples[:SAMPLE],
                "by_fault": self.duplicates_by_fault,
                "repeated_terminal_states": self.duplicate_dead_letter_count,
                "repeated_terminal_examples": self.duplicate_dead_letters[:SAMPLE],
            },
            "lateness_ms": self.lateness_ms,
            "offset_jumps": listing(self.offset_jumps),
            "key_order": {**listing(self.out_of_order), "pairs_checked": self.ordered_pairs},
            "forks": {"count": len(self.multi_terminal), "by_kind": multi["by_kind"]},
            "lifecycles": {
                "restarted": listing(self.restarted_lifecycles),
                "retries_after_end": listing(self.retries_after_end),
            },
            "stalls": self.stalls,
            "due_disagreements": self.due_disagreements,
            "missing_success_events": self.missing_success_events,
        }


def percentile(sorted_values: Sequence[int], fraction: float) -> int | None:
    """Nearest-rank percentile: always a value that was actually measured."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]


def lateness_summary(values: Iterable[int]) -> dict[str, float | int | None]:
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "p50": percentile(ordered, 0.50),
        "p99": percentile(ordered, 0.99),
        "max": ordered[-1] if ordered else None,
        "mean": round(sum(ordered) / len(ordered), 1) if ordered else None,
    }


STALL_TARGET_MS = 30_000
"""Issue 22: no stream stalled for more than 30 s after its fault."""
Stream = tuple[str, int]


@dataclass(frozen=True, slots=True)
class StallWork:
    """One item of work of a stream: ready at ``ready_ms``, first run by a call of the stream at ``run_ms``."""

    stream: Stream
    ready_ms: int
    run_ms: int | None


def _stream_name(stream: Stream) -> str:
    return f"{stream[0]} p{stream[1]}"


def stall_summary(
    work: Iterable[StallWork], calls: Iterable[Call], fault_windows: Sequence[tuple[int, int, str]]
) -> dict[str, Any]:
    """Per stream, the longest stall that followed a fault.

    A stream is a partition of the main topic, or a retry tier together with the partition of the original (the
    call log does not carry the tier record's own partition; the tier topics are keyed like the main topic). A stall
    is a gap between two consecutive calls of the stream (or before its first call, or after its last one up to the
    last call of the run) during part of which the stream had work ready that was not yet run. Within such a gap no
    work is run, so the work ready in it only grows: the stall starts when the earliest of it became ready (or at
    the gap's start) and ends at the next call. It counts only after a fault that started before it ended, and is
    measured from that fault's end or from the stall's start, whichever is later; stalls with no fault before them
    are ignored (not caused by a fault)."""
    work_by_stream: dict[Stream, list[StallWork]] = defaultdict(list)
    for item in work:
        work_by_stream[item.stream].append(item)
    call_times: dict[Stream, list[int]] = defaultdict(list)
    all_calls: list[int] = []
    for call in calls:
        stream = (call.topic, call.partition) if call.attempt == 0 else (f"tier {call.tier}", call.partition)
        call_times[stream].append(call.call_ms)
        all_calls.append(call.call_ms)
    end_ms = max(all_calls, default=0)
    starts = [start for start, _, _ in fault_windows]
    per_stream: dict[str, dict[str, Any]] = {}
    for stream in sorted(set(work_by_stream) | set(call_times)):
        times = sorted(set(call_times.get(stream, [])))
        # Gap k ends at times[k] and starts at times[k - 1]; gap len(times) runs from the last call to end_ms.
        gaps = len(times) + 1
        spanning = [0] * (gaps + 1)  # difference array: work waiting since an earlier gap
        newly_ready: dict[int, int] = {}  # gap -> earliest ready time of the work that became ready in it
        for item in work_by_stream.get(stream, []):
            first = bisect.bisect_right(times, item.ready_ms)
            last = gaps - 1 if item.run_ms is None else bisect.bisect_right(times, item.run_ms) - 1
            if first > last:
                continue
            newly_ready[first] = min(item.ready_ms, newly_ready.get(first, item.ready_ms))
            spanning[first + 1] += 1
            spanning[last + 1] -= 1
        worst: dict[str, Any] | None = None
        waiting_since_before = 0
        for gap in range(gaps):
            waiting_since_before += spanning[gap]
            before = times[gap - 1] if gap > 0 else None
            stop = times[gap] if gap < len(times) else end_ms
            if waiting_since_before > 0 and before is not None:
                begin = before
            elif gap in newly_ready:
                begin = newly_ready[gap] if before is None else max(before, newly_ready[gap])
            else:
                continue
            fault = bisect.bisect_left(starts, stop) - 1  # the faults that started before the stall ended
            if fault < 0:
                continue
            last_end, label = max((end, label) for _, end, label in fault_windows[: fault + 1])
            length = stop - max(begin, last_end)
            if length > 0 and (worst is None or length > worst["stall_ms"]):
                worst = {
                    "stall_ms": length,
                    "from_ms": max(begin, last_end),
                    "to_ms": stop,
                    "after": label,
                    "unserved": gap == len(times),
                }
        per_stream[_stream_name(stream)] = worst or {"stall_ms": 0}
    worst_name = max(per_stream, key=lambda name: per_stream[name]["stall_ms"], default=None)
    return {
        "target_ms": STALL_TARGET_MS,
        "streams": len(per_stream),
        "over_target": sum(1 for row in per_stream.values() if row["stall_ms"] > STALL_TARGET_MS),
        "worst_stream": worst_name,
        "worst_ms": 0 if worst_name is None else per_stream[worst_name]["stall_ms"],
        "per_stream": per_stream,
    }


def terminal_states(
    produced: Sequence[Produced], calls: Iterable[Call], dead_letters: Iterable[DeadLetter]
) -> dict[Origin, list[tuple[str, int | None]]]:
    """Every terminal state each produced message reached: one ``succeeded`` at most, plus each dead letter."""
    known = {message.origin for message in produced}
    states: dict[Origin, list[tuple[str, int | None]]] = {origin: [] for origin in known}
    succeeded: dict[Origin, int] = {}
    for call in calls:
        if call.outcome == CallOutcome.OK and call.origin in known:
            succeeded[call.origin] = min(call.attempt, succeeded.get(call.origin, call.attempt))
    for origin, attempt in succeeded.items():
        states[origin].append((SUCCEEDED, attempt))
    for letter in dead_letters:
        if letter.origin in known:
            states[letter.origin].append((letter.reason or "?", letter.attempt))
    return states


def pending(produced: Sequence[Produced], calls: Iterable[Call], dead_letters: Iterable[DeadLetter]) -> list[str]:
    """Ids of messages with no terminal state yet: what the harness waits for."""
    states = terminal_states(produced, calls, dead_letters)
    return [message.mid for message in produced if not states[message.origin]]


def _state_text(state: tuple[str, int | None]) -> str:
    return f"{state[0]}@attempt {state[1]}"


def check(inputs: CheckInputs) -> CheckResult:
    """Every property at once; each finding lists the ids involved, so a failure can be traced record by record."""
    return _Checker(inputs).run()


class _Checker:
    """The inputs indexed once by origin; one method per property."""

    def __init__(self, inputs: CheckInputs) -> None:
        self.inputs = inputs
        self.produced = {message.origin: message for message in inputs.produced}
        self.calls_by_origin: dict[Origin, list[Call]] = defaultdict(list)
        for call in inputs.calls:
            self.calls_by_origin[call.origin].append(call)
        self.due_by: dict[tuple[Origin, int], list[DueTime]] = defaultdict(list)
        self.due_by_origin: dict[Origin, list[DueTime]] = defaultdict(list)
        for due in inputs.due_times:
            self.due_by[(due.origin, due.attempt)].append(due)
            self.due_by_origin[due.origin].append(due)
        self.states = terminal_states(inputs.produced, inputs.calls, inputs.dead_letters)
        self.highest_handled: dict[tuple[str, int], int] = {}
        for call in inputs.calls:
            partition = (call.topic, call.partition)
            self.highest_handled[partition] = max(call.offset, self.highest_handled.get(partition, call.offset))
        self.result = CheckResult(
            messages=len(inputs.produced),
            by_kind=dict(Counter(message.kind for message in inputs.produced)),
            calls=len(inputs.calls),
            calls_by_outcome=dict(Counter(call.outcome for call in inputs.calls)),
            terminal=dict(Counter(state for found in self.states.values() for state, _ in found)),
        )

    def run(self) -> CheckResult:
        self.check_terminal_states()
        self.check_main_log()
        self.check_dead_letters()
        self.check_call_identities()
        self.count_duplicates()
        self.check_due_times()
        self.cross_check_success_events()
        self.find_offset_jumps()
        self.count_lifecycles()
        if self.inputs.key_ordered:
            self.check_key_order()
        self.measure_stalls()
        return self.result

    def measure_stalls(self) -> None:
        """Issue 22's stall target: per stream, the longest time after a fault during which the stream had work
        ready but no handler call of it happened (see :func:`stall_summary` for the streams and the ready times)."""
        self.result.stalls = stall_summary(self._stall_work(), self.inputs.calls, self._fault_windows())

    def _fault_windows(self) -> list[tuple[int, int, str]]:
        if self.inputs.fault_windows:
            return sorted(self.inputs.fault_windows)
        return sorted((start, start, label) for start, label in self.inputs.faults)

    def _stall_work(self) -> list[StallWork]:
        """One item of work per main record and per scheduled retry, with when it became ready and when its stream
        first ran it (None: never).

        A main record's produce time is not recorded; it was produced no later than the first call of any message
        acknowledged after it (``produced.jsonl`` is in acknowledgement order), so that bound is its ready time: it
        can only make a stall look shorter. In a key-ordered run a record is ready only once the message of its key
        before it settled. A retry is ready at its (earliest announced) due time."""
        produced = self.inputs.produced
        first_try: dict[Origin, int] = {}
        first_retry: dict[tuple[Origin, int], int] = {}
        tier_of: dict[int, str] = {}
        for call in self.inputs.calls:
            if call.attempt == 0:
                first_try[call.origin] = min(call.call_ms, first_try.get(call.origin, call.call_ms))
            else:
                at = (call.origin, call.attempt)
                first_retry[at] = min(call.call_ms, first_retry.get(at, call.call_ms))
                if call.tier is not None:
                    tier_of.setdefault(call.attempt, call.tier)
        bound: list[int | None] = [None] * len(produced)
        later: int | None = None
        for index in range(len(produced) - 1, -1, -1):
            called = first_try.get(produced[index].origin)
            if called is not None:
                later = called if later is None else min(later, called)
            bound[index] = later
        settled_before: dict[Origin, int | None] = {}
        if self.inputs.key_ordered:
            by_key: dict[bytes, list[Produced]] = defaultdict(list)
            for message in produced:
                if message.key is not None:
                    by_key[message.key].append(message)
            for messages in by_key.values():
                ordered = sorted(messages, key=lambda message: message.origin)
                for earlier, following in itertools.pairwise(ordered):
                    settled_before[following.origin] = self._settled_at(earlier)
        work: list[StallWork] = []
        for message, bound_ms in zip(produced, bound, strict=True):
            if bound_ms is None:
                continue  # neither it nor anything acknowledged after it was ever called: no ready time to go by
            ready = bound_ms
            if message.origin in settled_before:
                settled = settled_before[message.origin]
                if settled is None:
                    continue  # blocked behind a message that never settled: not ready, and lost elsewhere
                ready = max(ready, settled)
            stream = (message.origin[0], message.origin[1])
            work.append(StallWork(stream, ready, first_try.get(message.origin)))
        for (origin, attempt), dues in sorted(self.due_by.items()):
            if origin not in self.produced or attempt < 1:
                continue
            tier = tier_of.get(attempt, f"attempt {attempt}")
            stream = (f"tier {tier}", origin[1])
            work.append(StallWork(stream, min(due.due_ms for due in dues), first_retry.get((origin, attempt))))
        return work

    def check_key_order(self) -> None:
        """Key-ordered mode: of two messages of one key, the later one (by offset) is first called only after the
        earlier one settled: its first successful call, or the call that ended it on the failed topic (its last
        attempt, or a permanent or undecodable failure). At-least-once repeats after a crash are not order: only
        each message's first call and first settling call count."""
        by_key: dict[bytes, list[Produced]] = defaultdict(list)
        for message in self.inputs.produced:
            if message.key is not None:
                by_key[message.key].append(message)
        for messages in by_key.values():
            ordered = sorted(messages, key=lambda message: message.origin)
            for earlier, later in itertools.pairwise(ordered):
                settled = self._settled_at(earlier)
                later_calls = self.calls_by_origin.get(later.origin, [])
                if settled is None or not later_calls or earlier.origin[:2] != later.origin[:2]:
                    continue
                self.result.ordered_pairs += 1
                started = min(call.call_ms for call in later_calls)
                if started < settled:
                    self.result.out_of_order.append(
                        {"earlier": earlier.mid, "later": later.mid, "started_before_settled_ms": settled - started}
                    )

    def _settled_at(self, message: Produced) -> int | None:
        calls = self.calls_by_origin.get(message.origin, [])
        ends = [
            call.call_ms
            for call in calls
            if call.outcome in (CallOutcome.OK, CallOutcome.PERMANENT, CallOutcome.UNDECODABLE)
            or (message.expected != SUCCEEDED and call.attempt >= message.expected_attempt)
        ]
        return min(ends, default=None)

    def check_terminal_states(self) -> None:
        """Exactly one terminal state per message, and the one its script leads to."""
        committed = self.inputs.committed or {}
        for message in self.inputs.produced:
            found = self.states[message.origin]
            if not found:
                self.result.lost.append(
                    _lost_detail(
                        message,
                        self.calls_by_origin.get(message.origin, []),
                        self.due_by_origin.get(message.origin, []),
                        committed.get(message.origin[:2]),
                        self.highest_handled.get(message.origin[:2], -1) > message.origin[2],
                    )
                )
            elif len(set(found)) > 1:
                states = [_state_text(state) for state in found]
                self.result.multi_terminal.append({"id": message.mid, "kind": _multi_kind(found), "states": states})
            elif len(found) > 1 and len(self.result.duplicate_dead_letters) < SAMPLE:
                # The same terminal state reached again (a dead letter sent twice): a redelivery, which at-least-once
                # allows; counted with the duplicates, not as a second terminal state.
                self.result.duplicate_dead_letters.append({"id": message.mid, "state": _state_text(found[0])})
            if len(found) > 1 and len(set(found)) == 1:
                self.result.duplicate_dead_letter_count += len(found) - 1
            if message.expected == RANDOM:
                self._check_random_terminal(message, found)
            elif found and len(set(found)) == 1 and found[0] != (message.expected, message.expected_attempt):
                self.result.unexpected_terminal.append(
                    {
                        "id": message.mid,
                        "expected": _state_text((message.expected, message.expected_attempt)),
                        "found": _state_text(found[0]),
                    }
                )

    def _check_random_terminal(self, message: Produced, found: Sequence[tuple[str, int | None]]) -> None:
        """A ``random`` message has no planned end: each of its terminal states must follow from one of its calls
        (a permanent failure on that attempt, or a retryable one on the last attempt), not from nowhere."""
        calls = self.calls_by_origin.get(message.origin, [])
        explained = {(SUCCEEDED, call.attempt) for call in calls if call.outcome == CallOutcome.OK}
        explained |= {("permanent", call.attempt) for call in calls if call.outcome == CallOutcome.PERMANENT}
        explained |= {
            ("exhausted", call.attempt)
            for call in calls
            if call.outcome == CallOutcome.RETRYABLE and call.attempt >= message.expected_attempt
        }
        succeeded = {attempt for state, attempt in explained if state == SUCCEEDED}
        for state, attempt in set(found):
            if (state == SUCCEEDED and succeeded) or (state, attempt) in explained:
                continue
            self.result.unexpected_terminal.append(
                {
                    "id": message.mid,
                    "expected": "a state one of its calls led to",
                    "found": _state_text((state, attempt)),
                }
            )

    def count_lifecycles(self) -> None:
        """Second lifecycles, which Rebound refuses where it can (docs/guarantees.md): a first try run again after an
        earlier first try had sent the message to a tier or the failed topic, and a retry run after the message had
        ended. Reported, not failed: a worker killed between sending a retry and writing that it did leaves no trace
        to refuse a redelivery with (at-least-once); with ``--outcome random`` a second lifecycle that ended
        differently is a fork, and that fails."""
        for message in self.inputs.produced:
            calls = sorted(self.calls_by_origin.get(message.origin, []), key=lambda call: call.call_ms)
            left = next((call for call in calls if call.attempt == 0 and call.outcome != CallOutcome.OK), None)
            if left is not None:
                again = [call for call in calls if call.attempt == 0 and call.call_ms > left.call_ms]
                if again:
                    self.result.restarted_lifecycles.append(
                        {"id": message.mid, "left_at_ms": left.call_ms, "first_tries_after": len(again)}
                    )
            settled = self._settled_at(message)
            if settled is None:
                continue
            late = [call for call in calls if call.attempt >= 1 and call.call_ms > settled]
            if late:
                self.result.retries_after_end.append(
                    {"id": message.mid, "ended_at_ms": settled, "attempts": sorted({call.attempt for call in late})}
                )

    def check_main_log(self) -> None:
        """The broker holds every acknowledged record at its offset; otherwise the produced set itself is wrong."""
        main_log = self.inputs.main_log
        if main_log is None:
            return
        for message in self.inputs.produced:
            held = main_log.get(message.origin)
            if held != (message.key, message.value):
                self.result.not_in_log.append(
                    {"id": message.mid, "origin": list(message.origin), "held": held is not None}
                )

    def check_dead_letters(self) -> None:
        """Each dead letter names a produced message by its provenance and carries its key and value byte-exact."""
        for letter in self.inputs.dead_letters:
            message = self.produced.get(letter.origin) if letter.origin is not None else None
            where = f"failed partition {letter.partition} offset {letter.offset}"
            if message is None:
                self.result.unknown_records.append(
                    {"dead_letter": where, "origin": letter.origin, "reason": letter.reason}
                )
            elif (letter.key, letter.value) != (message.key, message.value):
                self.result.corrupt_dead_letters.append(
                    {"id": message.mid, "dead_letter": where, "key_equal": letter.key == message.key}
                )

    def check_call_identities(self) -> None:
        """A call's provenance names a produced message, and the bytes it got carry that message's id."""
        for origin, calls in self.calls_by_origin.items():
            message = self.produced.get(origin)
            if message is None:
                self.result.unknown_records.append({"call_origin": list(origin), "calls": len(calls)})
                continue
            self.result.id_mismatches += [
                {"id": message.mid, "call_id": call.mid, "attempt": call.attempt}
                for call in calls
                if call.mid is not None and call.mid != message.mid
            ]

    def count_duplicates(self) -> None:
        """At-least-once allows them; they are counted, and put down to the fault before them, so that a growing
        number is seen and its source can be told: a repeat by the same process is a record read again after a
        rebalance or a seek; one by another process is a partition's new owner redoing what was not committed."""
        by_attempt: dict[tuple[Origin, int], list[Call]] = defaultdict(list)
        for call in self.inputs.calls:
            if call.origin in self.produced:
                by_attempt[(call.origin, call.attempt)].append(call)
        result = self.result
        faults = sorted(self.inputs.faults)
        fault_starts = [start for start, _ in faults]
        windows: dict[int, Counter[str]] = defaultdict(Counter)  # index into faults (-1: before any) -> counts
        for (origin, attempt), calls in sorted(by_attempt.items()):
            if len(calls) < 2:
                continue
            result.duplicate_extra_calls += len(calls) - 1
            result.duplicate_pairs += 1
            result.duplicate_max_calls = max(result.duplicate_max_calls, len(calls))
            if len(result.duplicate_examples) < SAMPLE:
                mid = self.produced[origin].mid
                result.duplicate_examples.append({"id": mid, "attempt": attempt, "calls": len(calls)})
            ordered = sorted(calls, key=lambda call: call.call_ms)
            for before, again in itertools.pairwise(ordered):
                window = windows[bisect.bisect_right(fault_starts, again.call_ms) - 1]
                window["same_process" if (before.pid, before.worker) == (again.pid, again.worker) else "other"] += 1
        for index in sorted(windows):
            counts = windows[index]
            result.duplicates_by_fault.append(
                {
                    "after": "before any fault" if index < 0 else faults[index][1],
                    "extra_calls": counts["same_process"] + counts["other"],
                    "same_process": counts["same_process"],
                    "other_process": counts["other"],
                }
            )

    def check_due_times(self) -> None:
        """No retry call before its due time; lateness is measured on the first call of each retry."""
        lateness: list[int] = []
        for origin, calls in self.calls_by_origin.items():
            message = self.produced.get(origin)
            if message is None:
                continue
            retries: dict[int, list[Call]] = defaultdict(list)
            for call in calls:
                if call.attempt >= 1:
                    retries[call.attempt].append(call)
            for attempt, attempt_calls in sorted(retries.items()):
                due_ms = self._due(origin, attempt, attempt_calls)
                if due_ms is None:
                    self.result.unknown_due += [
                        {"id": message.mid, "attempt": attempt, "call_ms": call.call_ms, "worker": call.worker}
                        for call in attempt_calls
                    ]
                    continue
                self.result.early += [
                    {
                        "id": message.mid,
                        "attempt": attempt,
                        "call_ms": call.call_ms,
                        "due_ms": due_ms,
                        "early_by_ms": due_ms - call.call_ms,
                        "worker": call.worker,
                        "pid": call.pid,
                    }
                    for call in attempt_calls
                    if call.call_ms < due_ms
                ]
                lateness.append(min(call.call_ms for call in attempt_calls) - due_ms)
        self.result.lateness_ms = lateness_summary(lateness)

    def _due(self, origin: Origin, attempt: int, calls: Sequence[Call]) -> int | None:
        candidates = {due.due_ms for due in self.due_by.get((origin, attempt), [])}
        candidates |= {call.due_ms for call in calls if call.due_ms is not None}
        if not candidates:
            return None
        if len(candidates) > 1:
            self.result.due_disagreements += 1
        # The earliest announced due time is the one that legitimately allows a release: a re-delivered scheduling
        # of the same attempt can only announce a later one.
        return min(candidates)

    def find_offset_jumps(self) -> None:
        """Consecutive first tries of one worker whose offsets jump over records no worker ever handled."""
        first_tries: dict[tuple[str, int], list[Call]] = defaultdict(list)
        handled: set[Origin] = set()
        for call in self.inputs.calls:
            if call.attempt == 0 and call.origin in self.produced:
                first_tries[(call.topic, call.partition)].append(call)
                handled.add(call.origin)
        for (topic, partition), calls in sorted(first_tries.items()):
            by_worker: dict[str | None, list[Call]] = defaultdict(list)
            for call in sorted(calls, key=lambda call: call.call_ms):
                by_worker[call.worker].append(call)
            for worker, ordered in by_worker.items():
                for before, after in itertools.pairwise(ordered):
                    never = [
                        offset
                        for offset in range(before.offset + 1, after.offset)
                        if (topic, partition, offset) in self.produced and (topic, partition, offset) not in handled
                    ]
                    if never:
                        self.result.offset_jumps.append(
                            {
                                "partition": partition,
                                "worker": worker,
                                "from_offset": before.offset,
                                "to_offset": after.offset,
                                "never_handled": len(never),
                                "from_call_ms": before.call_ms,
                                "to_call_ms": after.call_ms,
                            }
                        )

    def cross_check_success_events(self) -> None:
        success_events = set(self.inputs.succeeded_events)
        if not success_events:
            return
        for origin, found in self.states.items():
            for state, attempt in found:
                if state == SUCCEEDED and (origin, attempt) not in success_events:
                    self.result.missing_success_events += 1


def _multi_kind(found: Sequence[tuple[str, int | None]]) -> str:
    """Names the pattern, because the causes differ: a repeated dead letter is a redelivery, a mix is a real fork."""
    if any(state == SUCCEEDED for state, _ in found):
        return "succeeded and dead-lettered"
    if len(set(found)) == 1:
        return "dead-lettered more than once, same reason and attempt"
    return "dead-lettered with different reasons or attempts"


def _lost_detail(
    message: Produced,
    calls: Sequence[Call],
    announced: Sequence[DueTime],
    committed: int | None,
    later_handled: bool,
) -> dict[str, Any]:
    """What was last seen of a lost message, so the report points at where it disappeared."""
    last = max(calls, key=lambda call: call.call_ms, default=None)
    offset = message.origin[2]
    if calls:
        kind = "handled, no terminal state"
        where = "handled, but no terminal state: neither a successful call nor a dead letter"
    elif committed is None:
        kind = "never handled"
        where = "never handled (committed offset unknown)"
    elif offset < committed:
        kind = "skipped"
        where = f"never handled, yet the group committed past it (offset {offset} < committed {committed}): skipped"
    elif later_handled:
        kind = "passed over"
        where = f"never handled, though later offsets of its partition were; the group's commit is stuck at {committed}"
    else:
        kind = "not consumed"
        where = f"never handled and not committed (offset {offset} >= committed {committed}): not consumed, wedged"
    return {
        "id": message.mid,
        "kind": message.kind,
        "expected": _state_text((message.expected, message.expected_attempt)),
        "origin": list(message.origin),
        "key": None if message.key is None else message.key.decode("utf-8", "backslashreplace"),
        "kind_of_loss": kind,
        "where": where,
        "calls": len(calls),
        "last_call": None
        if last is None
        else {"attempt": last.attempt, "outcome": last.outcome, "call_ms": last.call_ms, "worker": last.worker},
        "due_announced": sorted(f"attempt {due.attempt} due {due.due_ms} ({due.source})" for due in announced),
    }
