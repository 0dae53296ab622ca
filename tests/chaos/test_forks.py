"""The random-outcome mode and the fork count (issue 22, defect 4): a checker that can see a message with two lifecycles.

With the scripted handler two lifecycles of one message run the same attempts to the same end, so the checker could
not see them. ``--outcome random`` draws each call's outcome; a message whose lifecycles end differently is a fork,
and the checker fails on it. These tests feed it hand-made inputs, the shapes defect 4 produced among them.
"""

from __future__ import annotations

import json
from pathlib import Path

from chaos.__main__ import build_parser, config_from
from chaos.calllog import Call
from chaos.checker import CheckInputs, DeadLetter, DueTime, Produced, check
from chaos.evidence import load_inputs, save_observed, save_produced
from chaos.handler import idempotent_random
from chaos.scenario import (
    RANDOM,
    RANDOM_WEIGHTS,
    SUCCEEDED,
    CallOutcome,
    Kind,
    decide,
    is_random,
    plan_messages,
    random_outcome,
    script,
)

TOPIC = "orders"
LAST = 3
"""Attempts 0..3: three retries, as with ``--retry-sequence 1s,2s,3s``."""


def random_message(mid: str, offset: int) -> Produced:
    return Produced(mid, (TOPIC, 0, offset), f"key-{mid}".encode(), script(mid, Kind.RANDOM), "random", RANDOM, LAST)


def call(message: Produced, attempt: int, outcome: CallOutcome, at_ms: int, worker: str = "w1.0") -> Call:
    return Call(
        mid=message.mid,
        topic=TOPIC,
        partition=0,
        offset=message.origin[2],
        attempt=attempt,
        call_ms=at_ms,
        outcome=outcome.value,
        pid=1,
        worker=worker,
    )


def dead(message: Produced, reason: str, attempt: int) -> DeadLetter:
    return DeadLetter(message.origin, reason, attempt, message.key, message.value)


def due(message: Produced, attempt: int, at_ms: int) -> DueTime:
    return DueTime(message.origin, attempt, at_ms, "tier-header")


def inputs(message: Produced, calls: list[Call], letters: list[DeadLetter], dues: list[DueTime]) -> CheckInputs:
    return CheckInputs(produced=[message], calls=calls, dead_letters=letters, due_times=dues)


M = random_message("m1", 0)


def test_a_random_message_with_one_end_its_calls_explain_passes() -> None:
    calls = [call(M, 0, CallOutcome.RETRYABLE, 1000), call(M, 1, CallOutcome.PERMANENT, 2100)]
    result = check(inputs(M, calls, [dead(M, "permanent", 1)], [due(M, 1, 2000)]))
    assert result.passed, result.failures
    assert result.to_json()["forks"] == {"count": 0, "by_kind": {}}


def test_a_random_message_that_exhausted_its_retries_passes() -> None:
    calls = [call(M, attempt, CallOutcome.RETRYABLE, 1000 + 1000 * attempt) for attempt in range(LAST + 1)]
    dues = [due(M, attempt, 1000 + 1000 * attempt) for attempt in range(1, LAST + 1)]
    result = check(inputs(M, calls, [dead(M, "exhausted", LAST)], dues))
    assert result.passed, result.failures


def test_defect_4s_fork_fails_the_run() -> None:
    """Attempt 0 failed and its retry was parked; the main record, redelivered, ran attempt 0 again, which failed
    permanently (a dead letter); the parked retry then succeeded: succeeded and dead-lettered."""
    calls = [
        call(M, 0, CallOutcome.RETRYABLE, 1000),
        call(M, 0, CallOutcome.PERMANENT, 1500, worker="w2.0"),
        call(M, 1, CallOutcome.OK, 2100, worker="w2.0"),
    ]
    result = check(inputs(M, calls, [dead(M, "permanent", 0)], [due(M, 1, 2000)]))
    assert not result.passed
    assert result.failures == ["1 forks (in more than one terminal state)"]
    assert result.to_json()["forks"] == {"count": 1, "by_kind": {"succeeded and dead-lettered": 1}}
    assert [item["id"] for item in result.restarted_lifecycles] == ["m1"]


def test_two_different_dead_letters_are_a_fork() -> None:
    calls = [
        call(M, 0, CallOutcome.PERMANENT, 1000),
        call(M, 0, CallOutcome.RETRYABLE, 1500),
        *[call(M, attempt, CallOutcome.RETRYABLE, 2000 + attempt) for attempt in range(1, LAST + 1)],
    ]
    letters = [dead(M, "permanent", 0), dead(M, "exhausted", LAST)]
    result = check(inputs(M, calls, letters, [due(M, attempt, 2000) for attempt in range(1, LAST + 1)]))
    assert result.failures == ["1 forks (in more than one terminal state)"]
    assert result.multi_terminal[0]["kind"] == "dead-lettered with different reasons or attempts"


def test_a_dead_letter_no_call_led_to_is_unexpected() -> None:
    """A random message has no planned end, but its end must still follow from one of its calls."""
    calls = [call(M, 0, CallOutcome.RETRYABLE, 1000), call(M, 1, CallOutcome.RETRYABLE, 2100)]
    result = check(inputs(M, calls, [dead(M, "permanent", 1)], [due(M, 1, 2000)]))
    assert [item["found"] for item in result.unexpected_terminal] == ["permanent@attempt 1"]
    exhausted_early = check(inputs(M, calls, [dead(M, "exhausted", 1)], [due(M, 1, 2000)]))
    assert [item["found"] for item in exhausted_early.unexpected_terminal] == ["exhausted@attempt 1"]


