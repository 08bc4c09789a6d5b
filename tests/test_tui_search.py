"""The log search's matches (``clusterrun.tui.search``): pure, in milliseconds."""

from __future__ import annotations

import re

from clusterrun.tui.search import Matches

PATTERN = re.compile("err")


def test_matches_follow_a_ring_that_drops_and_gains_lines() -> None:
    matches = Matches()
    lines = ["ok", "err 1", "ok", "err 2"]
    matches.find(PATTERN, lines, first=10)
    assert (matches.lines, matches.current, matches.describe()) == ([11, 13], -1, "2 matches")
    assert matches.step(-1) == 13 and matches.describe() == "2/2"  # the first step back: the last match
    assert matches.step(1) == 11  # wraps
    matches.find_new(PATTERN, lines[2:] + ["err 3", "ok"], first=12)  # the ring dropped 2 lines, got 2
    assert matches.lines == [13, 14] and matches.current == -1  # the current match left the ring
    matches.find_new(PATTERN, ["err"] * 3, first=100)  # more arrived than the ring holds: searched again
    assert matches.lines == [100, 101, 102] and matches.searched == 103
    matches.forget_from(101)  # arrived after the last tick: not shown yet
    assert matches.lines == [100] and matches.searched == 101
    matches.clear()
    assert matches.step(1) is None and matches.describe() == "no match"
