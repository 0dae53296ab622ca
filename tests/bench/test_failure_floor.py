"""The pure parts of the failure path's floor: the variant list, the comparison with the floor, the baseline's
records."""

from __future__ import annotations

import pytest

from bench.baselines.retry_records import batches, decode_entry, decode_keys, encode_entry, encode_keys
from bench.scenarios.failure_path import of_floor, parse_variants


def test_variants_default_to_rebound_alone() -> None:
    assert parse_variants("") == ("rebound",)
    assert parse_variants(" , ") == ("rebound",)


def test_variants_keep_their_order() -> None:
    assert parse_variants("bare-faust, rebound") == ("bare-faust", "rebound")
    assert parse_variants("rebound,bare-faust,bare-faust-no-events") == (
        "rebound",
        "bare-faust",
        "bare-faust-no-events",
    )


@pytest.mark.parametrize("text", ["rebound,bare", "rebound,rebound", "bare-faust,bare-faust"])
def test_unknown_or_repeated_variants_are_refused(text: str) -> None:
    with pytest.raises(SystemExit, match="BENCH_FAILURE_VARIANTS"):
        parse_variants(text)


def run(round_: int, **figures: float | None) -> dict[str, object]:
    return {"round": round_, "summary": figures}


def test_the_floor_multiple_pairs_runs_of_the_same_round() -> None:
    mine = [
        run(1, release_cpu_us=600.0, release_per_s=900.0),
        run(2, release_cpu_us=900.0, release_per_s=None),
        run(3, release_cpu_us=800.0, release_per_s=1000.0),
    ]
    floor = [
        run(3, release_cpu_us=200.0, release_per_s=2000.0),
        run(1, release_cpu_us=300.0, release_per_s=1800.0),
        run(2, release_cpu_us=100.0, release_per_s=1500.0),
    ]
    out = of_floor(mine, floor)
    assert out["release_cpu_us"] == 4.0  # 2.0, 9.0, 4.0
    assert out["release_cpu_us_range"] == [2.0, 9.0]
    assert out["release_per_s"] == 0.5  # 0.5 and 0.5; round 2 has no rate
    assert out["first_try_cpu_us"] is None
    assert out["first_try_cpu_us_range"] is None


def test_a_round_without_the_floor_is_left_out() -> None:
    out = of_floor([run(1, park_per_s=100.0), run(2, park_per_s=300.0)], [run(2, park_per_s=600.0)])
    assert out["park_per_s"] == 0.5
    assert out["park_per_s_range"] == [0.5, 0.5]


@pytest.mark.parametrize(
    ("value", "headers"),
    [
        (b"fail", [("rebound.attempt", b"1"), ("rebound.due-at", b"1765000000000")]),
        (None, []),
        (b"", [("h", b"")]),
        (bytes(range(256)) * 4, [("\u00e9t\u00e9", b"\x00\xff")]),
    ],
)
def test_an_entry_reads_back_as_written(value: bytes | None, headers: list[tuple[str, bytes]]) -> None:
    assert decode_entry(encode_entry(1_765_000_000_123, value, headers)) == (1_765_000_000_123, value, headers)


def test_keys_read_back_in_order() -> None:
    keys = [b"f1", b"", b"\x00\x01" * 100, b"f1"]
    assert decode_keys(encode_keys(keys)) == keys
    assert decode_keys(b"") == []


def test_batches_cut_keys_in_order() -> None:
    keys = [bytes([i]) for i in range(7)]
    assert batches(keys, 3) == [keys[0:3], keys[3:6], keys[6:7]]
    assert batches(keys, 64) == [keys]
    assert batches(keys, 0) == [[key] for key in keys]
    assert batches([], 64) == []


def test_the_floor_on_stock_faust_is_a_variant_of_its_own() -> None:
    assert parse_variants("rebound,stock-faust,bare-faust") == ("rebound", "stock-faust", "bare-faust")
