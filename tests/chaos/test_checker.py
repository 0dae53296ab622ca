"""The checker on hand-made inputs: each violation it exists to find is found, and a clean run passes.

A checker that never fails would make every chaos run green; these tests are what makes its PASS mean something.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from chaos.calllog import Call, CallLogWriter, read_all
from chaos.checker import CheckInputs, CheckResult, DeadLetter, DueTime, Produced, check, pending, percentile
from chaos.evidence import load_inputs, save_observed, save_produced
from chaos.scenario import SUCCEEDED, CallOutcome, Kind, decide, plan_messages, script

TOPIC = "orders"


def produced(mid: str, offset: int, kind: Kind, expected: str, attempt: int = 0) -> Produced:
    value = script(mid, kind, succeed_on=attempt if kind is Kind.RETRY else 0)
    return Produced(mid, (TOPIC, 0, offset), f"key-{mid}".encode(), value, kind.value, expected, attempt)


def call(message: Produced, attempt: int, outcome: CallOutcome, at_ms: int) -> Call:
    return Call(
        mid=message.mid,
        topic=TOPIC,
        partition=0,
        offset=message.origin[2],
        attempt=attempt,
        call_ms=at_ms,
        outcome=outcome.value,
        pid=1,
        worker="w1.0",
    )


def dead(message: Produced, reason: str, attempt: int, offset: int = 0, value: bytes | None = None) -> DeadLetter:
    return DeadLetter(
        origin=message.origin,
        reason=reason,
        attempt=attempt,
        key=message.key,
        value=message.value if value is None else value,
        partition=0,
        offset=offset,
    )


OK = produced("m1", 0, Kind.SUCCESS, SUCCEEDED)
RETRIED = produced("m2", 1, Kind.RETRY, SUCCEEDED, attempt=1)
PERMANENT = produced("m3", 2, Kind.PERMANENT, "permanent")


def clean_inputs() -> CheckInputs:
    """A correct run: m1 succeeds at once, m2 succeeds on its retry (after due), m3 is dead-lettered."""
    return CheckInputs(
        produced=[OK, RETRIED, PERMANENT],
        calls=[
            call(OK, 0, CallOutcome.OK, 1000),
            call(RETRIED, 0, CallOutcome.RETRYABLE, 1000),
            call(RETRIED, 1, CallOutcome.OK, 2050),
            call(PERMANENT, 0, CallOutcome.PERMANENT, 1000),
        ],
        dead_letters=[dead(PERMANENT, "permanent", 0)],
        due_times=[
            DueTime(RETRIED.origin, 1, 2000, "scheduled-event"),
            DueTime(RETRIED.origin, 1, 2000, "tier-header"),
        ],
        succeeded_events=[(OK.origin, 0), (RETRIED.origin, 1)],
        main_log={message.origin: (message.key, message.value) for message in (OK, RETRIED, PERMANENT)},
    )


def with_changes(**changes: object) -> CheckInputs:
    inputs = clean_inputs()
    for name, value in changes.items():
        setattr(inputs, name, value)
    return inputs


def test_a_clean_run_passes_with_its_lateness_measured() -> None:
    result = check(clean_inputs())
    assert result.passed, result.failures
    assert result.terminal == {SUCCEEDED: 2, "permanent": 1}
    assert result.lateness_ms["p50"] == 50 and result.lateness_ms["max"] == 50
    assert result.duplicate_extra_calls == 0 and result.missing_success_events == 0


def lost_kind(result: CheckResult) -> dict[str, int]:
    by_kind: dict[str, int] = result.to_json()["lost"]["by_kind"]
    return by_kind


def test_a_lost_message_is_detected_with_where_it_was_last_seen() -> None:
    inputs = with_changes(calls=[c for c in clean_inputs().calls if c.mid != "m2" or c.attempt == 0])
    inputs.committed = {(TOPIC, 0): 3}
    result = check(inputs)
    assert not result.passed
    assert [item["id"] for item in result.lost] == ["m2"]
    assert result.lost[0]["last_call"]["attempt"] == 0
    assert "handled, but no terminal state" in result.lost[0]["where"]
    assert result.failures == ["1 lost"]


def test_a_message_never_handled_below_the_committed_offset_is_reported_as_skipped() -> None:
    inputs = with_changes(calls=[c for c in clean_inputs().calls if c.mid != "m1"])
    inputs.committed = {(TOPIC, 0): 3}
    lost = check(inputs).lost
    assert [item["id"] for item in lost] == ["m1"]
    assert lost[0]["kind_of_loss"] == "skipped" and "committed past it" in lost[0]["where"]


def test_a_message_never_handled_above_the_committed_offset_is_reported_as_wedged() -> None:
    inputs = with_changes(calls=[c for c in clean_inputs().calls if c.mid != "m3"], dead_letters=[])
    inputs.committed = {(TOPIC, 0): 2}
    lost = check(inputs).lost
    assert [item["id"] for item in lost] == ["m3"]
    assert lost[0]["kind_of_loss"] == "not consumed" and "wedged" in lost[0]["where"]


def test_a_message_passed_over_while_later_offsets_were_handled_is_told_apart_from_a_wedge() -> None:
    inputs = with_changes(calls=[c for c in clean_inputs().calls if c.mid != "m2"], due_times=[])
    inputs.committed = {(TOPIC, 0): 1}
    lost = check(inputs).lost
    assert [item["id"] for item in lost] == ["m2"]
    assert lost[0]["kind_of_loss"] == "passed over" and "stuck at 1" in lost[0]["where"]


def test_a_worker_jumping_over_offsets_nobody_handled_is_shown_as_evidence() -> None:
    inputs = with_changes(calls=[c for c in clean_inputs().calls if c.mid != "m2"], due_times=[])
    result = check(inputs)
    assert result.offset_jumps == [
        {
            "partition": 0,
            "worker": "w1.0",
            "from_offset": 0,
            "to_offset": 2,
            "never_handled": 1,
            "from_call_ms": 1000,
            "to_call_ms": 1000,
        }
    ]
    assert check(clean_inputs()).offset_jumps == []


def test_pending_lists_exactly_the_messages_without_a_terminal_state() -> None:
    inputs = clean_inputs()
    assert pending(inputs.produced, inputs.calls, inputs.dead_letters) == []
    assert pending(inputs.produced, inputs.calls[:1], inputs.dead_letters) == ["m2"]


def test_a_retry_run_before_its_due_time_is_early() -> None:
    inputs = clean_inputs()
    early_call = call(RETRIED, 1, CallOutcome.OK, 1999)
    inputs.calls = [*inputs.calls[:2], early_call, inputs.calls[3]]
    result = check(inputs)
    assert not result.passed
    assert result.early == [
        {
            "id": "m2",
            "attempt": 1,
            "call_ms": 1999,
            "due_ms": 2000,
            "early_by_ms": 1,
            "worker": "w1.0",
            "pid": 1,
        }
    ]


def test_the_earliest_announced_due_time_is_the_one_that_counts() -> None:
    """A re-scheduled attempt announces a later due time; a release after the first one is not early."""
    inputs = clean_inputs()
    inputs.due_times = [*inputs.due_times, DueTime(RETRIED.origin, 1, 2100, "scheduled-event")]
    result = check(inputs)
    assert result.passed, result.failures
    assert result.due_disagreements == 1


def test_a_retry_without_any_announced_due_time_fails_rather_than_passing_unchecked() -> None:
    result = check(with_changes(due_times=[]))
    assert not result.passed
    assert [(item["id"], item["attempt"]) for item in result.unknown_due] == [("m2", 1)]


def test_succeeded_and_dead_lettered_is_more_than_one_terminal_state() -> None:
    inputs = clean_inputs()
    inputs.dead_letters = [*inputs.dead_letters, dead(OK, "internal-error", 0, offset=1)]
    result = check(inputs)
    assert not result.passed
    assert result.multi_terminal == [
        {
            "id": "m1",
            "kind": "succeeded and dead-lettered",
            "states": ["succeeded@attempt 0", "internal-error@attempt 0"],
        }
    ]


def test_dead_lettered_twice_the_same_way_is_a_counted_duplicate_not_a_second_terminal_state() -> None:
    """At-least-once: a dead letter sent again after a redelivery is the same terminal state, counted, not a fork."""
    inputs = clean_inputs()
    inputs.dead_letters = [*inputs.dead_letters, dead(PERMANENT, "permanent", 0, offset=1)]
    result = check(inputs)
    assert result.passed, result.failures
    assert result.multi_terminal == []
    assert result.duplicate_dead_letter_count == 1
    assert result.duplicate_dead_letters == [{"id": "m3", "state": "permanent@attempt 0"}]


def test_dead_lettered_twice_with_different_reasons_is_more_than_one_terminal_state() -> None:
    inputs = clean_inputs()
    inputs.dead_letters = [*inputs.dead_letters, dead(PERMANENT, "exhausted", 3, offset=1)]
    result = check(inputs)
    assert not result.passed
    assert [item["kind"] for item in result.multi_terminal] == ["dead-lettered with different reasons or attempts"]


def test_duplicate_calls_are_counted_without_failing_at_least_once() -> None:
    inputs = clean_inputs()
    inputs.calls = [*inputs.calls, call(OK, 0, CallOutcome.OK, 1500), call(OK, 0, CallOutcome.OK, 1600)]
    result = check(inputs)
    assert result.passed, result.failures
    assert (result.duplicate_extra_calls, result.duplicate_pairs, result.duplicate_max_calls) == (2, 1, 3)
    assert result.duplicate_examples == [{"id": "m1", "attempt": 0, "calls": 3}]
    assert result.terminal[SUCCEEDED] == 2  # a message succeeding twice is still one terminal state


def test_duplicate_calls_are_put_down_to_the_last_fault_before_them_by_process() -> None:
    """A repeat by the same worker process is a record it read again; by another, a new owner redoing the work."""
    inputs = clean_inputs()
    first = next(c for c in inputs.calls if c.mid == "m1")
    inputs.calls = [
        *inputs.calls,
        replace(first, call_ms=first.call_ms + 5),  # before any fault, same process
        replace(first, call_ms=2500, pid=2, worker="w2.0"),  # after the kill, another process
        replace(first, call_ms=2600, pid=2, worker="w2.0"),  # and again by that one
    ]
    inputs.faults = [(2000, "kill w1.0"), (3000, "rebalance w2.0")]
    result = check(inputs)
    assert result.passed, result.failures
    assert result.duplicates_by_fault == [
        {"after": "before any fault", "extra_calls": 1, "same_process": 1, "other_process": 0},
        {"after": "kill w1.0", "extra_calls": 2, "same_process": 1, "other_process": 1},
    ]


def test_the_wrong_reason_is_an_unexpected_terminal_state() -> None:
    result = check(with_changes(dead_letters=[dead(PERMANENT, "internal-error", 0)]))
    assert not result.passed
    assert result.unexpected_terminal == [
        {"id": "m3", "expected": "permanent@attempt 0", "found": "internal-error@attempt 0"}
    ]


def test_a_dead_letter_that_is_not_byte_exact_is_reported() -> None:
    result = check(with_changes(dead_letters=[dead(PERMANENT, "permanent", 0, value=b"changed")]))
    assert not result.passed
    assert [item["id"] for item in result.corrupt_dead_letters] == ["m3"]


def test_records_of_messages_never_produced_are_reported() -> None:
    stranger = produced("m9", 9, Kind.SUCCESS, SUCCEEDED)
    inputs = clean_inputs()
    inputs.calls = [*inputs.calls, call(stranger, 0, CallOutcome.OK, 1000)]
    inputs.dead_letters = [*inputs.dead_letters, dead(stranger, "permanent", 0, offset=1)]
    result = check(inputs)
    assert not result.passed
    assert len(result.unknown_records) == 2


def test_a_call_carrying_another_messages_bytes_is_reported() -> None:
    inputs = clean_inputs()
    wrong = Call("m2", TOPIC, 0, 0, 0, 1000, CallOutcome.OK.value)  # m1's provenance, m2's bytes
    inputs.calls = [*inputs.calls, wrong]
    result = check(inputs)
    assert not result.passed
    assert result.id_mismatches == [{"id": "m1", "call_id": "m2", "attempt": 0}]


def test_an_acknowledged_record_missing_from_the_broker_log_invalidates_the_run() -> None:
    inputs = clean_inputs()
    assert inputs.main_log is not None
    inputs.main_log = {origin: held for origin, held in inputs.main_log.items() if origin != OK.origin}
    result = check(inputs)
    assert not result.passed
    assert result.not_in_log == [{"id": "m1", "origin": [TOPIC, 0, 0], "held": False}]


def test_a_success_without_its_attempt_event_is_counted_as_information_only() -> None:
    result = check(with_changes(succeeded_events=[(OK.origin, 0)]))
    assert result.passed
    assert result.missing_success_events == 1


def test_percentiles_are_nearest_rank_values_that_were_measured() -> None:
    values = list(range(1, 101))
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile(values, 1.0)) == (50, 99, 100)
    assert percentile([], 0.5) is None


def test_the_handler_script_and_the_plan_agree_on_every_terminal_state() -> None:
    """Replaying the plan through the handler's decision reaches exactly the expected terminal state."""
    for message in plan_messages(500, seed=7, max_retries=3):
        outcomes = []
        for attempt in range(4):
            mid, outcome = decide(message.value, attempt)
            assert mid == message.mid
            outcomes.append(outcome)
            if outcome is not CallOutcome.RETRYABLE:
                break
        last = outcomes[-1]
        if message.expected == SUCCEEDED:
            assert last is CallOutcome.OK and len(outcomes) - 1 == message.expected_attempt
        elif message.expected == "exhausted":
            assert outcomes == [CallOutcome.RETRYABLE] * 4 and message.expected_attempt == 3
        else:
            assert last.value == message.expected and len(outcomes) - 1 == message.expected_attempt
    # Every scripted kind is planned; ``random`` only with ``outcome="random"`` (tests/chaos/test_forks.py).
    assert {message.kind for message in plan_messages(500, seed=7, max_retries=3)} == set(Kind) - {Kind.RANDOM}


