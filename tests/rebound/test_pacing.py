"""The release pacer (``rebound/pacing.py``): a token bucket with a ramp, and one paced tick of the schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rebound.errors import ConfigurationError
from rebound.pacing import RAMP_START, PacingConfig, ReleasePacer, default_burst, min_burst, pop_paced
from rebound.schedule import ReleaseSchedule, Slot
from rebound.settings import load_settings


def test_unlimited_allows_anything_and_never_waits() -> None:
    pacer = ReleasePacer(PacingConfig(rate=None))
    assert pacer.allowance(0) is None
    pacer.take(10_000, 0)
    assert pacer.next_at_ms(5) == 5
    assert pacer.rate_at(0) is None


def test_a_full_bucket_then_the_rate() -> None:
    pacer = ReleasePacer(PacingConfig(rate=50, burst=5))
    assert pacer.allowance(1000) == 5
    pacer.take(5, 1000)
    assert pacer.allowance(1000) == 0
    assert pacer.next_at_ms(1000) == 1020  # one every 20 ms at 50/s
    assert pacer.allowance(1019) == 0
    assert pacer.allowance(1020) == 1
    assert pacer.allowance(1100) == 5  # never more than the burst, however long the quiet spell
    assert pacer.allowance(60_000) == 5


def test_taking_more_than_allowed_is_refused() -> None:
    pacer = ReleasePacer(PacingConfig(rate=10, burst=2))
    with pytest.raises(ValueError):
        pacer.take(3, 0)


def test_a_clock_stepping_back_earns_nothing() -> None:
    pacer = ReleasePacer(PacingConfig(rate=10, burst=1))
    pacer.take(1, 10_000)
    assert pacer.allowance(5_000) == 0
    assert pacer.allowance(10_099) == 0
    assert pacer.allowance(10_100) == 1


def test_the_ramp_starts_at_a_tenth_and_climbs_linearly_to_the_rate() -> None:
    pacer = ReleasePacer(PacingConfig(rate=100, burst=10, ramp_ms=10_000))
    pacer.allowance(0)
    pacer.ramp_from(0)
    assert pacer.rate_at(0) == pytest.approx(100 * RAMP_START)
    assert pacer.rate_at(5_000) == pytest.approx(55)
    assert pacer.rate_at(10_000) == pytest.approx(100)
    assert pacer.rate_at(20_000) == pytest.approx(100)
    assert pacer.allowance(0) == 1  # the bucket shrinks with the rate: no burst of 10 the moment it closes


def test_ramp_releases_over_the_ramp_are_its_integral() -> None:
    """Taking everything allowed every 10 ms over a 10 s ramp from 10/s to 100/s: about the area under the line,
    (10 + 100) / 2 * 10 s = 550, not 1,000 (the unramped rate)."""
    pacer = ReleasePacer(PacingConfig(rate=100, burst=10, ramp_ms=10_000))
    pacer.take(10, 0)
    pacer.ramp_from(0)
    released = 0
    for now in range(10, 10_001, 10):
        allowed = pacer.allowance(now)
        assert allowed is not None
        pacer.take(allowed, now)
        released += allowed
    assert 545 <= released <= 552


def test_without_a_ramp_closing_the_breaker_changes_nothing() -> None:
    pacer = ReleasePacer(PacingConfig(rate=100, burst=10))
    pacer.ramp_from(0)
    assert pacer.allowance(0) == 10
    assert pacer.rate_at(0) == 100


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"rate": 0}, "REBOUND_RELEASE_RATE"),
        ({"rate": -1.5}, "REBOUND_RELEASE_RATE"),
        ({"rate": float("inf")}, "REBOUND_RELEASE_RATE"),
        ({"rate": True}, "REBOUND_RELEASE_RATE"),
        ({"rate": 5, "burst": 0}, "REBOUND_RELEASE_BURST"),
        ({"rate": 5, "ramp_ms": -1}, "REBOUND_RELEASE_RAMP"),
        ({"rate": None, "ramp_ms": 1000}, "REBOUND_RELEASE_RAMP needs REBOUND_RELEASE_RATE"),
    ],
)
def test_bad_configs_name_their_variable(config: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        PacingConfig(**config)  # type: ignore[arg-type]


def test_the_default_burst_is_a_tenth_of_a_second_or_a_linger() -> None:
    assert default_burst(50, 10) == 5
    assert default_burst(0.5, 10) == 1
    assert default_burst(1000, 500) == 501  # what a linger accrues, plus the fraction carried over: min_burst


def window_counts_hold(events: list[tuple[int, int]], bound: Callable[[int, int], float]) -> None:
    """Every window between two release times holds no more than ``bound(start, end)`` releases."""
    for i, (start, _) in enumerate(events):
        total = 0
        for end, count in events[i:]:
            total += count
            assert total <= bound(start, end) + 1e-6, (start, end, total)


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(min_value=0.5, max_value=2000),
    burst=st.integers(min_value=1, max_value=50),
    ramp_ms=st.sampled_from([0, 500, 5_000]),
    gaps=st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=80),
    demands=st.lists(st.integers(min_value=0, max_value=500), min_size=80, max_size=80),
    ramp_at=st.integers(min_value=0, max_value=79),
)
def test_never_more_than_rate_times_t_plus_burst(
    rate: float, burst: int, ramp_ms: int, gaps: list[int], demands: list[int], ramp_at: int
) -> None:
    """Whatever the ticks and the demand, no window [a, b] holds more than rate * (b - a) + burst releases; and
    after the breaker closes, no more than the ramp's integral plus the burst."""
    pacer = ReleasePacer(PacingConfig(rate=rate, burst=burst, ramp_ms=ramp_ms))
    now, events, ramped_at = 1_000, [], None
    for index, gap in enumerate(gaps):
        now += gap
        if index == ramp_at:
            pacer.ramp_from(now)
            ramped_at = now
        allowed = pacer.allowance(now)
        assert allowed is not None
        taken = min(allowed, demands[index])
        pacer.take(taken, now)
        events.append((now, taken))
    window_counts_hold(events, lambda a, b: rate * (b - a) / 1000 + burst)
    if ramped_at is not None and ramp_ms:
        after = [(t, n) for t, n in events if t >= ramped_at]

        def ramp_bound(a: int, b: int) -> float:
            def share(t: int) -> float:
                return min(1.0, RAMP_START + (1 - RAMP_START) * (t - ramped_at) / ramp_ms)

            cut = min(b, ramped_at + ramp_ms)
            area = max(0, cut - a) * (share(a) + share(cut)) / 2 if a < cut else 0
            area += max(0, b - max(a, cut))
            return rate * area / 1000 + burst

        window_counts_hold(after, ramp_bound)


