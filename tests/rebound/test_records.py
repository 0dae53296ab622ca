"""Record sizes match the producer's own bound; dead letters always have a stand-in that fits."""

from __future__ import annotations

import pytest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from hypothesis import given, settings
from hypothesis import strategies as st

from rebound import headers as h
from rebound.dead_letters import dead_letter_records
from rebound.records import estimated_record_bytes

maybe_bytes = st.one_of(st.none(), st.binary(max_size=3000))
header_lists = st.lists(st.tuples(st.text(max_size=40), st.binary(max_size=400)), max_size=8)


@settings(max_examples=300, deadline=None)
@given(key=maybe_bytes, value=maybe_bytes, headers=header_lists)
def test_estimate_is_aiokafkas_own_upper_bound(key, value, headers) -> None:
    """What ``fits`` decides must agree with the producer, or a record we judged fine would still be refused."""
    assert estimated_record_bytes(key, value, headers) == DefaultRecordBatchBuilder.estimate_size_in_bytes(
        key, value, headers
    )


def dead_letters(make_provenance, *, value: bytes | None, limit: int, own=(), key=b"k", message="boom"):
    return dead_letter_records(
        key=key,
        value=value,
        own_headers=list(own),
        provenance=make_provenance(),
        group="rebound",
        attempt=2,
        reason="exhausted",
        error_class="rebound.errors.RetryableError",
        error_message=message,
        trace="Traceback ...\n" * 200,
        limit=limit,
    )


def test_a_dead_letter_that_fits_is_sent_whole_with_its_trace(make_provenance) -> None:
    first = dead_letters(make_provenance, value=b"v" * 100, limit=1_048_576)[0]
    assert (first.record.value, first.reason) == (b"v" * 100, "exhausted")
    assert h.ERROR_TRACE in dict(first.record.headers)


def test_stand_ins_drop_trace_then_message_then_value_and_name_the_original_reason(make_provenance) -> None:
    candidates = dead_letters(make_provenance, value=b"v" * 3000, limit=4096, message="m" * 900)
    reasons = [candidate.reason for candidate in candidates]
    assert reasons[0] == "exhausted" and reasons[-1] == "too-large"
    assert all(candidate.record.size <= 4096 for candidate in candidates)
    first = dict(candidates[0].record.headers)
    assert h.ERROR_TRACE not in first and len(first[h.ERROR_MESSAGE]) <= 128
    left_out = [candidate for candidate in candidates if candidate.reason == "too-large"]
    assert all(candidate.record.value is None for candidate in left_out)
    assert all("was exhausted" in candidate.error_message for candidate in left_out)
    assert all(dict(candidate.record.headers)[h.ORIGINAL_OFFSET] for candidate in candidates)


@pytest.mark.parametrize("limit", [1024, 2048, 65_536])
def test_the_last_stand_in_fits_the_smallest_limit_even_for_a_huge_key_and_headers(make_provenance, limit) -> None:
    candidates = dead_letters(
        make_provenance, value=b"v" * 100_000, limit=limit, key=b"k" * 100_000, own=[("big", b"h" * 100_000)]
    )
    assert len(candidates) == 1
    [last] = candidates
    assert last.record.size <= limit
    assert (last.record.key, last.record.value, last.reason) == (None, None, "too-large")
    assert dict(last.record.headers)[h.ORIGINAL_TOPIC] == b"items"
