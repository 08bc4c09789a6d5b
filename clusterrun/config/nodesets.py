"""Node sets (``gpu[01-08]``, ``gpu[01-04,07]``, ``rack[1-2]-n[1-4]``) expanded with ClusterShell.

ClusterShell's ``NodeSet`` does the expansion (zero padding kept); this module adds what it does
not: the order the user wrote (``b,a`` stays ``b, a``: node ranks follow it), no operators or
groups (``!``, ``&``, ``^``, ``@``: pdsh's ``-x`` is the way to drop nodes here), and errors that
name the position in the expression (``NodeSetError.column``, from 1).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from clusterrun.core.ranges import ranges_text

if TYPE_CHECKING:
    from ClusterShell.NodeSet import NodeSetParseError

# ClusterShell.NodeSet is imported where a set is expanded or folded (not for simple names: see
# fold), not at every command's start: it brings logging and configparser (docs/benchmarks.md,
# "Figures behind choices").

__all__ = ["FOLD_PAST", "MAX_HOSTS", "NodeSetError", "expand", "fold", "fold_ranks",
           "hosts_alike", "is_nodeset", "size"]

# Past this many nodes the plain output's per-node status lines fold (``views.printer.alike_lines``); up to it,
# a line per node reads better than node sets.
FOLD_PAST = 8
# The most hosts a hosts file (or a -w/-x node set) may name: what the rest of clusterrun is built
# and measured for (one connection and thread per host, the dashboard's table). ClusterShell
# expands a set before it can count it (4 s and most of a GB for a million names): ``size`` counts.
MAX_HOSTS = 10_000
_RANGE = re.compile(r"(\d+)(?:-(\d+)(?:/(\d+))?)?\Z")

# What ClusterShell would read as an operator, a group or a separator of its own.
_OPERATORS = re.compile(r"[!&^@\s]")
_QUOTED = re.compile(r'"([^"]*)"')


class NodeSetError(ValueError):
    """A node set that cannot be expanded: ``reason`` at ``column`` (from 1) of ``expression``."""

    def __init__(self, expression: str, column: int, reason: str) -> None:
        super().__init__(f"{reason} at position {column} of {expression!r}")
        self.expression = expression
        self.column = column
        self.reason = reason

    @property
    def pointer(self) -> str:
        """The expression with a caret under the position, two lines."""
        return f"{self.expression}\n{' ' * (self.column - 1)}^"


def is_nodeset(text: str) -> bool:
    """Whether ``text`` is more than one plain name: it has a range (``[``) or a list (``,``)."""
    return "[" in text or "]" in text or "," in text


def _parts(expression: str) -> Iterator[tuple[int, str]]:
    """The comma-separated parts outside brackets, each with its offset (an unclosed bracket runs
    to the end, where ClusterShell reports it)."""
    depth, start = 0, 0
    for i, char in enumerate(expression):
        if char == "[":
            depth += 1
        elif char == "]":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0:
            yield start, expression[start:i]
            start = i + 1
    yield start, expression[start:]


def size(expression: str) -> int:
    """How many names ``expression`` holds, counted without expanding it (a name written twice
    counts twice); a bracket ClusterShell would refuse counts as one name (``expand`` says why)."""
    total = 0
    for _, part in _parts(expression):
        names = 1
        for group in re.findall(r"\[([^\[\]]*)\]", part):
            count = 0
            for item in group.split(","):
                found = _RANGE.match(item.strip())
                if found is None:
                    count += 1
                    continue
                low, high, step = int(found[1]), int(found[2] or found[1]), int(found[3] or 1)
                count += (high - low) // max(step, 1) + 1 if high >= low else 1
            names *= count
        total += names
    return total


def expand(expression: str, most: int = MAX_HOSTS) -> list[str]:
    """The names of ``expression`` in the order written, each once; raise ``NodeSetError``, also
    for a set of more than ``most`` names (before expanding it)."""
    if (bad := _OPERATORS.search(expression)) is not None:
        what = "a space" if bad.group().isspace() else f"{bad.group()!r}"
        raise NodeSetError(expression, bad.start() + 1, f"{what} is not allowed in a node set")
    if (count := size(expression)) > most:
        raise NodeSetError(expression, 1, f"{count:,} names, more than the {most:,} allowed")
    from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet, NodeSetParseError

    names: dict[str, None] = {}
    for offset, part in _parts(expression):
        if not part:
            raise NodeSetError(expression, offset + 1, "an empty name")
        try:
            names.update(dict.fromkeys(NodeSet(part, resolver=RESOLVER_NOGROUP)))
        except NodeSetParseError as exc:
            raise NodeSetError(expression, offset + _column(part, exc), _reason(exc)) from None
    return list(names)


def _column(part: str, exc: NodeSetParseError) -> int:
    """Where in ``part`` ClusterShell's complaint points, from 1 (its start when unclear)."""
    text = str(exc)
    if text.startswith("missing bracket"):
        return part.rfind("[") + 1 or 1
    if text.startswith("illegal closing bracket"):
        return part.rfind("]") + 1 or 1
    for piece in _QUOTED.findall(str(exc.part)) or ["[]"]:  # a range error quotes the range
        if piece and (at := part.find(piece)) >= 0:
            return at + 1
    return 1


def _reason(exc: NodeSetParseError) -> str:
    """ClusterShell's complaint, short: ``missing bracket``, ``bad range "3-1"``."""
    kind = str(exc).split(":", 1)[0]
    quoted = _QUOTED.findall(str(exc.part))
    return f'{kind} "{quoted[-1]}"' if quoted else kind


# A name that is letters then one unpadded number (``sim12``, ``gpu_a3``): ``fold`` folds a set of
# them with one prefix itself, as ClusterShell would, without importing ``ClusterShell.NodeSet``
# (2.3 ms of CPU in `up`, 9 ms where logging is not loaded yet, and 0.25 ms per fold of 32 names).
_SIMPLE_NAME = re.compile(r"([A-Za-z_.-]*[A-Za-z_])([1-9][0-9]*|0)")


def fold(names: list[str]) -> str:
    """The shortest node set of ``names`` (for messages): ``gpu[01-03,07]``."""
    simple = [_SIMPLE_NAME.fullmatch(name) for name in names]
    prefixes = {m.group(1) for m in simple if m is not None}
    if names and len(prefixes) == 1 and all(simple):
        numbers = {int(m.group(2)) for m in simple if m is not None}
        prefix = prefixes.pop()
        return f"{prefix}{numbers.pop()}" if len(numbers) == 1 else f"{prefix}[{ranges_text(numbers)}]"
    from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet

    return str(NodeSet.fromlist(names, resolver=RESOLVER_NOGROUP))


def fold_ranks(ranks: list[int]) -> str:
    """Node ranks as a node set in words: ``node 3``, ``nodes 0-61``, ``nodes 0-2,5,7-9``."""
    return ("node " if len(set(ranks)) == 1 else "nodes ") + ranges_text(ranks)


def hosts_alike(items: Sequence[tuple[str, str]], total: int) -> list[str]:
    """Lines ``host: text`` of ``(host, text)`` items of ``total`` hosts; past ``FOLD_PAST`` the
    hosts of one text share a line, in the order of its first: ``63 hosts gpu[01-17,19-64]: text``."""
    if total <= FOLD_PAST:
        return [f"{host}: {text}" for host, text in items]
    groups: dict[str, list[str]] = {}
    for host, text in items:
        groups.setdefault(text, []).append(host)
    return [f"{hosts[0]}: {text}" if len(hosts) == 1 else f"{len(hosts)} hosts {fold(hosts)}: {text}"
            for text, hosts in groups.items()]