def test_a_success_redelivered_after_it_ended_is_no_fork() -> None:
    """An idempotent handler succeeds again: at-least-once, the same terminal state."""
    calls = [call(M, 0, CallOutcome.OK, 1000), call(M, 0, CallOutcome.OK, 5000, worker="w2.0")]
    result = check(inputs(M, calls, [], []))
    assert result.passed and result.restarted_lifecycles == [] and result.duplicate_extra_calls == 1


def test_a_retry_run_again_after_the_message_ended_is_counted_not_failed() -> None:
    """The tier record read again after its retry settled: the same end (no fork), but a second lifecycle's work."""
    calls = [
        call(M, 0, CallOutcome.RETRYABLE, 1000),
        call(M, 1, CallOutcome.OK, 2100),
        call(M, 1, CallOutcome.OK, 9000, worker="w2.0"),
    ]
    result = check(inputs(M, calls, [], [due(M, 1, 2000)]))
    assert result.passed, result.failures
    assert result.retries_after_end == [{"id": "m1", "ended_at_ms": 2100, "attempts": [1]}]
    lifecycles = result.to_json()["lifecycles"]
    assert (lifecycles["restarted"]["count"], lifecycles["retries_after_end"]["count"]) == (0, 1)


def test_a_scripted_run_counts_restarted_first_tries_too() -> None:
    """The scripted handler hides forks, not second lifecycles: a first try run again after it sent the message to a
    tier is counted whatever the handler."""
    message = Produced(
        "m2", (TOPIC, 0, 1), b"k", script("m2", Kind.RETRY, succeed_on=1), Kind.RETRY.value, SUCCEEDED, 1
    )
    calls = [
        call(message, 0, CallOutcome.RETRYABLE, 1000),
        call(message, 0, CallOutcome.RETRYABLE, 1500),
        call(message, 1, CallOutcome.OK, 2100),
    ]
    result = check(inputs(message, calls, [], [due(message, 1, 2000)]))
    assert result.passed, result.failures
    assert [item["id"] for item in result.restarted_lifecycles] == ["m2"]


def test_random_messages_survive_a_recheck_from_disk(tmp_path: Path) -> None:
    calls = [call(M, 0, CallOutcome.PERMANENT, 1000), call(M, 0, CallOutcome.OK, 1500)]
    original = inputs(M, calls, [dead(M, "permanent", 0)], [])
    save_produced(tmp_path, list(original.produced))
    save_observed(tmp_path, original)
    from chaos.calllog import CallLogWriter

    (tmp_path / "calls").mkdir()
    writer = CallLogWriter(tmp_path / "calls" / "w1.0.sqlite")
    for item in calls:
        writer.write(item)
    writer.close()
    assert check(load_inputs(tmp_path)).failures == ["1 forks (in more than one terminal state)"]


# --- the random handler -------------------------------------------------------------------------------------------


def test_the_random_plan_leaves_every_end_open() -> None:
    plan = plan_messages(50, seed=3, max_retries=LAST, outcome="random")
    assert {message.kind for message in plan} == {Kind.RANDOM}
    assert {(message.expected, message.expected_attempt) for message in plan} == {(RANDOM, LAST)}
    assert all(is_random(message.value) for message in plan)
    assert not any(is_random(message.value) for message in plan_messages(50, seed=3, max_retries=LAST))
    assert decide(plan[0].value, 0)[0] == plan[0].mid


def test_each_call_draws_its_outcome_by_the_weights() -> None:
    ok, retryable = RANDOM_WEIGHTS[CallOutcome.OK], RANDOM_WEIGHTS[CallOutcome.RETRYABLE]
    assert random_outcome(0.0) is CallOutcome.OK
    assert random_outcome(ok - 1e-9) is CallOutcome.OK
    assert random_outcome(ok) is CallOutcome.RETRYABLE
    assert random_outcome(ok + retryable) is CallOutcome.PERMANENT
    assert random_outcome(0.999999) is CallOutcome.PERMANENT


def test_the_random_handler_is_idempotent_once_a_call_succeeded(tmp_path: Path) -> None:
    """Its effect is done: a later call of the message, on any worker, succeeds whatever it draws."""
    effects = tmp_path / "effects"
    assert idempotent_random("m1", 0.99, effects) is CallOutcome.PERMANENT
    assert not (effects / "m1").exists()
    assert idempotent_random("m1", 0.0, effects) is CallOutcome.OK
    assert (effects / "m1").exists()
    assert idempotent_random("m1", 0.99, effects) is CallOutcome.OK
    assert idempotent_random("m2", 0.99, effects) is CallOutcome.PERMANENT


def test_the_command_line_selects_the_random_outcome(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--outcome", "random", "--quick", "--out", str(tmp_path)])
    assert config_from(args).outcome == "random"
    assert config_from(build_parser().parse_args(["--out", str(tmp_path)])).outcome == "scripted"
    assert json.loads(json.dumps(config_from(args).outcome)) == "random"
