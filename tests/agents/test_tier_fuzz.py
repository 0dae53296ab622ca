"""Fuzz of the tier agents: any record read from a tier topic is parked or dead-lettered, and the agent lives on.

Records are fed through the real tier agent (``agent.test_context()``), one fresh runtime per example. Each fuzz record
starts as a genuine tier record (``rebound.headers.retry_headers`` for the configured main topic and group, on the
tier partition its original partition maps to) and then gets a few mutations. Whatever it carries, it must end either

* parked: in the state table under its key, due exactly at its ``rebound.due-at``, nothing on the failed topic; or
* rejected: on ``<main>.failed`` byte-exact with ``rebound.reason: invalid-retry-headers``, and nothing parked;

and a valid sentinel sent right after it must still be parked (the agent did not die). Mutations that make a record
untrustworthy must reject it; a genuine record must be parked whatever its timestamp says.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from faust.types import TP
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from agents.runtime import Runtime
from rebound import headers as h
from rebound.policy import RetryPolicy, parse_duration_ms
from rebound.routing import Reason
from rebound.settings import Settings
from rebound.state import PendingMessage, table_key
from rebound.topics import tier_topic
from tests.agents.conftest import FakeClock, nothing_waits

MAIN = "items"
OTHER_MAIN = "orders"
GROUP = "agent-test"  # the app id make_runtime configures: the consumer group
SEQUENCE = "1s,1s,2s"
POLICY = RetryPolicy.parse(SEQUENCE)
TIERS = {tier_topic(MAIN, label): label for label in POLICY.tier_labels}
RETRIES = range(1, POLICY.max_retries + 1)
DELAY_MS = {POLICY.tier_label(retry): POLICY.delay_for_retry(retry) for retry in RETRIES}
ATTEMPTS = {label: [retry for retry in RETRIES if POLICY.tier_label(retry) == label] for label in POLICY.tier_labels}
PARTITIONS = 4
DAY_MS = 86_400_000
# Any tolerance for clock skew is far smaller than this: a due time further than delay + this is "far in the future".
FAR_MS = 3_600_000
# A tier accepts a due time up to REBOUND_RETRY_AFTER_MAX ahead (a Retry-After honoured), when that exceeds its delay.
LONGEST_WAIT_MS = parse_duration_ms(
    Settings.model_fields["retry_after_max"].default, variable="REBOUND_RETRY_AFTER_MAX"
)
SENTINEL_KEY = b"\xff\x00sentinel"
SETTLE_S = 5.0

REQUIRED = h.REQUIRED_RETRY_HEADERS
OPTIONAL = h.OPTIONAL_RETRY_HEADERS
NUMERIC = (h.ORIGINAL_PARTITION, h.ORIGINAL_OFFSET, h.ORIGINAL_TIMESTAMP, h.FIRST_RECEIVED_AT, h.ATTEMPT, h.DUE_AT)
TEXT_LIMITS = {
    h.ORIGINAL_TOPIC: 249,
    h.GROUP: 249,
    h.ERROR_CLASS: h.MAX_ERROR_CLASS_BYTES,
    h.ERROR_MESSAGE: h.MAX_ERROR_MESSAGE_BYTES,
}
# Record timestamps (seconds, as Faust gives them). test_context replaces a falsy timestamp with the wall clock, so
# Kafka's 0 ms is sent as 1 ns (read as 0 ms); Kafka's "no timestamp" (-1 ms) is -0.001 s. "lagging" is a genuine record
# read late (the whole record, timestamp and due time, is from up to ten days ago); "past" is a timestamp ten days older
# than a due time near now, which no genuine record has.
TIMESTAMPS = ("now", "zero", "minus-one", "future", "lagging", "past")


@dataclass
class RawRecordingTopic:
    """Records what is sent with the header pairs as sent (a dict would hide a repeated header)."""

    name: str
    sent: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]], int | None]] = field(default_factory=list)

    def get_topic_name(self) -> str:
        return self.name

    async def send(self, *, key: Any = None, value: Any = None, headers: Any = None, partition: Any = None) -> Any:
        self.sent.append((key, value, list(headers or []), partition))
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(("ack", self.name, len(self.sent) - 1))
        return done


# --- strategies --------------------------------------------------------------------------------------------------

user_names = st.one_of(
    st.text(max_size=16).filter(lambda name: not name.startswith(h.PREFIX)),
    st.sampled_from(["trace-id", "content-type", "rebound", "Rebound.attempt"]),
)
# The user's headers, and sometimes the redrive count a redriven record carries.
user_headers = st.lists(st.tuples(user_names, st.binary(max_size=64)), max_size=4) | st.lists(
    st.tuples(user_names, st.binary(max_size=64)), max_size=3
).map(lambda pairs: [*pairs, (h.REDRIVE_COUNT, b"1")])
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=60)
bad_numbers = st.one_of(
    st.sampled_from(
        [
            b"",
            b"-1",
            b"+5",
            "١٢".encode(),
            "\uff11\uff12".encode(),
            b"1.5",
            b" 7",
            b"7 ",
            b"0x10",
            b"1_000",
            b"1e3",
            b"\xff\xfe",
            b"9" * 21,
            b"12345678901234567890123",
        ]
    ),
    st.integers(1, 2**80).map(lambda n: b"-" + str(n).encode()),
    st.binary(min_size=1, max_size=12).filter(lambda raw: not (raw.isascii() and raw.isdigit())),
)

# How much further than delay + FAR_MS a far-future due time is: up to a day (mostly), or up to ten years.
far_beyond = st.one_of(st.integers(0, DAY_MS), st.integers(0, DAY_MS), st.integers(0, 3650 * DAY_MS))


@st.composite
def mutations(draw: Any) -> list[tuple[Any, ...]]:
    """Up to three mutations, each aimed at a different part of the record."""
    options = st.one_of(
        st.tuples(st.just("drop"), st.sampled_from(REQUIRED + OPTIONAL)),
        st.tuples(
            st.just("duplicate"),
            st.sampled_from(REQUIRED + OPTIONAL),  # a repeated redrive count: see the last test
            st.booleans(),
            st.binary(max_size=8),
            st.integers(0, 20),
        ),
        st.tuples(st.just("corrupt-number"), st.sampled_from(NUMERIC), bad_numbers),
        st.tuples(st.just("attempt-zero")),
        st.tuples(st.just("due-before-first"), st.integers(1, DAY_MS)),
        st.tuples(st.just("bad-text"), st.sampled_from(list(TEXT_LIMITS)), st.sampled_from(["non-utf8", "oversize"])),
        st.tuples(
            st.just("wrong-group"), st.one_of(st.sampled_from(["rebound", "agent-test ", "AGENT-TEST", ""]), texts)
        ),
        st.tuples(
            st.just("foreign-topic"), st.one_of(st.sampled_from([OTHER_MAIN, "payments", "items.retry.1s"]), texts)
        ),
        st.tuples(st.just("wrong-partition"), st.integers(1, PARTITIONS - 1)),
        st.tuples(st.just("far-future"), far_beyond),
        st.tuples(
            st.just("extra"),
            st.one_of(user_names, st.text(max_size=12).map(lambda s: "rebound.x-" + s)),
            st.binary(max_size=2000),
        ),
    )

    def target(mutation: tuple[Any, ...]) -> Any:
        kind = mutation[0]
        if kind in ("drop", "duplicate", "corrupt-number", "bad-text"):
            return mutation[1]
        if kind == "extra":
            return ("extra", mutation[1])
        return {
            "attempt-zero": h.ATTEMPT,
            "due-before-first": h.DUE_AT,
            "far-future": h.DUE_AT,
            "wrong-group": h.GROUP,
            "foreign-topic": h.ORIGINAL_TOPIC,
        }.get(kind, kind)

    return draw(st.lists(options, max_size=3, unique_by=target))


@st.composite
def tier_records(draw: Any, mutated: Any = None, timestamps: Any = None) -> dict[str, Any]:
    """A genuine tier record, described relative to the worker's clock, plus its mutations."""
    topic = draw(st.sampled_from(sorted(TIERS)))
    label = TIERS[topic]
    first_age = draw(st.integers(0, 7 * DAY_MS))
    return {
        "topic": topic,
        "label": label,
        "key": draw(st.one_of(st.none(), st.binary(max_size=24))),
        "value": draw(st.one_of(st.none(), st.binary(max_size=256), st.binary(min_size=5_000, max_size=20_000))),
        "own": draw(user_headers),
        "partition": draw(st.integers(0, 2**31 - 1)),
        "offset": draw(st.integers(0, 2**63 - 1)),
        "timestamp_age": draw(st.integers(0, DAY_MS)),
        "first_age": first_age,
        # due = now + due_offset: from overdue (but not before the first receipt) to one full tier delay ahead.
        "due_offset": draw(st.integers(-first_age, DELAY_MS[label])),
        "attempt": draw(st.sampled_from(ATTEMPTS[label])),
        "error_class": draw(texts),
        "error_message": draw(st.one_of(texts, st.text(max_size=3000))),
        "timestamp": draw(timestamps if timestamps is not None else st.sampled_from(TIMESTAMPS)),
        "lag": draw(st.integers(0, 10 * DAY_MS)),
        "mutations": draw(mutated if mutated is not None else mutations()),
    }


