"""A new job's first attempt, from ``up``'s options to its owner: the script looked for, the job
named, the hosts checked (the probe, the sync, their setup, the preflight), the record made and
owned by a ``Runner`` that has not started anything yet.

``first_attempt`` does it in that order and hands back what it made (``Launched``); nothing here
prints, exits or starts a process: what the user sees goes through the command's ``LaunchView``,
and a refusal is raised typed (``ConfigError``, ``HostsUnavailable``, ``StateError``), for the
command to turn into its message and exit code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import Protocol

from clusterrun.config.hostsfile import ClusterSpec
from clusterrun.core.errors import ConfigError, StateError
from clusterrun.core.events import Event, JobNote
from clusterrun.core.frozen import frozen
from clusterrun.life.gate import check_new, check_script
from clusterrun.life.recorder import new_record
from clusterrun.life.runner import Runner
from clusterrun.run.orchestrator import Emit, Job, Reconnect
from clusterrun.run.plan import MAX_NAME, LaunchPlan, job_name, new_job_id
from clusterrun.store.jobs import JobStore
from clusterrun.store.preparing import Preparing
from clusterrun.sync.copy import Progress, SyncReport
from clusterrun.transports import Transport, made


@frozen
class NewJob:
    """``up``'s options that make the job, as typed: what runs (``script``, its arguments, the
    ``--env`` values), the hosts file it came from (its path and the YAML its record keeps), and how
    it is checked, started and owned."""

    hosts_file: str
    hosts_text: str
    script: str
    script_args: tuple[str, ...]
    overrides: dict[str, str]
    local_cwd: str
    ssh_config: str | None
    name: str | None = None
    dry_run: bool = False
    follow_logs: bool = True  # False with -d: no log line is shown
    grace: float = 10.0
    sync_dir: str | None = None
    full: bool = True  # the whole preflight (not --no-preflight)
    retry_startup: bool = True
    max_restarts: int | None = None
    unreachable_timeout: float | None = None


@frozen
class Holder:
    """Who holds a job name now: an unfinished job, or an ``up`` still preparing one (``state``
    "preparing", with what that ``up`` last said)."""

    job_id: str
    state: str
    said: str = ""


@frozen
class Checked:
    """A new job checked and not started: its plan, what the sync copied, and its ``Job`` (the
    nodes' I/O, probed and set up: its interfaces and setups for what is shown)."""

    plan: LaunchPlan
    reports: Mapping[int, SyncReport]
    job: Job


class LaunchView(Protocol):
    """What the command shows of a launch and tells it: lines for the user, the sync's progress,
    the dry run's plan, and who holds a job name (records brought up to date the command's way: a
    Slurm job's by Slurm, which is above this layer)."""

    def note(self, text: str) -> None:
        """A line for the user: a name already taken, a setup still running, a warning."""

    def syncing(self) -> AbstractContextManager[Progress]:
        """The sync's progress, shown while inside."""

    def synced(self, reports: Mapping[int, SyncReport]) -> None:
        """What the sync copied to each host, once every check passed."""

    def planned(self, checked: Checked) -> None:
        """The dry run's answer: each node's command and environment; nothing was started."""

    def holder(self, name: str) -> Holder | None:
        """The unfinished job or the preparing ``up`` that has ``name``; None when it is free."""


@frozen
class Launched:
    """A new job checked, recorded and owned, not yet started: ``runner.start()`` starts it."""

    runner: Runner
    plan: LaunchPlan


def first_attempt(new: NewJob, spec: ClusterSpec, transports: Sequence[Transport], store: JobStore,
                  view: LaunchView, emit: Emit | None) -> Launched | None:
    """``up``'s job checked, named, recorded in ``store`` and owned (see the module docstring), the
    hosts' connections already under way (``transports``); ``emit`` hears the owner's events (None: the
    dashboard subscribes later). None for a dry run (its plan shown by ``view.planned``). Raises
    ``ConfigError`` (the script, the name, a bad ``--sync``), ``HostsUnavailable`` (a host refused:
    nothing started anywhere) or ``StateError`` (no record could be made: nothing started)."""
    check_script(spec, new.script, new.local_cwd, new.sync_dir)
    name = job_name(new.name, new.script)
    held = None if new.dry_run else view.holder(name)
    if held is not None and new.name is not None:  # two unfinished jobs of one name: `ps`, `down`... could not tell
        busy = (f"is being prepared by another `clusterrun up` (it said: {held.said})" if held.state == "preparing"
                else f"is {held.state}")
        raise ConfigError(f"job {held.job_id}, named {name!r}, {busy}; nothing was started", key="--name",
                          hint=("wait for that start to end (`clusterrun ps`)" if held.state == "preparing" else
                                f"stop it first (`clusterrun down {held.job_id}`)")
                          + ", or name this job otherwise with --name NAME")
    if held is not None:  # the script's name taken: the first free of NAME-2, NAME-3... (two learning rates)
        number, taken = 1, name
        while True:
            number += 1
            name = taken[:MAX_NAME - len(str(number)) - 1].rstrip("-.") + f"-{number}"
            if view.holder(name) is None:
                break
        view.note(f"{taken!r} is {held.state} (job {held.job_id}): this job is named {name!r}")
    job_id = new_job_id(name)
    job = Job(spec, new.script, new.script_args, job_id=job_id, name=name, emit=None, env_overrides=new.overrides,
              local_cwd=new.local_cwd, grace=new.grace, reconnect=Reconnect(give_up_after=new.unreachable_timeout),
              transport_factory=made(transports), follow_logs=new.follow_logs)
    prep = None if new.dry_run else Preparing(job_id, name, [h.host for h in spec.hosts])  # listed by `ps`
    runner = None
    try:
        with view.syncing() as progress:
            plan, reports, warnings = check_new(job, spec, new.script, new.local_cwd, full=new.full,
                                                dry_run=new.dry_run, sync_dir=new.sync_dir, progress=progress,
                                                emit=partial(_told, view, prep))
        view.synced(reports)
        for warning in warnings:
            view.note(f"warning: {warning}")
        if new.dry_run:
            view.planned(Checked(plan, reports, job))
            return None
        record = new_record(plan, hosts_file=new.hosts_file, hosts_text=new.hosts_text, env_overrides=new.overrides,
                            local_cwd=new.local_cwd, ssh_config=new.ssh_config,
                            unreachable_timeout=new.unreachable_timeout, retry_startup=new.retry_startup,
                            max_restarts=new.max_restarts, watch=spec.watch, notify=spec.notify)
        try:
            runner = Runner.create(store, record, job, emit, retry_startup=new.retry_startup,
                                   policy=spec.restart.with_max(new.max_restarts))
        except StateError as exc:
            exc.message += "; nothing was started"
            raise
    finally:
        if prep is not None:  # the record tells of the job now, or nothing started
            prep.close()
        if runner is None:  # a dry run, or a refusal: nothing will use the hosts' connections
            job.close()
    return Launched(runner, plan)


def _told(view: LaunchView, prep: Preparing | None, event: Event) -> None:
    if isinstance(event, JobNote):  # the setups still running: here and in `ps`
        view.note(event.text)
        if prep is not None:
            prep.say(event.text)


__all__ = ["Checked", "Holder", "LaunchView", "Launched", "NewJob", "first_attempt"]
