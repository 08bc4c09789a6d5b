"""Sets of ranks as people write them: ``0,4-7`` (``parse_ranges``) and back (``ranges_text``), by
ClusterShell's ``RangeSet`` (the node sets' library: one syntax for hosts, nodes and ranks)."""

from __future__ import annotations

from collections.abc import Iterable

from ClusterShell.RangeSet import RangeSet, RangeSetParseError


def parse_ranges(text: str) -> list[int]:
    """``0,4-7`` → ``[0, 4, 5, 6, 7]``; ``ValueError`` naming the part that is not a number or a range."""
    for part in text.split(","):
        try:
            items = [str(item) for item in RangeSet(part.strip())]  # ints before ClusterShell 1.9
        except RangeSetParseError:
            items = []
        if not items or not all(item.isdigit() for item in items):
            raise ValueError(f"{part.strip()!r} is not a number or a range (write 0,4-7)")
    return sorted({int(str(item)) for item in RangeSet(text.replace(" ", ""))})


def ranges_text(numbers: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` → ``0-2,5``."""
    return str(RangeSet.fromlist([str(n) for n in sorted(set(numbers))]))


__all__ = ["parse_ranges", "ranges_text"]