# --- running one record through the agent ------------------------------------------------------------------------


@dataclass
class Built:
    headers: list[tuple[str, bytes]]
    partition: int
    timestamp: float | None
    due_at_ms: int
    provenance: h.Provenance
    must_reject: list[str]
    must_park: bool


def build_record(case: dict[str, Any], now_ms: int) -> Built:
    label = case["label"]
    written = now_ms - case["lag"] if case["timestamp"] == "lagging" else now_ms  # when the tier record was written
    first = max(0, written - case["first_age"])
    due = written + case["due_offset"]
    provenance = h.Provenance(MAIN, case["partition"], case["offset"], max(0, first - case["timestamp_age"]), first)
    kinds = {mutation[0]: mutation for mutation in case["mutations"]}
    if "far-future" in kinds:
        due = now_ms + max(DELAY_MS[label], LONGEST_WAIT_MS) + FAR_MS + kinds["far-future"][1]
    if "due-before-first" in kinds:
        due = first - kinds["due-before-first"][1]
    pairs = h.retry_headers(
        case["own"],
        provenance=provenance,
        group=GROUP,
        attempt=case["attempt"],
        due_at_ms=due,
        error_class=case["error_class"],
        error_message=case["error_message"],
    )
    must_reject: list[str] = []
    partition = case["partition"] % PARTITIONS
    for mutation in case["mutations"]:
        partition, why = mutate(pairs, mutation, partition)
        if why:
            must_reject.append(why)
    if "far-future" in kinds:
        must_reject.append(f"due {due - now_ms} ms ahead of the worker's clock on the {label} tier")
    timestamp = {
        "now": None,
        "zero": 1e-9,
        "minus-one": -0.001,
        "future": (now_ms + 10 * DAY_MS) / 1000,
        "lagging": written / 1000,
        "past": (now_ms - 10 * DAY_MS) / 1000,
    }[case["timestamp"]]
    # A genuine record (foreign headers of the user's aside) is parked whatever its timestamp, unless that timestamp
    # is older than the due time allows: a tier record is written when its due time is set.
    harmless = all(m[0] == "extra" and not m[1].startswith(h.PREFIX) for m in case["mutations"])
    must_park = harmless and not must_reject and case["timestamp"] != "past"
    return Built(pairs, partition, timestamp, due, provenance, must_reject, must_park)


