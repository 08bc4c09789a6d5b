"""The owner of an attempt's life: its start and its verified stop (its record kept by ``recorder``).

Every attempt starts through ``start``: ``up``'s first (checked by ``checks.check_new``, started
by ``Runner.start``), and the next one of ``restart``, the dashboard's R, the start-up retry, the
restart policy and ``Runner.request_restart`` (``NextAttempt``, ``restart``), and the nodes a
controller that died during its start never reached (the monitor's ``ranks``). The order is the
guarantee: every check (``checks``: the hosts file, ``env_file`` and ``forward_env``, the secret
``--env`` values, the script, the probe, the sync, the hosts' setup, the preflight in setup's
environment) runs **before** anything of the running attempt is stopped, so a refused restart
(a failing setup too) leaves it running; then the one stop path (``stop``: recorded
``stopping``, the agents' verified stop, then ``stopped``; for an automatic restart of a failed
attempt, the agents' verified stop alone); then ``start``. What the next attempt is made of is
read from the record once, into an ``AttemptSpec``, and passed on.

The job's recorded state changes only through ``jobstate.transition``, applied by
``recorder.move``: by the ``Recorder`` (what the owner's follower sees, a failed start and an
attempt's end with the owner's restart decision, ``Recorder.finish``; the attempt's start is
recorded by ``start``),
``reconcile`` (the hosts' word for a job nobody owns), ``give_up`` and ``record_stop`` there, and
here by the stop and the start.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence

from clusterrun.config.hostsfile import ClusterSpec, HostSpec
from clusterrun.core import timings
from clusterrun.core.errors import ClusterrunError, HostsUnavailable, StateError
from clusterrun.core.events import AttemptStarted, JobResult, JobState, NodeStopped, StopReport
from clusterrun.life.gate import AttemptSpec, checked_attempt, note
from clusterrun.life.jobstate import Change, transition
from clusterrun.life.lifecycle import stop_job
from clusterrun.life.recorder import Recorder, move, record_stop
from clusterrun.run.orchestrator import Emit, Job
from clusterrun.run.plan import LaunchPlan, plan_to_json
from clusterrun.store.jobs import AttemptRecord, JobRecord, JobStore, NodeRecord
from clusterrun.transports import Transport


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


def begin_stop(store: JobStore, record: JobRecord, *, restart: bool = False) -> None:
    """Record that a stop of the current attempt is under way (``stopping``), before it is carried
    out: from now on the follower's view of the nodes as they die does not decide the end.
    ``restart``: a restart's stop, refused (nothing written) when another restart came first."""
    def stopping(rec: JobRecord) -> None:
        if rec.attempt == record.attempt:
            move(rec, Change.STOP)
        elif restart:
            raise ClusterrunError(f"not restarting job {rec.job_id}: it was restarted meanwhile "
                                  f"(attempt {rec.attempt})", hint=f"`clusterrun ps {rec.job_id}`")

    store.update(record.job_id, stopping)


