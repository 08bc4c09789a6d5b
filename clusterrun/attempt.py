"""The owner of an attempt's life: its checks, its start, its verified stop and its recorded state.

Every attempt starts here: ``up``'s first (``check_script``, the probe, ``preflight``, then
``launch`` through ``Runner.start``), and ``restart``'s, the dashboard's R's and the start-up
retry's (``NextAttempt``, ``restart``). The order is the guarantee: every check (the hosts file,
``env_file`` and ``forward_env``, the secret ``--env`` values, the script, the probe, a dry run of
the sync, the preflight) runs **before** anything of the running attempt is stopped, so a refused
restart leaves it running; then the one stop path (``stop``: recorded ``stopping``, the agents'
verified stop, then ``stopped``); then the start. What the next attempt is made of is read from
the record once, into an ``AttemptSpec``, and passed on.

The job's recorded state changes only through ``jobstate.transition`` (``_move``), here: the
``Recorder`` (what the owner's follower sees), ``reconcile`` (the hosts' word for a job nobody
owns), the stop, a failed start and the start of the next attempt.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from clusterrun import doctor, lifecycle, notify
from clusterrun.config import ClusterSpec
from clusterrun.environment import MASK, mask_env, resolve, unmask
from clusterrun.errors import ClusterrunError, ConfigError, HostsUnavailable, StateError, TransportError
from clusterrun.events import (
    AttemptStarted,
    Event,
    JobFinished,
    JobNote,
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
from clusterrun.lifecycle import per_node, spec_of, status_of, stop_job
from clusterrun.orchestrator import Emit, Job, node_state_of
from clusterrun.plan import LaunchPlan, node_env, plan_from_json, plan_to_json
from clusterrun.protocol import HostState
from clusterrun.sync import source_of, sync_hosts
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
        record.attempts[-1].state = new
        if new.is_terminal:
            record.attempts[-1].ended = record.attempts[-1].ended or time.time()
    return True


def new_record(plan: LaunchPlan, *, hosts_file: str, hosts_text: str, env_overrides: dict[str, str],
               local_cwd: str, ssh_config: str | None, unreachable_timeout: float | None = None,
               retry_startup: bool = True, watch: Watch | None = None, notify: Notify | None = None) -> JobRecord:
    """The record of a job about to start its first attempt (``starting``); ``watch`` and
    ``notify``: the hosts file's with ``up``'s options applied (kept for every later attempt)."""
    return JobRecord(
        job_id=plan.job_id, name=plan.name, created=time.time(), hosts_file=os.path.abspath(hosts_file),
        hosts_text=hosts_text, script=plan.script, script_args=list(plan.script_args),
        env_overrides=mask_env(env_overrides, plan.secret_env), local_cwd=local_cwd, grace=plan.grace,
        ssh_config=ssh_config,
        plan=plan_to_json(plan), attempt=1, unreachable_timeout=unreachable_timeout, retry_startup=retry_startup,
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


class Recorder:
    """An ``emit`` consumer that keeps the job's record up to date with what its owner's follower
    sees (and nothing else). Lifecycle: ``Recorder(store, job_id, attempt)`` → ``job.subscribe(it)``
    → ``flush()``."""

    def __init__(self, store: JobStore, job_id: str, attempt: int) -> None:
        self.store = store
        self.job_id = job_id
        self.attempt = attempt
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
            moved = [_move(record, c) for c in changes]
            if any(moved) and record.state in (JobState.FAILED, JobState.LOST):
                attempt = record.attempts[-1]
                cause = result.root_cause
                attempt.root_cause = cause.describe() if cause else None
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


def mark_failed_start(store: JobStore, job_id: str, attempt: int, error: ClusterrunError) -> None:
    """The attempt could not start on every host (those that started were stopped again)."""
    def change(rec: JobRecord) -> None:
        if rec.attempt == attempt and _move(rec, Change.START_FAILED) and rec.state is JobState.FAILED:
            rec.attempts[-1].root_cause = f"could not start: {error.render()}"

    store.update(job_id, change)


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


# ------------------------------------------------------------------------------ the checks


@dataclass(frozen=True)
class AttemptSpec:
    """What the next attempt of a recorded job is made of, read once: the hosts file as recorded
    with ``env_file`` and ``forward_env`` read now (``spec``), the ``--env`` values with their
    secrets taken from this environment (``overrides``), and the current attempt's plan."""

    spec: ClusterSpec
    plan: LaunchPlan
    overrides: Mapping[str, str]
    notes: tuple[str, ...] = ()

    @classmethod
    def of(cls, record: JobRecord, environ: Mapping[str, str]) -> AttemptSpec:
        """Raises ``ConfigError`` for a file that cannot be read or a secret no longer found: a
        secret value is kept masked in the record, so only this environment can give it again."""
        spec, notes = resolve(spec_of(record), environ)
        overrides = unmask(record.env_overrides, environ, "--env")
        return cls(spec, plan_from_json(record.plan, spec), overrides, tuple(notes))

    def plan_to_start(self) -> LaunchPlan:
        """The current attempt's plan with its secret values again (for starting nodes that were
        never started); ``ConfigError`` for one no longer found."""
        nodes = []
        for node in self.plan.nodes:
            fresh = node_env(node.host, self.overrides)
            env = dict(node.env)
            for name, value in node.env.items():
                if value == MASK:
                    if name not in fresh:
                        raise ConfigError(f"{name}: its value is secret, so it was not kept on this machine, and it "
                                          "is no longer found (forward_env, env_file)", key="env",
                                          hint=f"export {name}=... (or restore the env_file) and run this again")
                    env[name] = fresh[name]
            nodes.append(dataclasses.replace(node, env=env))
        return dataclasses.replace(self.plan, nodes=tuple(nodes))