def mutate(pairs: list[tuple[str, bytes]], mutation: tuple[Any, ...], partition: int) -> tuple[int, str | None]:
    """Apply one mutation to ``pairs`` in place; the tier partition to send on, and why it must be rejected (if so)."""

    def replace(name: str, value: bytes) -> None:
        pairs[:] = [(n, value if n == name else v) for n, v in pairs]

    kind = mutation[0]
    if kind == "drop":
        pairs[:] = [(n, v) for n, v in pairs if n != mutation[1]]
        return partition, f"without {mutation[1]}" if mutation[1] in REQUIRED else None
    if kind == "duplicate":
        _, name, same, other, position = mutation
        present = dict(pairs)
        pairs.insert(min(position, len(pairs)), (name, present[name] if same and name in present else other))
        return partition, f"{name} twice" if name in present else None
    if kind == "corrupt-number":
        replace(mutation[1], mutation[2])
        return partition, f"{mutation[1]}={mutation[2]!r}"
    if kind == "attempt-zero":
        replace(h.ATTEMPT, b"0")
        return partition, "attempt 0"
    if kind == "due-before-first":
        return partition, f"{h.DUE_AT} before {h.FIRST_RECEIVED_AT}"
    if kind == "bad-text":
        _, name, how = mutation
        replace(name, b"\xc3\x28bad" if how == "non-utf8" else b"a" * (TEXT_LIMITS[name] + 1))
        return partition, f"{name} {how}"
    if kind == "wrong-group" and mutation[1] != GROUP:
        replace(h.GROUP, mutation[1].encode("utf-8"))
        return partition, f"group {mutation[1]!r}"
    if kind == "foreign-topic" and mutation[1] != MAIN:
        replace(h.ORIGINAL_TOPIC, mutation[1].encode("utf-8"))
        return partition, f"original topic {mutation[1]!r}"
    if kind == "wrong-partition":
        moved = (partition + mutation[1]) % PARTITIONS
        return moved, f"original partition on tier partition {moved} instead of {partition}"
    if kind == "extra":
        pairs.append((mutation[1], mutation[2]))
    return partition, None


