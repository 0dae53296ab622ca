"""A cap on log lines of one kind, so a flood of failures cannot flood the log.

:class:`LineLimiter` lets at most ``per_window`` lines through in each window of ``window_s`` seconds (a window
starts with the first line after the previous one ended) and counts the rest, for one summary line ("K similar lines
suppressed") that the caller logs when the window ends. Pure, like :class:`rebound.pacing.ReleasePacer`: no clock of
its own, every call is given ``now`` (seconds, monotonic), so the tests drive it without sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LineLimiter:
    per_window: int = 10
    window_s: float = 1.0
    suppressed: int = 0
    """Lines refused since the last :meth:`take_suppressed`."""
    suppressed_since: float | None = None
    """When the first of them was refused."""
    _window_start: float = field(default=float("-inf"), repr=False)
    _used: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.per_window < 1 or self.window_s <= 0:
            raise ValueError(f"a line limiter needs per_window >= 1 and window_s > 0, got {self}")

    def allow(self, now: float) -> bool:
        """Whether a line may be logged at ``now``; if not, it is counted as suppressed."""
        if now >= self._window_start + self.window_s:
            self._window_start, self._used = now, 0
        if self._used < self.per_window:
            self._used += 1
            return True
        if not self.suppressed:
            self.suppressed_since = now
        self.suppressed += 1
        return False

    @property
    def window_ends_at(self) -> float:
        """When the current window ends: the time to log the summary of what it suppressed."""
        return self._window_start + self.window_s

    def take_suppressed(self) -> tuple[int, float | None]:
        """The lines suppressed and since when, and start counting again."""
        taken = (self.suppressed, self.suppressed_since)
        self.suppressed, self.suppressed_since = 0, None
        return taken
