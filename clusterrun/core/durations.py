"""Durations as users write them: ``90``, ``1.5``, ``250ms``, ``30s``, ``10m``, ``6h``, ``2d`` (one number, one unit).

The one parser for the command line and the hosts file (``restart:``, ``startup_timeout``,
``hang_after``), so that ``--hang-after 10m`` and ``hang_after: 10m`` mean the same. Pure; no clock.
"""

from __future__ import annotations

import math
import re

_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|sec|min|[smhd]?)\s*", re.IGNORECASE)


def parse_duration(text: str | float | int, *, minimum: float = 0.0) -> float:
    """Seconds, finite and at least ``minimum``; ``ValueError`` with a message a user can act on."""
    if isinstance(text, bool):
        raise ValueError(f"expected a duration such as 30s, 10m or 6h, got {text!r}")
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        match = _DURATION.fullmatch(text)
        if match is None:
            raise ValueError(f"expected a duration such as 30s, 10m or 6h (or seconds), got {text!r}")
        seconds = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(seconds):
        raise ValueError(f"expected a finite duration, got {text!r}")
    if seconds < minimum:
        raise ValueError(f"must be at least {minimum:g} s, got {text!r}")
    return seconds


def show_duration(seconds: float) -> str:
    """``45 s``, ``10 min``, ``6 h``: the largest unit that divides it, else seconds."""
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} s"