def sentinel_headers(now_ms: int, label: str) -> list[tuple[str, bytes]]:
    provenance = h.Provenance(MAIN, 0, 2**62, now_ms - 2, now_ms - 1)
    attempt = ATTEMPTS[label][0]
    return h.retry_headers(
        [],
        provenance=provenance,
        group=GROUP,
        attempt=attempt,
        due_at_ms=now_ms + 1,
        error_class="E",
        error_message="m",
    )


def parked_entry(runtime: Runtime, key: bytes | None, provenance: h.Provenance) -> PendingMessage | None:
    return runtime.store.load(table_key(key, provenance), entries=True, with_payloads=True).find(
        PendingMessage.origin_of(provenance)
    )


async def settle(predicate: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + SETTLE_S
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.002)
    return True


@dataclass
class Outcome:
    runtime: Runtime
    built: Built
    rejected: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]], int | None]]
    entry: PendingMessage | None
    table_keys: set[bytes]
    """Keys with anything parked (a rejected record of our own leaves its key remembering it as ended, no more)."""
    sentinel_key: bytes


async def run_record(make_runtime: Callable[..., Runtime], case: dict[str, Any]) -> Outcome:
    runtime = make_runtime(retry_sequence=SEQUENCE, main_topics=f"{MAIN},{OTHER_MAIN}")
    runtime.partitions = PARTITIONS
    # This worker owns every partition it is fed: a rejection asks ownership before its send (agents/tier.py).
    owned = {TP(runtime.release_topic.get_topic_name(), partition) for partition in range(PARTITIONS)}
    runtime.app.assignor.assigned_actives = lambda: owned  # type: ignore[method-assign]
    runtime.app.assignor.is_active = lambda tp: tp in owned  # type: ignore[method-assign]
    clock = FakeClock()
    runtime.clock = clock
    failed = RawRecordingTopic(f"{MAIN}.failed")
    runtime.failed_topics = {MAIN: failed, OTHER_MAIN: RawRecordingTopic(f"{OTHER_MAIN}.failed")}
    built = build_record(case, clock.now_ms)
    sentinel = h.Provenance(MAIN, 0, 2**62, 0, 0)
    sentinel_key = table_key(SENTINEL_KEY, sentinel)
    async with runtime.agents[case["topic"]].test_context() as agent:
        put = agent.put(
            case["value"], key=case["key"], headers=built.headers, partition=built.partition, timestamp=built.timestamp
        )
        await asyncio.wait_for(put, SETTLE_S)
        sentinel_put = agent.put(
            b"sentinel", key=SENTINEL_KEY, headers=sentinel_headers(clock.now_ms, case["label"]), partition=0
        )
        await asyncio.wait_for(sentinel_put, SETTLE_S)
        alive = await settle(
            lambda: (
                runtime.store.load(sentinel_key, entries=True, with_payloads=True).find(f"{MAIN}/0/{2**62}") is not None
            )
        )
        assert alive, "the sentinel after the fuzz record was never parked: the tier agent stopped"
    entry = None
    try:
        parsed = h.parse_retry_headers(built.headers, main_topics=[MAIN, OTHER_MAIN])
    except h.InvalidRetryHeadersError:
        parsed = None
    if parsed is not None:
        entry = parked_entry(runtime, case["key"], parsed.provenance)
    waiting = {key for key, _ in runtime.table.items() if not nothing_waits(runtime, key)}
    return Outcome(runtime, built, list(failed.sent), entry, waiting, sentinel_key)