@settings(max_examples=150, deadline=None)
@given(
    rate=st.floats(min_value=1, max_value=500),
    burst=st.integers(min_value=1, max_value=20),
    dues=st.lists(
        st.tuples(st.integers(min_value=0, max_value=3), st.integers(min_value=0, max_value=3_000)),
        min_size=1,
        max_size=120,
    ),
    gaps=st.lists(st.integers(min_value=1, max_value=200), min_size=1, max_size=60),
)
def test_a_paced_schedule_never_releases_early_and_takes_the_earliest_first(
    rate: float, burst: int, dues: list[tuple[int, int]], gaps: list[int]
) -> None:
    """The real schedule under the pacer: nothing is sent before its due time, nothing twice, the earliest due go
    first across partitions, the window counts hold, and ticking on long enough sends everything."""
    schedule = ReleaseSchedule(max_in_flight=10_000)
    slots: dict[int, list[Slot]] = {partition: [] for partition in range(4)}
    for number, (partition, due_at) in enumerate(dues):
        slots[partition].append(Slot(due_at, b"k%d" % number, f"items/{partition}/{number}", 1))
    for partition, found in slots.items():
        schedule.adopt(partition, found)
    pacer = ReleasePacer(PacingConfig(rate=rate, burst=burst))
    sent: dict[str, int] = {}
    events: list[tuple[int, int]] = []
    times = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    horizon = 3_000 + len(dues) * 1000 / rate + 1000  # by then everything is due and the rate has sent it all
    times += range(times[-1] + 50, int(horizon) + max(times[-1], 0) + 50, 50)  # ticks every 50 ms
    for now in times:
        due, _ = pop_paced(schedule, pacer, now)
        for partition, slot in due:
            assert slot.due_at_ms <= now, "released before due"
            assert slot.origin not in sent, "sent twice"
            sent[slot.origin] = now
            schedule.confirm(partition, slot.table_key, slot.origin, slot.attempt)
        if due:
            latest = max(slot for _, slot in due)
            waiting = [slot for _, slot in schedule.slots()]
            assert all(slot.due_at_ms > now or not slot < latest for slot in waiting), "a later slot went first"
            events.append((now, len(due)))
        if len(sent) == len(dues):
            break
    window_counts_hold(events, lambda a, b: rate * (b - a) / 1000 + burst)
    assert len(sent) == len(dues), "paced releases never stop: everything due is sent"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"release_rate": "fast"}, "REBOUND_RELEASE_RATE: 'fast' must be a number of releases per second"),
        ({"release_rate": "0"}, "REBOUND_RELEASE_RATE: '0' must be a number"),
        ({"release_rate": "nan"}, "REBOUND_RELEASE_RATE: 'nan' must be a number"),
        ({"release_ramp": "1m"}, "REBOUND_RELEASE_RAMP needs REBOUND_RELEASE_RATE"),
        ({"release_rate": "5", "release_ramp": "soon"}, "REBOUND_RELEASE_RAMP: 'soon' is not a duration"),
        ({"release_burst": "3"}, "REBOUND_RELEASE_BURST needs REBOUND_RELEASE_RATE"),
        ({"release_rate": "5", "release_burst": "0"}, "REBOUND_RELEASE_BURST"),
    ],
)
def test_settings_refuse_bad_pacing_at_start_up(values: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        load_settings(**values)


def test_settings_refuse_a_burst_that_would_cap_the_rate_below_itself() -> None:
    """Ticks are at least REBOUND_RELEASE_LINGER_MS apart: a bucket smaller than what accrues between two of them
    loses the rest (1,000/s with a burst of 1 and a 10 ms linger released 100/s). Refused at start-up, naming the
    variables and the least burst that keeps the rate."""
    with pytest.raises(ConfigurationError) as refused:
        load_settings(release_rate="1000", release_burst="1")
    message = str(refused.value)
    for variable in ("REBOUND_RELEASE_BURST=1", "REBOUND_RELEASE_RATE=1000", "REBOUND_RELEASE_LINGER_MS=10"):
        assert variable in message
    assert "at least 11" in message  # 10 accrue between two ticks, plus the fraction of one carried over
    with pytest.raises(ConfigurationError, match="at least 11"):
        load_settings(release_rate="1000", release_burst="10")
    assert load_settings(release_rate="1000", release_burst="11").release_pacing.burst == 11
    assert load_settings(release_rate="1000", release_burst="1", release_linger_ms="1").release_pacing.burst == 1
    assert load_settings(release_rate="0.5", release_burst="1", release_linger_ms="1000").release_pacing.burst == 1
    assert min_burst(1000, 0) == 1
    assert min_burst(50, 10) == 1  # half a release a linger: the timer wakes when the next is allowed
    assert min_burst(100, 10) == 1
    assert min_burst(333, 7) == 4
    assert default_burst(1000, 10) >= min_burst(1000, 10)  # the default is always accepted
    assert default_burst(1000, 500) >= min_burst(1000, 500)


@pytest.mark.parametrize(("rate", "linger_ms"), [(1000.0, 10), (333.0, 7), (50.0, 1000), (2.5, 400), (0.7, 10)])
def test_the_least_burst_allowed_keeps_the_rate_with_ticks_a_linger_apart(rate: float, linger_ms: int) -> None:
    """The least burst the settings accept, with the timer ticking every linger and taking all it may: a second's
    releases are the rate's (the scratch check behind the refusal: with a burst of 1 it was a tenth of it)."""
    pacer = ReleasePacer(PacingConfig(rate=rate, burst=min_burst(rate, linger_ms)))
    pacer.take(pacer.allowance(0) or 0, 0)  # start with an empty bucket: only the rate counts
    sent, now, last = 0, 0, 0
    while True:  # the release timer: a tick, then sleep till the next is allowed, at least the linger
        now += max(linger_ms, pacer.next_at_ms(now) - now)
        if now > 10_000:
            break
        allowed = pacer.allowance(now)
        assert allowed is not None
        pacer.take(allowed, now)
        sent, last = sent + allowed, now
    assert last > 8_000
    assert sent >= math.floor(rate * last / 1000 + 1e-9) - 1


def test_the_next_allowance_is_solved_on_the_ramp_line() -> None:
    """During a ramp the rate climbs, so the next token comes sooner than at the rate allowed now: the timer sleeps
    to the time the ramp's integral reaches it (not at the rate at the ramp's start, 1/s x 0.1: 10 s instead of 1.45 s)."""
    pacer = ReleasePacer(PacingConfig(rate=1, burst=1, ramp_ms=1000))
    pacer.take(1, 0)
    pacer.ramp_from(0)
    # 0.55 by the ramp's end ((0.1 + 1) / 2 over 1 s), the other 0.45 at 1/s: 1.45 s
    assert pacer.next_at_ms(0) == 1450
    assert pacer.allowance(1449) == 0
    assert pacer.allowance(1450) == 1
    within = ReleasePacer(PacingConfig(rate=100, burst=1, ramp_ms=10_000))
    within.take(1, 0)
    within.ramp_from(0)
    # 1 token = the area under 10/s + 9/s per s: 10 x + 4.5 x^2 = 1, x = 0.0959 s (not 0.1 s at 10/s)
    assert within.next_at_ms(0) == 96
    assert within.allowance(95) == 0
    assert within.allowance(96) == 1


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(min_value=0.05, max_value=2000),
    burst=st.integers(min_value=1, max_value=20),
    ramp_ms=st.sampled_from([0, 50, 1_000, 60_000]),
    ramp_at=st.integers(min_value=0, max_value=5_000),
    taken_at=st.integers(min_value=0, max_value=70_000),
)
def test_next_at_is_exactly_when_the_next_release_is_allowed(
    rate: float, burst: int, ramp_ms: int, ramp_at: int, taken_at: int
) -> None:
    """Whatever the ramp and wherever on it: at next_at_ms one release is allowed, a millisecond before none is (so
    the timer neither oversleeps nor wakes for nothing)."""

    def pacer() -> ReleasePacer:
        made = ReleasePacer(PacingConfig(rate=rate, burst=burst, ramp_ms=ramp_ms))
        made.allowance(0)
        made.ramp_from(ramp_at)
        made.take(made.allowance(taken_at) or 0, taken_at)
        return made

    wake = pacer().next_at_ms(taken_at)
    assert wake > taken_at
    assert pacer().allowance(wake) == 1 or (pacer().allowance(wake) or 0) >= 1
    assert pacer().allowance(wake - 1) == 0 or wake - 1 == taken_at


