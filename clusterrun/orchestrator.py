"""Run a job across its hosts and tell consumers what happens, as events.

Lifecycle of a ``Job``: create → ``prepare()`` (connect and probe every host in parallel, build
the plan; all or nothing) → ``start()`` (start every node; if one fails, stop those started) →
``run()`` (follow every node until all have ended; fail-fast; returns the ``JobResult``) →
``close()``. A job started earlier is followed again with ``resume(plan)`` instead of
``prepare()`` and ``start()``. ``request_stop()`` may be called from any thread or a signal
handler; the stop itself is carried out by ``run()``'s loop.

Who follows decides what is followed: the job's owner (``up``, the monitor) applies fail-fast;
a viewer (``attach``, ``logs -f``) passes ``fail_fast=False`` and only watches, and the monitor
passes ``follow_logs=False`` and watches states only. A node whose host cannot be reached is
retried, from the byte offset it had reached, for ``LOST_AFTER`` seconds before it counts as lost.

One follower thread per node reads the agent's ``follow`` stream and puts messages on a bounded
queue (back-pressure: a slow consumer slows the readers, never memory); ``run()`` is the only
place that changes job state and calls ``emit``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from clusterrun.config import ClusterSpec
from clusterrun.diagnose import NodeLog, find_root_cause
from clusterrun.errors import AgentError, ClusterrunError, HostsUnavailable, TransportError
from clusterrun.events import (
    Event,
    JobFinished,
    JobResult,
    LogLines,
    NodeExited,
    NodeLink,
    NodeResult,
    NodeStarted,
    NodeState,
    NodeStateChanged,
    NodeStopped,
    StopReport,
)
from clusterrun.plan import HostFacts, LaunchPlan, NodeLaunch, build_plan
from clusterrun.transports import AgentSession, Transport, transport_for

Emit = Callable[[Event], None]
MIN_PYTHON = (3, 8)
LOST_AFTER = 30.0


def split_lines(data: str) -> tuple[str, ...]:
    """The lines of a ``log`` message's data, without their newlines."""
    lines = data.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return tuple(lines)


def node_state_of(state: dict[str, Any], stop_sent: bool = False) -> NodeState:
    """A node's state from the agent's ``state.json`` (as ``follow``/``status`` report it)."""
    if state.get("state") == "lost":
        return NodeState.LOST
    if state.get("state") == "absent":
        return NodeState.PENDING
    if state.get("state") != "exited":
        return NodeState.STARTING if state.get("state") == "starting" else NodeState.RUNNING
    if state.get("exit_code") == 0 and not state.get("error"):
        return NodeState.SUCCEEDED
    if stop_sent or state.get("stop_requested"):
        return NodeState.STOPPED
    return NodeState.FAILED


@dataclass
class _Node:
    launch: NodeLaunch | None
    transport: Transport
    state: NodeState = NodeState.PENDING
    final: dict[str, Any] | None = None
    log: NodeLog = field(default_factory=NodeLog)
    stop_sent: bool = False
    agent: AgentSession | None = None  # the agent that probed the host, kept to start and follow the node
    probe: dict[str, Any] = field(default_factory=dict)  # its answer

    @property
    def host(self) -> str:
        return self.transport.name

    def close_agent(self) -> None:
        agent, self.agent = self.agent, None
        if agent is not None:
            agent.close()


