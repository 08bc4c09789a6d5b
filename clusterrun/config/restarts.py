"""The job-level restart policy: what the hosts file's ``restart:`` and ``up --max-restarts`` say, and
the owner's two decisions with it (restart this failure or not; after how long).

Pure (no I/O, no clock of its own: the caller passes ``now`` and the random source), so every
decision is tested in milliseconds. ``config`` parses the hosts file's block with ``parse_duration``
and ``parse_backoff``; the owner (``runner.Runner``) asks ``refusal`` and ``delay``.
::

    restart: {max: 3, backoff: 30s..10m, on_exit_codes: [1, 134], window: 6h}
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from clusterrun.core.durations import parse_duration
from clusterrun.core.frozen import frozen

MAX_RESTARTS = 1000  # restart.max and up --max-restarts: a budget, not a way to say "forever"
# The restarts that count against the budget: a failure's ("policy") and a hang's ("requested", by
# ``on_hang: restart``); the start-up retry ("start-up") is a retry of the start, not a restart.
COUNTED = ("policy", "requested")


def parse_backoff(text: str) -> tuple[float, float]:
    """``30s..10m`` (the first wait, the longest) or one duration (always that long), as seconds."""
    low, sep, high = text.partition("..")
    first = parse_duration(low)
    most = parse_duration(high) if sep else first
    if most < first:
        raise ValueError(f"the longest wait ({high.strip()}) is shorter than the first ({low.strip()})")
    return first, most


@frozen
class RestartPolicy:
    """Restart the whole job as a new attempt after a failure, at most ``max`` times (within any
    ``window`` seconds, if given), only for the exit codes ``on_exit_codes`` (any if None), after
    a wait from ``backoff_first`` doubling up to ``backoff_most`` seconds, with jitter."""

    max: int = 0
    backoff_first: float = 30.0
    backoff_most: float = 600.0
    on_exit_codes: tuple[int, ...] | None = None
    window: float | None = None

    def with_max(self, max_restarts: int | None) -> RestartPolicy:
        """The policy with ``up --max-restarts`` (None: as the hosts file says)."""
        if max_restarts is None:
            return self
        return RestartPolicy(max_restarts, self.backoff_first, self.backoff_most, self.on_exit_codes, self.window)

    def refusal(self, restarts: Sequence[float], exit_code: int | None, now: float) -> str | None:
        """Why a failure whose first failing process exited ``exit_code`` (None: no exit code, a
        lost node) is not restarted, given the times of the restarts made so far (``COUNTED``);
        None: restart."""
        if self.max > 0 and self.on_exit_codes is not None and exit_code not in self.on_exit_codes:
            codes = ", ".join(map(str, self.on_exit_codes))
            return f"exit code {exit_code} is not one of restart.on_exit_codes ({codes})"
        return self.hang_refusal(restarts, now)

    def hang_refusal(self, restarts: Sequence[float], now: float) -> str | None:
        """Why a hung job is not restarted (``on_hang: restart``), given the times of the restarts
        made so far: the same budget as failures, exit codes aside (a hang has none); None: restart."""
        if self.max <= 0:
            return "no restarts allowed (restart: max, up --max-restarts)"
        counted = [t for t in restarts if self.window is None or now - t < self.window]
        if len(counted) >= self.max:
            within = f" within {_human(self.window)}" if self.window is not None else ""
            return f"the restart budget is used up ({len(counted)} of {self.max}{within})"
        return None

    def delay(self, restart: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before restart number ``restart`` (1, 2, ...): ``backoff_first`` doubled
        per restart up to ``backoff_most``, of which a random quarter is taken off (jitter keeps
        jobs that failed together from restarting in step)."""
        base = min(self.backoff_most, self.backoff_first * 2.0 ** min(restart - 1, 60))
        return base * (1 - 0.25 * (rng.random() if rng is not None else random.random()))


def _human(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


__all__ = ["COUNTED", "MAX_RESTARTS", "RestartPolicy", "parse_backoff", "parse_duration"]
