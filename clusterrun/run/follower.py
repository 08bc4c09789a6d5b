"""One node of a job as the controller sees it (``Node``), and its follower thread (``Follower``).

A follower reads its agent's ``follow`` stream and puts each message, with its own news of the
link (``Link``), on the job's bounded inbox; it reconnects after ``Reconnect``'s delays from the
byte offset reached. Only ``Job.run()`` reads the inbox and changes the node's state.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from clusterrun.agent.wire import HEARTBEAT, NodeRequest
from clusterrun.core.errors import ClusterrunError
from clusterrun.core.events import (
    Event,
    NodeDegraded,
    NodeResult,
    NodeState,
    ProgressChanged,
    RankFailed,
    RootCause,
    stopped_after_text,
)
from clusterrun.core.frozen import frozen
from clusterrun.core.progress import Progress
from clusterrun.core.protocol import Beat, End, FollowMessage, HostState, LogChunk, NodeStatus, Probe, decode_follow
from clusterrun.diagnose.rootcause import NodeLog, find_root_cause
from clusterrun.run.plan import NodeLaunch
from clusterrun.transports import AgentSession, AgentStream, Transport


@frozen
class Reconnect:
    """How a follower retries a host it cannot reach: after ``first`` × failures seconds, at
    most ``most``; forever, unless ``give_up_after`` seconds of retrying have failed (then the
    node is lost). Each retry adds at most ``most`` + ``try_cap`` seconds to that count, so time
    the controller itself spent paused or asleep in one retry hardly counts."""

    first: float = 0.2
    most: float = 2.0
    give_up_after: float | None = None
    try_cap: float = 20.0  # a connection attempt over SSH times out after 10 s

    def delay(self, failures: int) -> float:
        return min(self.most, self.first * failures)


# The messages a second that one controller's followers may receive in all (a message costs the
# controller ~0.25-0.4 ms of CPU, docs/benchmarks.md): MESSAGE_BUDGET for up to BUDGET_NODES nodes,
# fewer beyond (√(BUDGET_NODES / nodes) of it: 200 for 64; at 400, 64 nodes on 2 shared cores fell
# seconds behind ``ssh tail -F``). Each node's ``follow`` reads its log at most every nodes / budget
# seconds, within FOLLOW_INTERVALS (one node at the supervisor's merge pace). A line after a pause
# goes at once.
MESSAGE_BUDGET = 400.0
BUDGET_NODES = 16
FOLLOW_INTERVALS = (0.01, 0.5)


def follow_interval(nodes: int) -> float:
    """The least time between two log messages of each of ``nodes`` followed nodes."""
    budget = MESSAGE_BUDGET * min(1.0, math.sqrt(BUDGET_NODES / max(nodes, 1)))
    return min(max(nodes / budget, FOLLOW_INTERVALS[0]), FOLLOW_INTERVALS[1])


def split_lines(data: str) -> tuple[str, ...]:
    """The lines of a ``log`` message's data, without their newlines."""
    lines = data.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return tuple(lines)


def node_state_of(status: NodeStatus, stop_sent: bool = False) -> NodeState:
    """A node's state from what its agent reports of its state file."""
    if status.state is HostState.LOST or status.exit_unknown:  # not a failure of torchrun: nobody knows
        # Ended after a stop reached its host (the host says so): the stop's doing, whoever sent it
        return NodeState.STOPPED if status.stop_requested else NodeState.LOST
    if status.state is HostState.ABSENT:
        return NodeState.PENDING
    if status.state is not HostState.EXITED:
        return NodeState.STARTING if status.state is HostState.STARTING else NodeState.RUNNING
    if status.exit_code == 0 and not status.error:
        return NodeState.SUCCEEDED
    if stop_sent or status.stop_requested:
        return NodeState.STOPPED
    return NodeState.FAILED


def end_note(status: NodeStatus) -> str | None:
    """How a node's exit code was learned where nobody reaped torchrun: ``exit code 0: every rank
    exited 0 (torchrun's own exit was not recorded: ...)``; None where it was recorded."""
    if status.exit_learned is None or status.exit_code is None:
        return None
    return f"exit code {status.exit_code}: {status.exit_learned}"


@frozen
class Link:
    """A follower's own news, beside the agent's messages: the host is unreachable (``up`` False)
    or back; ``gave_up``: a stop was asked for and the host could not be reached; ``lost``: the
    --unreachable-timeout ran out."""

    up: bool
    error: str = ""
    gave_up: bool = False
    lost: bool = False
    since: float | None = None  # unreachable: when it was gone at the latest (wall clock)