def plan_to_start(record: JobRecord) -> LaunchPlan:
    """The recorded plan of the current attempt with its secret values, read from this environment."""
    return AttemptSpec.of(record, os.environ).plan_to_start()


def check_script(spec: ClusterSpec, script: str, local_cwd: str, sync: str | None = None) -> None:
    """For local hosts the script must exist where torchrun will look for it (in the directory
    synced there, for a host with `sync`)."""
    for host in spec.hosts:
        if host.transport != "local":
            continue
        base = os.path.expanduser(host.workdir) if host.workdir else local_cwd
        base = source_of(spec, host, sync) or base
        path = os.path.join(base, script)
        if not os.path.isfile(path):
            raise ConfigError(f"{path} does not exist (needed by local host {host.host!r})",
                              path=script, hint="give the script's path relative to the current directory "
                              "or the host's workdir")


def preflight(job: Job, plan: LaunchPlan, spec: ClusterSpec, script: str, *, full: bool, local_cwd: str,
              synced: Collection[int] = (), test_port: bool = True) -> list[str]:
    """``doctor``'s checks on the probed hosts before anything starts (or stops): raises the
    refusal (``HostsUnavailable``, one line and a fix per problem); else the warnings."""
    report = doctor.preflight([job.probed(rank) for rank in range(plan.nnodes)], spec, script,
                              addr=plan.master_addr, port=plan.master_port, local_cwd=local_cwd, full=full,
                              synced=synced, test_port=test_port)
    refused = doctor.refusal(report)
    if refused is not None:
        raise refused
    return doctor.warnings(report)


def _note(emit: Emit | None, text: str) -> None:
    if emit is not None:
        emit(JobNote(None, text=text))


def checked_attempt(record: JobRecord, aspec: AttemptSpec, emit: Emit | None, *, full: bool) -> Job:
    """The next attempt probed and checked, nothing started nor stopped: the script, the probe, a
    dry run of the sync, the preflight (a fixed master port held by the running attempt is not
    tested). Raises ``ConfigError`` or ``HostsUnavailable``; the caller closes the ``Job``."""
    for note in aspec.notes:
        _note(emit, f"warning: {note}")
    check_script(aspec.spec, record.script, record.local_cwd)
    job = Job(aspec.spec, record.script, record.script_args, job_id=record.job_id, name=record.name, emit=emit,
              env_overrides=dict(aspec.overrides), local_cwd=record.local_cwd, grace=record.grace,
              attempt=record.attempt + 1, transport_factory=lifecycle.transport_factory(record))
    try:
        plan = job.prepare(run_setup=False)
        sync_hosts(aspec.spec, job.agents, dry_run=True)
        synced = {rank for rank, host in enumerate(aspec.spec.hosts) if host.sync}
        held = aspec.spec.master_port is not None and not record.finished
        for warning in preflight(job, plan, aspec.spec, record.script, full=full, local_cwd=record.local_cwd,
                                 synced=synced, test_port=not held):
            _note(emit, f"warning: {warning}")
    except BaseException:
        job.close()
        raise
    return job


