"""The owner of an attempt's life: its start, its verified stop and its recorded state.

Every attempt starts through ``start``: ``up``'s first (checked by ``checks.check_new``, started
by ``Runner.start``), and the next one of ``restart``, the dashboard's R, the start-up retry, the
restart policy and ``Runner.request_restart`` (``NextAttempt``, ``restart``). The order is the
guarantee: every check (``checks``: the hosts file, ``env_file`` and ``forward_env``, the secret
``--env`` values, the script, the probe, the sync, the hosts' setup, the preflight in setup's
environment) runs **before** anything of the running attempt is stopped, so a refused restart
(a failing setup too) leaves it running; then the one stop path (``stop``: recorded
``stopping``, the agents' verified stop, then ``stopped``; for an automatic restart of a failed
attempt, the agents' verified stop alone); then ``start``. What the next attempt is made of is
read from the record once, into an ``AttemptSpec``, and passed on.

The job's recorded state changes only through ``jobstate.transition`` (``_move``), here: the
``Recorder`` (what the owner's follower sees, the attempt's start, a failed start and the owner's
restart decision, ``Recorder.retry``), ``reconcile`` (the hosts' word for a job nobody owns), the
stop and ``give_up``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clusterrun import notify
from clusterrun.checks import AttemptSpec, checked_attempt, note
from clusterrun.config import ClusterSpec
from clusterrun.environment import mask_env
from clusterrun.errors import ClusterrunError, HostsUnavailable, StateError, TransportError
from clusterrun.events import (
    AttemptStarted,
    Event,
    JobFinished,
    JobResult,
    JobState,
    NodeExited,
    NodeHung,
    NodeLink,
    NodeStarted,
    NodeState,
    NodeStateChanged,
    NodeStopped,
    StopReport,
)
from clusterrun.jobs import AttemptRecord, JobRecord, JobStore, NodeRecord
from clusterrun.jobstate import Change, outcome, transition
from clusterrun.lifecycle import per_node, status_of, stop_job
from clusterrun.orchestrator import Emit, Job, node_state_of
from clusterrun.plan import LaunchPlan, plan_to_json
from clusterrun.protocol import HostState
from clusterrun.watch import Notify, Watch

# ------------------------------------------------------------------------------ the state


def _move(record: JobRecord, change: Change) -> bool:
    """Apply ``change`` to the record's current attempt (the one place a job's state is assigned);
    True if the state changed. An end also ends the attempt."""
    new = transition(record.state, change)
    if new is record.state:
        return False
    record.state = new
    if record.attempts:
        record.attempts[-1].state = new if new is not JobState.RESTARTING else JobState.FAILED
        if new.is_terminal or new is JobState.RESTARTING:
            record.attempts[-1].ended = record.attempts[-1].ended or time.time()
    return True


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


def attempt_event(plan: LaunchPlan, attempt: int, record: JobRecord | None = None) -> AttemptStarted:
    """What a consumer needs to know of an attempt's plan, as an event (with when the attempt
    started and ended, as ``record`` says)."""
    times = next((a for a in record.attempts if a.attempt == attempt), None) if record is not None else None
    nodes = []
    for launch in plan.nodes:
        gpus = launch.env.get("CUDA_VISIBLE_DEVICES")
        nodes.append((launch.host.host, launch.nproc, gpus if gpus else None))
    return AttemptStarted(None, job_id=plan.job_id, name=plan.name, attempt=attempt,
                          master_addr=plan.master_addr, master_port=plan.master_port,
                          world_size=plan.world_size, nodes=tuple(nodes),
                          started=times.started if times is not None else None,
                          ended=times.ended if times is not None else None)


@dataclass(frozen=True)
class Retry:
    """The owner's decision to restart a failed attempt: ``kind`` "policy" (``restart:``),
    "start-up" (the start-up retry) or "requested" (``Runner.request_restart``: the owner stopped
    it to restart it), at the wall-clock time ``at``, for ``reason``."""

    kind: str
    at: float
    reason: str


Decide = Callable[[JobRecord, JobResult], "Retry | None"]


class Recorder:
    """An ``emit`` consumer that keeps the job's record up to date with what its owner's follower
    sees (and nothing else). Lifecycle: ``Recorder(store, job_id, attempt)`` → ``job.subscribe(it)``
    → ``flush()``. ``retry``: the owner's restart decision for a failed attempt, taken in the same
    write that ends it (``restarting`` instead of ``failed``: nobody sees an end that is not one)."""

    def __init__(self, store: JobStore, job_id: str, attempt: int, retry: Decide | None = None) -> None:
        self.store = store
        self.job_id = job_id
        self.attempt = attempt
        self.retry = retry
        self.restarting = False  # the attempt's end was recorded as ``restarting`` (``retry`` decided so)
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
                self.store.update(self.job_id, change)
            except (OSError, ClusterrunError) as exc:  # the record is gone or damaged: say so, go on
                text = exc.render() if isinstance(exc, ClusterrunError) else str(exc)
                print(f"clusterrun: cannot update the record of job {self.job_id}: {text}", file=sys.stderr)

    def begin(self, change: Callable[[JobRecord], None]) -> JobRecord:
        """Record the start of this attempt (``change``) now, in the caller's thread: what it
        raises (``Cancelled``, ``IllegalTransition``, ``StateError``) stops the start."""
        return self.store.update(self.job_id, change)

    def start_failed(self, error: ClusterrunError) -> None:
        """This attempt could not start on every host (those that started were stopped again)."""
        self.flush()
        self.store.update(self.job_id, _failed_start(self.attempt, error))

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
                _move(record, Change.ALL_RUNNING)

        self._submit(change)

    def _link(self, rank: int, *, up: bool, since: float) -> None:
        def change(record: JobRecord) -> None:
            if record.attempt == self.attempt:
                node = record.nodes[rank]
                node.unreachable_since = None if up else node.unreachable_since or since

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
        elif event.node is not None and isinstance(event, NodeHung):
            self._node(event.node, hung_since=event.since)
        elif isinstance(event, JobFinished):
            self.finish(event.result)

    def finish(self, result: JobResult) -> None:
        """The attempt's end as its follower saw it: a stop asked of this owner is decided by the
        stop; otherwise the nodes' ends (absorbed if the job is stopping or ended already)."""
        end = JobState.of_nodes(n.state for n in result.nodes)
        if result.interrupted is not None:
            changes = [Change.STOP, Change.STOP_VERIFIED if end is not None else Change.STOP_UNVERIFIED]
        else:
            changes = [outcome(end)] if end is not None else []

        def change(record: JobRecord) -> None:
            if record.attempt != self.attempt:
                return
            retry = None
            ended_badly = end in (JobState.FAILED, JobState.LOST) or result.interrupted is not None
            if ended_badly and changes and record.state in (JobState.STARTING, JobState.RUNNING):
                retry = self.retry(record, result) if self.retry is not None else None  # stopped to restart?
            moved = [_move(record, c) for c in ([Change.RETRY] if retry is not None else changes)]
            self.restarting = retry is not None and all(moved)
            if retry is not None and record.attempts:
                record.attempts[-1].state, record.attempts[-1].restart = end or JobState.STOPPED, retry.kind
                record.restart_at = retry.at
            if any(moved) and record.state in (JobState.FAILED, JobState.LOST, JobState.RESTARTING):
                attempt = record.attempts[-1]
                cause = result.root_cause
                attempt.root_cause = cause.describe() if cause else (retry.reason if retry else None)
                explained = cause.explanation if cause else None
                attempt.cause, attempt.fix = (explained.cause, explained.fix) if explained else (None, None)

        self._submit(change)
        self.flush()