@dataclass
class Node:
    launch: NodeLaunch | None
    transport: Transport
    state: NodeState = NodeState.PENDING
    final: NodeStatus | None = None  # how the node ended, once the follower has ended
    log: NodeLog = field(default_factory=NodeLog)
    stop_sent: bool = False
    rank_failed: bool = False  # ``RankFailed`` was reported
    error: str | None = None  # why the node ended as it did, where its status does not say
    agent: AgentSession | None = None  # the agent that probed the host, kept to start and follow the node;
    # after the end, the one that followed it (``Job.idle_agents``)
    closed: bool = False  # the job was closed: an agent handed to the node after that is closed too (``hold``)
    probe: Probe | None = None  # what its agent said of the host
    degraded: str | None = None  # the agent's word that the supervisor cannot write its state
    progress: Progress | None = None  # the training's progress its host read last (node 0)
    earlier: list[str] = field(default_factory=list)  # scrollback lines read, before the resume point
    away_since: float | None = None  # its follower's first failure to reach the host, while it lasts
    stream: AgentStream | None = None  # its follower's stream while it runs: a stop may go down its channel
    _holding: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def host(self) -> str:
        return self.transport.name

    def unanswered(self, error: str | None) -> NodeStatus:
        """Its end when its host was waited for and never answered again: lost, since it went away."""
        return NodeStatus(HostState.LOST, error=error, away_since=self.away_since, unanswered=True)

    def news(self, rank: int, status: NodeStatus) -> list[Event]:
        """What ``status`` says beside the node's state that is news: degraded, progress."""
        found: list[Event] = []
        if status.degraded and status.degraded != self.degraded:
            self.degraded = status.degraded
            found.append(NodeDegraded(rank, host=self.host, reason=status.degraded))
        if status.progress is not None and status.progress != self.progress:
            self.progress = status.progress
            found.append(ProgressChanged(rank, host=self.host, progress=status.progress))
        failed = [w for w in status.workers if w.exit_code not in (None, 0)]
        if failed and not (self.rank_failed or self.stop_sent or status.stop_requested or status.ended):
            self.rank_failed = True  # the first worker's failure the host saw: torchrun is failing
            first = min(failed, key=lambda w: w.died or 0.0)
            found.append(RankFailed(rank, host=self.host, rank=first.rank, exit_code=first.exit_code or 0))
        return found

    def scrollback(self, message: LogChunk, resume: int) -> tuple[tuple[str, ...] | None, str]:
        """Keep the part of ``message`` before the resume point (a viewer's scrollback); once that
        point is reached, the lines kept (None before); and the part of ``message`` after it."""
        raw = message.data.encode("utf-8", "surrogateescape")
        cut = max(0, min(len(raw), resume - message.offset))
        self.earlier.extend(split_lines(raw[:cut].decode("utf-8", "surrogateescape")))
        earlier = None
        if message.next >= resume:
            earlier, self.earlier = tuple(self.earlier), []
        return earlier, raw[cut:].decode("utf-8", "surrogateescape")

    def hold(self, agent: AgentSession | None) -> bool:
        """Keep ``agent`` as the node's (the one that probes it, or the one its follow carried on);
        False, and ``agent`` closed, where the job was closed meanwhile: nobody else would close it."""
        with self._holding:
            if not self.closed:
                self.agent, agent = agent, None
        if agent is not None:
            agent.close()
            return False
        return True

    def close(self) -> None:
        """The job is closed: its agent is closed, and any handed to it later."""
        with self._holding:
            self.closed = True
        self.close_agent()

    def close_agent(self) -> None:
        with self._holding:
            agent, self.agent = self.agent, None
        if agent is not None:
            agent.close()


