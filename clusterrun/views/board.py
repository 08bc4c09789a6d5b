"""What a dashboard shows of a job, kept from the orchestrator's events: pure, no Textual.

``Board.apply(event)`` is called in the consumer's own thread (the dashboard drains a queue of
events every 50 ms). Per node it keeps the row of the node table and a ring of its last ``ring``
log lines; a merged ring holds every node's lines in arrival order. Rings are bounded: the full
logs stay on the hosts (``clusterrun logs``). The dashboard's log view reads the ring it shows by
reference (its ``lines``, and ``count`` to see what is new), so nothing is written into views
nobody looks at and switching views copies nothing. A viewer's scrollback (lines from before
where it resumed, ``LogLines(earlier=True)``) is followed by the ``RESUMED`` separator line.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from clusterrun.config.nodesets import fold_ranks
from clusterrun.core.errors import ClusterrunError
from clusterrun.core.events import (
    AttemptRestarting,
    AttemptStarted,
    Event,
    JobFinished,
    JobHung,
    JobNote,
    JobResult,
    JobState,
    LogLines,
    NodeDegraded,
    NodeExited,
    NodeGpus,
    NodeLink,
    NodeStarted,
    NodeState,
    NodeStateChanged,
    NodeStopped,
    ProgressChanged,
    RootCause,
    StopReport,
    hung_text,
    signal_name,
    unreachable_text,
)
from clusterrun.core.progress import POINTS, Progress
from clusterrun.diagnose.rootcause import undoubled
from clusterrun.views.gpus import only
from clusterrun.views.printer import stop_caveat, stop_text

RING = 10_000
LOSSES = POINTS  # losses kept for the dashboard's sparkline: the host's curve (else one per step read)
RESUMED = "---- resumed here: the lines above were shown before, new ones follow ----"


class Ring:
    """The last ``size`` lines, how many lines were ever added (``count``), and the length of the
    longest line ever added (``width``, in characters: a view's scroll width, never measured again)."""

    def __init__(self, size: int) -> None:
        self.lines: deque[str] = deque(maxlen=size)
        self.count = 0
        self.width = 0

    def extend(self, lines: tuple[str, ...] | list[str]) -> None:
        if lines:
            self.lines.extend(lines)
            self.count += len(lines)
            self.width = max(self.width, max(map(len, lines)))

    @property
    def first(self) -> int:
        """The number of the oldest line kept (0 for the first line ever added)."""
        return self.count - len(self.lines)


@dataclass
class NodeRow:
    rank: int
    host: str
    slots: str = ""  # "gpus 0,1" or "2 procs"
    nproc: int = 0
    state: NodeState = NodeState.PENDING
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    detail: str = ""
    reachable: bool = True
    unreachable_since: float | None = None  # wall clock: when its host was first found unreachable
    degraded: str | None = None  # why its supervisor cannot write its state on the host
    hung_since: float | None = None  # wall clock: since when no rank of the job wrote anything
    last_output: float | None = None
    gpus: NodeGpus | None = None  # its GPUs as last read (None: not yet)
    visible: tuple[str, ...] = ()  # its CUDA_VISIBLE_DEVICES: the host's GPUs that are the node's
    log: Ring = field(default_factory=lambda: Ring(RING))

    @property
    def unreachable(self) -> bool:
        """Its host cannot be reached and it had not ended: what it does is not known."""
        return not self.reachable and not self.state.is_terminal

    def status(self, now: float) -> str:
        """The state as the table shows it at wall-clock time ``now``: ``unreachable since
        16:04:05Z`` (``events.unreachable_text``), failed with its exit code, ..."""
        if self.unreachable:
            return unreachable_text(self.unreachable_since, now)
        if self.hung_since is not None and self.state is NodeState.RUNNING:
            return hung_text(self.hung_since, now)
        if self.state is NodeState.FAILED:
            if self.signal:
                return f"failed ({signal_name(self.signal)})"
            if self.exit_code is not None:
                return f"failed (exit {self.exit_code})"
        return self.state.value


class Board:
    """The state of one job as a dashboard shows it (see the module docstring)."""

    def __init__(self, ring: int = RING, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.ring = ring
        self.clock = clock
        self.wall = wall  # the wall clock of the times in a job's record (``AttemptStarted.started``)
        self.job_id = ""
        self.name = ""
        self.attempt = 0
        self.master = ""
        self.world_size = 0
        self.nodes: list[NodeRow] = []
        self.merged = Ring(ring)
        self.started = clock()
        self.ended: float | None = None
        self.result: JobResult | None = None
        self.first_failure: int | None = None  # the node that failed first, while the job runs
        self.stops: dict[int, StopReport] = {}
        self.notes: deque[str] = deque(maxlen=200)
        self.progress: Progress | None = None  # the training's, as node 0's host read it last
        self.losses: deque[float] = deque(maxlen=LOSSES)  # the loss at each step read: the sparkline
        self._caveat_noted = False  # what a stop's "nothing left" means without a cgroup, noted once
        self.restarting: AttemptRestarting | None = None  # the owner restarts the job: the countdown's latest
        self.restart_next = False  # the attempt ended and its owner restarts the job (its countdown follows)
        self.changed: set[int] = set()  # rows whose state changed: redraw them now
        self.gpus_shown = False  # some node's host has nvidia-smi: the table has a GPU column
        self.rank_view: tuple[int, str, Ring] | None = None  # (node, "[rankN]:", its lines): the node view's filter
        self.header_changed = True

    def node(self, rank: int, host: str = "") -> NodeRow:
        while len(self.nodes) <= rank:
            self.nodes.append(NodeRow(len(self.nodes), host if len(self.nodes) == rank else "", log=Ring(self.ring)))
        return self.nodes[rank]

    def ranks_of(self, node: int) -> range:
        """The global ranks of a node (node after node, as the plan packs them)."""
        first = sum(row.nproc for row in self.nodes[:node])
        return range(first, first + self.node(node).nproc)

    def watch_rank(self, node: int, rank: int | None) -> Ring | None:
        """Keep the lines of global rank ``rank`` of ``node`` in a ring of their own (from what the
        node's ring holds, then as they come), for the node view's filter; None: no filter. Only
        the node being filtered pays for it."""
        if rank is None:
            self.rank_view = None
            return None
        tag = f"[rank{rank}]:"
        ring = Ring(self.ring)
        ring.extend([line for line in self.node(node).log.lines if line.startswith(tag)])
        self.rank_view = (node, tag, ring)
        return ring

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.header_changed = True

    def apply(self, event: Event) -> None:
        rank = event.node
        if isinstance(event, LogLines) and rank is not None:
            row = self.node(rank, event.host)
            shown = undoubled(event.lines)  # torch's own rank tag after ours, once
            lines = [*shown, RESUMED] if event.earlier else shown  # scrollback, then the separator
            row.log.extend(lines)
            if not event.earlier:  # when the rank wrote it, not when it came here (a viewer's backlog)
                written = event.written
                row.last_output = event.ts if written is None else self.clock() - max(0.0, self.wall() - written)
            self.merged.extend([f"node{rank} | {line}" for line in lines])
            if self.rank_view is not None and self.rank_view[0] == rank:
                self.rank_view[2].extend([line for line in lines if line.startswith(self.rank_view[1])])
            return  # the row's line count and last output are redrawn by the clock, not per batch
        if isinstance(event, NodeGpus) and rank is not None:
            row = self.node(rank, event.host)
            reading = only(dataclasses.replace(event, ts=0.0), row.visible)  # equal readings are equal
            if row.gpus != reading:
                self.gpus_shown = self.gpus_shown or not reading.missing
                row.gpus = reading
                self.changed.add(rank)
            return
        self.header_changed = True
        if isinstance(event, AttemptStarted):
            self._attempt(event)
        elif isinstance(event, NodeStarted) and rank is not None:
            row = self.node(rank, event.host)
            row.pid = event.pid
        elif isinstance(event, NodeStateChanged) and rank is not None:
            row = self.node(rank, event.host)
            row.state, row.detail = event.state, event.detail
            if event.state is NodeState.RUNNING:
                row.reachable, row.unreachable_since = True, None
        elif isinstance(event, NodeDegraded) and rank is not None:
            row = self.node(rank, event.host)
            row.degraded = event.reason
            self.note(f"node{rank} {event.host}: degraded: {event.reason}")
        elif isinstance(event, ProgressChanged):
            before, self.progress = self.progress, event.progress
            loss = event.progress.loss
            if event.progress.curve:  # the host's curve: the whole run, though the board came later
                self.losses.clear()
                self.losses.extend(y for _, y in event.progress.curve)
            elif loss is not None and (before is None or before.step != event.progress.step or before.loss != loss):
                self.losses.append(loss)
        elif isinstance(event, JobHung):
            for node in event.nodes:
                self.node(node).hung_since = event.since
                self.changed.add(node)
            self.note("a rank wrote again: the job is running" if event.since is None else
                      f"the job is {hung_text(event.since, self.wall())} (no rank wrote anything)")
        elif isinstance(event, NodeLink) and rank is not None:
            row = self.node(rank, event.host)
            since = event.since if event.since is not None else self._to_wall(event.ts)
            if event.up:
                row.unreachable_since = None
            elif row.reachable or row.unreachable_since is None:
                row.unreachable_since = since
            else:  # still unreachable: since the first failure seen (a viewer's record may know an earlier one)
                row.unreachable_since = min(row.unreachable_since, since)
            row.reachable = event.up
            self.note(f"node{rank} {event.host}: " + ("reconnected" if event.up else
                      f"{unreachable_text(row.unreachable_since, self.wall())} ({event.detail})"))
        elif isinstance(event, NodeExited) and rank is not None:
            result = event.result
            row = self.node(rank, result.host)
            row.state, row.exit_code, row.signal = result.state, result.exit_code, result.signal
            row.detail = result.error or row.detail
            if result.state in (NodeState.FAILED, NodeState.LOST) and self.first_failure is None:
                self.first_failure = rank
        elif isinstance(event, NodeStopped) and rank is not None:
            report = event.report
            self.stops[rank] = report
            self.note(describe_stop(report))
            caveat = stop_caveat(report)
            if caveat is not None and not self._caveat_noted:  # once: it says the same of every such host
                self._caveat_noted = True
                self.note(caveat)
        elif isinstance(event, JobNote):
            self.note(event.text)
        elif isinstance(event, AttemptRestarting):
            if self.restarting is None or self.restarting.failed != event.failed:
                self.note(event.describe())  # once: it says when (the owner emits it again as it counts down)
            self.restarting = event
        elif isinstance(event, JobFinished):
            self.result, self.restart_next = event.result, event.restarting
            if not event.restarting:  # the job's end, also one during a restart's backoff
                self.restarting = None
            if self.ended is None:  # else the record said when the attempt ended
                self.ended = event.ts
        if rank is not None:
            self.changed.add(rank)

    def _attempt(self, event: AttemptStarted) -> None:
        again = event.attempt == self.attempt  # the same attempt, announced again (a restart's new follower)
        if self.attempt and event.attempt > self.attempt:  # replaces "restarting: ..." and the stop's notes
            self.note(f"attempt {event.attempt} started")
        self.job_id, self.name, self.attempt = event.job_id, event.name, event.attempt
        self.restarting, self.restart_next = None, False
        self.master, self.world_size = f"{event.master_addr}:{event.master_port}", event.world_size
        self.result, self.ended, self.first_failure = None, None, None
        self.stops = {}
        # The attempt's own start (and end) as recorded, on this board's clock: a viewer that
        # attaches later shows how long the attempt has really run.
        self.started = event.ts if event.started is None else self._from_wall(event.started)
        if event.ended is not None:
            self.ended = self._from_wall(event.ended)
        keep = [row.log for row in self.nodes]
        self.nodes = []
        for rank, (host, nproc, gpus) in enumerate(event.nodes):
            row = self.node(rank, host)
            row.slots = f"gpus {gpus}" if gpus else f"{nproc} proc" + ("s" if nproc != 1 else "")
            row.visible = tuple(gpus.split(",")) if gpus else ()
            row.nproc = nproc
            if rank < len(keep):  # the old attempt's lines stay visible above the new ones
                row.log = keep[rank]
        self.changed = set(range(len(self.nodes)))
        if event.attempt > 1 and not again:
            marker = f"---- attempt {event.attempt} ----"
            for row in self.nodes:
                row.log.extend([marker])
            self.merged.extend([marker])

    # ---------------------------------------------------------------------------- summaries

    @property
    def state(self) -> str:
        """The job's state: starting, running, failing, stopping, succeeded, failed, stopped, lost,
        restarting (the owner restarts it: ``restarting``), or unreachable (a stop that could not
        reach a host: the job may still run there)."""
        if self.restart_next or self.restarting is not None and self.restarting.failed == self.attempt:
            return "restarting"
        if self.result is not None:
            ended = JobState.of_nodes(n.state for n in self.result.nodes)
            if ended is not None and self.result.interrupted is not None:  # the user's stop decides, as recorded
                return JobState.STOPPED.value  # (K during a restart's backoff: its nodes had failed)
            return ended.value if ended is not None else "unreachable"  # stopped, but a host was not reached
        states = {row.state for row in self.nodes}
        if NodeState.STOPPING in states:
            return "stopping"
        if NodeState.RUNNING in states and all(s is NodeState.RUNNING or s.is_terminal for s in states):
            # a node failed or lost among running ones: fail-fast stops them (a viewer sees it later)
            return "failing" if any(s.fails_the_attempt for s in states) else "running"
        if states and all(s.is_terminal for s in states):
            return "ending"
        return "starting"

    @property
    def finished(self) -> bool:
        return self.result is not None

    def summary(self) -> str:
        """``61 running · 2 failed: nodes 62-63 · 1 unreachable: node 5``: the state most nodes
        are in counted, the others named (and ``· 1 degraded``: see ``degraded_text``)."""
        ranks: dict[str, list[int]] = {}
        for row in self.nodes:
            ranks.setdefault("unreachable" if row.unreachable else row.state.value, []).append(row.rank)
        most = max(ranks, key=lambda state: len(ranks[state])) if ranks else ""
        parts = [f"{len(r)} {state}" + ("" if state == most else f": {fold_ranks(r)}") for state, r in ranks.items()]
        degraded = sum(1 for row in self.nodes if row.degraded)
        if degraded:
            parts.append(f"{degraded} degraded")
        return " · ".join(parts)

    def _from_wall(self, when: float) -> float:
        """A wall-clock time (``time.time()``) on the board's clock."""
        return self.clock() - (self.wall() - when)

    def _to_wall(self, ts: float) -> float:
        """A time on the board's clock (an event's ``ts``) as a wall-clock time."""
        return self.wall() - (self.clock() - ts)

    def degraded_text(self) -> list[str]:
        """A line per node whose supervisor cannot write its state (``degraded: <reason>``)."""
        return [f"node{row.rank} {row.host}: degraded: {row.degraded}" for row in self.nodes if row.degraded]

    def elapsed(self) -> float:
        return (self.ended if self.ended is not None else self.clock()) - self.started

    def root_cause(self) -> RootCause | None:
        if self.result is not None:
            return self.result.root_cause
        return None

    def root_rank(self) -> int | None:
        """The node marked as the root cause in the table."""
        cause = self.root_cause()
        if cause is not None and self.state in ("failed", "lost"):
            return cause.node
        return self.first_failure

    def root_text(self) -> str:
        """The root cause, its exception and last lines; empty while nothing failed."""
        cause = self.root_cause()
        if cause is not None and self.state in ("failed", "lost"):
            lines = [f"root cause: {cause.describe()}", *(cause.explanation.lines() if cause.explanation else ())]
            lines += [f"  {line}" for line in cause.last_lines[-8 if cause.explanation is None else -6:]]
            return "\n".join(lines)
        if self.first_failure is not None:
            row = self.nodes[self.first_failure]
            last = list(row.log.lines)[-8:]
            return "\n".join([f"first failure: node {row.rank} ({row.host}): {row.status(self.wall())}"
                              + (f": {row.detail}" if row.detail else ""), *(f"  {line}" for line in last)])
        return ""


def exit_code(result: JobResult | None, error: ClusterrunError | None) -> int:
    """The dashboard's exit code for a job it did not leave running: 0 succeeded (or nothing to
    follow), 1 failed, 130 stopped by the user, 3 could not start (``error``, no result)."""
    if result is None:
        return 3 if error is not None else 0
    if result.ok:
        return 0
    return 130 if result.interrupted else 1


def describe_stop(report: StopReport) -> str:
    """One line of a stop's report (which guarantee held: see ``printer.stop_text``)."""
    return stop_text(report) + (f"; degraded: {report.degraded}" if report.degraded else "")
