"""Property tests of the ``rebound.*`` headers: written once per hop, UTF-8 decimal or bounded text, read strictly.

Only the public entry points of :mod:`rebound.headers` are used, so these properties hold whatever the agents do with
them. The bounds are the documented ones (``MAX_ERROR_CLASS_BYTES``, ``MAX_ERROR_MESSAGE_BYTES``, int64 numbers).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rebound import headers as h
from rebound.errors import InvalidRetryHeadersError

OURS = (*h.REQUIRED_RETRY_HEADERS, *h.OPTIONAL_RETRY_HEADERS)
NUMERIC = (h.ORIGINAL_PARTITION, h.ORIGINAL_OFFSET, h.ORIGINAL_TIMESTAMP, h.FIRST_RECEIVED_AT, h.ATTEMPT, h.DUE_AT)
INT64 = 2**63 - 1

# Kafka topic names: ASCII letters, digits, '.', '_' and '-'.
topics = st.from_regex(r"[a-zA-Z0-9_-][a-zA-Z0-9._-]{0,30}", fullmatch=True)
# Any text that can be encoded; lone surrogates are covered by the truncate_utf8 properties.
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=80)
# A consumer group is the Faust app id; the parser reads at most 249 bytes of it (60 characters are at most 240).
groups = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=60)
# Any Python string, lone surrogates included (st.text leaves them out).
raw_texts = st.lists(st.one_of(st.characters(), st.sampled_from(["\ud800", "\udcff", "\udfff"])), max_size=60).map(
    "".join
)
# Error texts: any Python string, including lone surrogates and texts far beyond the header bounds.
error_texts = st.one_of(
    raw_texts,
    st.text(max_size=3000),
    st.builds(lambda c, n: c * n, st.sampled_from(["a", "é", "€", "𝄞", "\ud800"]), st.integers(0, 2000)),
)
user_names = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["trace-id", "content-type", "rebound", "rebound-x", "Rebound.attempt", "x.rebound.attempt"]),
)
user_headers = st.lists(st.tuples(user_names, st.binary(max_size=40)), max_size=8).map(
    lambda pairs: [(name, value) for name, value in pairs if not name.startswith(h.PREFIX)]
)
# What a record can carry in from outside: any names, including ours, repeated, with any bytes. (A carried header that
# comes in repeated has a property of its own below.)
foreign_headers = st.lists(
    st.tuples(
        st.one_of(user_names, st.sampled_from([*OURS, h.REASON, h.REDRIVE_COUNT, "rebound.signature"])),
        st.binary(max_size=40),
    ),
    max_size=10,
).filter(lambda pairs: [name for name, _ in pairs].count(h.REDRIVE_COUNT) <= 1)


@st.composite
def provenances(draw: Any, topic: Any = topics) -> h.Provenance:
    return h.Provenance(
        topic=draw(topic),
        partition=draw(st.integers(0, 2**31 - 1)),
        offset=draw(st.integers(0, INT64)),
        timestamp_ms=draw(st.integers(0, INT64)),
        first_received_at_ms=draw(st.integers(0, INT64 // 2)),
    )


@st.composite
def hops(draw: Any) -> dict[str, Any]:
    """Keyword arguments of one :func:`retry_headers` call whose values are within the documented bounds."""
    provenance = draw(provenances())
    return {
        "provenance": provenance,
        "group": draw(groups),
        "attempt": draw(st.integers(1, 10_000)),
        "due_at_ms": draw(st.integers(provenance.first_received_at_ms, INT64)),
        "error_class": draw(error_texts),
        "error_message": draw(error_texts),
    }


def rebound_names(pairs: list[tuple[str, bytes]]) -> Counter[str]:
    return Counter(name for name, _ in pairs if name.startswith(h.PREFIX))


def is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@given(own=user_headers, hop=hops())
def test_parse_gives_back_what_retry_headers_wrote(own: list[tuple[str, bytes]], hop: dict[str, Any]) -> None:
    pairs = h.retry_headers(own, **hop)
    parsed = h.parse_retry_headers(pairs, main_topics=["unrelated", hop["provenance"].topic])
    assert parsed.provenance == hop["provenance"]
    assert parsed.attempt == hop["attempt"]
    assert parsed.due_at_ms == hop["due_at_ms"]
    assert parsed.group == hop["group"]
    expected_class = h.truncate_utf8(hop["error_class"], h.MAX_ERROR_CLASS_BYTES).decode("utf-8")
    expected_message = h.truncate_utf8(hop["error_message"], h.MAX_ERROR_MESSAGE_BYTES).decode("utf-8")
    assert parsed.error_class == expected_class
    assert parsed.error_message == expected_message
    # Truncation keeps a prefix of the text (up to lone surrogates, which become '?').
    if all(not 0xD800 <= ord(char) <= 0xDFFF for char in hop["error_message"]):
        assert hop["error_message"].startswith(parsed.error_message)


@given(own=user_headers, hop=hops())
def test_every_value_is_utf8_and_every_number_a_plain_decimal(
    own: list[tuple[str, bytes]], hop: dict[str, Any]
) -> None:
    values = dict(h.retry_headers(own, **hop))
    for name in OURS:
        assert is_utf8(values[name]), name
    for name in NUMERIC:
        raw = values[name]
        text = raw.decode("ascii")
        assert text.isascii() and text.isdigit(), (name, raw)
        assert len(raw) <= h.MAX_DECIMAL_DIGITS
        assert text == str(int(text))  # no sign, no padding, no leading zeros
    assert int(values[h.ATTEMPT]) == hop["attempt"]
    assert int(values[h.DUE_AT]) == hop["due_at_ms"]
    assert len(values[h.ERROR_CLASS]) <= h.MAX_ERROR_CLASS_BYTES
    assert len(values[h.ERROR_MESSAGE]) <= h.MAX_ERROR_MESSAGE_BYTES


@given(own=foreign_headers, chain=st.lists(hops(), min_size=1, max_size=6))
def test_each_rebound_header_is_set_once_however_many_hops(
    own: list[tuple[str, bytes]], chain: list[dict[str, Any]]
) -> None:
    """The output of one hop is the input of the next: ours are replaced, never appended, whatever came in."""
    pairs = own
    for hop in chain:
        pairs = h.retry_headers(pairs, **hop)
        counts = rebound_names(pairs)
        assert all(counts[name] == 1 for name in OURS), counts
        assert all(count == 1 for count in counts.values()), counts
    failed = h.failed_headers(
        pairs,
        provenance=chain[-1]["provenance"],
        group=chain[-1]["group"],
        attempt=chain[-1]["attempt"],
        reason="exhausted",
        error_class="E",
        error_message="m",
        trace="t",
    )
    counts = rebound_names(failed)
    assert all(count == 1 for count in counts.values()), counts
    assert h.DUE_AT not in counts
    assert counts[h.REASON] == 1
    # The last hop is what a reader sees.
    last = chain[-1]
    parsed = h.parse_retry_headers(pairs, main_topics=[last["provenance"].topic])
    assert (parsed.provenance, parsed.attempt, parsed.due_at_ms) == (
        last["provenance"],
        last["attempt"],
        last["due_at_ms"],
    )


@given(
    users=user_headers,
    counts=st.lists(st.binary(max_size=4), min_size=2, max_size=3),
    positions=st.lists(st.integers(0, 10), min_size=3, max_size=3),
    hop=hops(),
)
def test_a_carried_header_that_came_in_repeated_is_written_once(
    users: list[tuple[str, bytes]], counts: list[bytes], positions: list[int], hop: dict[str, Any]
) -> None:
    """The redrive count is carried from hop to hop; a record that came in with it twice must not keep both."""
    own = list(users)
    for value, position in zip(counts, positions, strict=False):
        own.insert(min(position, len(own)), (h.REDRIVE_COUNT, value))
    pairs = h.retry_headers(own, **hop)
    assert rebound_names(pairs)[h.REDRIVE_COUNT] <= 1, pairs
    h.parse_retry_headers(pairs, main_topics=[hop["provenance"].topic])  # and the next tier can read it


@given(own=foreign_headers, chain=st.lists(hops(), min_size=1, max_size=4))
def test_user_headers_are_kept_in_order_through_every_hop(
    own: list[tuple[str, bytes]], chain: list[dict[str, Any]]
) -> None:
    users = [(name, value) for name, value in own if not name.startswith(h.PREFIX)]
    pairs = own
    for hop in chain:
        pairs = h.retry_headers(pairs, **hop)
        assert [(name, value) for name, value in pairs if not name.startswith(h.PREFIX)] == users
        assert pairs[: len(h.without_rebound_headers(own))] == h.without_rebound_headers(own)


numbers = st.one_of(
    st.integers(-(2**70), 2**70).map(lambda n: str(n).encode()),
    st.integers(0, 2**70).map(lambda n: b"+" + str(n).encode()),
    st.integers(0, 2**70).map(lambda n: b"0" * 3 + str(n).encode()),
    st.sampled_from(
        [
            "١٢".encode(),  # Arabic-Indic digits
            "\uff11\uff12".encode(),  # full-width digits
            "²".encode(),
            b"1_000",
            b" 12",
            b"12 ",
            b"1e3",
            b"0x10",
            b"1.0",
            b"",
            b"\xff",
            b"9" * 21,
            b"9" * 20,
            b"18446744073709551616",
        ]
    ),
    st.binary(max_size=24),
)
header_values = st.one_of(
    numbers, st.binary(max_size=64), st.binary(min_size=2000, max_size=5000), texts.map(str.encode)
)


@st.composite
def arbitrary_header_sets(draw: Any) -> tuple[list[tuple[str, bytes]], list[str]]:
    """Headers and configured main topics: sometimes a genuine set (whose topic is usually configured), then mutated
    (dropped, duplicated, replaced and added headers), in any order."""
    pairs: list[tuple[str, bytes]] = []
    main_topics = draw(st.lists(topics, max_size=3))
    if draw(st.booleans()):
        hop = draw(hops())
        pairs = h.retry_headers(draw(user_headers), **hop)
        if draw(st.integers(0, 3)):
            main_topics.insert(draw(st.integers(0, len(main_topics))), hop["provenance"].topic)
    names = st.one_of(
        st.sampled_from([*OURS, h.REASON, h.REDRIVE_COUNT]),
        user_names,
        st.text(max_size=30).map(lambda s: h.PREFIX + s),
    )
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 4, 6]))):
        action = draw(st.sampled_from(["drop", "duplicate", "replace", "add"]))
        if action == "drop" and pairs:
            del pairs[draw(st.integers(0, len(pairs) - 1))]
        elif action == "duplicate" and pairs:
            pairs.insert(draw(st.integers(0, len(pairs))), pairs[draw(st.integers(0, len(pairs) - 1))])
        elif action == "replace" and pairs:
            index = draw(st.integers(0, len(pairs) - 1))
            pairs[index] = (pairs[index][0], draw(header_values))
        else:
            pairs.insert(draw(st.integers(0, len(pairs))), (draw(names), draw(header_values)))
    if draw(st.booleans()):
        pairs = draw(st.permutations(pairs))
    return pairs, main_topics


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(case=arbitrary_header_sets())
@example(case=([(h.ATTEMPT, "١٢".encode())], ["items"]))
def test_any_header_set_parses_to_valid_headers_or_raises_invalid(
    case: tuple[list[tuple[str, bytes]], list[str]],
) -> None:
    pairs, main_topics = case
    try:
        parsed = h.parse_retry_headers(pairs, main_topics=main_topics)
    except InvalidRetryHeadersError:
        return
    # Accepted: the values are exactly the (single) headers present, and all within bounds.
    values = dict(pairs)
    assert all(count == 1 for count in rebound_names(pairs).values())
    assert parsed.provenance.topic in main_topics
    assert values[h.ORIGINAL_TOPIC] == parsed.provenance.topic.encode("utf-8")
    for name, number in (
        (h.ORIGINAL_PARTITION, parsed.provenance.partition),
        (h.ORIGINAL_OFFSET, parsed.provenance.offset),
        (h.ORIGINAL_TIMESTAMP, parsed.provenance.timestamp_ms),
        (h.FIRST_RECEIVED_AT, parsed.provenance.first_received_at_ms),
        (h.ATTEMPT, parsed.attempt),
        (h.DUE_AT, parsed.due_at_ms),
    ):
        raw = values[name]
        assert raw.isascii() and raw.isdigit() and len(raw) <= h.MAX_DECIMAL_DIGITS, (name, raw)
        assert int(raw) == number >= 0
    assert parsed.attempt >= 1
    assert parsed.due_at_ms >= parsed.provenance.first_received_at_ms
    assert values[h.GROUP] == parsed.group.encode("utf-8")
    assert len(parsed.error_class.encode("utf-8")) <= h.MAX_ERROR_CLASS_BYTES
    assert len(parsed.error_message.encode("utf-8")) <= h.MAX_ERROR_MESSAGE_BYTES


@given(hop=hops(), name=st.sampled_from(NUMERIC), bad=numbers)
def test_a_number_that_is_not_a_plain_decimal_is_refused(hop: dict[str, Any], name: str, bad: bytes) -> None:
    pairs = [(n, bad if n == name else v) for n, v in h.retry_headers([], **hop)]
    plain = bad.isascii() and bad.isdigit() and 0 < len(bad) <= h.MAX_DECIMAL_DIGITS
    try:
        parsed = h.parse_retry_headers(pairs, main_topics=[hop["provenance"].topic])
    except InvalidRetryHeadersError:
        return
    assert plain, f"{name}={bad!r} was accepted"
    assert parsed is not None


@given(hop=hops(), name=st.sampled_from([n for n in OURS if n not in (h.ERROR_CLASS, h.ERROR_MESSAGE)]))
def test_a_missing_required_header_is_refused(hop: dict[str, Any], name: str) -> None:
    pairs = [(n, v) for n, v in h.retry_headers([], **hop) if n != name]
    try:
        h.parse_retry_headers(pairs, main_topics=[hop["provenance"].topic])
    except InvalidRetryHeadersError:
        return
    raise AssertionError(f"headers without {name} were accepted")


@given(hop=hops(), name=st.sampled_from(OURS), value=st.binary(max_size=8), position=st.integers(0, 20))
def test_a_repeated_rebound_header_is_refused(hop: dict[str, Any], name: str, value: bytes, position: int) -> None:
    pairs = h.retry_headers([], **hop)
    pairs.insert(min(position, len(pairs)), (name, value))
    try:
        h.parse_retry_headers(pairs, main_topics=[hop["provenance"].topic])
    except InvalidRetryHeadersError:
        return
    raise AssertionError(f"a repeated {name} was accepted")


@given(hop=hops(), others=st.lists(topics, max_size=3))
def test_an_unconfigured_original_topic_is_refused(hop: dict[str, Any], others: list[str]) -> None:
    configured = [topic for topic in others if topic != hop["provenance"].topic]
    try:
        h.parse_retry_headers(h.retry_headers([], **hop), main_topics=configured)
    except InvalidRetryHeadersError:
        return
    raise AssertionError("an original topic that is not configured was accepted")


@given(text=st.one_of(raw_texts, st.text(max_size=2000)), limit=st.integers(0, 5000))
@example(text="\ud800", limit=0)
@example(text="€€", limit=5)
@example(text="a\udcff\ud800b", limit=3)
def test_truncate_utf8_stays_within_its_limit_and_is_valid_utf8(text: str, limit: int) -> None:
    cut = h.truncate_utf8(text, limit)
    assert len(cut) <= limit
    assert is_utf8(cut)
    whole = text.encode("utf-8", errors="replace")
    assert whole.startswith(cut)  # a prefix: nothing reordered or invented
    if len(whole) <= limit:
        assert cut == whole
    else:
        assert len(cut) > limit - 4  # at most one partial character (< 4 bytes) is dropped


@given(
    pairs=st.lists(st.tuples(st.one_of(user_names, st.sampled_from([*OURS, h.REDRIVE_COUNT])), st.binary(max_size=4)))
)
def test_without_rebound_headers_keeps_the_others_in_order(pairs: list[tuple[str, bytes]]) -> None:
    kept = h.without_rebound_headers(pairs)
    assert [(n, v) for n, v in kept if n not in h.CARRIED] == [(n, v) for n, v in pairs if not n.startswith(h.PREFIX)]
    for name in h.CARRIED:  # a carried header is kept once, with its last value (Kafka's lastHeader)
        values = [v for n, v in pairs if n == name]
        assert [v for n, v in kept if n == name] == values[-1:]
    assert h.without_rebound_headers(kept) == kept