# ------------------------------------------------------------------------------ the start


def launch(store: JobStore, job: Job, recorder: Recorder) -> None:
    """Start every node of the prepared attempt; on failure the record says so and the nodes that
    started were stopped again (``HostsUnavailable``)."""
    try:
        job.start()
    except HostsUnavailable as exc:
        recorder.flush()
        mark_failed_start(store, job.job_id, job.attempt, exc)
        raise


class NextAttempt:
    """The next attempt of a recorded job, checked while the current one runs on.

    Create (every check; raises ``ConfigError`` or ``HostsUnavailable`` with nothing stopped) →
    ``replace()`` (the verified stop of the current attempt, then the start of this one) →
    ``close()``. A consumer with a follower of its own (the dashboard) stops following between
    the two."""

    def __init__(self, record: JobRecord, emit: Emit, *, full_preflight: bool = True) -> None:
        self.record = record
        self.emit = emit
        self.aspec = AttemptSpec.of(record, os.environ)
        self.aspec.plan_to_start()  # a secret of the running attempt that is no longer found refuses here
        self.job = checked_attempt(record, self.aspec, emit, full=full_preflight)

    def replace(self, store: JobStore, *, owner_fd: int | None = None, grace: float | None = None) -> JobRecord:
        """Stop the current attempt on every node (verified), then start this one; its record.
        ``NotStopped`` (nothing new started) when a node could not be verified stopped.

        ``owner_fd``: the caller owns the job and keeps owning it. Otherwise the owner lock is
        waited for (the monitor of the stopped attempt exits) and given to a new monitor."""
        record = store.load(self.record.job_id)
        if record.attempt != self.record.attempt:
            raise ClusterrunError(f"not restarting job {record.job_id}: it was restarted meanwhile "
                                  f"(attempt {record.attempt})", hint=f"`clusterrun ps {record.job_id}`")
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
            new = _start_next(store, self.job, self.aspec, self.emit)
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
            grace: float | None = None, full_preflight: bool = True) -> JobRecord:
    """Check the next attempt, stop the current one (verified), start the next: ``NextAttempt``."""
    attempt = NextAttempt(record, emit, full_preflight=full_preflight)
    try:
        return attempt.replace(store, owner_fd=owner_fd, grace=grace)
    finally:
        attempt.close()


def _start_next(store: JobStore, job: Job, aspec: AttemptSpec, emit: Emit) -> JobRecord:
    """Sync, set up and start the checked attempt ``job`` (the last one is verified stopped)."""
    plan = job.plan
    if plan is None:
        raise RuntimeError("_start_next() before checked_attempt()")
    for rank, report in sorted(sync_hosts(aspec.spec, job.agents).items()):  # `sync:` of the hosts file, if any
        _note(emit, f"sync node{rank} {report.host}: {report.describe()}")
    job.setup()

    def begin(rec: JobRecord) -> None:
        transition(rec.state, Change.START)  # only from an end (raises, nothing written): never two attempts
        rec.attempts.append(AttemptRecord(job.attempt, started=time.time(), master_port=plan.master_port))
        _move(rec, Change.START)
        rec.attempt, rec.plan = job.attempt, plan_to_json(plan)
        rec.adopted = False  # this controller starts the attempt: it owns it (and monitors it)
        rec.nodes = [NodeRecord(n.rank, n.host.host) for n in plan.nodes]

    record = store.update(job.job_id, begin)
    emit(attempt_event(plan, job.attempt, record))  # before the nodes' start: shown as the new attempt's
    recorder = Recorder(store, record.job_id, job.attempt)
    job.subscribe(recorder)
    launch(store, job, recorder)
    recorder.flush()  # the nodes' pids and states, before the record is read back
    record = store.load(record.job_id)
    notify.send_due(store, record, lambda text: _note(emit, text))  # restarted (and the last attempt's end)
    return record


__all__ = ["AttemptSpec", "NextAttempt", "NotStopped", "Recorder", "attempt_event", "begin_stop", "check_script",
           "checked_attempt", "launch", "new_record", "plan_to_start", "preflight", "reconcile", "record_stop",
           "refresh", "restart", "stop"]
