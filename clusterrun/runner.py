"""The owner's loop over a job on this controller: follow it, retry a start-up failure, hand it over.

Exactly one process owns a running job at a time (``jobs.JobStore``'s owner lock): the foreground
``up`` (stream or dashboard) or the job's background monitor. The owner follows the job, applies
fail-fast, keeps the record (``attempt.Recorder``), retries a known transient start-up failure
once (``attempt.restart``: the checks, the verified stop, the start, as every attempt), and either
sees the job end or hands it over to a monitor. The attempt's life itself (checks, start, stop,
its recorded state) is ``attempt.py``'s; this module is the loop around it:

- ``Runner``: start (or adopt) an attempt, ``follow()`` it to its end with the record kept and
  the start-up retry applied; ``request_stop()`` and ``request_hand_over()`` are safe from signal
  handlers and other threads, and ``hand_over()`` (in the owner's thread, after ``follow()``
  returned None) gives the lock to a monitor with what was shown saved.
- ``run_monitor()``: the background owner (``clusterrun _monitor``).

Lifecycle of a ``Runner``: ``Runner(store, record, job, owner_fd, emit)`` → ``start()`` (a new
job) → ``follow()`` → ``hand_over()`` if it returned None → ``close()``.
"""

from __future__ import annotations

import os
import threading
import time

from clusterrun import notify
from clusterrun.attempt import Recorder, launch, mark_failed_start, plan_to_start, restart
from clusterrun.diagnose import transient_start_failure
from clusterrun.errors import ClusterrunError, ConfigError, HostsUnavailable
from clusterrun.events import Event, JobNote, JobResult, JobState, NodeHung, hung_text
from clusterrun.jobs import OWNER_FD_VAR, JobRecord, JobStore
from clusterrun.lifecycle import follower, per_node, save_seen, status_of, stop_job
from clusterrun.orchestrator import Emit, Job
from clusterrun.protocol import HostState, NodeStatus


def run_monitor(store: JobStore, job_id: str, emit: Emit) -> int:
    """Own the job until it ends, in the background: follow its nodes' states (not their logs),
    apply fail-fast and the start-up retry, keep the record. Started by ``JobStore.spawn_monitor``."""
    fd_text = os.environ.pop(OWNER_FD_VAR, "")
    fd = int(fd_text) if fd_text.isdigit() else store.try_own(job_id)
    if fd is None:
        return 0  # somebody else owns the job
    record = store.load(job_id)
    if record.finished:
        notify.send_due(store, record)  # its end was recorded by an owner that died before notifying
        return 0
    store.note_monitor(job_id)
    os.chdir(record.local_cwd)
    runner = Runner.adopt(store, record, fd, emit, follow_logs=False, retry_startup=record.retry_startup)
    if record.state is JobState.STOPPING:  # a stop was asked for and its stopper died: carry it out
        runner.request_stop("stopped by an earlier command")
    try:
        if record.state == "starting":
            _finish_start(record, runner.job)
        runner.follow()
    except HostsUnavailable as exc:  # the missing nodes could not be started: the others wait in vain
        stop_job(record)
        mark_failed_start(store, job_id, record.attempt, exc)
    finally:
        runner.close()
    return 0


def _finish_start(record: JobRecord, job: Job) -> None:
    """Start the nodes that a controller which died during ``start`` never reached (from the
    plan in the record), so that the job can still run: the other nodes wait for them."""
    answers = per_node(record, lambda t, rank: status_of(t, record, rank))
    absent = [rank for rank, answer in answers.items()
              if isinstance(answer, NodeStatus) and answer.state is HostState.ABSENT]
    if absent:
        try:
            job.resume(plan_to_start(record))  # the record's plan holds secret values masked
        except ConfigError as exc:
            raise HostsUnavailable([exc]) from exc
        job.start(absent)


