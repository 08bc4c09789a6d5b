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
(``nodesets.alike_lines``); the odd ones keep theirs. Log lines are never held.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import TextIO

from clusterrun.config.nodesets import FOLD_PAST, alike_lines
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
    not_stopped_text,
    signal_name,
    stopped_after_text,
    unreachable_text,
)
from clusterrun.core.progress import Progress
from clusterrun.core.terminal import safe, wants_colour
from clusterrun.diagnose.rootcause import split_rank
from clusterrun.run.plan import LaunchPlan

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
    if node.exit_code is not None:
        how = f"exit code {node.exit_code}"
        if node.signal:
            how = f"killed by {signal_name(node.signal)}"
        elif node.error and node.error.startswith(f"{how}: "):  # learned from its ranks' ends: how
            how = node.error
    else:
        how = node.error or ""
    return node.state.value + (f" ({how})" if how else "")


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

    def write_log(self, node: int, host: str, text: str) -> None:
        """Print a chunk of node ``node``'s log: whole lines, made terminal-safe (a missing last
        newline is added); with ``raw``, the chunk as it is."""
        if self.ranks is not None:
            text = only_ranks(text, self.ranks)
        if not text:
            return
        if not self.raw:
            if not text.endswith("\n"):
                text += "\n"
            text = safe(text, self.colour)
            if self.prefix:
                text = self._prefixed(node, host, text)
        self._write_out(text)

    def _write_out(self, text: str) -> None:
        """Write ``text`` to ``out`` whole. Into a real file its bytes go through ``os.write`` in a
        loop: CPython's buffered stdout drops the rest of a large write that a signal interrupts
        part-way (Ctrl-C while a slow reader holds the pipe), and the offsets counted it as shown."""
        self.out.flush()  # whatever was written to it otherwise goes first
        try:
            fd = self.out.fileno()
        except (OSError, ValueError):  # not a file (a test's StringIO, pytest's capture)
            self.out.write(text)
            self.out.flush()
            return
        view = memoryview(text.encode(self.out.encoding or "utf-8", self.out.errors or "strict"))
        while view:
            view = view[os.write(fd, view):]

    def _prefixed(self, node: int, host: str, chunk: str) -> str:
        """``chunk`` (whole lines) with their prefixes. Done on the whole chunk with ``str``
        methods (C speed) when every tagged line carries a tag of this node's ranks; line by line
        otherwise (e.g. torch's doubled tag on a traceback, which ``split_rank`` drops)."""
        text = chunk[:-1]
        tags = self._tags.get(node)
        if tags and text.startswith("[rank"):  # every line of one rank (one process per node): 4 passes
            for tag, tag_rank in tags:
                if text.startswith(tag) and text.count("\n" + tag) == text.count("\n") and tag + tag not in text:
                    mine = self._prefix(node, host, tag_rank) + " | "
                    return mine + text[len(tag):].replace("\n" + tag, "\n" + mine) + "\n"
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
                               "\n".join(event.lines) + "\n")
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
        remarks = report.remarks()
        caveat = None if self._caveat_said else report.caveat()
        if caveat is not None:
            self._caveat_said = True
            remarks.append(caveat)
        if report.failed and report.ok:  # its own line says it: "failed (...; torchrun was stopped at once after it)"
            for line in remarks:
                self.note(line)
            return
        self._status(report.node, report.host, report.outcome(report.killed_text()), report.alike(), remarks)

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
