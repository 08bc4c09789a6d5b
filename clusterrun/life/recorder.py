"""A job's record kept true to its attempts: ``move``, the one place a job's recorded state is assigned.

The state changes only through ``jobstate.transition``, applied by ``move``: here by the
``Recorder`` (what the owner's follower sees, a failed start, and an attempt's end with the
restart the owner decided before, ``Recorder.finish``), ``reconcile`` (the hosts' word for a job
nobody owns), ``record_stop`` and ``give_up``; in ``attempt`` by the stop (``begin_stop``) and
the start of the next attempt.
``new_record`` is a job's record before its first attempt; ``refresh`` makes a record current
for ``ps`` and ``logs``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from clusterrun.config.environment import mask_env
from clusterrun.config.watch import Notify, Watch
from clusterrun.core import timings
from clusterrun.core.errors import ClusterrunError, StateError, TransportError
from clusterrun.core.events import (
    Event,
    EveryNodeJoined,
    JobFinished,
    JobHung,
    JobResult,
    JobState,
    NodeExited,
    NodeLink,
    NodeStarted,
    NodeState,
    NodeStateChanged,
    ProgressChanged,
    StopReport,
)
from clusterrun.core.frozen import frozen
from clusterrun.core.progress import Progress
from clusterrun.core.protocol import HostState
from clusterrun.life import notify
from clusterrun.life.jobstate import Change, outcome, transition
from clusterrun.life.lifecycle import per_node, status_of
from clusterrun.run.follower import end_note, node_state_of
from clusterrun.run.plan import LaunchPlan, plan_to_json
from clusterrun.store.jobs import AttemptRecord, JobRecord, JobStore, NodeRecord
from clusterrun.store.opened import Opened


def move(record: JobRecord, change: Change) -> bool:
    """Apply ``change`` to the record's current attempt (the one place a job's state is assigned);
    True if the state changed. An end also ends the attempt."""
    new = transition(record.state, change)
    if new is record.state:
        return False
    if record.attempts and record.state is JobState.RESTARTING and change is Change.STOP:
        record.attempts[-1].restart = None  # stopped during the backoff: the policy did not restart it
    record.state = new
    if record.attempts:
        attempt = record.attempts[-1]
        if not (attempt.ended is not None and attempt.state in ENDED_BY_ITSELF):  # an attempt ends once
            attempt.state = new if new is not JobState.RESTARTING else JobState.FAILED
        if new.is_terminal or new is JobState.RESTARTING:
            attempt.ended = attempt.ended or time.time()
    return True


# How an attempt that ended by itself is recorded; a stop during the backoff after it leaves that
# (the job is stopped, the attempt failed).
ENDED_BY_ITSELF = (JobState.FAILED, JobState.LOST, JobState.SUCCEEDED)


def new_record(plan: LaunchPlan, *, hosts_file: str, hosts_text: str, env_overrides: dict[str, str],
               local_cwd: str, ssh_config: str | None, unreachable_timeout: float | None = None,
               retry_startup: bool = True, max_restarts: int | None = None, watch: Watch | None = None,
               notify: Notify | None = None) -> JobRecord:
    """The record of a job about to start its first attempt (``starting``); ``watch`` and
    ``notify``: the hosts file's with ``up``'s options applied (kept for every later attempt)."""
    return JobRecord(
        job_id=plan.job_id, name=plan.name, created=time.time(), hosts_file=os.path.abspath(hosts_file),
        hosts_text=hosts_text, script=plan.script, script_args=list(plan.script_args),
        env_overrides=mask_env(env_overrides, plan.secret_env), local_cwd=local_cwd, grace=plan.grace,
        ssh_config=ssh_config,
        plan=plan_to_json(plan), attempt=1, unreachable_timeout=unreachable_timeout, retry_startup=retry_startup,
        max_restarts=max_restarts,
        attempts=[AttemptRecord(1, started=time.time(), master_port=plan.master_port)],
        nodes=[NodeRecord(n.rank, n.host.host) for n in plan.nodes],
        watch=(watch or Watch()).to_json(), notify=notify.to_json() if notify is not None else None,
    )


@frozen
class Retry:
    """The owner's decision to restart a failed attempt: ``kind`` "policy" (``restart:``),
    "start-up" (the start-up retry) or "requested" (``Runner.request_restart``: the owner stopped
    it to restart it), at the wall-clock time ``at``, for ``reason``."""

    kind: str
    at: float
    reason: str


class Recorder:
    """An ``emit`` consumer that keeps the job's record up to date with what its owner's follower
    sees (and nothing else); it records and never decides. Lifecycle: ``Recorder(store, job_id,
    attempt)`` → ``job.subscribe(it)`` → ``flush()``. ``finish(result, retry)``: the attempt's end,
    with the owner's decision to restart it recorded in the same write (``restarting`` instead of
    ``failed``: nobody sees an end that is not one). ``record``: the record as its last write left
    it (after ``flush()``; ``record`` as given until then), so that its owner never reloads it."""

    def __init__(self, store: JobStore, job_id: str, attempt: int, record: JobRecord | None = None) -> None:
        self.store = store
        self.job_id = job_id
        self.attempt = attempt
        self.record = record
        self.restarting = False  # the attempt's end was recorded as ``restarting`` (the owner's ``retry``)
        self._pending: list[Callable[[JobRecord], None]] = []
        self._idle = threading.Condition()
        self._writer: threading.Thread | None = None

    def _submit(self, change: Callable[[JobRecord], None]) -> None:
        """Queue ``change`` for the record. A writer thread applies what is queued in one write
        and exits when nothing is left: the threads that emit events never wait for the disk, and
        32 nodes starting at once make a few writes of the record, not 128. It is not a daemon:
        the process does not exit before the record is written."""
        with self._idle:
            self._pending.append(change)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_all, name=f"record-{self.job_id}")
                self._writer.start()

    def _write_all(self) -> None:
        while True:
            with self._idle:
                batch, self._pending = self._pending, []
                if not batch:
                    self._writer = None
                    self._idle.notify_all()
                    return

            def change(record: JobRecord, batch: list[Callable[[JobRecord], None]] = batch) -> None:
                for each in batch:
                    each(record)

            try:
                self.record = self.store.update(self.job_id, change)
            except (OSError, ClusterrunError) as exc:  # the record is gone or damaged: say so, go on
                text = exc.render() if isinstance(exc, ClusterrunError) else str(exc)
                print(f"clusterrun: cannot update the record of job {self.job_id}: {text}", file=sys.stderr)

    def begin(self, change: Callable[[JobRecord], None]) -> JobRecord:
        """Record the start of this attempt (``change``) now, in the caller's thread: what it
        raises (``Cancelled``, ``IllegalTransition``, ``StateError``) stops the start."""
        self.record = self.store.update(self.job_id, change)
        return self.record

    def start_failed(self, error: ClusterrunError) -> None:
        """This attempt could not start on every host (those that started were stopped again)."""
        self.flush()
        self.record = self.store.update(self.job_id, _failed_start(self.attempt, error))

    def flush(self) -> None:
        """Return once every change submitted so far is in the record."""
        with self._idle:
            while self._writer is not None:
                self._idle.wait()

    def _node(self, rank: int, **changes: Any) -> None:
        def change(record: JobRecord) -> None:
            if record.attempt != self.attempt:
                return  # a newer attempt has started: this one's news is history
            node = record.nodes[rank]
            for key, value in changes.items():
                setattr(node, key, value)
            now = JobState.of_nodes(n.state for n in record.nodes)
            if record.state is JobState.STARTING and now is JobState.RUNNING:
                move(record, Change.ALL_RUNNING)

        self._submit(change)

    def _hung(self, ranks: tuple[int, ...], since: float | None) -> None:
        def change(record: JobRecord) -> None:
            if record.attempt == self.attempt:
                for rank in ranks:
                    record.nodes[rank].hung_since = since

        self._submit(change)

    def _link(self, rank: int, *, up: bool, since: float) -> None:
        def change(record: JobRecord) -> None:
            if record.attempt == self.attempt:
                node = record.nodes[rank]
                node.unreachable_since = None if up else node.unreachable_since or since

        self._submit(change)

    def phase(self, name: str, at: float | None = None) -> None:
        """Phase ``name`` of this attempt's start is over (now, or ``at``): ``AttemptRecord.phases``."""
        at = time.time() if at is None else at

        def change(record: JobRecord) -> None:
            attempt = record.attempts[-1] if record.attempts else None
            if record.attempt == self.attempt and attempt is not None and attempt.attempt == self.attempt:
                attempt.phases = attempt.phases or {}
                timings.mark(attempt.phases, name, at)

        self._submit(change)

    def _progress(self, progress: Progress) -> None:
        shown = dataclasses.replace(progress, attempt=self.attempt)

        def change(record: JobRecord) -> None:
            if record.attempt == self.attempt:  # the earlier attempts' curves go on with this one's
                record.progress = shown.after(Progress.from_json(record.progress)).to_json()

        self._submit(change)

    def __call__(self, event: Event) -> None:
        if event.node is not None and isinstance(event, NodeStarted):
            self._node(event.node, pid=event.pid)
        elif event.node is not None and isinstance(event, NodeStateChanged):
            self._node(event.node, state=event.state)
        elif event.node is not None and isinstance(event, NodeExited):
            r = event.result
            self._node(event.node, state=r.state, exit_code=r.exit_code, signal=r.signal, error=r.error)
            self._link(event.node, up=r.state is not NodeState.UNREACHABLE, since=time.time())
        elif event.node is not None and isinstance(event, NodeLink):
            self._link(event.node, up=event.up, since=event.since or time.time())
        elif isinstance(event, JobHung):
            self._hung(event.nodes, event.since)
        elif isinstance(event, ProgressChanged):
            self._progress(event.progress)
        elif isinstance(event, EveryNodeJoined):
            self.phase("joined", event.at)
        elif isinstance(event, JobFinished):
            self.finish(event.result)

    def finish(self, result: JobResult, retry: Retry | None = None) -> None:
        """The attempt's end as its follower saw it: a stop asked of this owner is decided by the
        stop; otherwise the nodes' ends (absorbed if the job is stopping or ended already).
        ``retry``: the owner decided to restart the attempt that ended badly; recorded instead of
        its end if it is still starting or running (a stop recorded meanwhile decides)."""
        end = JobState.of_nodes(n.state for n in result.nodes)
        if result.interrupted is not None:
            changes = [Change.STOP, Change.STOP_VERIFIED if end is not None else Change.STOP_UNVERIFIED]
        else:
            changes = [outcome(end)] if end is not None else []

        def change(record: JobRecord) -> None:
            if record.attempt != self.attempt:
                return
            ended_badly = end in (JobState.FAILED, JobState.LOST) or result.interrupted is not None
            applies = retry is not None and ended_badly and bool(changes) and record.state in (JobState.STARTING,
                                                                                              JobState.RUNNING)
            moved = [move(record, c) for c in ([Change.RETRY] if applies else changes)]
            self.restarting = applies and all(moved)
            if applies and retry is not None and record.attempts:
                record.attempts[-1].state, record.attempts[-1].restart = end or JobState.STOPPED, retry.kind
                record.restart_at = retry.at
            if any(moved) and record.state in (JobState.FAILED, JobState.LOST, JobState.RESTARTING):
                attempt = record.attempts[-1]
                cause = result.root_cause
                attempt.root_cause = cause.describe() if cause else (retry.reason if applies and retry else None)
                explained = cause.explanation if cause else None
                attempt.cause, attempt.fix = (explained.cause, explained.fix) if explained else (None, None)

        self._submit(change)
        self.flush()