NOT_STARTED = (NodeState.PENDING, NodeState.CONNECTING, NodeState.STARTING)
GONE = ("its host has no state of it any more (the state directory was deleted?): whether it still runs is not "
        "known; `clusterrun down` looks for its processes")


def reconcile(store: JobStore, record: JobRecord) -> JobRecord:
    """Ask every host how the current attempt is doing and write that into the record.

    Only for a job that has no owner (the owner keeps the record itself). A host that cannot be
    reached leaves its node as it was, with the error noted (and since when: ``note_reachable``);
    so does a host that has no state of a node that was started (``GONE``). A job left
    ``stopping`` (its stopper died) whose nodes have all ended is ``stopped``."""
    answers = per_node(record, lambda t, rank: status_of(t, record, rank))
    now = time.time()

    def change(rec: JobRecord) -> None:
        if rec.attempt != record.attempt:
            return
        for rank, answer in answers.items():
            node = rec.nodes[rank]
            note_reachable(node, answer, now)
            if isinstance(answer, ClusterrunError):
                why = "unreachable" if isinstance(answer, TransportError) else "no answer"
                node.error = f"{why}: {answer.render()}"
                continue
            if answer.state is HostState.ABSENT and (node.pid is not None or node.state not in NOT_STARTED):
                node.error = GONE  # it was started: never shown pending again, nor ended, on this word alone
                continue
            node.state = node_state_of(answer)
            node.pid = answer.torchrun_pid or node.pid
            node.exit_code, node.signal = answer.exit_code, answer.signal
            node.error = answer.error or ("neither the supervisor nor torchrun runs any more"
                                          if node.state is NodeState.LOST else None)
        new = JobState.of_nodes(NodeState.UNREACHABLE if isinstance(answers.get(n.rank), ClusterrunError)
                                else n.state for n in rec.nodes)
        if new is JobState.RUNNING and rec.state is JobState.STARTING:
            _move(rec, Change.ALL_RUNNING)
        elif new is not None and new.is_terminal:  # pending nodes were never started: the monitor starts them
            _move(rec, Change.STOP_VERIFIED if rec.state is JobState.STOPPING else outcome(new))

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


