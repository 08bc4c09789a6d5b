"""What a hung job's ranks were doing: the report the job's owner saves when the job hangs.

Pure: from every node's ``stack`` answer, looked at twice some seconds apart (``looks=2``: each
rank's Python stacks, whether they moved between the looks, how busy it was meanwhile) to
``HangReport`` and its text. The stacks are grouped as ``clusterrun stack`` groups them
(``stacks.group``); the ranks to look at are named first:

- ``elsewhere``: ranks outside a collective while others wait in one (a rank that sleeps, loads
  data or spins while the rest wait in ``barrier``), else those outside the one largest group;
- ``busy``: ranks whose main thread ran, or waited for a core, at least ``BUSY`` of the time
  between the looks (where the host does not say, whose process used that share of a core): a
  spinning rank is busy also on a host whose cores are taken. CPU is evidence, never the reason
  for the verdict: gloo's and NCCL's threads poll and CUDA spins in ranks that wait;
- ``unmoved``: ranks whose stacks were the same at both looks (stuck there, or a tight loop on
  one line);
- ``working``: the stacks of more than half the ranks moved between the looks: the job works on
  without writing (a long silent step), as far as the stacks tell; no rank is then singled out.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from clusterrun.agent.wire import RankStack, StackAnswer
from clusterrun.core.errors import ClusterrunError
from clusterrun.core.events import iso
from clusterrun.core.frozen import frozen
from clusterrun.core.ranges import ranges_text
from clusterrun.diagnose.stacks import StackGroup, StackView, group, render

BUSY = 0.25  # share of the time between the looks above which a rank is busy (a waiting rank: about 0.01)
_SILENT_FIX = "print progress more often than hang_after, or raise it"  # for a job that works without a word


def _ranks(ranks: tuple[int, ...] | list[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {ranges_text(ranks)}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def busyness(stack: RankStack) -> float | None:
    """How busy a rank was between the looks: the share of the time its main thread ran or waited
    for a core, else the share of a core its process used; None if neither is known."""
    return stack.runnable if stack.runnable is not None else stack.cpu


def in_collective(g: StackGroup) -> bool:
    """Whether the group's main thread (else its first) waits in torch.distributed (a collective,
    a barrier, the store)."""
    thread = next((t for t in g.threads if t.name == "MainThread"), g.threads[0] if g.threads else None)
    return thread is not None and any("torch/distributed/" in f.file.replace("\\", "/") for f in thread.frames)


def elsewhere(view: StackView) -> tuple[int, ...]:
    """The ranks the others wait for, as far as their stacks tell: those outside a collective
    while the others are in one; else, where one group is larger than every other, the ranks
    outside it; else none."""
    groups = view.groups
    if len(groups) < 2:
        return ()
    waiting = [g for g in groups if in_collective(g)]
    if 0 < len(waiting) < len(groups):
        return tuple(sorted(r for g in groups if g not in waiting for r in g.ranks))
    sizes = sorted((len(g.ranks) for g in groups), reverse=True)
    if sizes[0] == sizes[1]:
        return ()
    largest = max(groups, key=lambda g: len(g.ranks))
    return tuple(sorted(r for g in groups if g is not largest for r in g.ranks))


@frozen
class HangReport:
    """The report of one hang: since when, for how long, the grouped stacks and each rank's looks."""

    since: float
    silent: float  # seconds without output when the ranks were looked at
    apart: float  # seconds between the two looks
    view: StackView
    ranks: Mapping[int, tuple[int, RankStack]]  # by global rank: its node and its last look

    @classmethod
    def of(cls, answers: Mapping[int, StackAnswer | ClusterrunError], hosts: Mapping[int, str], since: float,
           apart: float, now: float | None = None) -> HangReport:
        """The report from the nodes' ``stack`` answers (``looks=2``, ``apart`` seconds apart)."""
        ranks = {s.rank: (node, s) for node, a in answers.items() if isinstance(a, StackAnswer) for s in a.ranks}
        return cls(since=since, silent=max(0.0, (time.time() if now is None else now) - since), apart=apart,
                   view=group(answers, hosts), ranks=ranks)

    @property
    def elsewhere(self) -> tuple[int, ...]:
        """The ranks the others wait for; none while the job works (its ranks caught at different points)."""
        return () if self.working else elsewhere(self.view)

    @property
    def busy(self) -> tuple[int, ...]:
        return tuple(r for r, (_, s) in sorted(self.ranks.items()) if (b := busyness(s)) is not None and b >= BUSY)

    @property
    def idle(self) -> tuple[int, ...]:
        return tuple(r for r, (_, s) in sorted(self.ranks.items()) if (b := busyness(s)) is not None and b < BUSY)

    @property
    def unmoved(self) -> tuple[int, ...]:
        return tuple(r for r, (_, s) in sorted(self.ranks.items()) if s.moved is False)

    @property
    def moved(self) -> tuple[int, ...]:
        return tuple(r for r, (_, s) in sorted(self.ranks.items()) if s.moved is True)

    @property
    def working(self) -> bool:
        """Whether the stacks of more than half the ranks looked at twice moved between the looks."""
        return 2 * len(self.moved) > len(self.moved) + len(self.unmoved)

    def working_text(self) -> str:
        """Why the job looks at work, for ``on_hang: restart``'s refusal."""
        moved = _ranks(self.moved)
        return f"the stacks of {moved} moved between the looks: the job works without writing ({_SILENT_FIX})"

    def _where(self, ranks: tuple[int, ...]) -> str:
        """Where these ranks are: each of their groups' headline."""
        return "; ".join(f"{g.headline}" + (" (stopped)" if g.stopped else "")
                         + ("" if set(g.ranks) <= set(ranks) else f" ({_ranks(g.ranks)})")
                         for g in self.view.groups if set(g.ranks) & set(ranks))

    def summary(self) -> str:
        """One line: the ranks to look at and why, ``rank 7 elsewhere: __next__ at data.py:88 (the
        others: barrier in step at train.py:42) · busy: rank 7 · stacks unmoved: ranks 0-15``."""
        parts = []
        away = self.elsewhere
        if self.working:
            parts.append(f"stacks moved: {_ranks(self.moved)} (the job may be working without writing: {_SILENT_FIX})")
        elif away:
            others = tuple(r for g in self.view.groups for r in g.ranks if r not in away)
            parts.append(f"{_ranks(away)} elsewhere: {self._where(away)} (the others: {self._where(others)})")
        elif self.view.groups:
            parts.append(self.view.summary())
        if self.busy or self.idle:
            parts.append(f"busy: {_ranks(self.busy) if self.busy else 'none'}")
        if any(s.moved is not None for _, s in self.ranks.values()):
            parts.append(f"stacks unmoved: {_ranks(self.unmoved) if self.unmoved else 'none'}")
        if not self.view.groups:
            parts.append("no stacks: " + (self.view.problems[0].error if self.view.problems else "no rank runs"))
        return " · ".join(parts)

    def render(self) -> list[str]:
        """The report as lines: what hung and the summary, each rank's looks, then the grouped
        stacks and what could not be looked at, as ``clusterrun stack`` shows them."""
        lines = [f"hung since {iso(self.since)}: no rank wrote anything for {self.silent:.0f} s",
                 f"each rank looked at twice, {self.apart:g} s apart: {self.summary()}", ""]
        if self.busy or self.idle:
            lines.append(f"busy (running or runnable at least {BUSY:.0%} of the time between the looks): "
                         f"{_ranks(self.busy) if self.busy else 'none'}; idle: "
                         f"{_ranks(self.idle) if self.idle else 'none'}")
        if self.elsewhere:
            lines.append(f"elsewhere (not where the others wait): {_ranks(self.elsewhere)}")
        rows = [("RANK", "NODE", "HOST", "CPU", "RUNNABLE", "STATE", "STACKS")]
        for rank, (node, s) in sorted(self.ranks.items()):
            moved = {None: "-", True: "moved", False: "did not move"}[s.moved]
            rows.append((str(rank), str(node), self.view.hosts.get(node, "?"), _share(s.cpu), _share(s.runnable),
                         s.state or "-", s.error or moved))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines += ["", *("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)]
        return [*lines, "", *render(self.view)]


__all__ = ["BUSY", "HangReport", "busyness", "elsewhere", "in_collective"]