NOT_STARTED = (NodeState.PENDING, NodeState.CONNECTING, NodeState.STARTING)
GONE = ("its host has no state of it any more (the state directory was deleted?): whether it still runs is not "
        "known; `clusterrun down` looks for its processes")


def reconcile(store: JobStore, job: Opened) -> JobRecord:
    """Ask every host how the current attempt is doing and write that into the record.

    Only for a job that has no owner (the owner keeps the record itself). A host that cannot be
    reached leaves its node as it was, with the error noted (and since when: ``note_reachable``);
    so does a host that has no state of a node that was started (``GONE``). A job left
    ``stopping`` (its stopper died) whose nodes have all ended is ``stopped``."""
    record = job.record
    answers = per_node(record, lambda t, rank: status_of(t, record, rank), spec=job.spec())
    now = time.time()

    def change(rec: JobRecord) -> None:
        if rec.attempt != record.attempt:
            return
        for rank, answer in answers.items():
            node = rec.nodes[rank]
            note_reachable(node, answer, now)
            if isinstance(answer, ClusterrunError):
                why = "unreachable" if isinstance(answer, TransportError) else "no answer"
                node.error = f"{why}: {answer.one_line()}"
                continue
            if answer.state is HostState.ABSENT and (node.pid is not None or node.state not in NOT_STARTED):
                node.error = GONE  # it was started: never shown pending again, nor ended, on this word alone
                continue
            node.state = node_state_of(answer)
            node.pid = answer.torchrun_pid or node.pid
            node.exit_code, node.signal = answer.exit_code, answer.signal
            node.error = answer.error or end_note(answer) or ("neither the supervisor nor torchrun runs any more"
                                                              if node.state is NodeState.LOST else None)
        new = JobState.of_nodes(NodeState.UNREACHABLE if isinstance(answers.get(n.rank), ClusterrunError)
                                else n.state for n in rec.nodes)
        if new is JobState.RUNNING and rec.state is JobState.STARTING:
            move(rec, Change.ALL_RUNNING)
        elif new is not None and new.is_terminal:  # pending nodes were never started: the monitor starts them
            move(rec, Change.STOP_VERIFIED if rec.state is JobState.STOPPING else outcome(new))

    return store.update(record.job_id, change)