def refresh(store: JobStore, record: JobRecord) -> JobRecord:
    """The record made current: if the job is unfinished and nobody owns it, reconcile it with
    its hosts and start a monitor for it (fail-fast resumes), unless it was adopted from its hosts
    (``discover``): the controller that started it may still be watching it."""
    if record.finished and record.notify is not None and notify.due(record) and not store.owned(record.job_id):
        notify.send_due(store, record)  # its owner recorded the end and died before notifying
    if record.finished or store.owned(record.job_id):
        return record
    record = reconcile(store, record)
    if not record.finished and not record.adopted:
        store.spawn_monitor(record.job_id)
    elif not record.adopted:  # it ended with nobody owning it: its notifications are due here
        notify.send_due(store, record)
    return record


def give_up(store: JobStore, job_id: str, attempt: int, why: str) -> None:
    """A restart the owner decided could not be carried out: the job is ``failed`` with ``why``
    (unless a stop came first: then it stays stopped)."""
    def change(rec: JobRecord) -> None:
        if rec.attempt == attempt and rec.state is JobState.RESTARTING and _move(rec, Change.GIVE_UP):
            rec.attempts[-1].root_cause = f"{rec.attempts[-1].root_cause or 'failed'}; not restarted: {why}"
            rec.restart_at = None

    store.update(job_id, change)


def _failed_start(attempt: int, error: ClusterrunError) -> Callable[[JobRecord], None]:
    """The change that records that ``attempt`` could not start on every host (those that started
    were stopped again)."""
    def change(rec: JobRecord) -> None:
        if rec.attempt == attempt and _move(rec, Change.START_FAILED) and rec.state is JobState.FAILED:
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
        _move(rec, Change.STOP)
        _move(rec, Change.STOP_VERIFIED if all(r.ok for r in reports.values()) else Change.STOP_UNVERIFIED)

    return store.update(record.job_id, change)


# ------------------------------------------------------------------------------ the stop


