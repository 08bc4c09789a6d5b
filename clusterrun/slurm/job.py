"""A job of ``up --from-slurm`` as a recorded job: its record in the same store as a job over SSH
(``engine: slurm``, the allocation and the step), kept up to date from ``slurmrun``'s events by the
same ``Recorder``, and what ``ps`` can say of it once the ``up`` that ran it is gone.

The ``up`` that runs the step owns the job (its owner lock) until it ends: there is no monitor
under Slurm, and no agent to ask. A record whose owner is gone while it is unfinished is checked
against Slurm's own listing of the user's steps (``squeue --steps --me``): a step still listed
runs on without anyone recording it; one no longer listed ended unseen (``lost``: how, only
``sacct`` knows). Where no Slurm configuration is found, the record says it could not be checked.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clusterrun.core.errors import ClusterrunError, ConfigError
from clusterrun.core.events import Event, JobFinished, JobResult, LogLines, NodeExited, NodeResult, NodeState
from clusterrun.life.attempt import attempt_event
from clusterrun.life.recorder import Recorder, new_record
from clusterrun.run.plan import LaunchPlan
from clusterrun.store.jobs import SLURM, JobRecord, JobStore

# Slurm's own modules are imported where a Slurm job is handled: `ps` and `up` of a job without Slurm
# ask only `store.jobs.is_slurm`.
if TYPE_CHECKING:
    from clusterrun.slurm.run import SlurmRun
    from clusterrun.slurm.step import SlurmStep

def hosts_text(step: SlurmStep) -> str:
    """The allocation's nodes as a hosts file (the record's ``hosts_text``): the plan of a recorded
    job is read back against it. Nothing connects to them: a Slurm job's record never goes over SSH."""
    return "# the nodes of a Slurm allocation (up --from-slurm): srun runs the job, not SSH\nhosts:\n" + "".join(
        f"  - host: {node}\n    nproc: {nproc}\n" for node, nproc in zip(step.nodes, step.nprocs, strict=True))


def slurm_record(plan: LaunchPlan, step: SlurmStep, *, allocation: str, hosts_file: str | None,
                 env_overrides: dict[str, str], grace: float) -> JobRecord:
    """The record of a job ``up --from-slurm`` is about to start in Slurm job ``allocation``."""
    record = new_record(plan, hosts_file=hosts_file or os.devnull, hosts_text=hosts_text(step),
                        env_overrides=env_overrides, local_cwd=os.getcwd(), ssh_config=None)
    return dataclasses.replace(record, engine=SLURM, grace=grace, hosts_file=os.path.abspath(hosts_file) if hosts_file
                               else "", slurm={"job": allocation, "step": None, "controller": socket.gethostname(),
                                               "pid": os.getpid(), "unwatched": None})


def slurm_of(record: JobRecord) -> dict[str, Any]:
    """The record's Slurm part (the allocation ``job``, the ``step`` once known, the ``controller``
    host and ``pid`` of the ``up`` that runs it, ``unwatched``: why nobody records it any more)."""
    return record.slurm or {}


class StepNoter:
    """An ``emit`` consumer that records the step's ``JOBID.STEPID`` once the step's first line came
    (srun creates the step before any task writes), asked of squeue in a thread of its own, and
    the root cause's details at the end (``root_cause``: what a viewer's summary shows of it)."""

    def __init__(self, store: JobStore, record: JobRecord, environ: Mapping[str, str] | None = None) -> None:
        self.store, self.job_id, self.allocation = store, record.job_id, slurm_of(record)["job"]
        self._env = environ
        self._asked: threading.Thread | None = None

    def __call__(self, event: Event) -> None:
        if isinstance(event, LogLines) and self._asked is None:
            self._asked = threading.Thread(target=self._ask, name="squeue-step", daemon=True)
            self._asked.start()
        elif isinstance(event, JobFinished) and event.result.root_cause is not None:
            from clusterrun.store.slurmlogs import ROOT_CAUSE_FIELDS

            cause = dataclasses.asdict(event.result.root_cause)
            kept = {k: cause[k] for k in ROOT_CAUSE_FIELDS}
            self.store.update(self.job_id, lambda rec: rec.slurm.update(root_cause=kept) if rec.slurm else None)

    def _ask(self) -> None:
        from clusterrun.slurm.run import find_step

        try:
            step = find_step(self.allocation, self.job_id, self._env)
        except OSError:  # no squeue here: the record names the allocation only
            return
        if step is not None:
            self.store.update(self.job_id, lambda rec: rec.slurm.update(step=step) if rec.slurm else None)

    def join(self) -> None:
        if self._asked is not None:
            self._asked.join()


def fan_out(*consumers: Callable[[Event], None]) -> Callable[[Event], None]:
    """One ``emit`` that hands every event to each of ``consumers``, in order."""
    def emit(event: Event) -> None:
        for consumer in consumers:
            consumer(event)
    return emit


def refresh(store: JobStore, record: JobRecord, steps: Callable[[], Sequence[str]] | None = None) -> JobRecord:
    """The record made current where its ``up`` is gone while it is unfinished: ``lost`` once Slurm
    no longer lists its step, else why nobody records it (``unwatched``). ``steps``: the names of
    this user's running steps (default: squeue's, where Slurm's client and configuration are here)."""
    if record.finished or store.owned(record.job_id):
        return record
    from clusterrun.slurm.run import my_steps, slurm_here

    where = slurm_of(record)
    up = f"its `up --from-slurm` (pid {where.get('pid')} on {where.get('controller')}) is gone"
    if steps is None and not slurm_here(os.environ):
        return _unwatched(store, record, f"{up}; whether Slurm still runs its step could not be checked here "
                                         "(no Slurm configuration): ask `squeue --steps --me` where Slurm is")
    names = list(steps()) if steps is not None else [s.name for s in my_steps()]
    if record.job_id in names:
        return _unwatched(store, record, f"{up}; Slurm still runs its step {where.get('step') or ''}".rstrip()
                          + ", and no more of its output is kept (`clusterrun down` stops it)")
    error = (f"{up} and Slurm no longer runs its step: how it ended is not known here "
             f"(`sacct -j {where.get('job')}` says)")
    record_end(store, record, JobResult(record.job_id, tuple(
        NodeResult(n.rank, n.host, NodeState.LOST, error=error) for n in record.nodes)))
    return store.load(record.job_id)