def note_reachable(node: NodeRecord, answer: object, now: float) -> None:
    """Keep in ``node`` since when its host could not be reached (``answer``: a status answer, or
    the error that kept it away; only a ``TransportError`` says the host is unreachable), from the
    first failure on, until the host answers."""
    if isinstance(answer, TransportError):
        node.unreachable_since = node.unreachable_since or now
    elif not isinstance(answer, ClusterrunError):
        node.unreachable_since = None


def record_reachability(store: JobStore, record: JobRecord, answers: dict[int, Any]) -> JobRecord:
    """What every node's status call (``lifecycle.node_statuses``) said of reaching its host, into
    the record (written only when that changes it); a record that cannot be written is changed in
    memory only, for what is shown now."""
    now = time.time()

    def change(rec: JobRecord) -> None:
        if rec.attempt == record.attempt:
            for rank, answer in answers.items():
                if rank < len(rec.nodes):
                    note_reachable(rec.nodes[rank], answer, now)

    preview = JobRecord.from_json(record.to_json())
    change(preview)
    if [n.unreachable_since for n in preview.nodes] == [n.unreachable_since for n in record.nodes]:
        return record
    try:
        return store.update(record.job_id, change)
    except StateError:
        return preview


def refresh(store: JobStore, job: Opened) -> Opened:
    """The job made current: if it is unfinished and nobody owns it, reconcile it with its hosts
    and start a monitor for it (fail-fast resumes), unless it was adopted from its hosts
    (``discover``): the controller that started it may still be watching it."""
    record = job.record
    if record.finished and record.notify is not None and notify.due(record) and not store.owned(record.job_id):
        notify.send_due(store, record)  # its owner recorded the end and died before notifying
    if record.finished or store.owned(record.job_id):
        return job
    record = reconcile(store, job)
    if not record.finished and not record.adopted:
        store.spawn_monitor(record.job_id)
    elif not record.adopted:  # it ended with nobody owning it: its notifications are due here
        notify.send_due(store, record)
    return job.with_record(record)


