"""The plain CLI consumer: every node's lines on stdout with a node prefix, status on stderr.

A line is printed whole, in one write, so lines of different nodes never split or interleave.
On a terminal each node's prefix gets its own colour. Lines that torchrun tagged with a global
rank (``[rank3]:``) show that rank in the prefix: ``node1 gpu-b rank3 | text``.

Text from the hosts is made terminal-safe (``terminal.safe``): colours (SGR) pass when colour is
on, and dropped when it is off (not a terminal, ``NO_COLOR``, ``TERM=dumb``); every other escape
sequence and control character is shown escaped. Only ``raw`` output (``logs --node N``) is
written as the node wrote it, byte for byte.

Past ``nodesets.FOLD_PAST`` nodes the per-node status lines (started, a state, unreachable, a
stop's report) are held until their phase is over — every node has a line, a note or
the summary comes, or ``hold`` seconds passed — and then nodes alike share one line
(``alike_lines``); the odd ones keep theirs. Log lines are never held.

The words other consumers share are here too: a stop's report (``stop_text`` and its parts:
``down``, the dashboard, the web page say it alike), lines of nodes alike (the sync's too) and
``up``'s network line.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, TextIO

from clusterrun.config.nodesets import FOLD_PAST, fold, fold_ranks
from clusterrun.core import timings
from clusterrun.core.events import (
    AttemptRestarting,
    AttemptTimed,
    Event,
    JobFinished,
    JobHung,
    JobNote,
    JobResult,
    LogLines,
    NodeDegraded,
    NodeLink,
    NodeResult,
    NodeStarted,
    NodeState,
    NodeStateChanged,
    NodeStopped,
    ProgressChanged,
    RankFailed,
    StopReport,
    hung_text,
    signal_name,
    stopped_after_text,
    unreachable_text,
)
from clusterrun.core.progress import Progress
from clusterrun.core.terminal import safe, wants_colour
from clusterrun.diagnose.rootcause import split_rank
from clusterrun.run.plan import LaunchPlan

if TYPE_CHECKING:  # the network line's, as `up` shows it
    from clusterrun.run.interfaces import Interface

_COLOURS = (36, 33, 35, 32, 34, 31, 96, 93, 95, 92, 94, 91)
_QUIET_STATES = {NodeState.PENDING, NodeState.CONNECTING, NodeState.STARTING, NodeState.RUNNING,
                 NodeState.SUCCEEDED, NodeState.STOPPED}


def only_ranks(text: str, ranks: frozenset[int]) -> str:
    """The lines of ``text`` tagged ``[rankN]:`` with N in ``ranks`` (torchrun's own lines dropped)."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if line.startswith("[rank") and split_rank(line)[0] in ranks)


def node_end_text(node: NodeResult) -> str:
    """How a node ended, as the summary says it: ``failed (exit code 1)``."""
    if node.stopped_after is not None:  # why it was stopped, not how torchrun ended (our SIGTERM)
        return stopped_after_text(node.stopped_after)
    if node.stopped_by is not None:  # a stop from elsewhere (a viewer's, `down`'s): who, as its host said
        return f"stopped by {node.stopped_by}"
    if node.exit_code is not None:
        how = f"exit code {node.exit_code}"
        if node.signal:
            how = f"killed by {signal_name(node.signal)}"
        elif node.error and node.error.startswith(f"{how}: "):  # learned from its ranks' ends: how
            how = node.error
    else:
        how = node.error or ""
    return node.state.value + (f" ({how})" if how else "")


def alike_lines(items: Sequence[tuple[int, str, str | None, str]], total: int) -> list[str]:
    """Status lines of a job of ``total`` nodes from ``(rank, host, alike, own)`` items: ``own``
    is what one node's line says (``node3 gpu04: own``), ``alike`` the same without what is that
    node's only (a pid), by which nodes are grouped (None: never grouped). Up to ``FOLD_PAST``
    nodes a line per item; past it a line per group, in the order of its first item, a group of
    one as its own line: ``64 nodes 0-63 (gpu[01-64]): alike``. Every item is in exactly one line."""
    if total <= FOLD_PAST:
        return [f"node{rank} {host}: {own}" for rank, host, _, own in items]
    groups: dict[object, list[tuple[int, str, str | None, str]]] = {}
    for i, item in enumerate(items):
        groups.setdefault(item[2] if item[2] is not None else i, []).append(item)
    lines = []
    for alike, group in groups.items():
        if len(group) == 1 or not isinstance(alike, str):
            rank, host, _, own = group[0]
            lines.append(f"node{rank} {host}: {own}")
            continue
        ranks = [rank for rank, *_ in group]
        lines.append(f"{len(set(ranks))} {fold_ranks(ranks)} ({fold([host for _, host, *_ in group])}): {alike}")
    return lines


def network_text(plan: LaunchPlan, interfaces: Sequence[Interface]) -> str | None:
    """``network: node0 gpu-a eth1, node1 gpu-b eth1``: the interface each node's ranks use, when
    clusterrun chose one (not on a job whose nodes all share this machine's loopback)."""
    if not any(i.name for i in interfaces):
        return None
    if plan.nnodes > FOLD_PAST:  # nodes alike share a part: ``64 nodes 0-63 (gpu[01-64]): eth0``
        return "network: " + "; ".join(alike_lines([(n.rank, n.host.host, i.name or "loopback", i.name or "loopback")
                                                    for n, i in zip(plan.nodes, interfaces, strict=True)], plan.nnodes))
    return "network: " + ", ".join(f"node{n.rank} {n.host.host} {i.name or 'loopback'}"
                                   for n, i in zip(plan.nodes, interfaces, strict=True))


# How a stop is said: here, by ``down``, the dashboard and the web page alike.

def not_stopped_text(job_id: str, nodes: Iterable[tuple[int, str]]) -> str:
    """What ``down`` and the printer's summary say of a stop that could not reach some nodes'
    hosts (``(rank, host)``): the job is not known to have stopped there."""
    which = ", ".join(f"node {rank} ({host})" for rank, host in nodes)
    return f"job {job_id} is NOT marked stopped: {which} could not be stopped (see above); it may still run there"


def killed_text(report: StopReport, with_pids: bool = True) -> str:
    """``torchrun (pid 58)``, ``torchrun (pid 58) and 2 other processes``, or ``nothing was running``;
    without pids (``with_pids=False``) what nodes alike share: ``torchrun and 2 other processes``."""
    if not report.killed:
        return "nothing was running"
    first = next((k for k in report.killed if k.get("pid") == report.torchrun_pid), report.killed[0])
    name = "torchrun" if first.get("pid") == report.torchrun_pid else str(first.get("name"))
    text = f"{name} (pid {first.get('pid')})" if with_pids else name
    others = len(report.killed) - 1
    return text + (f" and {others} other process{'es' if others > 1 else ''}" if others else "")


def stop_text(report: StopReport) -> str:
    """One line: what was stopped on the node and whether anything is left."""
    return f"node{report.node} {report.host}: {stop_outcome(report, killed_text(report))}"


def stop_alike(report: StopReport) -> str | None:
    """``stop_text`` without the node and its pids, which nodes whose stop went alike share
    (``alike_lines``; hosts without a cgroup apart, and named so); None for a stop that failed or
    left a process: its own line."""
    if report.error or report.left:
        return None
    return stop_outcome(report, killed_text(report, with_pids=False)) + (
        " (no cgroup)" if report.containment == "sweep" else "")


def stop_outcome(report: StopReport, killed: str) -> str:
    """What the stop did (``killed``: the processes it stopped, in words) and whether anything of
    the job is left: ``stopped torchrun (pid 58); nothing left (verified by cgroup)``. How far
    "nothing left" goes without a cgroup is said once per command (``stop_caveat``), not on every line."""
    if report.error:
        return f"could not be stopped: {report.error}"
    # Nothing killed: the node had ended before the stop came (it was not stopped by it).
    stopped = f"stopped {killed}" if report.killed else "nothing was running"
    if report.records_gone:  # never "nothing was running" without saying where it looked
        if not report.killed and not report.left and not report.found_by:
            return ("no records of the attempt on the host (never started, or deleted) and nothing "
                    f"of it runs: looked for {' and '.join(report.looked) or 'its cgroup and its marker'}")
        stopped += f" (its records on the host were gone; found by: {'; '.join(report.found_by)})"
    if report.at_once and report.killed:
        stopped += " at once (SIGKILL, the attempt had failed)"
    if report.grace_ran_out:
        grace = f"the {report.grace:g} s grace" if report.grace is not None else "the grace"
        stopped += f"; torchrun outlived {grace} after SIGTERM: SIGKILLed"
    if report.left:
        left = ", ".join(f"{p.get('name')}[{p.get('pid')}] state {p.get('state')}" for p in report.left)
        return f"{stopped}; STILL RUNNING: {left}"
    if report.containment == "reboot":
        return f"{stopped}; the host rebooted since the job started: nothing of it runs"
    if report.containment == "cgroup" and report.verified:
        return f"{stopped}; nothing left (verified by cgroup)"
    if report.containment in ("cgroup", "sweep"):
        return f"{stopped}; nothing left"
    return f"{stopped}; no process of the job was found"


def stop_caveat(report: StopReport) -> str | None:
    """What "nothing left" means where the host had no cgroup for the attempt (None where a
    cgroup verified it): said once per command, after the first such host's line."""
    if not report.ok or report.containment != "sweep":
        return None
    why = [f.removeprefix("no cgroup: ") for f in report.fallbacks if f.startswith("no cgroup")]
    return (f"no cgroup on {report.host}{f' ({why[0]})' if why else ''}: \"nothing left\" there is of what could "
            "be seen; processes that left the job's tree, session and environment could not be seen")


def stop_remarks(report: StopReport) -> list[str]:
    """Further lines of a stop, only where the host failed at something: what it could not write."""
    where = f"node{report.node} {report.host}"
    degraded = [f"{where}: degraded: {report.degraded}"] if report.degraded else []
    return degraded + [f"{where}: {note}" for note in report.notes]


class Printer:
    """Turns events into text. ``__call__`` is the orchestrator's ``emit``."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None, colour: bool | None = None,
                 prefix: bool = True, quiet: bool = False, raw: bool = False,
                 ranks: Collection[int] | None = None, hold: float = 2.0, nnodes: int = 0) -> None:
        self.out = out or sys.stdout
        self.ranks = None if ranks is None else frozenset(ranks)  # only these ranks' lines (``logs --rank``)
        self.err = err or sys.stderr
        self.colour = wants_colour(self.out) if colour is None else colour
        self.prefix = prefix and not raw  # False: no node prefix
        self.raw = raw  # True: log data exactly as the node wrote it (no prefix, nothing escaped or added)
        self.quiet = quiet  # True: log lines only, no status
        self._prefix_width = 0
        self._hosts: dict[int, str] = {}
        self._prefixes: dict[tuple[int, str, int | None], str] = {}  # a spare in a node's place: another host
        self._tags: dict[int, list[tuple[str, int]]] = {}  # node → its ranks' line tags, "[rank3]:"
        self.hold = hold  # the longest a held status line waits for the rest of its phase (seconds)
        self._nnodes = nnodes  # the job's nodes (``set_plan`` sets it): past FOLD_PAST status lines fold
        self._lock = threading.RLock()  # events come from the orchestrator's threads
        # The held status lines: (rank, host, alike, own, remarks), see ``_status``.
        self._held: list[tuple[int, str, str | None, str, list[str]]] = []
        self._timer: threading.Timer | None = None
        self.progress: Progress | None = None  # the training's, last read: in the summary
        self._said: dict[int, str] = {}  # node → the state the stream said last (see ``summary``)
        self._caveat_said = False  # what "nothing left" means without a cgroup: once per command
        self._restart_said: int | None = None  # the failed attempt whose restart was announced (once, with its time)

    def set_plan(self, plan: LaunchPlan) -> None:
        self._hosts = {n.rank: n.host.host for n in plan.nodes}
        self._tags = {n.rank: [(f"[rank{r}]:", r) for r in n.ranks] for n in plan.nodes}
        width_rank = len(f"rank{max(plan.world_size - 1, 0)}")
        self._prefix_width = max(len(f"node{n.rank} {n.host.host}") for n in plan.nodes) + 1 + width_rank
        self._prefixes.clear()
        self._nnodes = len(plan.nodes)

    def _prefix(self, node: int, host: str, rank: int | None) -> str:
        key = (node, host, rank)
        found = self._prefixes.get(key)
        if found is None:
            found = self._prefixes[key] = self._make_prefix(node, host, rank)
        return found

    def _make_prefix(self, node: int, host: str, rank: int | None) -> str:
        text = f"node{node} {host}" + (f" rank{rank}" if rank is not None else "")
        text = text.ljust(self._prefix_width)
        if self.colour:
            return f"\x1b[{_COLOURS[node % len(_COLOURS)]}m{text}\x1b[0m"
        return text

    def write_log(self, node: int, host: str, text: str, count: int | None = None) -> None:
        """Print a chunk of node ``node``'s log: whole lines, made terminal-safe (a missing last
        newline is added); with ``raw``, the chunk as it is. ``count``: its lines, where the caller
        knows it (a pass over the chunk saved)."""
        if self.ranks is not None:
            text, count = only_ranks(text, self.ranks), None
        if not text:
            return
        if not self.raw:
            if not text.endswith("\n"):
                text += "\n"
            text = safe(text, self.colour)
            if self.prefix:
                head, text, skip = self._prefix_parts(node, host, text, count)
                self._write_out(text, head, skip)
                return
        self._write_out(text)

    def _write_out(self, text: str, head: str = "", skip: int = 0) -> None:
        """Write ``head`` and ``text`` from its ``skip``-th character (one write; no copy of
        ``text`` made to join them) to ``out`` whole. Into a real file the bytes go through
        ``os.writev`` in a loop: CPython's buffered stdout drops the rest of a large write that a
        signal interrupts part-way (Ctrl-C while a slow reader holds the pipe), and the offsets
        counted it as shown."""
        self.out.flush()  # whatever was written to it otherwise goes first
        encoding, errors = getattr(self.out, "encoding", None) or "utf-8", getattr(self.out, "errors", None) or "strict"
        try:
            fd = self.out.fileno()
        except (OSError, ValueError):  # not a file (a test's StringIO, pytest's capture)
            fd = -1
        if fd < 0 or "".encode(encoding):  # UTF-16 or -32: only the stream knows its byte-order mark went out
            self.out.write(head + text[skip:])
            self.out.flush()
            return
        skipped = len(text[:skip].encode(encoding, errors))
        views = [memoryview(head.encode(encoding, errors)), memoryview(text.encode(encoding, errors))[skipped:]]
        views = [view for view in views if view]
        while views:
            written = os.writev(fd, views)
            while views and written >= len(views[0]):
                written -= len(views.pop(0))
            if views:
                views[0] = views[0][written:]

    def _prefix_parts(self, node: int, host: str, chunk: str, count: int | None = None) -> tuple[str, str, int]:
        """``chunk`` (whole lines; ``count`` of them, if known) with their prefixes, as ``head``
        followed by ``text`` from its ``skip``-th character. Done on the whole chunk with ``str``
        methods (C speed) when every tagged line carries a tag of this node's ranks; line by line
        otherwise (e.g. torch's doubled tag on a traceback, which ``split_rank`` drops)."""
        tags = self._tags.get(node)
        if tags and chunk.startswith("[rank"):  # every line of one rank (one process per node): 2 passes
            for tag, tag_rank in tags:
                if chunk.startswith(tag):
                    mine = self._prefix(node, host, tag_rank) + " | "
                    # Each tag after a newline replaced lengthens the chunk alike (``mine`` is longer than any
                    # tag): every line but the first was one when it grew by that for each newline but the last.
                    whole = chunk.replace("\n" + tag, "\n" + mine)
                    lines = chunk.count("\n") if count is None else count
                    if (len(mine) > len(tag) and len(whole) - len(chunk) == (lines - 1) * (len(mine) - len(tag))
                            and tag + tag not in chunk):
                        return mine, whole, len(tag)  # the first line's tag is skipped, not cut off by a copy
                    break
        return "", self._prefixed_slowly(node, host, tags, chunk), 0

    def _prefixed_slowly(self, node: int, host: str, tags: list[tuple[str, int]] | None, chunk: str) -> str:
        """``chunk`` prefixed where its lines are of several ranks, or some of none."""
        text = chunk[:-1]
        head = self._prefix(node, host, None) + " | "
        if tags is not None and head not in text:
            tagged = text.count("\n[rank") + text.startswith("[rank")
            present = [(tag, rank) for tag, rank in tags if tag in text]
            if tagged == sum(text.count("\n" + tag) + text.startswith(tag) for tag, _ in present) and not any(
                    tag + tag in text for tag, _ in present):
                whole = head + text.replace("\n", "\n" + head) + "\n"
                for tag, tag_rank in present:  # head is now exactly at every line's start
                    whole = whole.replace(head + tag, self._prefix(node, host, tag_rank) + " | ")
                return whole
        out = []
        for line in text.split("\n"):
            rank, rest = split_rank(line)
            out.append(f"{self._prefix(node, host, rank)} | {rest}\n")
        return "".join(out)

    def note(self, text: str) -> None:
        with self._lock:
            self.flush()
            self._note(text)

    def _note(self, text: str) -> None:
        self.err.write(f"clusterrun: {safe(text, colour=False)}\n")
        self.err.flush()

    def _status(self, rank: int, host: str, own: str, alike: str | None, remarks: Sequence[str] = (),
                urgent: bool = False) -> None:
        """One node's status line (``own``; ``alike``: what nodes alike share, None: never shared)
        and ``remarks`` after it: printed now up to ``FOLD_PAST`` nodes or when ``urgent`` (a
        failure: never held, nor does it end the others' hold), else held until every node has a
        line, a note or the summary comes, or ``hold`` seconds passed."""
        with self._lock:
            if self._nnodes <= FOLD_PAST or urgent:
                if not urgent:
                    self.flush()
                self._note(f"node{rank} {host}: {own}")
                for line in remarks:
                    self._note(line)
                return
            self._held.append((rank, host, alike, own, list(remarks)))
            if len({item[0] for item in self._held}) >= self._nnodes:
                self.flush()
            elif self._timer is None:
                self._timer = threading.Timer(self.hold, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Print the held status lines, nodes alike on one line, then their remarks."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            held, self._held = self._held, []
            for line in alike_lines([item[:4] for item in held], self._nnodes):
                self._note(line)
            for item in held:
                for line in item[4]:
                    self._note(line)

    def __call__(self, event: Event) -> None:
        if isinstance(event, LogLines):
            if event.lines:
                self.write_log(event.node if event.node is not None else -1, event.host,
                               "\n".join(event.lines) + "\n" if event.text is None else event.text, len(event.lines))
            if event.earlier:
                self.note(f"node{event.node} {event.host}: resumed here; the lines above were shown before")
        elif self.quiet:
            return
        elif isinstance(event, NodeStarted):
            started = f"started attempt {event.attempt}"
            self._said.pop(event.node or 0, None)
            self._status(event.node or 0, event.host, f"{started} (torchrun pid {event.pid})", started)
        elif isinstance(event, NodeStateChanged):
            if event.state not in _QUIET_STATES:
                state = event.state.value + (f" ({event.detail})" if event.detail else "")
                self._said[event.node or 0] = state
                self._status(event.node or 0, event.host, state, state,
                             urgent=event.state in (NodeState.FAILED, NodeState.LOST))
        elif isinstance(event, RankFailed):
            code = event.exit_code
            how = f"killed by {signal_name(-code)}" if code < 0 else f"exit code {code}"
            who = f"rank {event.rank}" if event.rank is not None else "a rank"
            self._status(event.node or 0, event.host, f"failing ({who}: {how}); torchrun ends", None, urgent=True)
        elif isinstance(event, NodeLink):
            rank, host = event.node or 0, event.host
            if event.up:
                back = "reconnected; the log continues where it stopped"
                self._status(rank, host, back, back)
            else:
                now = time.time()
                since = unreachable_text(event.since if event.since is not None else now, now)
                runs_on = f" ({event.detail}); the job runs on there as far as anybody knows; reconnecting"
                self._status(rank, host, since + runs_on, "unreachable" + runs_on)  # alike: no time
        elif isinstance(event, NodeStopped):
            self.report(event.report)
        elif isinstance(event, NodeDegraded):
            degraded = f"degraded: {event.reason}"
            self._status(event.node or 0, event.host, degraded, degraded)
        elif isinstance(event, JobHung):
            now = time.time()
            self.note("a rank wrote again: the job is running" if event.since is None else
                      f"the job is {hung_text(event.since, now)}: no rank wrote anything for "
                      f"{now - event.since:.0f} s")
        elif isinstance(event, ProgressChanged):
            self.progress = event.progress  # the stream shows rank 0's own lines; the summary sums them up
        elif isinstance(event, JobNote):
            self.note(event.text)
        elif isinstance(event, AttemptRestarting):
            if self._restart_said != event.failed:  # the owner emits it again as it counts down
                self._restart_said = event.failed
                self.note(event.describe())
        elif isinstance(event, AttemptTimed):
            if timings.enabled():  # `up --timings`: how each attempt came to run, the restarts' from the failure
                self.note(f"timings: attempt {event.attempt}: {timings.phases_text(dict(event.phases), event.began)}")
        elif isinstance(event, JobFinished):
            self.summary(event.result, restarting=event.restarting)

    def report(self, report: StopReport) -> None:
        """What a stop did on one node, whether anything is left, and what the host could not record;
        after the first host without a cgroup, once, how far its "nothing left" goes."""
        remarks = stop_remarks(report)
        caveat = None if self._caveat_said else stop_caveat(report)
        if caveat is not None:
            self._caveat_said = True
            remarks.append(caveat)
        if report.failed and report.ok:  # its own line says it: "failed (...; torchrun was stopped at once after it)"
            for line in remarks:
                self.note(line)
            return
        self._status(report.node, report.host, stop_outcome(report, killed_text(report)), stop_alike(report), remarks)

    def reports(self, reports: Sequence[StopReport], nnodes: int) -> None:
        """Every node's stop report of a job of ``nnodes`` nodes (``down``), nodes alike on one line."""
        with self._lock:
            self.flush()
            nodes, self._nnodes = self._nnodes, nnodes
            for report in reports:
                self.report(report)
            self.flush()
            self._nnodes = nodes

    def summary(self, result: JobResult, restarting: bool = False) -> None:
        """How each node and the job ended; ``restarting``: only an attempt ended (its owner's
        ``AttemptRestarting`` line follows), so no "job ... FAILED"."""
        self.flush()
        # An attempt the job goes on from: a node's end the stream said is not said again (the job's
        # end lists every node, the one account of it)
        ends = [(node.node, node.host, end, end) for node in result.nodes for end in [node_end_text(node)]
                if not (restarting and self._said.get(node.node) == end)]
        for line in alike_lines(ends, len(result.nodes)):
            self.note(line)
        if self.progress is not None and not restarting:
            self.note("progress: " + replace(self.progress, eta_seconds=None).text())
        cause = result.root_cause
        if result.ok:
            self.note(f"job {result.job_id} succeeded")
            return
        unreached = [(n.node, n.host) for n in result.nodes if n.state is NodeState.UNREACHABLE]
        if restarting:
            pass  # the job goes on
        elif result.stopped and unreached:  # as `down` says it
            self.note(not_stopped_text(result.job_id, unreached))
        elif result.stopped:
            self.note(f"job {result.job_id} stopped" + (f" ({result.interrupted})" if result.interrupted else ""))
        else:
            self.note(f"job {result.job_id} FAILED")
        if cause is not None and not result.stopped:
            self.note(f"root cause: {cause.describe()}")
            for line in cause.explanation.lines() if cause.explanation else ():
                self.note(line)
            if cause.last_lines:
                who = f"rank {cause.rank}" if cause.rank is not None else f"node {cause.node}"
                self.err.write(f"clusterrun: last lines of {who}:\n")
                self.err.write("".join(f"    {safe(line, colour=False)}\n" for line in cause.last_lines))
                self.err.flush()
