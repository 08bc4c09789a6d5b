"""The log search's matches in the lines of one view, by absolute line number (pure, no Textual).

Lifecycle: ``find()`` over the lines shown → ``find_new()`` for the lines that arrived while the
view follows → ``step()`` from match to match; ``forget_before()`` as the ring drops lines.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Sequence


class Matches:
    """Line numbers that match, the current one (-1: none yet) and how far the lines were searched."""

    def __init__(self) -> None:
        self.lines: list[int] = []
        self.current = -1
        self.searched = 0

    def clear(self) -> None:
        self.lines, self.current, self.searched = [], -1, 0

    def find(self, pattern: re.Pattern[str] | None, lines: Sequence[str], first: int) -> None:
        """Search every line (the first numbered ``first``); no match is the current one."""
        self.lines = [first + i for i, line in enumerate(lines) if pattern.search(line)] if pattern else []
        self.current = -1
        self.searched = first + len(lines)

    def find_new(self, pattern: re.Pattern[str], lines: Sequence[str], first: int) -> None:
        """Search only the lines after those searched, and forget matches whose lines left."""
        end = first + len(lines)
        if self.searched < first:  # more arrived than the ring holds: search it all again
            self.find(pattern, lines, first)
            return
        if end > self.searched:
            new = itertools.islice(lines, self.searched - first, None)
            self.lines += [self.searched + i for i, line in enumerate(new) if pattern.search(line)]
            self.searched = end
        self.forget_before(first)

    def forget_before(self, first: int) -> None:
        gone = bisect.bisect_left(self.lines, first)
        if gone:
            del self.lines[:gone]
            self.current = max(-1, self.current - gone)

    def forget_from(self, end: int) -> None:
        """Drop matches at or after line ``end``: lines that arrived after the last tick are not shown."""
        shown = bisect.bisect_left(self.lines, end)
        if shown < len(self.lines):
            del self.lines[shown:]
            self.current = min(self.current, shown - 1)
            self.searched = end

    def step(self, step: int) -> int | None:
        """Move ``step`` matches on (wrapping; the first step from none goes to the first or the
        last); the line of the match now current, None when there is none."""
        if not self.lines:
            return None
        here = self.current
        self.current = (here + step) % len(self.lines) if here >= 0 else (0 if step > 0 else len(self.lines) - 1)
        return self.lines[self.current]

    def describe(self) -> str:
        """``2/5``, ``5 matches`` (none current yet) or ``no match``."""
        count = len(self.lines)
        if self.current >= 0 and count:
            return f"{self.current + 1}/{count}"
        return f"{count} match{'es' if count != 1 else ''}" if count else "no match"


__all__ = ["Matches"]
