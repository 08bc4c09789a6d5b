"""Sets of ranks as people write them: ``0,4-7`` (``parse_ranges``) and back (``ranges_text``)."""

from __future__ import annotations

from collections.abc import Iterable


def parse_ranges(text: str) -> list[int]:
    """``0,4-7`` → ``[0, 4, 5, 6, 7]``; ``ValueError`` naming the part that is not a number or a range."""
    found: set[int] = set()
    for part in text.split(","):
        low, sep, high = part.strip().partition("-")
        if not low.isdigit() or (sep and not high.isdigit()) or (sep and int(high) < int(low)):
            raise ValueError(f"{part.strip()!r} is not a number or a range (write 0,4-7)")
        found.update(range(int(low), int(high if sep else low) + 1))
    return sorted(found)


def ranges_text(numbers: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` → ``0-2,5``."""
    spans: list[list[int]] = []
    for n in sorted(set(numbers)):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


__all__ = ["parse_ranges", "ranges_text"]