def give_up(store: JobStore, job_id: str, attempt: int, why: str) -> None:
    """A restart the owner decided could not be carried out: the job is ``failed`` with ``why``
    (unless a stop came first: then it stays stopped)."""
    def change(rec: JobRecord) -> None:
        if rec.attempt == attempt and rec.state is JobState.RESTARTING and move(rec, Change.GIVE_UP):
            rec.attempts[-1].root_cause = f"{rec.attempts[-1].root_cause or 'failed'}; not restarted: {why}"
            rec.restart_at = None

    store.update(job_id, change)


def _failed_start(attempt: int, error: ClusterrunError) -> Callable[[JobRecord], None]:
    """The change that records that ``attempt`` could not start on every host (those that started
    were stopped again)."""
    def change(rec: JobRecord) -> None:
        if rec.attempt == attempt and move(rec, Change.START_FAILED) and rec.state is JobState.FAILED:
            rec.attempts[-1].root_cause = f"could not start: {error.render()}"

    return change


def mark_failed_start(store: JobStore, job_id: str, attempt: int, error: ClusterrunError) -> None:
    """The attempt could not start on every host (those that started were stopped again)."""
    Recorder(store, job_id, attempt).start_failed(error)


def record_stop(store: JobStore, record: JobRecord, reports: Mapping[int, StopReport]) -> JobRecord:
    """Record a verified stop (``stopped``); nodes whose stop failed keep their state (they may
    still run), and so does the job: ``running`` again, for the next ``ps`` to ask."""
    def change(rec: JobRecord) -> None:
        if rec.attempt != record.attempt:
            return
        for rank, report in reports.items():
            if report.ok and rec.nodes[rank].state not in (NodeState.SUCCEEDED, NodeState.FAILED, NodeState.LOST):
                rec.nodes[rank].state = NodeState.STOPPED
        move(rec, Change.STOP)
        move(rec, Change.STOP_VERIFIED if all(r.ok for r in reports.values()) else Change.STOP_UNVERIFIED)

    return store.update(record.job_id, change)


__all__ = ["Recorder", "Retry", "give_up", "move", "new_record", "reconcile", "record_stop", "refresh"]
