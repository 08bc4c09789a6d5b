"""Every rank's Python stack, grouped: identical stacks shown once with their ranks.

Pure: from the nodes' ``stack`` answers (``agent.wire.StackAnswer``, or the error that kept a
host away) to ``StackView``, its groups and what could not be looked at, and its text
(``render``: a summary line as ``ranks 0-6,8-15: all_reduce in step at train.py:42 · rank 7:
__next__ at dataset.py:88``, then each group's frames). ``clusterrun stack`` and the dashboard's ``s``
show the same text (``stack --json``: ``view_json``, docs/json.md); ``lifecycle.stacks_view``
asks the hosts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import field
from typing import Any

from clusterrun.agent.wire import STOPPED, Frame, RankStack, StackAnswer, ThreadStack
from clusterrun.core.errors import ClusterrunError, TransportError
from clusterrun.core.frozen import frozen
from clusterrun.core.ranges import ranges_text

# A rank's stacks as compared: per thread its name and its frames (function, file, line).
Signature = tuple[tuple[str | None, tuple[tuple[str, str, int | None], ...]], ...]


def fold_ranks(ranks: Iterable[int]) -> str:
    """``0-6,8-15`` for 0..6 and 8..15 (ClusterShell's range syntax), each rank once, sorted."""
    return ranges_text(ranks)


def parse_ranks(text: str) -> list[int]:
    """The ranks of ``0,4-7`` (``ValueError`` naming the part that is not a rank or a range)."""
    ranks: list[int] = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not a rank or a range of ranks (0,4-7)") from None
        if first < 0 or last < first:
            raise ValueError(f"{part.strip()!r} is not a rank or a range of ranks (0,4-7)")
        ranks.extend(range(first, last + 1))
    return sorted(set(ranks))


def _ranks_text(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {fold_ranks(ranks)}"


@frozen
class StackGroup:
    """Ranks whose stacks are identical (every thread, every frame and line)."""

    ranks: tuple[int, ...]
    threads: tuple[ThreadStack, ...]
    nodes: tuple[int, ...]
    stopped: bool = False  # their processes are stopped (SIGSTOP, Ctrl-Z, a debugger): they go on only when continued
    pids: tuple[int, ...] = ()  # of a stopped group: its processes, on their hosts

    @property
    def headline(self) -> str:
        """Where the main thread (else the first) is: its innermost frame, ``load at data.py:88``,
        or inside a library the call and the job's frame that made it, ``barrier in step at train.py:42``."""
        thread = next((t for t in self.threads if t.name == "MainThread"), self.threads[0] if self.threads else None)
        if thread is None or not thread.frames:
            return "no Python frames"
        inner = thread.frames[0]
        caller = next((f for f in thread.frames if not f.lib), None) if inner.lib else None
        return f"{inner.name} in {_where(caller)}" if caller is not None else _where(inner)


@frozen
class Problem:
    """What could not be looked at: ranks (or a whole node, ``ranks`` empty) with the reason and fix."""

    nodes: tuple[int, ...]
    ranks: tuple[int, ...]
    error: str
    fix: str | None = None


@frozen
class StackView:
    groups: tuple[StackGroup, ...]
    problems: tuple[Problem, ...] = ()
    idle: tuple[tuple[int, str], ...] = ()  # nodes that run no attempt here: (node, its state)
    unreachable: bool = False  # a host could not be reached (not: its agent answered an error)
    hosts: Mapping[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every rank asked for was looked at."""
        return bool(self.groups) and not self.problems and not self.idle

    def summary(self) -> str:
        return " · ".join(f"{_ranks_text(g.ranks)}: {g.headline}" + (" (stopped)" if g.stopped else "")
                          for g in self.groups)


def _where(frame: Frame) -> str:
    return f"{frame.name} at {frame.file}" + (f":{frame.line}" if frame.line is not None else "")


def signature(stack: RankStack) -> Signature:
    """What two ranks must share to be one group: their threads (in any order) and every frame."""
    threads = ((t.name, tuple((f.name, f.file, f.line) for f in t.frames)) for t in stack.threads)
    return tuple(sorted(threads, key=repr))


def group(answers: Mapping[int, StackAnswer | ClusterrunError], hosts: Mapping[int, str]) -> StackView:
    """The nodes' answers as groups of identical stacks, and what could not be looked at."""
    by_signature: dict[tuple[Signature, bool], list[tuple[int, RankStack]]] = {}
    by_problem: dict[tuple[str, str | None], list[tuple[int, int | None]]] = {}
    idle: list[tuple[int, str]] = []
    unreachable = False
    for node, answer in sorted(answers.items()):
        if isinstance(answer, ClusterrunError):
            unreachable |= isinstance(answer, TransportError)
            by_problem.setdefault((answer.render(), None), []).append((node, None))
            continue
        if answer.error:
            by_problem.setdefault((answer.error, answer.fix), []).append((node, None))
            continue
        if answer.state not in ("starting", "running"):
            idle.append((node, answer.state))
            continue
        if not answer.ranks:
            by_problem.setdefault(("no rank of it runs now: torchrun is starting (or restarting) its workers",
                                   "try again in a moment"), []).append((node, None))
        for stack in answer.ranks:
            if stack.error:
                by_problem.setdefault((stack.error, stack.fix), []).append((node, stack.rank))
            else:
                by_signature.setdefault((signature(stack), stack.state in STOPPED), []).append((node, stack))
    groups = []
    for (_, stopped), same in by_signature.items():
        same.sort(key=lambda member: member[1].rank)
        groups.append(StackGroup(ranks=tuple(s.rank for _, s in same), threads=tuple(same[0][1].threads),
                                 nodes=tuple(sorted({n for n, _ in same})), stopped=stopped,
                                 pids=tuple(s.pid for _, s in same) if stopped else ()))
    problems = [Problem(nodes=tuple(sorted({n for n, _ in members})),
                        ranks=tuple(sorted(r for _, r in members if r is not None)), error=error, fix=fix)
                for (error, fix), members in by_problem.items()]
    return StackView(groups=tuple(sorted(groups, key=lambda g: g.ranks)),
                     problems=tuple(sorted(problems, key=lambda p: (p.ranks[:1], p.nodes))),
                     idle=tuple(idle), unreachable=unreachable, hosts=dict(hosts))


def _nodes_text(view: StackView, nodes: Sequence[int]) -> str:
    if len(nodes) == 1:
        return f"node {nodes[0]} {view.hosts.get(nodes[0], '?')}"
    return f"nodes {fold_ranks(nodes)}"


def render(view: StackView) -> list[str]:
    """The view as lines: the summary, then each group's threads and frames (innermost first, as
    py-spy prints them), then what could not be looked at with its fix."""
    lines = [view.summary()] if view.groups else []
    for g in view.groups:
        lines += ["", f"{_ranks_text(g.ranks)} ({_nodes_text(view, g.nodes)}):"]
        if g.stopped:
            one = len(g.ranks) == 1
            lines.append(f"  stopped (a SIGSTOP, Ctrl-Z or a debugger holds {'it' if one else 'them'}): the ranks that "
                         f"wait for {'it' if one else 'them'} wait until `kill -CONT {' '.join(map(str, g.pids))}` "
                         f"on {view.hosts.get(g.nodes[0], 'its host') if one else 'their hosts'}")
        for thread in g.threads:
            lines.append(f"  Thread {thread.name or '?'}" + (" (active)" if thread.active else ""))
            lines += [f"    {f.name} ({f.file}" + (f":{f.line})" if f.line is not None else ")") for f in thread.frames]
    if view.problems or view.idle:
        lines.append("")
    for p in view.problems:
        who = f"{_ranks_text(p.ranks)} ({_nodes_text(view, p.nodes)})" if p.ranks else _nodes_text(view, p.nodes)
        lines.append(f"{who}: {p.error}")
        if p.fix:
            lines.append(f"  fix: {p.fix}")
    for node, state in view.idle:
        lines.append(f"{_nodes_text(view, [node])}: not running ({state}): no stacks to take")
    return lines


def view_json(view: StackView, job: str, attempt: int) -> dict[str, Any]:
    """``stack --json`` (schema 1, docs/json.md)."""
    return {
        "schema": 1, "job": job, "attempt": attempt, "summary": view.summary(),
        "groups": [{"ranks": list(g.ranks), "nodes": list(g.nodes), "where": g.headline,
                    "threads": [t.to_json() for t in g.threads], "stopped": g.stopped, "pids": list(g.pids)}
                   for g in view.groups],
        "problems": [{"ranks": list(p.ranks), "nodes": list(p.nodes), "error": p.error, "fix": p.fix}
                     for p in view.problems],
        "idle": [{"node": node, "state": state} for node, state in view.idle],
    }
