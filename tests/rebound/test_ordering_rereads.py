"""Key-ordered mode's decisions when records of a key are read again below later ones that already ran.

A record lost on its way to the dispatcher (a stream queue cleared when the flow resumed) is read again after later
records of its key ran without it. ``place`` must neither hold it behind those later records nor lose it: it runs at
once when it is below everything unsettled of its key, and otherwise takes its place in offset order among the held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from rebound.attempts import Outcome
from rebound.ordering import Placement, first_unsettled_offset, hold, place, unblock, waits_for
from rebound.state import PendingMessage
from tests.rebound.test_ordering import RUN_OUTCOMES, TOPIC, KeyModel, held, provenance


class FirstRuns(list[int]):
    """The model's log of first runs, checking each as it is appended (:meth:`ReReadModel.check_first_run`)."""

    def __init__(self, model: ReReadModel) -> None:
        super().__init__()
        self.model = model

    def append(self, offset: int) -> None:
        self.model.check_first_run(offset)
        assert offset not in self, f"{offset} first ran twice: {self.model.runs}"
        super().append(offset)


@dataclass
class ReReadModel(KeyModel):
    """:class:`KeyModel` whose records may be lost on the way and read again later, below records that ran."""

    next_offset: int = 0
    lost: list[int] = field(default_factory=list)
    placed: set[int] = field(default_factory=set)
    below_all: set[int] = field(default_factory=set)
    """Records that arrived at or below every unsettled message of the key (or with nothing unsettled)."""

    def __post_init__(self) -> None:
        self.first_runs = FirstRuns(self)

    def check_first_run(self, offset: int) -> None:
        """No record first runs while a lower offset that had arrived has not: a record read again runs before
        every later record of its key that had not run yet, held or not."""
        waiting = sorted(other for other in self.placed if other < offset and other not in self.first_runs)
        assert not waiting, f"{offset} first ran while {waiting}, arrived, had not: {self.runs}"

    def check_retry(self, offset: int, attempt: int) -> None:
        """No retry runs while a lower record that arrived below everything unsettled of its key has not first run:
        those it is below have not succeeded, so it runs before their next attempts (held behind them, it would run
        only after they succeeded, out of order). What it cannot get back is the order of the attempts that ran
        before it arrived. One that fails too leaves two messages of the key retrying: their retries come due in any
        order (:meth:`retry_due`), and the one above waits (``waits_for``), so a retry never runs below a lower
        unsettled one, and the key's successes stay in offset order (:meth:`KeyModel.check_success`)."""
        waiting = sorted(other for other in self.below_all if other < offset and other not in self.first_runs)
        assert not waiting, f"{offset} attempt {attempt} ran while {waiting}, arrived, had not: {self.runs}"

    def run(self, offset: int, attempt: int, outcome: Outcome) -> None:
        if attempt > 0:  # first runs are checked as they are logged
            self.check_retry(offset, attempt)
        super().run(offset, attempt, outcome)

    def place_record(self, offset: int, outcome: Outcome) -> None:
        self.placed.add(offset)
        self.arrived.append(offset)
        first = first_unsettled_offset(self.state, TOPIC, 0)
        if first is None or offset <= first:
            self.below_all.add(offset)
        placement = place(self.state, provenance(offset))
        assert placement is not Placement.ALREADY_HELD
        if placement is Placement.RUN:
            self.run(offset, 0, outcome)
        else:
            self.state, changed = hold(self.state, held(offset, blocked_by=self.state.blocked_by))
            assert changed

    def waits(self, entry: PendingMessage) -> bool:
        return waits_for(self.state, entry, dead_letters_block=self.dead_letter_blocks) is not None

    def retry_due(self, outcome: Outcome, pick: int) -> bool:
        """Any parked retry of the key comes due (``pick``: which; due times put them in any order). It runs, as
        the release agent runs it, unless a lower message of the key is unsettled: then it is deferred (False)."""
        entry = self.state.pending[pick % len(self.state.pending)]
        if self.waits(entry):
            return False
        self.state, settled = self.state.settle(entry.origin, entry.attempt)
        assert settled
        self.run(entry.provenance.offset, entry.attempt, outcome)
        return True

    def finish(self, data: st.DataObject) -> None:
        """Every retry that may run succeeds (an operator lifts dead-letter blocks) and the held drain, until the
        key is idle. A round in which nothing can move is a deadlock: two messages waiting for each other."""
        for _ in range(4 * len(self.placed) + 4):
            pending = self.state.pending
            ready = [pick for pick, entry in enumerate(pending) if not self.waits(entry)]
            moved = bool(ready) and self.retry_due(Outcome.SUCCEEDED, ready[data.draw(st.integers(0, len(ready) - 1))])
            if self.state.blocked_dead:
                self.state, moved = unblock(self.state), True
            ran = len(self.runs)
            self.drain(data)
            if self.state.is_idle:
                return
            assert moved or len(self.runs) > ran, f"deadlock: nothing of the key can run: {self.state}"
        raise AssertionError(f"the key never became idle: {self.state}")

    def lose(self) -> None:
        self.lost.append(self.next_offset)
        self.next_offset += 1


