"""What the orchestrator tells its consumers: node states, results and events (past-tense facts).

Events are frozen dataclasses with the node rank they concern (``None`` for the whole job) and a
monotonic timestamp ``ts``; ``to_json()`` serialises any of them. This module imports nothing of
the package, so consumers (the CLI printer, the Textual app) depend on it and nothing else.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import field
from datetime import datetime, timezone
from enum import Enum
from typing import Any

from clusterrun.core.frozen import frozen
from clusterrun.core.progress import Progress


class _Named(str, Enum):
    """A str enum that prints as its value: "running" in messages and tables (Python 3.11's
    format() of a str enum says "JobState.RUNNING")."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class NodeState(_Named):
    """One node's state as the controller sees it.

    ::

        pending → connecting → starting → running ─┬→ succeeded
                                   │               ├→ failed      (torchrun exited non-zero)
                                   │               ├→ stopping → stopped   (stop requested)
                                   └→ failed       └→ lost        (the host says the job's processes are gone)

    ``unreachable`` is not a state of the job but of the controller's view: a node whose host
    cannot be reached keeps its state (it runs on, for all anybody knows) in the record, with
    when the controller first failed to reach it, and is shown ``unreachable since <time>``
    (``unreachable_text``), never as running: we do not know. A node ends ``unreachable`` only
    in a result: the controller stopped following it (a stop was asked for) without reaching its
    host, so it may still run.

    ``hung`` is, like ``unreachable``, a view of a node that runs: no rank of the job, on any node,
    wrote anything for ``hang_after`` (``JobHung``: the job hangs, so each of its running nodes is
    hung); it is shown ``hung since <time>`` (``hung_text``) until a rank writes again, and never
    ends a node or the job by itself (the job's owner acts on it: ``on_hang``).
    """

    PENDING = "pending"
    CONNECTING = "connecting"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"
    UNREACHABLE = "unreachable"
    HUNG = "hung"

    @property
    def is_terminal(self) -> bool:
        return self in (NodeState.SUCCEEDED, NodeState.FAILED, NodeState.STOPPED, NodeState.LOST)

    @property
    def fails_the_attempt(self) -> bool:
        """Failed or lost: while other nodes of its attempt run, the attempt is ``failing`` (fail-fast stops them)."""
        return self in (NodeState.FAILED, NodeState.LOST)