def test_undecodable_values_are_not_json_yet_carry_their_id() -> None:
    value = script("m000042", Kind.UNDECODABLE)
    try:
        json.loads(value)
    except ValueError:
        pass
    else:  # pragma: no cover - the assertion below explains
        raise AssertionError("an undecodable message must not be JSON")
    assert decide(value, 0) == ("m000042", CallOutcome.UNDECODABLE)


def test_call_logs_and_saved_evidence_round_trip_to_the_same_verdict(tmp_path: Path) -> None:
    inputs = clean_inputs()
    inputs.dead_letters = [*inputs.dead_letters, dead(PERMANENT, "permanent", 0, offset=1)]
    inputs.committed = {(TOPIC, 0): 3}
    writer = CallLogWriter(tmp_path / "calls" / "w1.0.sqlite")
    for made in inputs.calls:
        writer.write(made)
    writer.close()
    assert read_all(tmp_path / "calls") == list(inputs.calls)
    save_produced(tmp_path, inputs.produced)
    save_observed(tmp_path, inputs)
    assert check(load_inputs(tmp_path)).to_json() == check(inputs).to_json()


def test_key_order_is_checked_only_for_key_ordered_runs_and_finds_a_message_run_too_soon() -> None:
    """In a key-ordered run, a key's later message may start only once the earlier one settled."""
    first = replace(RETRIED, key=b"shared")
    second = replace(OK, origin=(TOPIC, 0, 5), key=b"shared")
    base = clean_inputs()
    in_order = replace(
        base,
        produced=[first, second],
        calls=[
            call(first, 0, CallOutcome.RETRYABLE, 1000),
            call(first, 1, CallOutcome.OK, 2050),
            call(second, 0, CallOutcome.OK, 2060),
        ],
        dead_letters=[],
        main_log=None,
        key_ordered=True,
    )
    result = check(in_order)
    assert result.passed and result.ordered_pairs == 1, result.failures
    too_soon = replace(in_order, calls=[*in_order.calls[:2], call(second, 0, CallOutcome.OK, 1500)])
    result = check(too_soon)
    assert not result.passed
    assert result.out_of_order == [{"earlier": "m2", "later": "m1", "started_before_settled_ms": 550}]
    assert check(replace(too_soon, key_ordered=False)).passed  # non-blocking retry reorders by design
    # A repeat of the earlier message after the later one ran (a crash before the commit) is not an order violation.
    repeated = replace(in_order, calls=[*in_order.calls, call(first, 1, CallOutcome.OK, 3000)])
    assert check(repeated).passed