def stop(store: JobStore, record: JobRecord, grace: float | None = None, *, spec: ClusterSpec,
         by: str | None = None, restart: bool = False) -> tuple[dict[int, StopReport], StateError | None]:
    """The one stop path: ``stopping`` recorded first (what the follower sees of the nodes as they
    are killed no longer decides the end), then the agents' verified stop of the current attempt
    on every node, then its outcome in the record. The stop on the hosts stands even when the
    record cannot be written: then the ``StateError`` comes back beside the reports. ``by``: who
    stops it, as the mark in each node's log says (``down``, ``restart``); ``restart``: as ``begin_stop``'s."""
    try:
        begin_stop(store, record, restart=restart)
    except StateError:
        pass  # the stop matters more than its record: the error comes back after it (below)
    reports = stop_job(record, grace=grace, spec=spec, by=by)
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
                 script_args: Sequence[str] | None = None, recorded: ClusterSpec,
                 replace: Mapping[str, str] | None = None, recheck: bool = False,
                 phases: dict[str, float] | None = None,
                 transports: Callable[[HostSpec], Transport] | None = None) -> None:
        self.record = record
        self.emit = emit
        self.phases = dict(phases or {})  # the restart's so far (``timings.ATTEMPT_PHASES``): in its record
        self.replace_hosts = dict(replace or {})  # a current host → the spare that takes its place
        self.aspec = AttemptSpec.of(record, os.environ, recorded)  # recorded: the owner's parsed hosts file
        self.aspec.plan_to_start()  # a secret of the running attempt that is no longer found refuses here
        following = dataclasses.replace(self.aspec, spec=self.aspec.spec.with_spares(self.replace_hosts))
        for old, new in self.replace_hosts.items():
            rank = [h.host for h in self.aspec.spec.hosts].index(old)
            note(emit, f"node {rank}: the spare {new} takes the place of {old} from attempt {record.attempt + 1}")
        self.job = checked_attempt(record, following, emit, full=full_preflight, script_args=script_args,
                                   recheck=recheck, transports=transports)  # the owner's connections, if lent
        if self.phases:
            timings.mark(self.phases, "checked")

    def replace(self, store: JobStore, *, owner_fd: int | None = None, grace: float | None = None,
                automatic: bool = False, verified: frozenset[int] = frozenset()) -> JobRecord:
        """Stop the current attempt on every node (verified), then start this one; its record.
        ``NotStopped`` (nothing new started) when a node could not be verified stopped.

        ``owner_fd``: the caller owns the job and keeps owning it. Otherwise the owner lock is
        waited for (the monitor of the stopped attempt exits) and given to a new monitor.
        ``automatic``: the owner's restart of a failed attempt (``restarting``): its stop is not
        the user's (the record stays ``restarting``), and ``Cancelled`` if a stop came first; its nodes
        in ``verified`` (``verified_ended``: nothing of them is left, as a cgroup verified) are not
        stopped again."""
        record = self.record  # as the command (the owner's backoff) read it: not read again
        if automatic and record.state is not JobState.RESTARTING:
            raise Cancelled(f"not restarting job {record.job_id}: it is {record.state}")
        if automatic:  # a `down` meanwhile: the start refuses (``Cancelled``), under the record's lock
            rest = [rank for rank in range(len(record.nodes)) if rank not in verified]
            reports = stop_job(record, grace=grace, spec=self.aspec.spec, by="the restart policy", ranks=rest) \
                if rest else {}
            unrecorded = None
        else:  # a restart meanwhile: the stop's first write refuses, under the record's lock
            reports, unrecorded = stop(store, record, grace, spec=self.aspec.spec, by="restart", restart=True)
        for rank in sorted(reports):
            self.emit(NodeStopped(rank, report=reports[rank]))
        if unrecorded is not None:
            raise StateError(unrecorded.path, f"not restarting job {record.job_id}: its record cannot be written "
                             f"({unrecorded.message})", hint=unrecorded.hint)
        # A host being replaced that cannot be reached is left out: its stop cannot be verified (said).
        left_out = {r.node for r in reports.values() if r.host in self.replace_hosts and r.error is not None}
        for rank in sorted(left_out):
            note(self.emit, f"node {rank} ({reports[rank].host}) is left out unverified ({reports[rank].error}); "
                            f"if it comes back, look for the job's processes there")
        unstopped = [r for r in reports.values() if not r.ok and r.node not in left_out]
        if unstopped:
            bad = ", ".join(f"node {r.node} ({r.host})" for r in unstopped)
            raise NotStopped(f"not restarting job {record.job_id}: attempt {record.attempt} could not be verified "
                             f"stopped on {bad}", reports,
                             hint="see the stop report; `clusterrun down` again once the host is back, then restart")
        owner = owner_fd if owner_fd is not None else store.wait_own(record.job_id, timeout=60)
        if owner is None:
            raise ClusterrunError(f"job {record.job_id} is still owned by another clusterrun process",
                                  hint="wait for it to finish, or stop it")
        try:
            recorder = Recorder(store, record.job_id, self.job.attempt, record)
            self.job.subscribe(recorder)
            start(self.job, self.emit, recorder, automatic=automatic, replaced=self.replace_hosts,
                  phases=self.phases)
            recorder.flush()  # the nodes' pids and states are in the record it carries
            new = recorder.record or record  # its owner sends `restarted` as it follows it (``Runner.follow``)
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
            script_args: Sequence[str] | None = None, recorded: ClusterSpec,
            replace: Mapping[str, str] | None = None, recheck: bool = False, phases: dict[str, float] | None = None,
            verified: frozenset[int] = frozenset(),
            transports: Callable[[HostSpec], Transport] | None = None) -> JobRecord:
    """Check the next attempt, stop the current one (verified), start the next: ``NextAttempt``."""
    attempt = NextAttempt(record, emit, full_preflight=full_preflight, script_args=script_args, recorded=recorded,
                          replace=replace, recheck=recheck, phases=phases, transports=transports)
    try:
        return attempt.replace(store, owner_fd=owner_fd, grace=grace, automatic=automatic, verified=verified)
    finally:
        attempt.close()