class Follower:
    """One node's follower: ``run()`` in its own thread until the stream ends, the job detaches,
    a stop cannot reach the host, or ``Reconnect.give_up_after`` runs out."""

    def __init__(self, rank: int, node: Node, request: Callable[[dict[str, Any]], NodeRequest], *,
                 inbox: queue.Queue[tuple[int, FollowMessage | Link]], reconnect: Reconnect, tail: int | None,
                 offset: int, before: int, detach: threading.Event, stopping: threading.Event,
                 wake: threading.Event) -> None:
        self.rank = rank
        self.node = node
        self.request = request  # the ``follow`` request for a position (``offset``/``tail``, ``before``)
        self.inbox = inbox
        self.reconnect = reconnect
        self.tail = tail
        self.offset = offset  # where the stream resumes: the end of what was queued
        self.before = before  # scrollback lines wanted before ``offset``, on the first request only
        self.detach = detach
        self.stopping = stopping
        self.wake = wake

    def run(self) -> None:
        node, rank = self.node, self.rank
        tail = self.tail
        position = self.offset  # where the stream resumes: the end of what was queued
        failures = 0
        retrying = 0.0  # seconds spent failing to reach the host (see Reconnect)
        # When contact was lost, until the host shows the job alive after it (a heartbeat, lines
        # written since): a ``lost`` said before that means the host went away then.
        away: float | None = None
        heard: float | None = None  # when the host's last message came
        before = self.before if tail is None else 0
        while True:
            where: dict[str, Any] = {"offset": position} if tail is None else {"tail": tail}
            if before:
                where["before"], before = before, 0  # only the first request: the lines after are new
            request = self.request(where)
            agent, node.agent = node.agent, None
            began = time.monotonic()
            try:
                stream = node.stream = agent.stream(request) if agent is not None else node.transport.stream(request)
                try:
                    for raw in stream:
                        message = decode_follow(node.host, raw)
                        heard = time.time()
                        if failures:
                            self.inbox.put((rank, Link(up=True)))
                            failures, retrying, node.away_since = 0, 0.0, None
                        if isinstance(message, Beat):
                            away = None
                            continue
                        if isinstance(message, LogChunk):
                            position, tail = message.next, None
                            if away is not None and (message.written or 0) > away:
                                away = None
                        if (isinstance(message, End) and away is not None
                                and node_state_of(message.status) is NodeState.LOST):
                            message = End(replace(message.status, away_since=away))
                        if isinstance(message, End):  # its agent answers on (the owner's next attempt)
                            node.hold(stream.carry_on())
                        self.inbox.put((rank, message))
                        if isinstance(message, End):
                            return
                finally:
                    node.stream = None
                    stream.close()
            except ClusterrunError as exc:
                error = exc.one_line()
            except Exception as exc:  # noqa: BLE001 - a transport's untranslated error must not end the follower
                error = f"{node.host}: {type(exc).__name__}: {exc}"
            else:
                error = "the log stream ended early"
            if self.detach.is_set():
                return
            failures += 1
            if failures == 1:  # a dead link is noticed only after a silence (FOLLOW_TIMEOUT), but the host
                # speaks every HEARTBEAT: by its next word after the last one, it was gone
                now = time.time()
                away = node.away_since = now if heard is None else min(now, heard + HEARTBEAT)
            delay = self.reconnect.delay(failures)
            retrying += min(time.monotonic() - began, self.reconnect.try_cap) + delay
            if failures == 1 and not self.stopping.is_set():
                self.inbox.put((rank, Link(up=False, error=error, since=away)))
            if self.stopping.is_set() and failures > 1:
                self.inbox.put((rank, Link(up=False, error=error, gave_up=True)))  # a stop cannot wait for the host
                return
            limit = self.reconnect.give_up_after
            if limit is not None and retrying >= limit:
                self.inbox.put((rank, Link(up=False, lost=True,
                                             error=f"unreachable for {limit:g} s (--unreachable-timeout): {error}")))
                return
            self.wake.wait(delay)


def who_stopped(status: NodeStatus) -> str | None:
    """Who stopped a node whose stop was requested, as its host recorded it."""
    return status.stopped_by if status.stop_requested else None


def end_text(status: NodeStatus, after: int | None) -> str | None:
    """Why a node ended as it did, in words: after which node's failure fail-fast stopped it (the
    owner knows), else its host's error, how its exit was learned, or who stopped it as its host
    recorded it (a viewer, which stopped nothing, says so rather than how torchrun ended)."""
    if after is not None:
        return stopped_after_text(after)
    by = who_stopped(status)
    return status.error or end_note(status) or (f"stopped by {by}" if by else None)


def node_results(nodes: Sequence[Node], failed_first: int | None) -> list[NodeResult]:
    """Each node's end as the attempt's result says it; a node that fail-fast stopped says after
    which node's failure (``failed_first``)."""
    results = []
    for rank, node in enumerate(nodes):
        final = node.final or NodeStatus(HostState.RUNNING)
        after = failed_first if node.state is NodeState.STOPPED else None
        why = node.error or end_text(final, after)
        by = who_stopped(final) if node.state is NodeState.STOPPED else None
        results.append(NodeResult(rank, node.host, node.state, exit_code=final.exit_code, signal=final.signal,
                                  error=why, stopped_after=after, stopped_by=by,
                                  hardware=final.oom.hardware if final.oom else (), contained=final.contained))
    return results


def root_cause_of(nodes: Sequence[Node]) -> RootCause | None:
    """The failure that came first across the nodes, from their logs and final states."""
    return find_root_cause(
        hosts={r: n.host for r, n in enumerate(nodes)},
        logs={r: n.log for r, n in enumerate(nodes)},
        states={r: n.final for r, n in enumerate(nodes) if n.final is not None},
        stopped_by_us={r for r, n in enumerate(nodes)
                       if n.stop_sent or (n.final is not None and n.final.stop_requested)},
    )


__all__ = ["Follower", "Link", "Node", "Reconnect", "end_note", "end_text", "follow_interval", "node_results",
           "node_state_of", "root_cause_of", "split_lines", "who_stopped"]
