"""The back-off between two sends of a record that must be acknowledged: 0.1 s, doubled after each, at most 5 s.

One rule for every record Rebound sends again until the broker takes it: a forward to a tier or the failed topic
(``agents/delivery.py``), a changelog write awaiting its confirmation (``tables/retry_state.py``), a writer-epoch
claim and the read of the span before its marker (``tables/fencing.py``). Pure: the caller counts and sleeps.
"""

from __future__ import annotations

FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0


def _delays() -> tuple[float, ...]:
    delays = [FIRST_BACKOFF_S]
    while delays[-1] < MAX_BACKOFF_S:
        delays.append(min(delays[-1] * 2, MAX_BACKOFF_S))
    return tuple(delays)


_DELAYS = _delays()
"""0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0: worked out once, so a send that succeeds pays for nothing (a generator of
delays made per send would cost the healthy path more than the counter its caller keeps)."""


def backoff_s(failures: int) -> float:
    """The delay, in seconds, before sending again after the ``failures``-th failure in a row (1 for the first)."""
    if failures < 1:  # a caller counting from 0 would otherwise sleep the longest delay, silently
        raise ValueError(f"failures counts from 1, got {failures}")
    return _DELAYS[min(failures, len(_DELAYS)) - 1]