def lost_and_resent(rate: float, burst: int) -> tuple[ReleaseSchedule, ReleasePacer]:
    """Three requests sent and never taken (lost), the partition silent for the resend window since."""
    schedule = ReleaseSchedule(resend_after_ms=30_000, max_in_flight=1000)
    schedule.adopt(0, [Slot(0, b"k%d" % i, f"items/0/{i}", 1, "1s") for i in range(3)])
    pacer = ReleasePacer(PacingConfig(rate=rate, burst=burst))
    assert len(pop_paced(schedule, pacer, 0)[0]) == 3
    return schedule, pacer


def test_a_resend_is_neither_paced_nor_charged() -> None:
    """A lost request sent again: its release never ran, so it takes no token (the new release due with it does),
    and it is not held back (the window bounds resends)."""
    schedule, pacer = lost_and_resent(rate=100, burst=3)
    schedule.add(0, Slot(30_000, b"new", "items/0/new", 1, "1s"))
    popped, delayed = pop_paced(schedule, pacer, 30_000)
    assert len(popped.resent) == 3 and [slot.origin for _, slot in popped.new] == ["items/0/new"]
    assert delayed == 0
    assert pacer.allowance(30_000) == 2  # only the new release took a token
    slow, slow_pacer = lost_and_resent(rate=0.01, burst=3)  # the bucket empty for 100 s: resends go anyway
    assert len(pop_paced(slow, slow_pacer, 30_000)[0]) == 3
    assert slow_pacer.allowance(30_000) == 0