def check_parked_or_rejected(case: dict[str, Any], outcome: Outcome) -> str:
    """The either/or every record must satisfy; returns which one it was."""
    rejected, entry = outcome.rejected, outcome.entry
    assert len(rejected) <= 1, f"{len(rejected)} failed records for one tier record"
    others = outcome.table_keys - {outcome.sentinel_key}
    if rejected:
        key, value, headers, _ = rejected[0]
        # Neither key nor value cannot be produced: such a record travels as b"" marked rebound.null-value: 1.
        value = h.restore_null_value(value, list(headers.items()) if isinstance(headers, dict) else headers)
        assert (key, value) == (case["key"], case["value"]), "the failed record is not byte-exact"
        reasons = [v for n, v in headers if n == h.REASON]
        assert reasons == [Reason.INVALID_RETRY_HEADERS.value.encode()], f"failed with reasons {reasons}"
        assert not others and entry is None, "a rejected record was parked as well"
        return "rejected"
    assert entry is not None, "the record was neither parked nor sent to the failed topic"
    assert len(others) <= 1, f"one record parked under several keys: {others}"
    due = dict(outcome.built.headers)[h.DUE_AT]
    assert entry.due_at_ms == int(due), f"parked due at {entry.due_at_ms}, header says {due!r}"
    assert (entry.key, entry.value) == (case["key"], case["value"])
    assert entry.tier == case["label"]
    return "parked"


SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


def plain(**overrides: Any) -> dict[str, Any]:
    """A simple genuine record of the 2s tier (for explicit examples)."""
    case = {
        "topic": tier_topic(MAIN, "2s"),
        "label": "2s",
        "key": None,
        "value": None,
        "own": [],
        "partition": 0,
        "offset": 0,
        "timestamp_age": 0,
        "first_age": 0,
        "due_offset": 0,
        "attempt": ATTEMPTS["2s"][0],
        "error_class": "",
        "error_message": "",
        "timestamp": "now",
        "lag": 0,
        "mutations": [],
    }
    case.update(overrides)
    return case


