"""The retry policy: a list of delays computed up front, an optional total-duration cap, and their tier topics.

Parsing is strict because a typo in a delay would otherwise silently change how long messages wait: every error
names the environment variable it came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rebound.errors import ConfigurationError

_UNITS_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION = re.compile(r"^\s*([0-9]{1,18})\s*(ms|s|m|h|d)\s*$")  # ASCII digits; 18 of them reach past any real need
_EXPONENTIAL = re.compile(
    r"^\s*exp\s*:\s*(?P<start>[^.]+?)\s*\.\.\s*(?P<stop>[^,x*]+?)\s*(?:[x*]\s*(?P<factor>\d+(?:\.\d+)?))?\s*$"
)
MAX_RETRIES = 100
MAX_FACTOR = 1000.0


def parse_duration_ms(text: str, *, variable: str) -> int:
    """``"30m"`` gives 1_800_000. Zero, negative, fractional or unit-less values are refused."""
    match = _DURATION.match(text)
    if not match:
        raise ConfigurationError(
            f"{variable}: {text.strip()!r} is not a duration; use a positive whole number with a unit "
            f"({', '.join(_UNITS_MS)}), e.g. 30s or 5m"
        )
    amount, unit = int(match.group(1)), match.group(2)
    if amount <= 0:
        raise ConfigurationError(f"{variable}: {text.strip()!r} must be greater than zero")
    return amount * _UNITS_MS[unit]


def format_duration(ms: int) -> str:
    """The shortest exact label: 300000 gives ``5m``, 1500 gives ``1500ms``; used in tier topic names."""
    for unit in ("d", "h", "m", "s"):
        size = _UNITS_MS[unit]
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def _exponential(match: re.Match[str], variable: str) -> list[int]:
    start = parse_duration_ms(match.group("start"), variable=variable)
    stop = parse_duration_ms(match.group("stop"), variable=variable)
    factor = float(match.group("factor") or 2)
    if factor > MAX_FACTOR:  # also catches a factor so long that it reads as infinity
        raise ConfigurationError(f"{variable}: exponential factor must be at most {MAX_FACTOR:g}")
    if stop < start:
        raise ConfigurationError(
            f"{variable}: exponential range must grow, got {format_duration(start)}..{format_duration(stop)}"
        )
    if factor <= 1:
        raise ConfigurationError(f"{variable}: exponential factor must be greater than 1, got {factor}")
    delays = [start]
    while delays[-1] < stop:
        delays.append(min(stop, round(delays[-1] * factor)))
        if len(delays) > MAX_RETRIES:
            raise ConfigurationError(f"{variable}: expands to more than {MAX_RETRIES} retries")
    return delays


def parse_sequence(text: str, *, variable: str = "REBOUND_RETRY_SEQUENCE") -> tuple[int, ...]:
    """Parse ``5m,5m,30m`` or ``exp:1s..1h`` (optionally ``exp:1s..1h x3``) into delays in milliseconds."""
    if not text or not text.strip():
        raise ConfigurationError(f"{variable} is empty; give at least one delay, e.g. 5m,5m,30m")
    exponential = _EXPONENTIAL.match(text)
    if exponential:
        return tuple(_exponential(exponential, variable))
    delays = [parse_duration_ms(part, variable=variable) for part in text.split(",")]
    if len(delays) > MAX_RETRIES:
        raise ConfigurationError(f"{variable}: more than {MAX_RETRIES} retries")
    return tuple(delays)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Delays (ms) for retry 1..n, and the optional total cap measured from the first receipt."""

    delays_ms: tuple[int, ...]
    max_duration_ms: int | None = None

    def __post_init__(self) -> None:
        if not self.delays_ms:
            raise ConfigurationError("a retry policy needs at least one delay")
        if any(delay <= 0 for delay in self.delays_ms):
            raise ConfigurationError("retry delays must be greater than zero")
        if self.max_duration_ms is not None and self.max_duration_ms <= 0:
            raise ConfigurationError("the maximum retry duration must be greater than zero")

    @classmethod
    def parse(cls, sequence: str, max_duration: str | None = None) -> RetryPolicy:
        cap = None
        if max_duration is not None and max_duration.strip():
            cap = parse_duration_ms(max_duration, variable="REBOUND_MAX_RETRY_DURATION")
        return cls(parse_sequence(sequence), cap)

    @property
    def max_retries(self) -> int:
        return len(self.delays_ms)

    def delay_for_retry(self, retry: int) -> int:
        """Delay before retry number ``retry`` (1-based)."""
        return self.delays_ms[retry - 1]

    def tier_label(self, retry: int) -> str:
        return format_duration(self.delay_for_retry(retry))

    @property
    def tier_labels(self) -> tuple[str, ...]:
        """Distinct delays in first-use order: one tier topic each."""
        return tuple(dict.fromkeys(format_duration(delay) for delay in self.delays_ms))

    def describe(self) -> str:
        text = ",".join(format_duration(delay) for delay in self.delays_ms)
        if self.max_duration_ms is not None:
            text += f" (max {format_duration(self.max_duration_ms)})"
        return text