@settings(max_examples=400, deadline=None)
@given(data=st.data(), dead_letter_blocks=st.booleans())
def test_records_read_again_run_before_every_later_record_that_had_not_run_and_none_is_lost(
    data: st.DataObject, dead_letter_blocks: bool
) -> None:
    """Model: one key of one partition. Each step is one of: the next record arrives (placed, run or held), the
    next record is lost on its way, a lost record is read again (placed), one of the key's parked retries comes due
    (run, or deferred behind a lower unsettled message), a drain of the held line. Then every retry that may run
    succeeds, dead-letter blocks are lifted, and the key drains, without ever waiting on itself.

    Checked on every first run, every retry and every success (:meth:`ReReadModel.check_first_run`,
    :meth:`ReReadModel.check_retry`, :meth:`KeyModel.check_success`). At the end: every record that arrived first
    ran exactly once.
    """
    model = ReReadModel(dead_letter_blocks=dead_letter_blocks)
    play(model, data, data.draw(st.lists(st.sampled_from(STEPS), max_size=40)))
    model.finish(data)
    assert sorted(model.first_runs) == sorted(model.placed)
    assert model.state.is_idle


@settings(max_examples=300, deadline=None)
@given(data=st.data(), dead_letter_blocks=st.booleans())
def test_two_retrying_messages_of_a_key_succeed_in_offset_order_and_never_wait_for_each_other(
    data: st.DataObject, dead_letter_blocks: bool
) -> None:
    """The same model, from where the gap was: K@0 lost on its way, K@1 fails and retries, K@0 read again runs and
    fails too. Two messages of the key retry, K@0 blocks it, and their retries come due in any order; then random
    steps (more records read again between them, held ones, further failures) and the drain. Each success is
    checked to come with nothing unsettled below it, and the drain to end without two messages waiting for each
    other."""
    model = ReReadModel(dead_letter_blocks=dead_letter_blocks)
    model.lose()
    model.place_record(model.next_offset, Outcome.SCHEDULED)
    model.next_offset += 1
    model.place_record(model.lost.pop(), Outcome.SCHEDULED)
    assert sorted(entry.origin for entry in model.state.pending) == ["items/0/0", "items/0/1"]
    assert model.state.blocked_by == "items/0/0"
    play(model, data, data.draw(st.lists(st.sampled_from(STEPS), max_size=30)))
    model.finish(data)
    assert sorted(model.first_runs) == sorted(model.placed)
    assert model.state.is_idle


STEPS = ["arrive", "lose", "read-again", "retry", "drain"]


def play(model: ReReadModel, data: st.DataObject, steps: list[str]) -> None:
    """Carry out the model's steps, drawing outcomes and choices from ``data``."""
    for step in steps:
        if step == "arrive":
            model.place_record(model.next_offset, data.draw(RUN_OUTCOMES))
            model.next_offset += 1
        elif step == "lose":
            model.lose()
        elif step == "read-again" and model.lost:
            offset = model.lost.pop(data.draw(st.integers(0, len(model.lost) - 1)))
            model.place_record(offset, data.draw(RUN_OUTCOMES))
        elif step == "retry" and model.state.pending:
            model.retry_due(data.draw(RUN_OUTCOMES), data.draw(st.integers(0, len(model.state.pending) - 1)))
        elif step == "drain":
            model.drain(data)
