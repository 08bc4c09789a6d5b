"""A job as an interactive consumer drives it: follow it, kill it, restart it, detach from it.

The dashboard runs in the main thread and must never block on a host; a ``Session`` runs the
orchestrator in a background thread and hands every event to ``emit`` — from that thread, so the
consumer queues them for its own thread. Two roles:

- the **owner** (``up`` on a terminal) holds the job's owner lock: it starts the job, records
  what happens, and on ``detach()`` hands the lock to a background monitor;
- a **viewer** (``attach``) follows a job a monitor owns; ``kill()`` and ``restart()`` act on the
  hosts all the same (the monitor sees the job end and exits), and ``detach()`` just stops
  following.

While it follows an attempt, a ``GpuPoller`` reads each host's GPUs every few seconds over the
job's connections (``NodeGpus`` events; ``gpu_interval=None`` turns it off).

``kill()`` is the orchestrator's verified stop (torchrun first, then the sweep, per node, with
``NodeStopped`` reports). ``restart()`` is ``attempt.restart`` — the next attempt checked, then
the verified stop of every node, whatever this view believes of them, then the next attempt
(``AttemptStarted``) — and follows the new attempt; a refused restart leaves the job running.
In ``up``'s dashboard the one owner carries both out (``Runner.request_stop``,
``Runner.restart_by_user``): the session asks it and reads its ``state``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from clusterrun.core.errors import ClusterrunError, HostsUnavailable
from clusterrun.core.events import (
    Event,
    JobFinished,
    JobNote,
    JobResult,
    NodeLink,
    NodeStarted,
    NodeState,
    NodeStateChanged,
    NodeStopped,
)
from clusterrun.diagnose.stacks import render
from clusterrun.life.attempt import NextAttempt, attempt_event, begin_stop, stop
from clusterrun.life.lifecycle import after_attempt, follower, save_seen, stacks_view
from clusterrun.life.recorder import record_stop, refresh
from clusterrun.life.runner import Runner
from clusterrun.run.orchestrator import Emit, Job
from clusterrun.store.jobs import JobRecord, JobStore
from clusterrun.store.opened import Opened
from clusterrun.transports import Transport
from clusterrun.views.gpus import INTERVAL, GpuPoller
from clusterrun.views.joblist import history_rows, job_state_text, table_text

KILLED = "stopped from the dashboard"
RESTARTED = "restarted from the dashboard"  # the stop of the attempt R replaces: not K's


class Session:
    """One job followed in the background, with the controls of a dashboard.

    Create → ``subscribe(consumer)`` → ``begin()`` → ``kill()`` / ``restart()`` / ``detach()`` /
    ``stacks()`` → ``wait()``. The policies (fail-fast, restart, hand-over, the record) are the ``Runner``'s and
    ``attempt.restart``'s: a session only runs them off the consumer's thread. An owner's session
    asks its one ``Runner`` and reads its ``state`` (started, start failed, a restart under way)."""

    supports = frozenset({"kill", "restart", "stack", "detach"})  # the dashboard's controls it carries out

    def __init__(self, store: JobStore, record: JobRecord, emit: Emit | None = None, *, runner: Runner | None = None,
                 offsets: dict[int, int] | None = None, tail: int | None = None, scrollback: int = 0,
                 gpu_interval: float | None = INTERVAL, opened: Opened | None = None) -> None:
        self.store = store
        self.record = record
        self._opened = opened or Opened(record)  # the command's; its hosts file parsed once, when first needed
        self._listeners: list[Emit] = [emit] if emit is not None else []
        self.runner = runner  # this process owns the job (``up``); else a monitor does and we view it
        self.result: JobResult | None = None
        self.error: ClusterrunError | None = None  # the job could not be started or followed
        self.detached = False
        self._offsets = offsets
        self._tail = tail
        self._scrollback = scrollback  # lines shown before where the last viewer stopped (attach)
        self._viewer: Job | None = None
        self._ended: JobFinished | None = None  # the viewed attempt's end, until its owner has decided
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._restarting = False  # a viewer's restart is under way (an owner's is in ``runner.state``)
        self._kill_asked = False  # K during a viewer's restart: the restart carries it out (see ``kill``)
        self._waiting = False  # a viewer waits for the owner's next attempt (``_view_on``)
        self._reached: set[int] = set()  # nodes this view has reached after a failure: the record's since is old
        self._gpu_interval = gpu_interval
        if runner is not None:
            runner.subscribe(self.emit)

    @property
    def job_id(self) -> str:
        return self.record.job_id

    @property
    def owner(self) -> bool:
        return self.runner is not None and self.runner.owner_fd is not None

    @property
    def running(self) -> bool:
        """The job is being followed and has not ended."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def busy(self) -> bool:
        """A restart is under way: the owner's state says so (a viewer, without one, its own)."""
        return self.runner.state.user_restart if self.runner is not None else self._restarting

    @property
    def failed_start(self) -> bool:
        """``up``'s start failed: nothing runs (the owner's state)."""
        return self.runner is not None and self.runner.state.start_failed

    def subscribe(self, listener: Emit) -> None:
        """Hand every event to ``listener`` too (from the session's thread)."""
        self._listeners.append(listener)

    def emit(self, event: Event) -> None:
        if isinstance(event, NodeLink) and event.node is not None:
            if event.up:
                self._reached.add(event.node)
            elif event.node not in self._reached:
                event = self._since_recorded(event)
        for listener in list(self._listeners):
            listener(event)

    def _since_recorded(self, event: NodeLink) -> NodeLink:
        """A viewer's news of an unreachable host, with since when the job's record knew it so
        (the owner's first failure, as ``ps`` says), if earlier than this view's own."""
        nodes = self.record.nodes
        known = nodes[event.node].unreachable_since if event.node is not None and event.node < len(nodes) else None
        if known is None or (event.since is not None and event.since <= known):
            return event
        return dataclasses.replace(event, since=known)

    def begin(self) -> None:
        """Start (``up``) or follow (``attach``) the job in the background."""
        self._spawn(self._first)

    def _spawn(self, target: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=target, daemon=True, name=f"session-{self.job_id}")
        self._thread.start()

    def _first(self) -> None:
        runner = self.runner
        if runner is not None:
            if not runner.state.started:
                assert runner.job.plan is not None
                self.emit(attempt_event(runner.job.plan, runner.job.attempt, runner.record))
                try:
                    runner.start()
                except HostsUnavailable as exc:
                    self.error = exc
                    runner.close()
                    return
        elif not self._view(self._offsets, self._tail):
            return
        self._follow()

    def _view(self, offsets: dict[int, int] | None, tail: int | None) -> bool:
        """Follow the job's current attempt as a viewer (the monitor owns it); False if it cannot be."""
        try:
            self._opened = self._opened.with_record(self.store.load(self.job_id))
            record = self._opened.record
            job = follower(record, self._viewed, owner=False, follow_logs=True, offsets=offsets, tail=tail,
                           scrollback=self._scrollback if offsets else 0, spec=self._opened.spec())
        except ClusterrunError as exc:  # e.g. the record is gone or damaged: the UI shows it
            self.error = exc
            return False
        self.record = record
        self._viewer = job
        self._announce(record, job)
        return True

    def _viewed(self, event: Event) -> None:
        """A viewer's event: its attempt's end waits for what the job's owner decides (``_view_on``)."""
        if isinstance(event, JobFinished):
            self._ended = event
        else:
            self.emit(event)

    def _announce(self, record: JobRecord, job: Job) -> None:
        assert job.plan is not None
        self.emit(attempt_event(job.plan, record.attempt, record))
        for launch in job.plan.nodes:  # as ``resume`` assumes until the hosts say otherwise
            self.emit(NodeStateChanged(launch.rank, host=launch.host.host, state=NodeState.RUNNING))
            known = record.nodes[launch.rank] if launch.rank < len(record.nodes) else None
            if known is not None and known.pid:
                self.emit(NodeStarted(launch.rank, host=launch.host.host, attempt=record.attempt, pid=known.pid))

    def _follow(self) -> None:
        job = self.runner.job if self.runner is not None else self._viewer
        assert job is not None
        poller = None
        if self._gpu_interval is not None:
            poller = GpuPoller(self._transports, self.emit, self._gpu_interval)
            poller.start()
        try:
            self._follow_job(job)
        finally:
            if poller is not None:
                poller.stop()

    def _transports(self) -> list[Transport]:
        """The transports of the nodes of the job followed now (the runner's start-up retry replaces it)."""
        job = self.runner.job if self.runner is not None else self._viewer
        return [transport for transport, _agent in job.agents] if job is not None else []

    def _follow_job(self, job: Job) -> None:
        if self.runner is not None:
            self.result = self.runner.follow()
            self.record = self.runner.record
            return
        while True:
            try:
                self.result = job.run()
            finally:
                save_seen(self.store, self.job_id, job.attempt, job.offsets)
                job.close()
            ended, self._ended = self._ended, None
            if self.result is not None and self.result.interrupted == KILLED:
                try:
                    record_stop(self.store, self.store.load(self.job_id), {s.node: s for s in self.result.stops})
                except ClusterrunError as exc:  # e.g. a full state directory: the stop stands, unrecorded
                    self.error = exc
            if ended is None:
                return
            if self.result is None or self.result.interrupted is not None:  # this view's K or R stopped it
                self.emit(ended)
                return
            if not self._view_on(ended, job.attempt):
                return
            assert self._viewer is not None
            job = self._viewer

    def _view_on(self, ended: JobFinished, attempt: int) -> bool:
        """The viewed ``attempt`` ended by itself (``ended``): once its owner has decided, either the
        job's end (False) or a restart (said as the owner's dashboard says it), its next attempt
        followed from its start (True). False too when this view is left or restarts the job itself."""
        def restarting(record: JobRecord) -> None:
            self.emit(dataclasses.replace(ended, restarting=True))
            if record.attempt == attempt:  # its backoff: when the next one starts
                self.emit(JobNote(None, text=f"the job is {job_state_text(record, time.time())}"))

        def look() -> JobRecord:  # nobody owns it (its monitor died): reconciled, and a monitor again
            self._opened = refresh(self.store, self._opened.with_record(self.store.load(self.job_id)))
            self.record = self._opened.record
            return self.record

        with self._lock:
            self._waiting = True
        try:
            record = after_attempt(look, attempt, restarting, lambda: self.detached or self.busy or self._kill_asked)
        except ClusterrunError as exc:  # the record went away or cannot be read: the end as seen
            self.error = exc
            record = None
        finally:
            with self._lock:
                self._waiting = False
                kill = self._kill_asked and not self._restarting
                if kill:
                    self._kill_asked = False
        if kill and (record is None or not record.finished):  # K during the backoff: `down`'s stop
            try:
                stop(self.store, self.store.load(self.job_id), spec=self._opened.spec(), by="K in the dashboard")
            except ClusterrunError as exc:
                self.error = exc
            record = None
            ended = dataclasses.replace(ended, result=dataclasses.replace(ended.result, interrupted=KILLED))
        if record is None or record.attempt == attempt:
            if not self.detached:
                self.emit(dataclasses.replace(ended, restarting=False))
            return False
        return self._view({}, None)

    def kill(self) -> None:
        """Stop the job on every host (verified); the result arrives as ``JobFinished``."""
        if not self.running:
            return
        if self.runner is not None:
            self.runner.request_stop(KILLED)
            return
        with self._lock:
            # stopped by the restart before it starts anything, else its new attempt; or, while the
            # owner restarts the job, by the waiting view (``_view_on``)
            if self._restarting or self._waiting:
                self._kill_asked = True
                return
        self._stop_viewed()

    def _stop_viewed(self) -> None:
        if self._viewer is not None:
            try:  # the monitor that owns the job sees the nodes die: the record says why first
                begin_stop(self.store, self.record)
            except ClusterrunError as exc:  # e.g. a full state directory: the stop goes on, unrecorded
                self.error = exc
            self._viewer.request_stop(KILLED)

    def restart(self) -> None:
        """Stop the job on every host (verified, whatever this view believes of its nodes), then
        start the next attempt and follow it; in the background. Errors arrive as ``self.error``.
        One at a time: the owner's state says whether one is under way (``Runner.begin_user_restart``)."""
        if self.runner is not None:
            if not self.runner.begin_user_restart():
                return
        else:
            with self._lock:
                if self._restarting:
                    return
                self._restarting = True
        previous = self._thread
        self._spawn(lambda: self._restart(previous))

    def _restarted(self) -> None:
        """The restart asked for ended without a new attempt to follow (refused, or it failed)."""
        if self.runner is not None:
            self.runner.end_user_restart()
        with self._lock:
            self._restarting = False
            kill, self._kill_asked = self._kill_asked, False
        if kill:  # asked once the new attempt was being started: it is the one followed now
            self._stop_viewed()

    def _restart(self, previous: threading.Thread | None) -> None:
        followed = False  # the one owner follows the new attempt: ``Runner.restarted`` ended the restart
        try:
            try:  # every check first, while the job runs on: a refused restart leaves it running
                self._opened = self._opened.with_record(self.store.load(self.job_id))
                attempt = NextAttempt(self._opened.record, self._confirmations,
                                      recorded=self.runner.spec if self.runner is not None else self._opened.spec())
            except ClusterrunError as exc:
                self.emit(JobNote(None, text="restart refused by its checks; nothing was stopped, the job runs on"))
                self.error = exc
                self._thread = previous  # still following the running attempt
                return
            ended: list[JobResult | None] = []  # the attempt's result, the job's if K cancels the restart

            def stopped() -> None:  # the attempt followed has ended: its result is not the job's
                if previous is not None:
                    previous.join()
                ended.append(self.result)
                self.result = None

            try:
                if self.owner and self.runner is not None:  # the one owner stops, starts and follows
                    record = self.runner.restart_by_user(attempt, RESTARTED, stopped)
                    followed = True
                else:
                    self._stop_viewed()
                    stopped()
                    with self._lock:
                        if self._kill_asked:  # K during the checks or the stop: nothing new starts
                            self._kill_asked = False
                            self.result = ended[0] if ended else None
                            return
                    record = attempt.replace(self.store, owner_fd=None)
            except ClusterrunError as exc:
                self.error = exc
                return
            finally:
                attempt.close()
            self.record = record
            if followed and self.runner is not None:
                self._announce(record, self.runner.job)
            elif not self._view({}, None):  # the new attempt runs, owned by its monitor; only following it failed
                return
        finally:
            if not followed:
                self._restarted()
        self._follow()

    def _confirmations(self, event: Event) -> None:
        """The restart's own verified stop, after this view's: a node it found nothing of was shown
        stopped already, so only what is news is shown (something killed, left or unreachable)."""
        r = event.report if isinstance(event, NodeStopped) else None
        if r is not None and not (r.killed or r.left or r.error or r.degraded or r.notes):
            return
        self.emit(event)

    def detach(self) -> None:
        """Stop following and leave the job running (owned by a background monitor from now on)."""
        self.detached = True
        if self.runner is not None:
            self.runner.request_hand_over()
        elif self._viewer is not None:
            self._viewer.detach()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.runner is not None and self.result is None and not self.failed_start:
            self.runner.hand_over()

    def stacks(self) -> list[str]:
        """Every rank's Python stack, grouped, as ``clusterrun stack`` prints it (blocks on the
        hosts: call it off the consumer's thread)."""
        try:
            return render(stacks_view(self._opened.with_record(self.record)))
        except ClusterrunError as exc:
            return [exc.render()]

    def history(self) -> list[str]:
        """The job's attempts as ``ps JOB`` lists them (started, duration, end, restarted, root
        cause), from its record now: the dashboard's ``h``."""
        try:
            record = self.store.load(self.job_id)
        except ClusterrunError as exc:
            return [exc.render()]
        return table_text(history_rows(record, time.time()))

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