def verified_ended(result: JobResult) -> frozenset[int]:
    """The nodes of a finished attempt of which nothing is left, as a cgroup verified: stopped by a
    verified stop, or ended with their attempt's cgroup emptied and removed. A restart does not stop
    them again."""
    stopped = {r.node for r in result.stops if r.complete}
    return frozenset(stopped | {n.node for n in result.nodes if n.contained})


class Cancelled(ClusterrunError):
    """An automatic restart found the job stopped (``down`` during the backoff): nothing started."""


def start(job: Job, emit: Emit, recorder: Recorder, *, first: bool = False, automatic: bool = False,
          ranks: Sequence[int] | None = None, replaced: Mapping[str, str] | None = None,
          phases: Mapping[str, float] | None = None) -> None:
    """The one start of an attempt, checked (``checks``: its sync and setup ran there, before any
    stop) and with the last one verified stopped: ``up``'s ``first`` (its record just created),
    and the next attempt of ``restart``, the start-up retry and the restart policy (the attempt's
    start in the record: only from an end, or, ``automatic``, from ``restarting``, else
    ``Cancelled`` with nothing written). ``ranks``: only these nodes of the recorded attempt
    (a monitor finishing the start of a controller that died during it). Then the nodes start;
    on a failure the record says so and the nodes that started were stopped again
    (``HostsUnavailable``). ``recorder``, subscribed to ``job`` by the caller, writes the
    attempt's record, its start's too, with its ``phases`` so far (a restart's); ``replaced``: the
    spares it runs on instead of hosts of the last."""
    plan = job.plan
    if plan is None:
        raise RuntimeError("start() before the checks")
    event = attempt_event(plan, job.attempt)
    begin = _begun(plan, job.attempt, job.script_args, automatic, replaced, phases)
    if not first and ranks is None:
        recorder.begin(begin)
        emit(event)  # before the nodes' start: shown as the new attempt's
    try:
        job.start(ranks)
    except HostsUnavailable as exc:
        recorder.start_failed(exc)
        raise
    if ranks is None:
        recorder.phase("started")


def _begun(plan: LaunchPlan, attempt: int, script_args: Sequence[str], automatic: bool,
           replaced: Mapping[str, str] | None = None,
           phases: Mapping[str, float] | None = None) -> Callable[[JobRecord], None]:
    """The change that records the start of the next attempt ``attempt`` of ``plan``."""
    def begin(rec: JobRecord) -> None:
        if automatic and rec.state is not JobState.RESTARTING:
            raise Cancelled(f"not restarting job {rec.job_id}: it is {rec.state}")
        transition(rec.state, Change.START)  # only from an end (raises, nothing written): never two attempts
        if not automatic and rec.attempts:
            rec.attempts[-1].restart = "user"  # `restart`, the dashboard's R: also of a failure in its backoff
        rec.attempts.append(AttemptRecord(attempt, started=time.time(), master_port=plan.master_port,
                                          replaced=dict(replaced) if replaced else None,
                                          phases=dict(phases) if phases else None))
        move(rec, Change.START)
        rec.attempt, rec.plan, rec.restart_at = attempt, plan_to_json(plan), None
        rec.script_args = list(script_args)  # `restart JOB -- ARGS` replaces them from now on
        rec.adopted = False  # this controller starts the attempt: it owns it (and monitors it)
        rec.nodes = [NodeRecord(n.rank, n.host.host) for n in plan.nodes]

    return begin


def record_next_attempt(recorder: Recorder, plan: LaunchPlan, script_args: Sequence[str]) -> JobRecord:
    """Record the start of ``recorder``'s attempt of ``plan`` (only from an end, else ``IllegalTransition``
    and nothing written), for a launcher without agents: ``restart`` of a Slurm job starts its step after this."""
    return recorder.begin(_begun(plan, recorder.attempt, script_args, False))


__all__ = ["Cancelled", "NextAttempt", "NotStopped", "attempt_event", "begin_stop", "record_next_attempt", "restart",
           "start", "stop", "verified_ended"]