def allocation_gone(record: JobRecord, environ: Mapping[str, str] | None = None) -> str | None:
    """Why no new step can start in the record's allocation (it ended, or Slurm cannot be asked
    here), or None while squeue lists it running."""
    from clusterrun.slurm.run import slurm_here

    job = slurm_of(record).get("job")
    env = os.environ if environ is None else environ
    if not slurm_here(env):
        return f"whether its Slurm job {job} still runs could not be checked here (no Slurm configuration)"
    try:
        done = subprocess.run(["squeue", f"--jobs={job}", "--noheader", "--format=%T"], capture_output=True,
                              text=True, check=False, env=environ)
    except OSError as exc:
        return f"squeue could not run: {exc}"
    state = done.stdout.strip() if done.returncode == 0 else ""
    if state != "RUNNING":
        return f"its allocation, Slurm job {job}, has ended" + (f" ({state.lower()})" if state else "")
    return None


def record_end(store: JobStore, record: JobRecord, result: JobResult) -> None:
    """Record ``result`` as the end of the record's attempt, its nodes' ends first, as its ``up`` would have."""
    recorder = Recorder(store, record.job_id, record.attempt)
    for node in result.nodes:
        recorder(NodeExited(node.node, result=node))
    recorder.finish(result)


def _unwatched(store: JobStore, record: JobRecord, why: str) -> JobRecord:
    if slurm_of(record).get("unwatched") == why:
        return record
    return store.update(record.job_id, lambda rec: rec.slurm.update(unwatched=why) if rec.slurm else None)


def engine_text(record: JobRecord) -> str:
    """``ps JOB``'s line on what runs a Slurm job, and where its logs are."""
    where = slurm_of(record)
    step = f", step {where['step']}" if where.get("step") else ""
    return (f"engine: Slurm (job {where.get('job')}{step}, named {record.job_id}); its logs are kept on "
            f"{where.get('controller')}, where `up --from-slurm` ran")


STOPPED_HERE = "stopped from the dashboard"
SRUN_MISSING = ConfigError("srun not found on PATH", key="--from-slurm",
                           hint="run this where Slurm's client commands are installed (a node of the allocation)")


class SlurmSession:
    """``up --from-slurm`` in the dashboard: the controls a ``session.Session`` gives it, over one
    ``SlurmRun``. Create (the run made with ``emit=session.emit``) → ``subscribe(consumer)`` →
    ``begin()`` (srun started and read in a thread) → ``kill()`` → ``wait()``. Only K stops
    (``scancel`` on the step): nothing of a Slurm job runs on without this process, so there is
    no detaching (``supports``), and no restart or stacks from here."""

    supports = frozenset({"kill"})

    def __init__(self, store: JobStore, record: JobRecord, plan: LaunchPlan, *, listeners: Sequence[Callable[[Event],
                 None]] = ()) -> None:
        self.store, self.record, self.plan = store, record, plan
        self.run: SlurmRun | None = None  # set by the caller before ``begin``, emitting into ``emit``
        self._listeners = list(listeners)
        self.result: JobResult | None = None
        self.error: ClusterrunError | None = None
        self.failed_start = False
        self.busy = False
        self.detached = False
        self._thread: threading.Thread | None = None

    @property
    def job_id(self) -> str:
        return self.record.job_id

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        self._listeners.append(listener)

    def emit(self, event: Event) -> None:
        for listener in list(self._listeners):
            listener(event)

    def begin(self) -> None:
        self._thread = threading.Thread(target=self._follow, daemon=True, name=f"srun-{self.job_id}")
        self._thread.start()

    def _follow(self) -> None:
        if self.run is None:
            raise RuntimeError("set run first")
        self.emit(attempt_event(self.plan, self.record.attempt, self.record))
        try:
            self.run.start()
        except FileNotFoundError:
            self.failed_start, self.error = True, SRUN_MISSING
            return
        self.result = self.run.run()

    def kill(self) -> None:
        """Stop the step (SIGTERM to every task, ``scancel`` after the grace); the end comes as ``JobFinished``."""
        if self.run is not None and self.running:
            self.run.request_stop(STOPPED_HERE)

    def restart(self) -> None:
        self.error = ConfigError("a Slurm job is not restarted from the dashboard",
                                 hint="stop it and run `up --from-slurm` again inside the allocation")

    def stacks(self) -> list[str]:
        return ["under Slurm the ranks' stacks are not taken by clusterrun: "
                "`srun --overlap --jobid=ALLOCATION py-spy dump --pid PID` on the node"]

    def history(self) -> list[str]:
        from clusterrun.views.joblist import history_rows, table_text

        return table_text(history_rows(self.store.load(self.job_id), time.time()))

    def detach(self) -> None:
        """The terminal is gone (SIGHUP): the step cannot outlive this process: stopped, its end recorded."""
        self.detached = True
        self.kill()
        self.wait(timeout=(self.run.grace if self.run is not None else 10.0) + 10)

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