class JobState(_Named):
    """A whole job's state, as its record keeps it: ``starting → running (→ stopping) → one of the
    ends``; its transitions are ``jobstate.TABLE``, and only ``jobstate.transition`` moves it."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    RESTARTING = "restarting"  # an attempt failed; the next starts after a backoff (``restart:``)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"

    @property
    def is_terminal(self) -> bool:
        return self not in (JobState.STARTING, JobState.RUNNING, JobState.STOPPING, JobState.RESTARTING)

    @classmethod
    def of_nodes(cls, states: Iterable[NodeState | str]) -> JobState | None:
        """The job's state from its nodes' (the one rule, for results, records and dashboards):
        an end once every node has ended — succeeded if all did, else failed if one failed, else
        lost if one was lost, else stopped; ``running`` once all started and none ended badly;
        None while the job is still starting or a node may still run unseen (``unreachable``)."""
        seen = {NodeState(s) for s in states}
        if not seen or NodeState.UNREACHABLE in seen:
            return None
        if all(s.is_terminal for s in seen):
            if seen == {NodeState.SUCCEEDED}:
                return cls.SUCCEEDED
            if NodeState.FAILED in seen:
                return cls.FAILED
            return cls.LOST if NodeState.LOST in seen else cls.STOPPED
        if seen <= {NodeState.RUNNING, NodeState.SUCCEEDED}:
            return cls.RUNNING
        return None


def iso(timestamp: float) -> str:
    """``2026-11-23T16:04:05Z``: ISO 8601, UTC, whole seconds."""
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def unreachable_text(since: float | None, now: float) -> str:
    """How every consumer (``ps``, ``wait``, the printer, the dashboard) words a node whose host
    cannot be reached: ``unreachable since 16:04:05Z`` (a wall-clock time, UTC; with its date,
    ``2026-11-22T16:04:05Z``, when that is not today's)."""
    if since is None:
        return "unreachable"
    text = iso(since)
    return "unreachable since " + (text[11:] if text[:10] == iso(now)[:10] else text)


def hung_text(since: float | None, now: float) -> str:
    """``hung since 16:04:05Z``: no rank of the job wrote anything since then."""
    return "hung" if since is None else unreachable_text(since, now).replace("unreachable", "hung", 1)


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9, or ``signal 64`` for numbers without a name."""
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@frozen
class Explanation:
    """What a known failure signature says about a root cause (``signatures.SIGNATURES``): its
    name, the cause in one line and the fix in one line."""

    signature: str
    cause: str
    fix: str

    def lines(self) -> list[str]:
        """``["cause: ...", "fix: ..."]``, as the summary, ``ps JOB`` and the dashboard show them."""
        return [f"cause: {self.cause}", f"fix: {self.fix}"]


@frozen
class OomEvidence:
    """What the root cause's host said of OOM kills, for a root cause killed by SIGKILL.

    ``line`` is the kernel's own line naming the root cause's ``pid`` (``... out of memory:
    Killed process PID (COMM) ...``, or its ``oom-kill:...,pid=PID`` line), None when its log
    was read and names no such kill, or could not be read: ``unreadable`` then says why.
    ``memcg`` is the memory cgroup whose limit was reached (``CONSTRAINT_MEMCG``), ``constraint``
    the kernel's; ``others`` are the other OOM kills of the attempt's time (``PID (COMM)``);
    ``overwritten`` that records were lost before they were read; ``pid_namespace`` that the
    job's PIDs are not the kernel's. ``cgroup_kills`` is ``oom_kill`` of the attempt's cgroup's
    ``memory.events`` (``cgroup_events``), None where there is none (``cgroup_error``)."""

    pid: int | None = None
    line: str | None = None
    constraint: str | None = None
    memcg: str | None = None
    unreadable: str | None = None
    others: tuple[str, ...] = ()
    overwritten: bool = False
    pid_namespace: bool = False
    cgroup_kills: int | None = None
    cgroup_events: str | None = None
    cgroup_error: str | None = None
    recorded: bool = True  # False: the node's supervisor recorded nothing of it (it did not see torchrun end)


@frozen
class RootCause:
    """The first failure across the cluster: where, which rank (and ``pid``), how, its last
    lines, for a SIGKILL what the host's kernel said of OOM kills (``oom``), and what a known
    failure signature says about it (``explanation``, None when none matched). A ``lost`` node
    (its host went away, its processes killed) is named by its node alone: no torchrun exit to tell."""

    node: int
    host: str
    rank: int | None
    local_rank: int | None
    exit_code: int | None
    signal: int | None
    last_lines: tuple[str, ...] = ()
    message: str = ""
    explanation: Explanation | None = None
    pid: int | None = None  # its process on its host, where torchrun's report or the agent names it
    oom: OomEvidence | None = None  # for a SIGKILL: what the host's kernel said of OOM kills
    lost: bool = False  # the node's processes are gone without an exit status: ``message`` says how

    def describe(self) -> str:
        if self.lost:
            return f"node {self.node} ({self.host}): {self.message or 'lost'}"
        how = (f"killed by {signal_name(self.signal)}" if self.signal
               else f"exit code {self.exit_code}" if self.exit_code is not None else "failed")
        who = f"rank {self.rank}" if self.rank is not None else "torchrun"
        local = f", local rank {self.local_rank}" if self.local_rank is not None else ""
        text = f"{who} on node {self.node} ({self.host}{local}): {how}"
        return text + (f": {self.message}" if self.message else "")


@frozen
class StopReport:
    """What the agent's stop did on one node, and which guarantee held.

    ``containment`` is ``cgroup`` (``verified``: the attempt's cgroup was empty, then removed),
    ``sweep`` (no cgroup on that host: ``left == ()`` only means that no process the sweep could
    see is left), ``reboot`` (the host rebooted since), or None (no answer, or an older agent)."""

    node: int
    host: str
    killed: tuple[dict[str, Any], ...] = ()
    left: tuple[dict[str, Any], ...] = ()
    error: str | None = None
    containment: str | None = None
    verified: bool = False
    detail: str = ""
    fallbacks: tuple[str, ...] = ()
    degraded: str | None = None
    notes: tuple[str, ...] = ()
    grace: float | None = None  # the seconds torchrun was given after SIGTERM
    grace_ran_out: bool = False  # torchrun still ran when they were over: it was SIGKILLed
    records_gone: bool = False  # the host had no records of the attempt: its processes were looked for
    found_by: tuple[str, ...] = ()  # then: what found them (the cgroup by name, the marker scan)
    looked: tuple[str, ...] = ()  # and where it looked
    torchrun_pid: int | None = None  # torchrun's, as the host recorded it: named so among ``killed``
    at_once: bool = False  # a failing attempt's: SIGKILLed with its cgroup, without torchrun's shutdown
    failed: bool = False  # this node's rank failed first: the stop only cut its torchrun's teardown short

    @property
    def ok(self) -> bool:
        """Stopped, and nothing the stop could see is left."""
        return self.error is None and not self.left

    @property
    def complete(self) -> bool:
        """Stopped, and verified by a method that sees every process of the job (its cgroup)."""
        return self.ok and self.verified


@frozen
class NodeResult:
    """How one node's torchrun ended."""

    node: int
    host: str
    state: NodeState
    exit_code: int | None = None
    signal: int | None = None
    error: str | None = None
    stopped_after: int | None = None  # fail-fast stopped it after this node failed (``error`` says so)
    stopped_by: str | None = None  # stopped: who stopped it, as its host recorded it (``error`` says so)
    hardware: tuple[str, ...] = ()  # its host's kernel logged these errors of the machine (GPU Xid, MCE, ECC)
    contained: bool = False  # it ended with its attempt's cgroup emptied and removed (``NodeStatus.contained``)

    @property
    def ok(self) -> bool:
        return self.state is NodeState.SUCCEEDED


# Who stopped a job, as the mark in each node's log says it (``---- stopped by Ctrl-C at ... ----``), for
# the reasons its stop is asked with; other reasons are said as they are.
STOPPED_BY = {"SIGINT": "Ctrl-C", "SIGTERM": "SIGTERM to clusterrun", "SIGHUP": "SIGHUP to clusterrun",
              "stopped from the dashboard": "K in the dashboard", "restarted from the dashboard": "R in the dashboard",
              "stopped by an earlier command": "an earlier command", "stop requested": "clusterrun"}


def stopped_by(reason: str) -> str:
    """Who stopped a job whose stop was asked for with ``reason``, in the words of its logs' mark."""
    return STOPPED_BY.get(reason, reason)


def stopped_after_text(node: int) -> str:
    """Why fail-fast stopped a node, said instead of how its torchrun ended (by clusterrun's SIGTERM)."""
    return f"stopped by clusterrun after node {node} failed"


@frozen
class JobResult:
    """The outcome of a whole job: every node's result, the root cause, and the stop reports."""

    job_id: str
    nodes: tuple[NodeResult, ...]
    root_cause: RootCause | None = None
    stops: tuple[StopReport, ...] = ()
    interrupted: str | None = None  # the signal name when the user stopped the job

    @property
    def ok(self) -> bool:
        return self.interrupted is None and all(n.ok for n in self.nodes)

    @property
    def failed(self) -> bool:
        return not self.ok

    @property
    def stopped(self) -> bool:
        """Stopped on request (here or by ``clusterrun down``) rather than failed."""
        if self.interrupted is not None:
            return True
        states = {n.state for n in self.nodes}
        return NodeState.STOPPED in states and states <= {NodeState.STOPPED, NodeState.SUCCEEDED}


@frozen
class Event:
    node: int | None
    ts: float = field(default_factory=time.monotonic, kw_only=True)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["event"] = type(self).__name__
        return data


@frozen
class AttemptStarted(Event):
    """An attempt of the job is being started or followed: what a consumer shows of its plan.
    ``nodes`` holds per node rank ``(host, nproc, CUDA_VISIBLE_DEVICES or None)``; ``started``
    and ``ended`` are the wall-clock times (``time.time()``) the attempt started and ended as its
    record says, where known (a viewer attaching later shows the attempt's real elapsed time)."""

    job_id: str
    name: str
    attempt: int
    master_addr: str
    master_port: int
    world_size: int
    nodes: tuple[tuple[str, int, str | None], ...]
    started: float | None = None
    ended: float | None = None


@frozen
class AttemptRestarting(Event):
    """Attempt ``failed`` ended and its owner restarts the whole job as attempt ``attempt``:
    emitted when the wait begins and, for the restart policy's backoff, as it counts down
    (``remaining`` seconds, until the wall-clock time ``at``; consumers that print say it once, with
    ``at``). ``kind``: "policy" (``restart:``;
    ``restart`` of ``most`` counts the job's restarts by it), "start-up" (the start-up retry) or
    "requested" (``on_hang: restart`` and the like); ``reason``: why the attempt ended."""

    job_id: str
    attempt: int
    failed: int
    at: float
    remaining: float
    kind: str
    restart: int
    most: int | None
    reason: str

    def describe(self) -> str:
        if self.kind == "start-up":
            return (f"attempt {self.failed} failed at start-up: {self.reason}; retrying once as attempt "
                    f"{self.attempt} (--no-retry-startup turns this off)")
        if self.kind != "policy":
            return f"attempt {self.failed} stopped ({self.reason}); restarting the job as attempt {self.attempt}"
        when = iso(self.at)[11:] if iso(self.at)[:10] == iso(self.at - self.remaining)[:10] else iso(self.at)
        return (f"attempt {self.failed} failed: {self.reason} · restarting at {when} (in {self.remaining:.0f} s) as "
                f"attempt {self.attempt} (restart {self.restart} of {self.most}; `clusterrun down` cancels)")


@frozen
class NodeStarted(Event):
    host: str
    attempt: int
    pid: int | None


@frozen
class NodeStateChanged(Event):
    host: str
    state: NodeState
    detail: str = ""


@frozen
class NodeLink(Event):
    """The connection to a node's host was lost (``up`` False; being retried) or is back.
    ``since`` (when lost): the wall-clock time of the failure, or of an earlier one the job's
    record kept (a viewer's ``Session``); None: the event's own time."""

    host: str
    up: bool
    detail: str = ""
    since: float | None = None


@frozen
class JobHung(Event):
    """No rank of the job, on any node, has written anything since ``since`` (wall clock), for the
    job's ``hang_after`` at least: ``nodes``, those that had not ended, are hung; ``since`` None:
    a rank wrote again, ``nodes`` are running again (``run/hangwatch.py`` decides)."""

    since: float | None
    nodes: tuple[int, ...] = ()


@frozen
class StartupExpired(Event):
    """Nodes of the attempt started no workers within ``startup_timeout``: ``nodes`` are blamed
    (the owner fails the attempt with ``cause`` and stops the others; a viewer only shows it)."""

    cause: RootCause
    nodes: tuple[int, ...]


@frozen
class EveryNodeJoined(Event):
    """Every node of the attempt started its workers (torchrun's rendezvous completed) at ``at``
    (``time.time()``): the end of the start-up watch."""

    at: float


@frozen
class AttemptTimed(Event):
    """The phases of attempt ``attempt``'s start are all known (``AttemptRecord.phases``: name →
    wall-clock time; ``began``: when the attempt started); ``up --timings`` shows them."""

    attempt: int
    began: float
    phases: tuple[tuple[str, float], ...]


@frozen
class ProgressChanged(Event):
    """The training's progress, as the host of rank 0 read it from its output, changed."""

    host: str
    progress: Progress


@frozen
class LogLines(Event):
    """Complete lines of one node's log, in order, without their newlines. ``earlier``: lines
    before the point a viewer resumed at, sent once as its scrollback (they were shown before).
    ``text``: the same lines each ended by a newline, where the producer had them so (the log's
    chunk as read): a consumer that writes text uses it instead of joining ``lines`` again."""

    host: str
    lines: tuple[str, ...]
    earlier: bool = False
    written: float | None = None  # wall clock: when the last of them was written on the host, if known
    text: str | None = field(default=None, compare=False, repr=False)


@frozen
class RankFailed(Event):
    """A worker of the node's torchrun exited non-zero (``exit_code``; negative: killed by that
    signal) while nobody stopped it: the node fails (torchrun restarts no worker, ``--max-restarts=0``)
    before torchrun itself has ended. Its owner stops the other nodes at once (fail-fast)."""

    host: str
    rank: int | None
    exit_code: int


@frozen
class NodeDegraded(Event):
    """The node's supervisor could not write its state on the host (``reason``: a full or
    read-only disk, a quota); it goes on supervising, with its state in memory."""

    host: str
    reason: str


@frozen
class NodeExited(Event):
    result: NodeResult


@frozen
class NodeStopped(Event):
    report: StopReport


@frozen
class JobFinished(Event):
    """The attempt ended with ``result``; ``restarting``: its owner restarts the job (an
    ``AttemptRestarting`` follows), so this is not the job's end."""

    result: JobResult
    restarting: bool = False


@frozen
class JobNote(Event):
    """Something the owner did that every consumer should show (a start-up retry, ...)."""

    text: str


@frozen
class GpuReading:
    """One GPU of a node's host: utilisation in percent, memory in MiB (None: nvidia-smi says N/A)."""

    index: int
    util: int | None = None
    mem_used: int | None = None
    mem_total: int | None = None


@frozen
class NodeGpus(Event):
    """What the node's host said of its GPUs just now: ``gpus``; or ``missing``, it has no
    ``nvidia-smi``; or ``problem``, why there are no readings although it has (it failed, hung
    or printed something else)."""

    host: str
    gpus: tuple[GpuReading, ...] = ()
    missing: bool = False
    problem: str = ""
