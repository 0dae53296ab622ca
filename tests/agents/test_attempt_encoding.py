"""``emit_attempt`` writes :meth:`AttemptEvent.to_json`'s bytes without building the event (the healthy path's
cost): whatever it is given, the record it sends must be byte for byte the event's, since the pipeline reads it."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from enum import IntEnum
from types import SimpleNamespace
from typing import Any, cast

from hypothesis import example, given, settings
from hypothesis import strategies as st

from agents.delivery import _ENCODE, _json, emit_attempt
from agents.runtime import Runtime
from rebound.attempts import AttemptEvent, Outcome, event_id, key_text
from rebound.headers import Provenance
from rebound.routing import Reason


class Recorder:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.metrics: list[tuple[Any, ...]] = []

    async def send(self, **record: Any) -> None:
        self.sent.append(record)

    def attempt(self, *labels: Any) -> None:
        self.metrics.append(labels)


def fake_runtime(recorder: Recorder, *, group: str, now_ms: int, succeeded_events: str) -> Runtime:
    return cast(
        Runtime,
        SimpleNamespace(
            counters=Counter(),
            metrics=recorder,
            settings=SimpleNamespace(succeeded_events=succeeded_events),
            group=group,
            clock=lambda: now_ms,
            attempts_topic=recorder,
        ),
    )


def expected_json(
    *, group: str, key: bytes | None, provenance: Provenance, attempt: int, outcome: Outcome, now_ms: int, **rest: Any
) -> bytes:
    """What ``emit_attempt`` sent before it stopped building the event (its code then, verbatim)."""
    message = rest["error_message"]
    return AttemptEvent(
        event_id=event_id(group, provenance.topic, provenance.partition, provenance.offset, attempt, outcome),
        group=group,
        key=key_text(key),
        original_topic=provenance.topic,
        original_partition=provenance.partition,
        original_offset=provenance.offset,
        attempt=attempt,
        tier=rest["tier"],
        outcome=outcome.value,
        reason=rest["reason"],
        error_class=rest["error_class"],
        error_message=message[:1024] if message else message,
        first_received_at=provenance.first_received_at_ms,
        due_at=rest["due_at"],
        event_time=now_ms,
        next_tier=rest["next_tier"],
    ).to_json()


def emit(runtime: Runtime, **arguments: Any) -> None:
    asyncio.run(emit_attempt(runtime, **arguments))


texts = st.text(max_size=40)  # any code point but lone surrogates: quotes, controls, NUL, astral, RTL, ...
optional_texts = st.none() | texts
ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
provenances = st.builds(
    Provenance,
    topic=texts,
    partition=st.integers(min_value=0, max_value=2**31 - 1),
    offset=ints,
    timestamp_ms=ints,
    first_received_at_ms=ints,
)


@settings(max_examples=600, deadline=None)
@given(
    group=texts,
    key=st.none() | st.binary(max_size=40) | texts.map(str.encode),
    provenance=provenances,
    attempt=st.integers(min_value=0, max_value=2**31),
    outcome=st.sampled_from(Outcome),
    tier=optional_texts,
    reason=st.none() | st.sampled_from(Reason) | texts,
    error_class=optional_texts,
    error_message=st.none() | st.text(max_size=1500),
    due_at=st.none() | ints,
    next_tier=optional_texts,
    now_ms=ints,
    succeeded_events=st.sampled_from(["all", "retries"]),
)
@example(
    group="g",
    key=b"\xff\xfe k\xc3",  # not UTF-8: escaped, never an error
    provenance=Provenance('it"ems\\\n', 0, 0, 0, 0),
    attempt=0,
    outcome=Outcome.SUCCEEDED,
    tier=None,
    reason=None,
    error_class=None,
    error_message="",  # empty stays empty, not null
    due_at=None,
    next_tier=None,
    now_ms=0,
    succeeded_events="all",
)
@example(
    group="grüppe ✓",
    key="ключ 🔑".encode(),
    provenance=Provenance("items\u2028\u0000", 7, 2**62, 1, 1_700_000_000_000),
    attempt=3,
    outcome=Outcome.DEAD,
    tier="5m",
    reason=Reason.EXHAUSTED,
    error_class="app.errors.RetryableError",
    error_message="é" * 1030,  # cut at 1024 characters, not bytes
    due_at=-1,
    next_tier="1h",
    now_ms=1_700_000_000_005,
    succeeded_events="retries",
)
@example(  # a success: the fast path (names encoded once and cached, ints as they are)
    group='g"\\ü',
    key=b"k",
    provenance=Provenance("it\u2028ems\x01", 3, 2**40, 5, 1_700_000_000_000),
    attempt=0,
    outcome=Outcome.SUCCEEDED,
    tier='5"m',
    reason=None,
    error_class=None,
    error_message=None,
    due_at=None,
    next_tier=None,
    now_ms=1_700_000_000_001,
    succeeded_events="all",
)
def test_the_record_sent_is_the_events_json_byte_for_byte(
    group: str, key: bytes | None, provenance: Provenance, outcome: Outcome, succeeded_events: str, **rest: Any
) -> None:
    recorder = Recorder()
    runtime = fake_runtime(recorder, group=group, now_ms=rest["now_ms"], succeeded_events=succeeded_events)
    arguments = {name: value for name, value in rest.items() if name != "now_ms"}
    emit(runtime, key=key, provenance=provenance, outcome=outcome, **arguments)

    assert runtime.counters == Counter({f"outcome.{outcome.value}": 1})
    assert recorder.metrics == [(provenance.topic, rest["tier"], outcome.value, rest["reason"], rest["error_class"])]
    if outcome is Outcome.SUCCEEDED and rest["attempt"] == 0 and succeeded_events == "retries":
        assert recorder.sent == []
        return
    expected = expected_json(group=group, key=key, provenance=provenance, outcome=outcome, **rest)
    assert recorder.sent == [{"key": key, "value": expected, "partition": provenance.partition}]
    assert AttemptEvent.from_json(recorder.sent[0]["value"]).outcome == outcome.value


def test_a_message_that_cannot_be_encoded_is_logged_and_not_sent_as_before(caplog: Any) -> None:
    """A lone surrogate (``str(exc)`` of a handler's error can hold one) fails UTF-8 encoding: the event's own
    ``to_json`` raises, and ``emit_attempt`` logs it and goes on, as when it built the event."""
    recorder = Recorder()
    runtime = fake_runtime(recorder, group="g", now_ms=5, succeeded_events="all")
    provenance = Provenance("items", 0, 3, 1, 2)
    arguments: dict[str, Any] = {
        "key": b"k",
        "provenance": provenance,
        "attempt": 0,
        "outcome": Outcome.DEAD,
        "tier": None,
        "reason": Reason.EXHAUSTED,
        "error_class": "E",
        "error_message": "bad \ud800 surrogate",
        "due_at": None,
        "next_tier": None,
    }
    try:
        expected_json(group="g", now_ms=5, **arguments)
    except UnicodeEncodeError:
        pass
    else:
        raise AssertionError("the event's own encoding was expected to fail")
    emit(runtime, **arguments)
    assert recorder.sent == []
    assert runtime.counters == Counter({"outcome.dead": 1})
    assert "could not emit attempt event " + event_id("g", "items", 0, 3, 0, Outcome.DEAD) in caplog.text


class _Level(IntEnum):
    HIGH = 2


class _Text(str):
    def __str__(self) -> str:
        return "not what is encoded"


json_values = (
    st.none()
    | st.booleans()  # an int subclass: must not take the int shortcut
    | st.integers()
    | st.integers(min_value=10**4300, max_value=10**4400)  # past the int-to-str digit limit: the encoder's ValueError
    | st.floats()  # nan and the infinities included
    | st.text(st.characters(codec=None))  # lone surrogates included: kept, so the UTF-8 step fails as before
    | st.text().map(_Text)
    | st.sampled_from([*Reason, *_Level, (1, "a"), [None], {"k": 1.5}, b"bytes", object()])
)


@settings(max_examples=2000, deadline=None)
@given(json_values)
def test_every_value_is_written_as_the_encoder_writes_it_in_the_events_dict(value: Any) -> None:
    """The fields ``emit_attempt`` writes itself: whatever type a field holds, the text (or the error) is the one the
    dict's encoding gave, which the test above only draws strings, 64-bit ints and nulls for."""

    def outcome(encode: Callable[[Any], str]) -> tuple[str, Any]:
        try:
            return "text", encode(value)
        except Exception as error:
            return "error", type(error)

    assert outcome(_json) == outcome(lambda value: _ENCODE({"v": value})[len('{"v":') : -1])
