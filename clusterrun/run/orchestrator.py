"""Run a job across its hosts and tell consumers what happens, as events.

Lifecycle of a ``Job``: create → ``prepare()`` (connect and probe every host in parallel, build
the plan, choose each node's network interface: ``interfaces``; all or nothing; the part up to
the start is ``hosts.JobHosts``, its base) → ``start()``
(start every node; if one fails, stop those started) → ``run()`` (follow every node until all
have ended, reporting what happens as events; returns the ``JobResult``) → ``close()``. A job
started earlier is followed again with ``resume(plan)`` instead of ``prepare()`` and ``start()``.
``stop(order)`` and ``request_stop()`` may be called from any thread, a signal handler or a
listener of ``run()``'s events; ``run()``'s loop carries the stop out.

A ``Job`` decides nothing: it reports (a node failed or was lost, the start-up watch expired, the
job hung) and stops when told by its owner (``life.runner``: fail-fast, the start-up timeout); a
viewer (``attach``, ``logs -f``) only watches; the monitor watches states only (``follow_logs``).

Losing contact is never evidence: a node whose host cannot be reached is shown unreachable
(``NodeLink``) and retried from the byte offset it had reached, for as long as it takes. Only the
hosts' own word fails a node: torchrun exited non-zero, or the agent found the job's processes
gone (``lost``: killed, or the host rebooted). A host that died for good shows as the other
ranks failing in their collectives. ``Reconnect.give_up_after`` (``--unreachable-timeout``)
opts into treating long silence as a loss; it counts the time spent retrying, each retry's share
capped, so a paused or suspended controller does not count its own pause.

One follower thread per node (``follower.Follower``) reads the agent's ``follow`` stream and
puts messages on a bounded queue (back-pressure: a slow consumer slows the readers, never
memory); ``run()`` is the only place that changes job state and calls ``emit``. ``offsets``
advance only once ``emit`` has returned for a log message, so a viewer that detaches saves what
it has shown, not what was merely queued: the next viewer resumes there and loses nothing.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from clusterrun.agent.wire import NodeRequest, node_request
from clusterrun.config.environment import secret_names
from clusterrun.config.hostsfile import ClusterSpec
from clusterrun.core import parallel
from clusterrun.core.errors import AgentError, ClusterrunError, HostsUnavailable
from clusterrun.core.events import (
    JobFinished,
    JobResult,
    LogLines,
    NodeExited,
    NodeLink,
    NodeResult,
    NodeStarted,
    NodeState,
    NodeStopped,
    RootCause,
    StopReport,
    stopped_by,
)
from clusterrun.core.protocol import (
    End,
    FollowMessage,
    HostState,
    LogChunk,
    NodeStatus,
    StateUpdate,
    decode_follow,
    decode_status,
)
from clusterrun.diagnose.rootcause import NodeLog
from clusterrun.run.follower import (
    Follower,
    Link,
    Node,
    Reconnect,
    end_text,
    follow_interval,
    node_results,
    node_state_of,
    root_cause_of,
    split_lines,
    who_stopped,
)
from clusterrun.run.hangwatch import HangWatch
from clusterrun.run.hosts import Emit, JobHosts
from clusterrun.run.inbox import Inbox
from clusterrun.run.interfaces import Interface
from clusterrun.run.plan import LaunchPlan, NodeLaunch, about_json
from clusterrun.run.probing import Early
from clusterrun.run.setups import redacted
from clusterrun.run.startwatch import StartupWatch
from clusterrun.run.stops import StopOrder, stop_node
from clusterrun.run.unreachable import UnreachableWait
from clusterrun.transports import AgentSession, Transport, transport_for
from clusterrun.transports.lent import Lent

DRAIN = 256  # messages handled at most between two rounds of the job loop's checks
# The job's loop wakes for a message, a stop or a detach (``Inbox.ring``); besides, every TICK
# while a check may change with time alone (``Job._timed``, a stop under way), else every IDLE:
# a signal that another thread took runs its handler only when the loop's thread wakes.
TICK = 0.1
IDLE = 0.5
# In a flow the loop handles the messages that came within SETTLE of its last round together: each
# of its wakes takes the interpreter lock from the followers and paramiko's readers, and a wake per
# message cost 1.4× the CPU at 400 messages a second (docs/benchmarks.md). A stop or a detach ends
# the wait; the first message after a pause is handled at once.
SETTLE = 0.01
TAIL_READ = 200  # lines of a failed node's log read for its diagnosis when the log is not followed


class Job(JobHosts):
    """One run of a job on its hosts (see the module docstring for the lifecycle; ``JobHosts``: the
    part up to the start)."""

    def __init__(
        self,
        spec: ClusterSpec,
        script: str,
        script_args: Sequence[str] = (),
        *,
        job_id: str,
        name: str,
        emit: Emit | None,
        env_overrides: dict[str, str] | None = None,
        local_cwd: str | None = None,
        grace: float = 10.0,
        attempt: int = 1,
        transport_factory: Callable[..., Transport] = transport_for,
        follow_logs: bool = True,
        offsets: dict[int, int] | None = None,
        tail: int | None = None,
        ranks: Sequence[int] | None = None,
        reconnect: Reconnect = Reconnect(),  # noqa: B008 - frozen
        scrollback: int = 0,
    ) -> None:
        self.spec = spec
        self.script = script
        self.script_args = tuple(script_args)
        self.job_id = job_id
        self.name = name
        self._listeners: list[Emit] = [emit] if emit is not None else []
        self.env_overrides = env_overrides or {}
        self.local_cwd = local_cwd
        self.grace = grace
        self.attempt = attempt
        self.follow_logs = follow_logs
        self.offsets: dict[int, int] = dict(offsets or {})  # per node: the log's bytes emitted so far
        self.reconnect = reconnect
        self.tail = tail
        # nodes whose log this follower does not read from its start (a viewer's resume point, --tail)
        self._partial = {r for r, at in self.offsets.items() if at > 0} if tail is None else None
        # A viewer resuming at ``offsets`` first gets up to ``scrollback`` lines before each
        # node's resume point, emitted once as ``LogLines(earlier=True)``.
        self._resume_at = {rank: at for rank, at in self.offsets.items() if at > 0} if scrollback else {}
        self.scrollback = scrollback
        self.plan: LaunchPlan | None = None
        self.started_at: float | None = None  # the attempt's start (wall clock): the start-up watch counts from it
        self._startup: StartupWatch | None = None
        self._hang: HangWatch | None = None
        self.interfaces: list[Interface] = []  # per node, once prepared: the network interface its ranks use
        self.set_up: dict[int, str] = {}  # nodes whose setup ran: the job's interpreter there, in words
        self.setup_skipped: dict[int, str] = {}  # nodes whose setup did not run (a dry run's missing workdir): why
        self._detach = threading.Event()
        self._wake = threading.Event()  # set by detach() and request_stop(): followers stop waiting to retry
        self._nodes = [Node(None, transport_factory(h)) for h in spec.hosts]
        self.ranks = list(range(len(self._nodes))) if ranks is None else sorted(ranks)  # the nodes run() follows
        self._inbox = Inbox()  # bounded by count and by log bytes: a flood waits on the hosts, not in memory
        self._order: StopOrder | None = None  # the first stop ordered: it decides the attempt's end
        self._failed_first: int | None = None  # the node whose failure the others were stopped after
        self._stop_event = threading.Event()  # a stop was asked for: the followers wait for no host
        self._threads: list[threading.Thread] = []
        self._routed_to: str | None = None  # the master the probes were routed to
        self.early: dict[int, Early] = {}  # by rank: what the probes answered of the preflight's requests
        self._listening: int | None = None  # node 0's preflight listener on the master port, until its start
        self._pool = ThreadPoolExecutor(max_workers=min(32, max(4, len(self._nodes))),
                                        thread_name_prefix="clusterrun-host")

    # -------------------------------------------------------------------------------- start

    def _request(self, rank: int, op: str, **extra: Any) -> NodeRequest:
        return node_request(op, job=self.job_id, node=rank, attempt=self.attempt, state_dir=self.spec.state_dir,
                            **extra)

    def _start_node(self, rank: int) -> tuple[NodeStatus, str]:
        node = self._nodes[rank]
        launch, plan = node.launch, self.plan
        if launch is None or plan is None:
            raise RuntimeError("start() before prepare()")
        self._set_state(rank, NodeState.STARTING)
        request = self._request(rank, "start", argv=list(launch.argv), env=dict(launch.env), cwd=launch.cwd,
                                first_rank=launch.first_rank, about=about_json(plan, self.env_overrides),
                                hang_after=self.spec.watch.hang_after, progress=self.spec.watch.progress,
                                unlisten=self._listening if rank == 0 else None, **self._env_extras(launch))
        try:
            if node.agent is None:
                answer = node.transport.call(request)
            else:
                try:
                    answer = node.agent.call(request)
                except BaseException:
                    node.close_agent()
                    raise
        except AgentError as exc:  # a setup run by the start quotes its output
            raise redacted(exc, launch, self.spec.secret_env) from None
        return decode_status(node.host, answer.get("state"), "start answer's state"), str(answer.get("setup_log") or "")

    def _env_extras(self, launch: NodeLaunch) -> dict[str, Any]:
        """What a start request says of its environment beyond ``env``: the names whose values the
        agent must not write to disk, and the ``setup`` commands (only where there are some)."""
        extras: dict[str, Any] = {"secret_env": secret_names(launch.env, self.spec.secret_env)}
        if launch.host.setup:
            extras.update(setup=list(launch.host.setup), setup_timeout=self.spec.watch.setup_timeout)
        return extras

    def start(self, ranks: Sequence[int] | None = None) -> None:
        """Start every node (or those of ``ranks``) of the prepared (or resumed) job in parallel; if
        any fails, stop the ones that started and raise."""
        if self.plan is None:
            raise RuntimeError("start() before prepare() or resume()")
        self.started_at = self.started_at or time.time()
        ranks = list(range(len(self._nodes))) if ranks is None else list(ranks)
        futures = [self._pool.submit(self._start_node, rank) for rank in ranks]
        errors: list[ClusterrunError] = []
        started: list[int] = []
        for rank, future in zip(ranks, futures, strict=True):
            try:
                answer, setup_log = parallel.result(future)
            except ClusterrunError as exc:
                errors.append(exc)
                self._set_state(rank, NodeState.FAILED, exc.message)
                continue
            started.append(rank)
            if setup_log and self.follow_logs and rank not in self.offsets:  # setup ran first: its lines first
                node, lines = self._nodes[rank], split_lines(setup_log)
                node.log.feed(lines)
                self.emit(LogLines(rank, host=node.host, lines=lines))
                self.offsets[rank] = len(setup_log.encode("utf-8", "surrogateescape"))  # the follower goes on after
            self.emit(NodeStarted(rank, host=self._nodes[rank].host, attempt=self.attempt, pid=answer.torchrun_pid))
            self._set_state(rank, NodeState.RUNNING)
        if errors:
            self._stop_nodes(started)
            raise HostsUnavailable(errors)

    # ---------------------------------------------------------------------------------- run

    def stop(self, order: StopOrder) -> None:
        """Have ``run()`` stop every node for ``order`` (safe from any thread); the first order
        decides the end (an asked one also ends the followers' wait for an unreachable host)."""
        if self._order is None:
            self._order = order
        if order.asked:
            self._stop_event.set()
        self._wake.set()
        self._inbox.ring()

    def request_stop(self, reason: str, by: str | None = None) -> None:
        """Ask ``run()`` to stop every node (the user's stop, a restart's): ``stop``; ``by``: who, for the logs."""
        self.stop(StopOrder(reason, by=by or stopped_by(reason)))

    def detach(self) -> None:
        """Make ``run()`` return None soon, leaving the job as it is (safe from signal handlers)."""
        self._detach.set()
        self._wake.set()
        self._inbox.ring()

    @property
    def detached(self) -> bool:
        return self._detach.is_set()

    def _follower(self, rank: int) -> Follower:
        interval = follow_interval(len(self.ranks))

        def request(where: dict[str, Any]) -> NodeRequest:
            return self._request(rank, "follow", logs=self.follow_logs, interval=interval, asks=True, **where)

        return Follower(rank, self._nodes[rank], request, inbox=self._inbox, reconnect=self.reconnect, tail=self.tail,
                        offset=self.offsets.get(rank, 0),
                        before=self.scrollback if rank in self._resume_at else 0,
                        detach=self._detach, stopping=self._stop_event, wake=self._wake)

    def run(self) -> JobResult | None:
        """Follow the nodes until all have ended, reporting what happens as events; stop them when
        ``stop()`` is called (by a listener too). Blocks; None if ``detach()`` was called first."""
        for rank in self.ranks:
            thread = threading.Thread(target=self._follower(rank).run, daemon=True, name=f"follow-node{rank}")
            thread.start()
            self._threads.append(thread)
        order: StopOrder | None = None  # the stop under way
        stop_futures: list[Any] = []
        watch = self._startup = (StartupWatch({r: self._nodes[r].host for r in self.ranks}, self.started_at,
                                              self.spec.watch.startup_timeout) if self.started_at else None)
        every_node = self.ranks == list(range(len(self._nodes)))  # a hang is the silence of all of them
        self._hang = HangWatch(self.ranks, hang) if every_node and (hang := self.spec.watch.hang_after) else None
        waiting = UnreachableWait(self.reconnect.give_up_after, self.emit)
        drained = 0.0  # when the loop last handled what was queued (``SETTLE``)
        while not all(self._nodes[r].final is not None for r in self.ranks):
            if self._detach.is_set():
                return None
            self._wait_unreachable(waiting, stop_futures)
            if watch is not None and order is None:
                watch.step(time.time(), self.emit)
            if self._hang is not None and (hung := self._hang.poll()) is not None:  # a node's end ages too
                if hung.since is not None or (order or self._order) is None:  # what a stop makes torchrun
                    self.emit(hung)  # print is not the job running again
            if self._order is not None and order is None:
                order, self._failed_first = self._order, self._order.after
                stop_futures = self._stop_async(order)
            self._inbox.wait(TICK if order is not None or waiting.pending or self._timed(watch) else IDLE)
            if order is None:
                self._inbox.settle(drained + SETTLE)
            self._drain(order is None)
            drained = time.monotonic()
        stops = self._stop_reports(stop_futures)
        for thread in self._threads:
            thread.join(timeout=5)
        late = order.late if order is not None else None
        for rank in late.nodes if late is not None else ():  # the nodes that started no workers failed the attempt
            self._nodes[rank].error = late.cause.message if late is not None else None
            self._set_state(rank, NodeState.FAILED, self._nodes[rank].error or "")
        interrupted = order.reason if order is not None and order.asked else None
        return self._result(stops, interrupted, late.cause if late is not None else None)

    def _timed(self, watch: StartupWatch | None) -> bool:
        """Whether a check of the loop may change with time alone: the start-up watch's notes and
        expiry, until every node started; the hang watch's wait after a node's end."""
        return (watch is not None and not watch.done) or (self._hang is not None and self._hang.waiting)

    def _drain(self, unordered: bool) -> None:
        """Handle what is in the inbox before the loop's checks again (each looks at every node),
        unless a detach or, while ``unordered``, a stop order waits."""
        for _ in range(DRAIN):
            if self._detach.is_set() or (unordered and self._order is not None):
                return
            try:
                rank, message = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(rank, message)

    def _stop_reports(self, stop_futures: Sequence[Any]) -> list[StopReport]:
        stops: list[StopReport] = []  # each node's state mended by what its stop found
        for future in stop_futures:
            report = parallel.result(future)
            if report is not None:
                stops.append(report)
                node = self._nodes[report.node]
                if report.ok and node.state is NodeState.UNREACHABLE:  # the stop got through after all
                    node.final, node.error = NodeStatus(HostState.EXITED, stop_requested=True), None
                    self._set_state(report.node, NodeState.STOPPED)
                elif report.ok and not report.killed and node.state is NodeState.STOPPED:
                    # It had ended on its own before the stop reached it (the stop killed nothing):
                    # reported as stopped, it would be "nothing was running" and "stopped (exit code 1)".
                    self._set_state(report.node, NodeState.FAILED, node.error or "")
        return stops

    def _wait_unreachable(self, waiting: UnreachableWait, stops: Sequence[Any]) -> None:
        """A failing attempt's nodes whose stop could not reach their host are waited for a bounded
        time (``run.unreachable``), then lost: never a silent wait without end."""
        now = time.time()
        for future in stops:
            report = future.result() if future.done() else None
            if report is not None and report.error and self._nodes[report.node].final is None:
                waiting.begin(report.node, report.host, report.error, now)
        for rank in (r for r in waiting.due(now) if self._nodes[r].final is None):
            node, text = self._nodes[rank], waiting.lost_text()
            node.final, node.error = node.unanswered(text), text
            self._set_state(rank, NodeState.LOST, text)
            self.emit(NodeExited(rank, result=NodeResult(rank, node.host, NodeState.LOST, error=text)))

    def _handle(self, rank: int, message: FollowMessage | Link) -> None:
        """Apply one message from a follower, and emit what it changed."""
        node = self._nodes[rank]
        if isinstance(message, LogChunk):
            data = message.data
            resume = self._resume_at.get(rank)
            if resume is not None:
                data = self._earlier(rank, message, resume)
            lines = split_lines(data)
            if lines:
                text = data if data.endswith("\n") else data + "\n"  # the lines as written: nobody joins them again
                node.log.feed(lines, text)
                self.emit(LogLines(rank, host=node.host, lines=lines, written=message.written, text=text))
            self.offsets[rank] = message.next  # shown: a viewer that leaves now resumes after it
            return
        if isinstance(message, (StateUpdate, End)):
            for event in node.news(rank, message.status):  # degraded, progress
                self.emit(event)
            if self._startup is not None:
                self._startup.update(rank, message.status)
            if self._hang is not None:  # polled by ``run``'s loop
                self._hang.update(rank, message.status)
        if isinstance(message, StateUpdate):
            new = node_state_of(message.status)
            if new in (NodeState.STARTING, NodeState.RUNNING) and node.state in (NodeState.STARTING,
                                                                                NodeState.RUNNING):
                self._set_state(rank, new)
            return
        if isinstance(message, Link) and message.gave_up:
            node.final, node.error = NodeStatus(HostState.RUNNING), f"unreachable, may still run: {message.error}"
            node.state = NodeState.UNREACHABLE
            self.emit(NodeExited(rank, result=NodeResult(rank, node.host, NodeState.UNREACHABLE, error=node.error)))
            return
        if isinstance(message, Link) and message.lost:
            node.final = node.unanswered(message.error)
            self._set_state(rank, NodeState.LOST, message.error)
            self.emit(NodeExited(rank, result=NodeResult(rank, node.host, NodeState.LOST, error=message.error)))
            return
        if isinstance(message, Link):
            self.emit(NodeLink(rank, host=node.host, up=message.up, detail=message.error,
                               since=None if message.up else message.since or time.time()))
            return
        if isinstance(message, End):
            status = message.status
            new = node_state_of(status, node.stop_sent)
            if new is NodeState.LOST and not status.error:
                status = dataclasses.replace(status, error="neither the supervisor nor torchrun runs any more "
                                             "(the host rebooted, or they were killed)")
            node.final, code = status, status.exit_code
            after = self._failed_first if new is NodeState.STOPPED else None  # fail-fast stopped it
            why = end_text(status, after)
            by = who_stopped(status) if new is NodeState.STOPPED else None
            self._set_state(rank, new, why or (f"exit code {code}" if code is not None else ""))
            self.emit(NodeExited(rank, result=NodeResult(rank, node.host, new, exit_code=code, signal=status.signal,
                                                         error=why, stopped_after=after,
                                                         stopped_by=by)))
            return

    def _earlier(self, rank: int, message: LogChunk, resume: int) -> str:
        """Emit the scrollback before the resume point once it is reached (``LogLines(earlier=True)``);
        the part of ``message`` after it."""
        node = self._nodes[rank]
        earlier, data = node.scrollback(message, resume)
        if earlier is not None:
            del self._resume_at[rank]
            if earlier:
                node.log.feed(earlier)
                self.emit(LogLines(rank, host=node.host, lines=earlier, earlier=True))
        return data

    def _stop_node(self, rank: int, by: str | None = None, failing: bool = False,
                   failed: bool = False) -> StopReport | None:
        node = self._nodes[rank]
        # A failing attempt's stop (no grace: nothing of torchrun's shutdown to stream meanwhile)
        # goes to the agent that follows the node where it still streams
        aside = node.stream if failing else None
        report = stop_node(node.transport, rank, node.host, job_id=self.job_id, attempt=self.attempt,
                           state_dir=self.spec.state_dir, grace=self.grace, by=by, failing=failing, failed=failed,
                           aside=aside)
        self.emit(NodeStopped(rank, report=report))
        return report

    def _stop_async(self, order: StopOrder) -> list[Any]:
        ranks = [r for r, n in enumerate(self._nodes) if not n.state.is_terminal and n.launch and r != order.after]
        for rank in ranks:
            self._nodes[rank].stop_sent = True
            if self._nodes[rank].final is None:
                self._set_state(rank, NodeState.STOPPING, order.reason)
        futures = [self._pool.submit(self._stop_node, rank, order.by, not order.asked) for rank in ranks]
        after = order.after
        if after is not None and (failed := self._nodes[after]).rank_failed and failed.final is None and failed.launch:
            # Its host saw a rank exit non-zero: torchrun's teardown (seconds of Python) is cut short
            # the same way; the agent records the rank's failure as the node's end (not a stop).
            futures.append(self._pool.submit(self._stop_node, after, "fail-fast after its rank failed",
                                             True, True))
        return futures

    def _stop_nodes(self, ranks: Sequence[int]) -> list[StopReport]:
        for rank in ranks:
            self._nodes[rank].stop_sent = True
        by = "clusterrun: another node could not be started"
        reports = [parallel.result(f) for f in [self._pool.submit(self._stop_node, r, by) for r in ranks]]
        return [r for r in reports if r is not None]

    def _read_tails(self, ranks: Sequence[int]) -> None:
        """Feed the last ``TAIL_READ`` lines of these nodes' logs to their diagnosis: a job followed
        without its logs (the monitor) names the root cause's rank and last lines as ``up`` does."""
        def read(rank: int) -> None:
            node = self._nodes[rank]
            request = self._request(rank, "follow", tail=TAIL_READ, once=True)
            try:
                for raw in node.transport.stream(request):
                    message = decode_follow(node.host, raw)
                    if isinstance(message, LogChunk):
                        node.log.feed(split_lines(message.data))
            except ClusterrunError:
                pass  # the diagnosis goes on from the states alone

        parallel.settled([self._pool.submit(read, rank) for rank in ranks])

    def _result(self, stops: list[StopReport], interrupted: str | None, late: RootCause | None = None) -> JobResult:
        results = node_results(self._nodes, self._failed_first)
        root = late
        if late is None and (any(r.state in (NodeState.FAILED, NodeState.LOST) for r in results)
                             or interrupted is None):
            # A node whose log was not read from its start is diagnosed from its log's tail, as by the owner (ps)
            unread = [r.node for r in results if r.state in (NodeState.FAILED, NodeState.STOPPED, NodeState.LOST)
                      and (not self.follow_logs or self._partial is None or r.node in self._partial)]
            for rank in unread:
                self._nodes[rank].log = NodeLog()
            self._read_tails(unread)
            root = root_cause_of(self._nodes)
        result = JobResult(self.job_id, tuple(results), root_cause=root, stops=tuple(stops),
                           interrupted=interrupted)
        self.emit(JobFinished(None, result=result))
        return result

    def lend_transports(self) -> list[Transport]:
        """Give this job's own transports to its owner's pool (``transports.lent``), open: from now
        on it only borrows them, and ``close`` leaves them open."""
        given = []
        for node in self._nodes:
            if not isinstance(node.transport, Lent):
                given.append(node.transport)
                node.transport = Lent(node.transport)
        return given

    def idle_agents(self) -> dict[str, AgentSession]:
        """Give the agents this job holds idle (those that followed its ended nodes), by host, to its
        owner's pool for the next attempt (``transports.lent``); ``close`` no longer closes them."""
        idle = {}
        for node in self._nodes:
            if node.agent is not None and node.agent.idle:
                idle[node.host], node.agent = node.agent, None
        return idle

    def close(self) -> None:
        self._stop_event.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for node in self._nodes:
            node.close()
            node.transport.close()


__all__ = ["Emit", "Job", "Reconnect", "node_state_of"]  # the last two: imported from here
