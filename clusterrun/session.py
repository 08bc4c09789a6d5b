"""A job as an interactive consumer drives it: follow it, kill it, restart it, detach from it.

The dashboard runs in the main thread and must never block on a host; a ``Session`` runs the
orchestrator in a background thread and hands every event to ``emit`` — from that thread, so the
consumer queues them for its own thread. Two roles:

- the **owner** (``up`` on a terminal) holds the job's owner lock: it starts the job, records
  what happens, and on ``detach()`` hands the lock to a background monitor;
- a **viewer** (``attach``) follows a job a monitor owns; ``kill()`` and ``restart()`` act on the
  hosts all the same (the monitor sees the job end and exits), and ``detach()`` just stops
  following.

``kill()`` is the orchestrator's verified stop (torchrun first, then the sweep, per node, with
``NodeStopped`` reports). ``restart()`` kills, waits until the attempt is verified gone, then
starts the next attempt with the same plan (``AttemptStarted``) and follows it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from clusterrun.errors import ClusterrunError, HostsUnavailable
from clusterrun.events import AttemptStarted, JobResult, NodeStarted, NodeState, NodeStateChanged
from clusterrun.jobs import JobRecord, JobStore
from clusterrun.lifecycle import (
    Recorder,
    fan_out,
    follower,
    mark_failed_start,
    mark_stopped,
    save_seen,
    start_attempt,
)
from clusterrun.orchestrator import Emit, Job
from clusterrun.plan import LaunchPlan

KILLED = "stopped from the dashboard"


def attempt_event(plan: LaunchPlan, attempt: int) -> AttemptStarted:
    """What a consumer needs to know of an attempt's plan, as an event."""
    nodes = []
    for launch in plan.nodes:
        gpus = launch.env.get("CUDA_VISIBLE_DEVICES")
        nodes.append((launch.host.host, launch.nproc, gpus if gpus else None))
    return AttemptStarted(None, job_id=plan.job_id, name=plan.name, attempt=attempt,
                          master_addr=plan.master_addr, master_port=plan.master_port,
                          world_size=plan.world_size, nodes=tuple(nodes))