def test_the_paced_count_counts_each_delayed_release_once() -> None:
    """Two due at once at 1/s, never confirmed: the second goes a second late (1 paced); the resends of both, at
    30 s and 60 s, are not counted again."""
    schedule = ReleaseSchedule(resend_after_ms=30_000, max_in_flight=1000)
    schedule.adopt(0, [Slot(0, b"k%d" % i, f"items/0/{i}", 1, "1s") for i in range(2)])
    pacer = ReleasePacer(PacingConfig(rate=1, burst=1))
    delayed_total, sends = 0, 0
    for now in range(0, 70_001, 1000):
        due, delayed = pop_paced(schedule, pacer, now)
        delayed_total += delayed
        sends += len(due)
    assert sends == 2 + 2 + 2  # sent, and twice sent again
    assert delayed_total == 1


def test_what_pacing_held_back_is_forgotten_once_a_tick_holds_nothing_back() -> None:
    """A backlog once held back by pacing says nothing of slots sent after a tick that held nothing back: a
    partition adopted later with old due times, sent at once, was not delayed by pacing."""
    schedule = ReleaseSchedule(resend_after_ms=30_000, max_in_flight=1000)
    schedule.adopt(0, [Slot(1_000, b"k%d" % i, f"items/0/{i}", 1, "1s") for i in range(2)])
    pacer = ReleasePacer(PacingConfig(rate=1, burst=1))
    assert pop_paced(schedule, pacer, 1_000)[1] == 0  # one sent, one held back
    assert pop_paced(schedule, pacer, 2_000)[1] == 1  # the held one, a second late; nothing held back now
    schedule.adopt(1, [Slot(500, b"old", "items/1/old", 1, "1s")])  # assigned later, due long ago
    due, delayed = pop_paced(schedule, pacer, 5_000)
    assert [slot.origin for _, slot in due] == ["items/1/old"]
    assert delayed == 0, "sent as soon as it was found: pacing did not delay it"