class Job:
    """One run of a job on its hosts (see the module docstring for the lifecycle)."""

    def __init__(
        self,
        spec: ClusterSpec,
        script: str,
        script_args: Sequence[str] = (),
        *,
        job_id: str,
        name: str,
        emit: Emit,
        env_overrides: dict[str, str] | None = None,
        local_cwd: str | None = None,
        grace: float = 10.0,
        attempt: int = 1,
        transport_factory: Callable[..., Transport] = transport_for,
        fail_fast: bool = True,
        follow_logs: bool = True,
        offsets: dict[int, int] | None = None,
        tail: int | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        self.spec = spec
        self.script = script
        self.script_args = tuple(script_args)
        self.job_id = job_id
        self.name = name
        self.emit = emit
        self.env_overrides = env_overrides or {}
        self.local_cwd = local_cwd
        self.grace = grace
        self.attempt = attempt
        self.fail_fast = fail_fast
        self.follow_logs = follow_logs
        self.offsets: dict[int, int] = dict(offsets or {})  # where each node's log is followed from/to
        self.tail = tail
        self.plan: LaunchPlan | None = None
        self._detach = threading.Event()
        self._nodes = [_Node(None, transport_factory(h)) for h in spec.hosts]
        self.ranks = list(range(len(self._nodes))) if ranks is None else sorted(ranks)  # the nodes run() follows
        self._inbox: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue(maxsize=256)
        self._stop_reason: str | None = None
        self._stop_event = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pool = ThreadPoolExecutor(max_workers=min(32, max(4, len(self._nodes))),
                                        thread_name_prefix="clusterrun-host")

    # ------------------------------------------------------------------------------ prepare

    def _set_state(self, rank: int, state: NodeState, detail: str = "") -> None:
        node = self._nodes[rank]
        if node.state is not state:
            node.state = state
            self.emit(NodeStateChanged(rank, host=node.host, state=state, detail=detail))

    def _probe(self, rank: int) -> dict[str, Any]:
        node = self._nodes[rank]
        node.transport.connect()
        node.agent = node.transport.session()
        answer = node.agent.call({"op": "probe", "free_port": rank == 0 and self.spec.master_port is None,
                                  "state_dir": self.spec.state_dir})
        version = tuple(int(p) for p in str(answer.get("python", "0.0")).split(".")[:2])
        if version < MIN_PYTHON:
            raise AgentError(node.host, f"{node.transport.python} is Python {answer.get('python')}; "
                             "the agent needs 3.8 or newer", hint="set `python:` for this host")
        if not answer.get("torch"):
            raise AgentError(node.host, f"torch is not installed for {node.transport.python}",
                             hint="install torch on that host, or set `python:` to an interpreter that has it")
        node.probe = answer
        return answer

    @property
    def host_fallbacks(self) -> dict[int, list[str]]:
        """What each probed host lacks, by node rank (no cgroup and why, no pidfd, ...): see the agent's probe."""
        return {rank: [str(f) for f in node.probe.get("fallbacks") or ()] for rank, node in enumerate(self._nodes)}

    def prepare(self) -> LaunchPlan:
        """Connect to and probe every host in parallel, then build the plan. Raises
        ``HostsUnavailable`` listing every host that failed; then nothing has started."""
        for rank in range(len(self._nodes)):
            self._set_state(rank, NodeState.CONNECTING)
        futures = [self._pool.submit(self._probe, rank) for rank in range(len(self._nodes))]
        answers: list[dict[str, Any]] = []
        errors: list[ClusterrunError] = []
        for future, node in zip(futures, self._nodes, strict=True):
            try:
                answers.append(future.result())
            except ClusterrunError as exc:
                errors.append(exc)
            except OSError as exc:  # a transport that did not translate its error
                errors.append(TransportError(node.host, str(exc)))
        if errors:
            for node in self._nodes:
                node.close_agent()
            raise HostsUnavailable(errors)
        port = self.spec.master_port or int(answers[0]["port"])
        facts = [HostFacts(python=n.transport.python, torchrun_flags=tuple(a.get("torchrun_flags") or ()),
                           address=n.transport.address)
                 for n, a in zip(self._nodes, answers, strict=True)]
        self.plan = build_plan(self.spec, self.script, self.script_args, job_id=self.job_id, name=self.name,
                               facts=facts, master_port=port, env_overrides=self.env_overrides,
                               local_cwd=self.local_cwd, grace=self.grace)
        for node, launch in zip(self._nodes, self.plan.nodes, strict=True):
            node.launch = launch
        return self.plan

    def resume(self, plan: LaunchPlan) -> None:
        """Follow a job that was started earlier (by this or another controller) with ``plan``."""
        self.plan = plan
        for node, launch in zip(self._nodes, plan.nodes, strict=True):
            node.launch = launch
            node.state = NodeState.RUNNING

    # -------------------------------------------------------------------------------- start

    def _request(self, rank: int, op: str, **extra: Any) -> dict[str, Any]:
        return {"op": op, "job": self.job_id, "node": rank, "attempt": self.attempt,
                "state_dir": self.spec.state_dir, **extra}

    def _start_node(self, rank: int) -> dict[str, Any]:
        node = self._nodes[rank]
        launch = node.launch
        if launch is None:
            raise RuntimeError("start() before prepare()")
        self._set_state(rank, NodeState.STARTING)
        request = self._request(rank, "start", argv=list(launch.argv), env=dict(launch.env), cwd=launch.cwd,
                                first_rank=launch.first_rank)
        if node.agent is None:
            return node.transport.call(request)
        try:
            return node.agent.call(request)
        except BaseException:
            node.close_agent()
            raise

    def start(self, ranks: Sequence[int] | None = None) -> None:
        """Start every node (or those of ``ranks``) in parallel; if any fails, stop the ones that
        started and raise."""
        if self.plan is None:
            self.prepare()
        ranks = list(range(len(self._nodes))) if ranks is None else list(ranks)
        futures = [self._pool.submit(self._start_node, rank) for rank in ranks]
        errors: list[ClusterrunError] = []
        started: list[int] = []
        for rank, future in zip(ranks, futures, strict=True):
            try:
                answer = future.result()
            except ClusterrunError as exc:
                errors.append(exc)
                self._set_state(rank, NodeState.FAILED, exc.message)
                continue
            started.append(rank)
            pid = ((answer.get("state") or {}).get("torchrun") or {}).get("pid")
            self.emit(NodeStarted(rank, host=self._nodes[rank].host, attempt=self.attempt, pid=pid))
            self._set_state(rank, NodeState.RUNNING)
        if errors:
            self._stop_nodes(started)
            raise HostsUnavailable(errors)

    # ---------------------------------------------------------------------------------- run

    def request_stop(self, reason: str) -> None:
        """Ask ``run()`` to stop every node (safe from signal handlers and other threads)."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._stop_event.set()

    def detach(self) -> None:
        """Make ``run()`` return None soon, leaving the job as it is (safe from signal handlers)."""
        self._detach.set()

    def _follow(self, rank: int) -> None:
        node = self._nodes[rank]
        tail = self.tail
        failures = 0
        last_heard = time.monotonic()
        while True:
            where: dict[str, Any] = {"offset": self.offsets.get(rank, 0)} if tail is None else {"tail": tail}
            request = self._request(rank, "follow", logs=self.follow_logs, **where)
            agent, node.agent = node.agent, None
            try:
                stream = agent.stream(request) if agent is not None else node.transport.stream(request)
                try:
                    for message in stream:
                        if message.get("ok") is False:
                            raise AgentError(node.host, str(message.get("error")))
                        if failures:
                            self._inbox.put((rank, {"t": "reconnected"}))
                        last_heard, failures = time.monotonic(), 0
                        if message.get("t") == "beat":
                            continue
                        if message.get("t") == "log":
                            self.offsets[rank] = int(message["next"])
                            tail = None
                        self._inbox.put((rank, message))
                        if message.get("t") == "end":
                            return
                finally:
                    stream.close()
            except ClusterrunError as exc:
                error = exc.render()
            else:
                error = "the log stream ended early"
            if self._detach.is_set():
                return
            failures += 1
            if failures == 1 and not self._stop_event.is_set():
                self._inbox.put((rank, {"t": "unreachable", "error": error}))
            if time.monotonic() - last_heard > LOST_AFTER or self._stop_event.is_set() and failures > 1:
                self._inbox.put((rank, {"t": "lost", "error": error}))
                return
            time.sleep(min(2.0, 0.2 * failures))

    def run(self) -> JobResult | None:
        """Follow the nodes until all have ended; stop the rest when one fails (``fail_fast``).
        Blocks; returns None if ``detach()`` was called first."""
        for rank in self.ranks:
            thread = threading.Thread(target=self._follow, args=(rank,), daemon=True, name=f"follow-node{rank}")
            thread.start()
            self._threads.append(thread)
        stopping = False
        interrupted: str | None = None
        stops: list[StopReport] = []
        stop_futures: list[Any] = []
        while not all(self._nodes[r].state.is_terminal and self._nodes[r].final is not None for r in self.ranks):
            if self._detach.is_set():
                return None
            if self._stop_event.is_set() and not stopping:
                stopping = True
                interrupted = self._stop_reason
                stop_futures = self._stop_async(reason=self._stop_reason or "stop requested")
            try:
                rank, message = self._inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if self._handle(rank, message) and self.fail_fast and not stopping:
                stopping = True
                failed = self._nodes[rank]
                stop_futures = self._stop_async(reason=f"node {rank} ({failed.host}) failed")
        for future in stop_futures:
            report = future.result()
            if report is not None:
                stops.append(report)
        for thread in self._threads:
            thread.join(timeout=5)
        return self._result(stops, interrupted)

    def _handle(self, rank: int, message: dict[str, Any]) -> bool:
        """Apply one message from a follower; True if the node has just failed."""
        node = self._nodes[rank]
        kind = message.get("t")
        if kind == "log":
            lines = split_lines(message["data"])
            if lines:
                node.log.feed(lines)
                self.emit(LogLines(rank, host=node.host, lines=lines))
            return False
        if kind == "state":
            new = node_state_of(message.get("state") or {})
            if new in (NodeState.STARTING, NodeState.RUNNING) and node.state in (NodeState.STARTING,
                                                                                NodeState.RUNNING):
                self._set_state(rank, new)
            return False
        if kind in ("unreachable", "reconnected"):
            self.emit(NodeLink(rank, host=node.host, up=kind == "reconnected", detail=str(message.get("error") or "")))
            return False
        if kind == "lost":
            node.final = {"state": "lost", "error": message.get("error")}
            self._set_state(rank, NodeState.LOST, str(message.get("error") or ""))
            self.emit(NodeExited(rank, result=NodeResult(rank, node.host, NodeState.LOST, error=message.get("error"))))
            return True
        if kind == "end":
            state = message.get("state") or {}
            node.final = state
            code, sig = state.get("exit_code"), state.get("signal")
            new = node_state_of(state, node.stop_sent)
            if new is NodeState.LOST:
                state = dict(state, error=state.get("error") or "neither the supervisor nor torchrun runs any more "
                             "(the host rebooted, or they were killed)")
                node.final = state
            detail = state.get("error") or (f"exit code {code}" if code is not None else "")
            self._set_state(rank, new, detail)
            self.emit(NodeExited(rank, result=NodeResult(rank, node.host, new, exit_code=code, signal=sig,
                                                         error=state.get("error"))))
            return new in (NodeState.FAILED, NodeState.LOST)
        return False

    def _stop_node(self, rank: int) -> StopReport | None:
        node = self._nodes[rank]
        try:
            answer = node.transport.call(self._request(rank, "stop", grace=self.grace))
        except ClusterrunError as exc:
            report = StopReport(rank, node.host, error=exc.render())
        else:
            report = StopReport.from_answer(rank, node.host, answer)
        self.emit(NodeStopped(rank, report=report))
        return report

    def _stop_async(self, reason: str) -> list[Any]:
        ranks = [r for r, n in enumerate(self._nodes) if not n.state.is_terminal and n.launch is not None]
        for rank in ranks:
            self._nodes[rank].stop_sent = True
            self._set_state(rank, NodeState.STOPPING, reason)
        return [self._pool.submit(self._stop_node, rank) for rank in ranks]

    def _stop_nodes(self, ranks: Sequence[int]) -> list[StopReport]:
        for rank in ranks:
            self._nodes[rank].stop_sent = True
        reports = [f.result() for f in [self._pool.submit(self._stop_node, r) for r in ranks]]
        return [r for r in reports if r is not None]

    def _result(self, stops: list[StopReport], interrupted: str | None) -> JobResult:
        results = []
        for rank, node in enumerate(self._nodes):
            final = node.final or {}
            results.append(NodeResult(rank, node.host, node.state, exit_code=final.get("exit_code"),
                                      signal=final.get("signal"), error=final.get("error")))
        root = None
        if any(r.state in (NodeState.FAILED, NodeState.LOST) for r in results) or interrupted is None:
            root = find_root_cause(
                hosts={r: n.host for r, n in enumerate(self._nodes)},
                logs={r: n.log for r, n in enumerate(self._nodes)},
                states={r: n.final for r, n in enumerate(self._nodes) if n.final is not None},
                stopped_by_us={r for r, n in enumerate(self._nodes)
                                if n.stop_sent or (n.final or {}).get("stop_requested")},
            )
        result = JobResult(self.job_id, tuple(results), root_cause=root, stops=tuple(stops),
                           interrupted=interrupted)
        self.emit(JobFinished(None, result=result))
        return result

    def close(self) -> None:
        self._stop_event.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for node in self._nodes:
            node.close_agent()
            node.transport.close()