class Session:
    """One job followed in the background, with the controls of a dashboard."""

    def __init__(self, store: JobStore, record: JobRecord, emit: Emit, *, job: Job | None = None,
                 owner_fd: int | None = None, offsets: dict[int, int] | None = None, tail: int | None = None) -> None:
        self.store = store
        self.record = record
        self.emit = emit
        self.owner_fd = owner_fd  # held: this process owns the job (else a monitor does)
        self.result: JobResult | None = None
        self.error: ClusterrunError | None = None  # the job could not be started
        self.detached = False
        self.failed_start = False  # `up`'s start failed: nothing runs
        self._to_start = job  # prepared by `up`, not started yet
        self._offsets = offsets
        self._tail = tail
        self._job: Job | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._busy = False  # a kill or restart is under way
        self._recorders: list[Recorder] = []  # flushed by detach(): the process may exit right after

    @property
    def job_id(self) -> str:
        return self.record.job_id

    @property
    def owner(self) -> bool:
        return self.owner_fd is not None

    @property
    def running(self) -> bool:
        """The job is being followed and has not ended."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def busy(self) -> bool:
        return self._busy

    def begin(self) -> None:
        """Start (``up``) or follow (``attach``) the job in the background."""
        self._spawn(self._first)

    def _spawn(self, target: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=target, daemon=True, name=f"session-{self.job_id}")
        self._thread.start()

    def _first(self) -> None:
        job = self._to_start
        if job is not None:
            assert job.plan is not None
            self._job = job
            job.emit = fan_out(self.emit, self._recorder(job.attempt))
            self.emit(attempt_event(job.plan, job.attempt))
            try:
                job.start()
            except HostsUnavailable as exc:
                mark_failed_start(self.store, self.job_id, job.attempt, exc)
                self.failed_start = True
                self.error = exc
                job.close()
                return
        else:
            try:
                self._job = self._viewer(self._offsets, self._tail)
            except ClusterrunError as exc:  # e.g. the record is gone or damaged: the UI shows it
                self.error = exc
                return
        self._follow()

    def _recorder(self, attempt: int) -> Recorder:
        recorder = Recorder(self.store, self.job_id, attempt)
        self._recorders.append(recorder)
        return recorder

    def _viewer(self, offsets: dict[int, int] | None, tail: int | None) -> Job:
        record = self.store.load(self.job_id)
        self.record = record
        emit = fan_out(self.emit, self._recorder(record.attempt)) if self.owner else self.emit
        job = follower(record, emit, fail_fast=self.owner, follow_logs=True, offsets=offsets, tail=tail)
        assert job.plan is not None
        self.emit(attempt_event(job.plan, record.attempt))
        for launch in job.plan.nodes:  # as ``resume`` assumes until the hosts say otherwise
            self.emit(NodeStateChanged(launch.rank, host=launch.host.host, state=NodeState.RUNNING))
            known = record.nodes[launch.rank] if launch.rank < len(record.nodes) else None
            if known is not None and known.pid:
                self.emit(NodeStarted(launch.rank, host=launch.host.host, attempt=record.attempt, pid=known.pid))
        return job

    def _follow(self) -> None:
        job = self._job
        assert job is not None
        try:
            self.result = job.run()
        finally:
            save_seen(self.store, self.job_id, job.attempt, job.offsets)
            job.close()
        result = self.result
        if result is not None and result.interrupted == KILLED and not self.owner:
            mark_stopped(self.store, self.store.load(self.job_id), {s.node: s for s in result.stops})

    def kill(self) -> None:
        """Stop the job on every host (verified); the result arrives as ``JobFinished``."""
        job = self._job
        if job is not None and self.running:
            job.request_stop(KILLED)

    def restart(self) -> None:
        """Kill the job if it runs, then start the next attempt and follow it; in the background.
        Errors arrive as ``self.error`` (and the session stops following)."""
        with self._lock:
            if self._busy:
                return
            self._busy = True
        previous = self._thread
        self._spawn(lambda: self._restart(previous))

    def _restart(self, previous: threading.Thread | None) -> None:
        try:
            self.kill()
            if previous is not None:
                previous.join()
            result = self.result
            if result is not None and result.stops and not all(s.ok for s in result.stops):
                self.error = ClusterrunError(f"job {self.job_id}: the last attempt could not be verified stopped "
                                             "everywhere; not restarting", hint="see the stop report")
                return
            owner = self.owner_fd
            if owner is None:
                owner = self.store.wait_own(self.job_id, timeout=60)
                if owner is None:
                    self.error = ClusterrunError(f"job {self.job_id} is still owned by another clusterrun process")
                    return
            self.result = None
            try:
                record = start_attempt(self.store, self.store.load(self.job_id), self.emit)
            except ClusterrunError as exc:
                self.error = exc
                if self.owner_fd is None:
                    os.close(owner)
                return
            self.record = record
            if self.owner_fd is None:
                self.store.spawn_monitor(self.job_id, owner)  # the monitor owns it, as after `clusterrun restart`
            try:
                self._job = self._viewer({}, None)
            except ClusterrunError as exc:  # the attempt runs; only following it failed
                self.error = exc
                return
        finally:
            self._busy = False
        self._follow()

    def detach(self) -> None:
        """Stop following and leave the job running (owned by a background monitor from now on)."""
        self.detached = True
        job = self._job
        if job is not None:
            job.detach()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for recorder in self._recorders:  # what the nodes reported, in the record before the monitor reads it
            recorder.flush()
        if self.owner_fd is not None and (self.result is None and self.error is None):
            self.store.spawn_monitor(self.job_id, self.owner_fd)
            self.owner_fd = None

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