@SETTINGS
@given(case=tier_records())
async def test_every_tier_record_is_parked_or_rejected_and_the_agent_lives_on(
    make_runtime: Callable[..., Runtime], case: dict[str, Any]
) -> None:
    outcome = await run_record(make_runtime, case)
    result = check_parked_or_rejected(case, outcome)
    built = outcome.built
    event(f"{result} ({'must park' if built.must_park else 'must reject' if built.must_reject else 'either'})")
    if built.must_park:
        assert result == "parked", f"a genuine record was rejected: {outcome.rejected[0][2]}"
    # One assertion per kind of reason, so that Hypothesis reports each broken check as its own failure.
    reasons = " / ".join(built.must_reject)
    if any(r.startswith((h.DUE_AT, "due ")) for r in built.must_reject):
        assert result == "rejected", f"a due time out of bounds was accepted: {reasons}"
    elif any(r.endswith(" twice") or r.startswith("without ") for r in built.must_reject):
        assert result == "rejected", f"missing or repeated headers were accepted: {reasons}"
    elif any(r.startswith(("group ", "original topic ", "original partition ")) for r in built.must_reject):
        assert result == "rejected", f"a record of another topic, group or partition was accepted: {reasons}"
    elif built.must_reject:
        assert result == "rejected", f"malformed headers were accepted: {reasons}"
    if result == "rejected":
        # The failed record carries one fresh set of our headers, never a repeated one.
        headers = outcome.rejected[0][2]
        counts = Counter(n for n, _ in headers if n.startswith(h.PREFIX))
        assert all(count == 1 for count in counts.values()), f"repeated headers on the failed record: {counts}"
        user = [(n, v) for n, v in built.headers if not n.startswith(h.PREFIX)]
        assert [(n, v) for n, v in headers if not n.startswith(h.PREFIX)] == user


@settings(SETTINGS, max_examples=40)
@given(case=tier_records(mutated=st.tuples(st.just("far-future"), far_beyond).map(lambda m: [m])))
@example(case=plain(timestamp="zero", mutations=[("far-future", 0)]))
@example(case=plain(timestamp="minus-one", mutations=[("far-future", 0)]))
@example(case=plain(timestamp="future", mutations=[("far-future", 0)]))
async def test_a_record_due_far_beyond_its_tier_delay_is_rejected_whatever_its_timestamp(
    make_runtime: Callable[..., Runtime], case: dict[str, Any]
) -> None:
    """The bound is the worker's clock plus the tier's delay (and a skew tolerance), not the record's own timestamp."""
    outcome = await run_record(make_runtime, case)
    result = check_parked_or_rejected(case, outcome)
    assert result == "rejected", (
        f"due {outcome.built.due_at_ms - outcome.runtime.clock()} ms ahead on the {case['label']} tier, "
        f"record timestamp {case['timestamp']!r}: parked"
    )


@settings(SETTINGS, max_examples=40)
@given(case=tier_records(mutated=st.just([]), timestamps=st.sampled_from(TIMESTAMPS[:-1])))
async def test_a_genuine_record_is_parked_whatever_its_timestamp(
    make_runtime: Callable[..., Runtime], case: dict[str, Any]
) -> None:
    outcome = await run_record(make_runtime, case)
    assert check_parked_or_rejected(case, outcome) == "parked", f"rejected: {outcome.rejected[0][2]}"
    assert outcome.entry is not None
    assert outcome.entry.due_at_ms == outcome.built.due_at_ms
    assert outcome.entry.attempt == case["attempt"]
    assert outcome.entry.provenance == outcome.built.provenance


@settings(SETTINGS, max_examples=15)
@given(
    case=st.builds(
        lambda own, same, other, position: plain(
            own=[*own, (h.REDRIVE_COUNT, b"1")], mutations=[("duplicate", h.REDRIVE_COUNT, same, other, position)]
        ),
        st.lists(st.tuples(user_names, st.binary(max_size=8)), max_size=3),
        st.booleans(),
        st.binary(max_size=4),
        st.integers(0, 20),
    )
)
async def test_a_record_with_a_repeated_redrive_count_is_rejected_with_it_written_once(
    make_runtime: Callable[..., Runtime], case: dict[str, Any]
) -> None:
    outcome = await run_record(make_runtime, case)
    assert check_parked_or_rejected(case, outcome) == "rejected"
    headers = outcome.rejected[0][2]
    assert [n for n, _ in headers].count(h.REDRIVE_COUNT) == 1, headers