class NotStopped(ClusterrunError):
    """A restart was refused: some node of the last attempt could not be verified stopped."""

    def __init__(self, message: str, reports: dict[int, StopReport], *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.reports = reports

    @property
    def unreachable(self) -> bool:
        """A host could not be reached (rather than a process that would not die)."""
        return any(r.error for r in self.reports.values())


def begin_stop(store: JobStore, record: JobRecord) -> None:
    """Record that a stop of the current attempt is under way (``stopping``), before it is carried
    out: from now on the follower's view of the nodes as they die does not decide the end."""
    def stopping(rec: JobRecord) -> None:
        if rec.attempt == record.attempt:
            _move(rec, Change.STOP)

    store.update(record.job_id, stopping)


def stop(store: JobStore, record: JobRecord, grace: float | None = None,
         spec: ClusterSpec | None = None) -> tuple[dict[int, StopReport], StateError | None]:
    """The one stop path: ``stopping`` recorded first (what the follower sees of the nodes as they
    are killed no longer decides the end), then the agents' verified stop of the current attempt
    on every node, then its outcome in the record. The stop on the hosts stands even when the
    record cannot be written: then the ``StateError`` comes back beside the reports."""
    try:
        begin_stop(store, record)
    except StateError:
        pass  # the stop matters more than its record: the error comes back after it (below)
    reports = stop_job(record, grace=grace, spec=spec)
    try:
        record_stop(store, record, reports)
    except StateError as exc:
        return reports, exc
    return reports, None


# ------------------------------------------------------------------------------ the start


class NextAttempt:
    """The next attempt of a recorded job, checked while the current one runs on.

    Create (every check; raises ``ConfigError`` or ``HostsUnavailable`` with nothing stopped) →
    ``replace()`` (the verified stop of the current attempt, then the start of this one) →
    ``close()``. A consumer with a follower of its own (the dashboard) stops following between
    the two."""

    def __init__(self, record: JobRecord, emit: Emit, *, full_preflight: bool = True,
                 script_args: Sequence[str] | None = None) -> None:
        self.record = record
        self.emit = emit
        self.aspec = AttemptSpec.of(record, os.environ)
        self.aspec.plan_to_start()  # a secret of the running attempt that is no longer found refuses here
        self.job = checked_attempt(record, self.aspec, emit, full=full_preflight, script_args=script_args)

    def replace(self, store: JobStore, *, owner_fd: int | None = None, grace: float | None = None,
                automatic: bool = False) -> JobRecord:
        """Stop the current attempt on every node (verified), then start this one; its record.
        ``NotStopped`` (nothing new started) when a node could not be verified stopped.

        ``owner_fd``: the caller owns the job and keeps owning it. Otherwise the owner lock is
        waited for (the monitor of the stopped attempt exits) and given to a new monitor.
        ``automatic``: the owner's restart of a failed attempt (``restarting``): its stop is not
        the user's (the record stays ``restarting``), and ``Cancelled`` if a stop came first."""
        record = store.load(self.record.job_id)
        if record.attempt != self.record.attempt:
            raise ClusterrunError(f"not restarting job {record.job_id}: it was restarted meanwhile "
                                  f"(attempt {record.attempt})", hint=f"`clusterrun ps {record.job_id}`")
        if automatic and record.state is not JobState.RESTARTING:
            raise Cancelled(f"not restarting job {record.job_id}: it is {record.state}")
        if automatic:
            reports, unrecorded = stop_job(record, grace=grace, spec=self.aspec.spec), None
        else:
            reports, unrecorded = stop(store, record, grace, spec=self.aspec.spec)
        for rank in sorted(reports):
            self.emit(NodeStopped(rank, report=reports[rank]))
        if unrecorded is not None:
            raise StateError(unrecorded.path, f"not restarting job {record.job_id}: its record cannot be written "
                             f"({unrecorded.message})", hint=unrecorded.hint)
        if not all(r.ok for r in reports.values()):
            bad = ", ".join(f"node {r.node} ({r.host})" for r in reports.values() if not r.ok)
            raise NotStopped(f"not restarting job {record.job_id}: attempt {record.attempt} could not be verified "
                             f"stopped on {bad}", reports,
                             hint="see the stop report; `clusterrun down` again once the host is back, then restart")
        owner = owner_fd if owner_fd is not None else store.wait_own(record.job_id, timeout=60)
        if owner is None:
            raise ClusterrunError(f"job {record.job_id} is still owned by another clusterrun process",
                                  hint="wait for it to finish, or stop it")
        try:
            recorder = Recorder(store, record.job_id, self.job.attempt)
            self.job.subscribe(recorder)
            start(self.job, self.emit, recorder, automatic=automatic)
            recorder.flush()  # the nodes' pids and states, before the record is read back
            new = store.load(record.job_id)
            notify.send_due(store, new, lambda text: note(self.emit, text))  # restarted (and the last end)
        except BaseException:
            if owner_fd is None:
                store.release(owner)
            raise
        if owner_fd is None:
            store.spawn_monitor(record.job_id, owner)
        return new

    def close(self) -> None:
        self.job.close()


def restart(store: JobStore, record: JobRecord, emit: Emit, *, owner_fd: int | None = None,
            grace: float | None = None, full_preflight: bool = True, automatic: bool = False,
            script_args: Sequence[str] | None = None) -> JobRecord:
    """Check the next attempt, stop the current one (verified), start the next: ``NextAttempt``."""
    attempt = NextAttempt(record, emit, full_preflight=full_preflight, script_args=script_args)
    try:
        return attempt.replace(store, owner_fd=owner_fd, grace=grace, automatic=automatic)
    finally:
        attempt.close()


class Cancelled(ClusterrunError):
    """An automatic restart found the job stopped (``down`` during the backoff): nothing started."""


def start(job: Job, emit: Emit, recorder: Recorder, *, first: bool = False, automatic: bool = False) -> None:
    """The one start of an attempt, checked (``checks``: its sync and setup ran there, before any
    stop) and with the last one verified stopped: ``up``'s ``first`` (its record just created),
    and the next attempt of ``restart``, the start-up retry and the restart policy (the attempt's
    start in the record: only from an end, or, ``automatic``, from ``restarting``, else
    ``Cancelled`` with nothing written). Then every node starts; on a failure the record
    says so and the nodes that started were stopped again (``HostsUnavailable``). ``recorder``,
    subscribed to ``job`` by the caller, writes the attempt's record, its start's too."""
    plan = job.plan
    if plan is None:
        raise RuntimeError("start() before the checks")
    event, begin = attempt_event(plan, job.attempt), _begun(plan, job.attempt, job.script_args, automatic)
    if not first:
        recorder.begin(begin)
        emit(event)  # before the nodes' start: shown as the new attempt's
    try:
        job.start()
    except HostsUnavailable as exc:
        recorder.start_failed(exc)
        raise


def _begun(plan: LaunchPlan, attempt: int, script_args: Sequence[str], automatic: bool) -> Callable[[JobRecord], None]:
    """The change that records the start of the next attempt ``attempt`` of ``plan``."""
    def begin(rec: JobRecord) -> None:
        if automatic and rec.state is not JobState.RESTARTING:
            raise Cancelled(f"not restarting job {rec.job_id}: it is {rec.state}")
        transition(rec.state, Change.START)  # only from an end (raises, nothing written): never two attempts
        rec.attempts.append(AttemptRecord(attempt, started=time.time(), master_port=plan.master_port))
        _move(rec, Change.START)
        rec.attempt, rec.plan, rec.restart_at = attempt, plan_to_json(plan), None
        rec.script_args = list(script_args)  # `restart JOB -- ARGS` replaces them from now on
        rec.adopted = False  # this controller starts the attempt: it owns it (and monitors it)
        rec.nodes = [NodeRecord(n.rank, n.host.host) for n in plan.nodes]

    return begin


def record_next_attempt(recorder: Recorder, plan: LaunchPlan, script_args: Sequence[str]) -> JobRecord:
    """Record the start of ``recorder``'s attempt of ``plan`` (only from an end, else ``IllegalTransition``
    and nothing written), for a launcher without agents: ``restart`` of a Slurm job starts its step after this."""
    return recorder.begin(_begun(plan, recorder.attempt, script_args, False))


__all__ = ["Cancelled", "NextAttempt", "NotStopped", "Recorder", "Retry", "attempt_event", "begin_stop", "give_up",
           "new_record", "reconcile", "record_next_attempt", "record_stop", "refresh", "restart", "start", "stop"]