@settings(max_examples=120, deadline=None)
@given(
    rate=st.floats(min_value=5, max_value=500),
    burst=st.integers(min_value=1, max_value=20),
    window=st.integers(min_value=1, max_value=8),
    dues=st.lists(
        st.tuples(st.integers(min_value=0, max_value=2), st.integers(min_value=0, max_value=2_000)),
        min_size=1,
        max_size=60,
    ),
    fates=st.lists(st.booleans(), min_size=1, max_size=20).filter(any),
)
def test_with_lost_requests_new_releases_keep_the_rate_and_resends_the_windows(
    rate: float, burst: int, window: int, dues: list[tuple[int, int]], fates: list[bool]
) -> None:
    """Requests get lost (``fates``, in turn per send: True = taken and confirmed, False = never arrives) and are
    sent again. New releases stay within rate * t + burst; the pacer is charged exactly the new ones; a tick re-sends
    at most a window per partition, only requests sent before and not confirmed; and everything ends confirmed."""
    schedule = ReleaseSchedule(resend_after_ms=1_000, max_in_flight=window)
    found: dict[int, list[Slot]] = {partition: [] for partition in range(3)}
    for number, (partition, due_at) in enumerate(dues):
        found[partition].append(Slot(due_at, b"k%d" % number, f"items/{partition}/{number}", 1))
    for partition, slots in found.items():
        schedule.adopt(partition, slots)
    pacer = ReleasePacer(PacingConfig(rate=rate, burst=burst))
    new_events: list[tuple[int, int]] = []
    sent_new: set[str] = set()
    confirmed: set[str] = set()
    sends = 0
    horizon = 2_000 + len(dues) * (1000 / rate + 1_000 * len(fates)) + 5_000
    for now in range(0, int(horizon), 50):
        allowed = pacer.allowance(now)
        assert allowed is not None
        popped, _ = pop_paced(schedule, pacer, now)
        assert len(popped.new) <= allowed
        assert pacer.allowance(now) == allowed - len(popped.new), "resends took tokens"
        for partition in range(3):
            assert sum(1 for p, _ in popped.resent if p == partition) <= window
        for _, slot in popped.resent:
            assert slot.origin in sent_new and slot.origin not in confirmed
        for _, slot in popped.new:
            assert slot.origin not in sent_new, "a new release twice"
            sent_new.add(slot.origin)
        if popped.new:
            new_events.append((now, len(popped.new)))
        for partition, slot in popped:
            assert slot.due_at_ms <= now
            if fates[sends % len(fates)]:
                schedule.received(partition, now, slot.ident, schedule.send_number(partition, slot.ident))
                schedule.confirm(partition, slot.table_key, slot.origin, slot.attempt)
                confirmed.add(slot.origin)
            sends += 1
        if len(confirmed) == len(dues):
            break
    window_counts_hold(new_events, lambda a, b: rate * (b - a) / 1000 + burst)
    assert len(confirmed) == len(dues), "a lost request was never sent again"


def test_settings_build_the_pacing_config() -> None:
    assert load_settings().release_pacing == PacingConfig(rate=None)
    assert load_settings(release_rate="unlimited").release_pacing == PacingConfig(rate=None)
    assert load_settings(release_rate="50").release_pacing == PacingConfig(rate=50.0, burst=5)
    assert load_settings(release_rate="0.5", release_ramp="2m", release_burst="3").release_pacing == PacingConfig(
        rate=0.5, burst=3, ramp_ms=120_000
    )