class Runner:
    """The owner's loop over one job (see the module docstring)."""

    def __init__(self, store: JobStore, record: JobRecord, job: Job, owner_fd: int, emit: Emit | None = None, *,
                 retry_startup: bool = True) -> None:
        self.store = store
        self.record = record
        self.job = job
        self.owner_fd: int | None = owner_fd
        self.retry_startup = retry_startup
        self._listeners: list[Emit] = [emit] if emit is not None else []
        self.recorder = Recorder(store, record.job_id, job.attempt)
        job.subscribe(self.emit)
        job.subscribe(self.recorder)
        self._hand_over = threading.Event()
        self._stop_reason: str | None = None
        self._hang_restart: str | None = None  # why the attempt is being stopped for a restart (on_hang)

    @property
    def job_id(self) -> str:
        return self.record.job_id

    @classmethod
    def adopt(cls, store: JobStore, record: JobRecord, owner_fd: int, emit: Emit | None = None, *,
              follow_logs: bool = True, offsets: dict[int, int] | None = None, retry_startup: bool = True) -> Runner:
        """The owner of a job started earlier (a monitor, or after a restart), following its current attempt."""
        job = follower(record, None, fail_fast=True, follow_logs=follow_logs, offsets=offsets)
        return cls(store, record, job, owner_fd, emit, retry_startup=retry_startup)

    def subscribe(self, listener: Emit) -> None:
        """Hand every event of the job, of this attempt and the next ones, to ``listener`` too."""
        self._listeners.append(listener)

    def unsubscribe(self, listener: Emit) -> None:
        self._listeners.remove(listener)

    def emit(self, event: Event) -> None:
        for listener in list(self._listeners):
            listener(event)
        if isinstance(event, NodeHung) and event.since is not None and event.node is not None:
            self.on_hang(event.node, event.host, event.since, event.report)

    def note(self, text: str) -> None:
        self.emit(JobNote(None, text=text))

    def on_hang(self, node: int, host: str, since: float, report: str | None) -> None:
        """Node ``node`` of the job hung (its host's hang watch): notify, then what ``on_hang`` says.
        ``stack``: its host saved the ranks' stacks already (``report``); ``restart``: stop this
        attempt, and ``follow()`` starts the next; ``nothing``: only the notification."""
        self.recorder.flush()  # what came before the hang (the job running) is in the record it sends
        record = self.store.load(self.job_id)
        notify.send_due(self.store, record, self.note, also=[notify.hung(record.attempt, node, since)])
        action = self.job.spec.watch.on_hang
        where = f"node {node} ({host}) {hung_text(since, time.time())}"
        if action == "stack" and report:
            self.note(f"{where}: its ranks' stacks are in {report} on {host}")
        elif action == "restart" and self._hang_restart is None and self._stop_reason is None:
            self._hang_restart = where
            self.job.request_stop(f"{where} (on_hang: restart)")

    def start(self) -> None:
        """Start every node of the prepared job; on failure the record says so and the nodes that
        started were stopped again (``HostsUnavailable``)."""
        launch(self.store, self.job, self.recorder)

    def request_stop(self, reason: str) -> None:
        """Stop the job on every host (verified); ``follow()`` then returns its result."""
        self._stop_reason = reason
        self.job.request_stop(reason)

    def request_hand_over(self) -> None:
        """Make ``follow()`` return None soon, so that ``hand_over()`` can give the job to a monitor."""
        self._hand_over.set()
        self.job.detach()

    def follow(self) -> JobResult | None:
        """Follow the job until it ends (then its result) or a hand-over was requested (None).
        A known transient start-up failure of the first attempt is retried once, visibly."""
        while True:
            try:
                result = self.job.run()
            except OSError:
                if self.job.detached:  # the terminal went away while a line was being shown
                    return None
                raise
            finally:
                save_seen(self.store, self.job_id, self.job.attempt, self.job.offsets)
            if result is None:
                return None
            notify.send_due(self.store, self.store.load(self.job_id), self.note)  # the attempt's end
            hang, self._hang_restart = self._hang_restart, None
            why = hang or self._retryable(result)
            if why is None:
                return result
            self.note(f"{hang}: restarting the job as attempt {self.job.attempt + 1} (on_hang: restart)" if hang else
                      f"attempt {self.job.attempt} failed at start-up: {why}; retrying once as attempt "
                      f"{self.job.attempt + 1} (--no-retry-startup turns this off)")
            try:
                record = restart(self.store, self.store.load(self.job_id), self.emit, owner_fd=self.owner_fd,
                                 full_preflight=False)  # the costlier checks passed at this job's start
            except ClusterrunError as exc:
                self.emit(JobNote(None, text=f"could not retry: {exc.render()}"))
                return result
            self.job.close()
            self.record = record
            self.job = follower(record, self.emit, fail_fast=True, follow_logs=self.job.follow_logs,
                                reconnect=self.job.reconnect)
            self.recorder = Recorder(self.store, record.job_id, record.attempt)
            self.job.subscribe(self.recorder)
            if self._stop_reason is not None:
                self.job.request_stop(self._stop_reason)
            if self._hand_over.is_set():
                self.job.detach()

    def _retryable(self, result: JobResult) -> str | None:
        if not self.retry_startup or self.job.attempt != 1 or result.interrupted is not None or result.ok:
            return None
        return transient_start_failure(result.root_cause, self.job.logs)

    def hand_over(self) -> None:
        """Give the job to a background monitor: what the nodes reported and what was shown are in
        the record first, then the owner lock passes on without a moment unowned."""
        self.recorder.flush()
        save_seen(self.store, self.job_id, self.job.attempt, self.job.offsets)
        if self.owner_fd is not None:
            self.store.spawn_monitor(self.job_id, self.owner_fd)
            self.owner_fd = None

    def close(self) -> None:
        self.job.close()


__all__ = ["Runner", "run_monitor"]
