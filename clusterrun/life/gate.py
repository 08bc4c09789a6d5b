"""The checks of an attempt before anything starts or stops: what it is made of (``AttemptSpec``,
read from the job's record once), the script, the probe, the sync (for a next attempt while the
current one runs on), the hosts' setup, the preflight in the environment setup made.

``check_new`` checks ``up``'s first attempt, ``checked_attempt`` every next one; nothing here
starts or stops a process (``attempt.start`` does).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence

from clusterrun.checks import doctor
from clusterrun.config.environment import MASK, resolve, unmask
from clusterrun.config.hostsfile import ClusterSpec, HostSpec
from clusterrun.core.errors import ConfigError
from clusterrun.core.events import JobNote
from clusterrun.core.frozen import frozen
from clusterrun.life import lifecycle
from clusterrun.run import setups
from clusterrun.run.orchestrator import Emit, Job
from clusterrun.run.plan import LaunchPlan, node_env, plan_from_json
from clusterrun.store.jobs import JobRecord
from clusterrun.sync.copy import Progress, SyncReport, source_of, sync_hosts
from clusterrun.transports import Transport


@frozen
class AttemptSpec:
    """What the next attempt of a recorded job is made of, read once: the hosts file as recorded
    with ``env_file`` and ``forward_env`` read now (``spec``), the ``--env`` values with their
    secrets taken from this environment (``overrides``), and the current attempt's plan."""

    spec: ClusterSpec
    plan: LaunchPlan
    overrides: Mapping[str, str]
    notes: tuple[str, ...] = ()

    @classmethod
    def of(cls, record: JobRecord, environ: Mapping[str, str], recorded: ClusterSpec) -> AttemptSpec:
        """Raises ``ConfigError`` for a file that cannot be read or a secret no longer found: a
        secret value is kept masked in the record, so only this environment can give it again.
        ``recorded``: the record's hosts file (``Opened.spec``), as the command parsed it."""
        spec, notes = resolve(recorded, environ)
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


def plan_to_start(record: JobRecord, recorded: ClusterSpec) -> LaunchPlan:
    """The recorded plan of the current attempt with its secret values, read from this environment."""
    return AttemptSpec.of(record, os.environ, recorded).plan_to_start()


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
            close = doctor.close_script(script, base)
            hint = (f"did you mean {close}?" if close else
                    "give the script's path relative to the current directory or the host's workdir "
                    "(or `sync: .` in the hosts file to copy the project there)")
            raise ConfigError(f"{path} does not exist (needed by local host {host.host!r})", path=script, hint=hint)


def check_new(job: Job, spec: ClusterSpec, script: str, local_cwd: str, *, full: bool, dry_run: bool,
              sync_dir: str | None = None, progress: Progress | None = None, emit: Emit | None = None,
              ) -> tuple[LaunchPlan, dict[int, SyncReport], list[str]]:
    """The first attempt of a new job (``up``) probed and checked, nothing started: see
    ``_probe_and_check`` (``dry_run``: the sync only says what it would copy; ``emit`` hears which
    nodes are still in their setup). Raises ``HostsUnavailable`` or ``ConfigError``; the plan,
    the sync's reports and the preflight's warnings."""
    return _probe_and_check(job, spec, script, local_cwd, full=full, dry_run=dry_run, sync_dir=sync_dir,
                            progress=progress, emit=emit)


def _probe_and_check(job: Job, spec: ClusterSpec, script: str, local_cwd: str, *, full: bool, dry_run: bool,
                     sync_dir: str | None = None, progress: Progress | None = None, test_port: bool = True,
                     emit: Emit | None = None, recheck: bool = False,
                     ) -> tuple[LaunchPlan, dict[int, SyncReport], list[str]]:
    """The checks every attempt goes through, in order: the probe, the sync (``sync_dir`` or the
    hosts' ``sync:``; for a ``dry_run`` only what it would copy), the hosts' setup (it sees the
    synced files; a dry run's, where the sync would make the workdir, not before it exists),
    then the preflight, whose python checks run in the environment setup made, as the job will.
    Setup runs once per attempt: its agent keeps the environment for the start. What of the
    preflight nothing before it changes goes with the probes (``Preflight.ahead``). ``recheck``:
    hosts checked minutes ago, restarted automatically: the probe, the cheap inspection (workdir, script,
    disk; it goes with the probe) and the master port's test, not the GPUs or the versions."""
    checks = doctor.Preflight(spec, script, local_cwd, full, test_port=test_port, recheck=recheck,
                              sync_dir=sync_dir, copies=not dry_run)
    job.prepare(run_setup=False, ahead=checks.ahead())
    reports = sync_hosts(spec, job.agents, progress, override=sync_dir, dry_run=dry_run)
    synced = {rank for rank, host in enumerate(spec.hosts) if source_of(spec, host, sync_dir)} if dry_run else ()
    setups.run(job, emit, if_cwd=synced)
    plan = job.plan  # torchrun's argv as the interpreter after setup takes it
    if plan is None:
        raise RuntimeError("the checks before the plan")
    report = checks.run([job.probed(rank) for rank in range(plan.nnodes)], addr=plan.master_addr,
                        port=plan.master_port, synced=synced, set_up=job.set_up,
                        setup_of=(job.job_id, job.attempt), early=job.early)
    refused = doctor.refusal(report)  # one line and a fix per problem
    if refused is not None:
        raise refused
    return plan, reports, doctor.warnings(report)


def note(emit: Emit | None, text: str) -> None:
    """Tell every consumer ``text`` (a ``JobNote``), if anybody listens."""
    if emit is not None:
        emit(JobNote(None, text=text))


def checked_attempt(record: JobRecord, aspec: AttemptSpec, emit: Emit | None, *, full: bool,
                    script_args: Sequence[str] | None = None, recheck: bool = False,
                    transports: Callable[[HostSpec], Transport] | None = None) -> Job:
    """The next attempt probed and checked, nothing started nor stopped: the script, the probe,
    the sync (what changed is copied while the current attempt runs on: files are written under
    a temporary name and renamed, never deleted), the hosts' setup (once: its agent keeps the
    environment for the start), the preflight in setup's environment (a fixed master port held
    by the running attempt is not tested). ``script_args``: new arguments for the script
    (default: the record's); ``recheck``: an automatic restart's, of hosts checked minutes ago whose
    failure points at none of them: the probe (reachable), the cheap inspection and the master port's
    test, not the full preflight (GPUs, versions); ``transports``: the owner's, lent (its
    connections to the hosts: ``transports.lent``), else new ones.
    Raises ``ConfigError`` or ``HostsUnavailable``; the caller closes the ``Job``."""
    for text in aspec.notes:
        note(emit, f"warning: {text}")
    check_script(aspec.spec, record.script, record.local_cwd)
    args = record.script_args if script_args is None else script_args
    job = Job(aspec.spec, record.script, args, job_id=record.job_id, name=record.name, emit=emit,
              env_overrides=dict(aspec.overrides), local_cwd=record.local_cwd, grace=record.grace,
              attempt=record.attempt + 1, transport_factory=transports or lifecycle.transport_factory(record),
              follow_logs=False)  # it starts the attempt; its follower (``lifecycle.follower``) shows the log
    try:
        held = aspec.spec.master_port is not None and not record.finished
        _, reports, warnings = _probe_and_check(job, aspec.spec, record.script, record.local_cwd, full=full,
                                                dry_run=False, test_port=not held, emit=emit, recheck=recheck)
        for rank, report in sorted(reports.items()):  # `sync:`, if any
            note(emit, f"sync node{rank} {report.host}: {report.describe()}")
        for warning in warnings:
            note(emit, f"warning: {warning}")
    except BaseException:
        job.close()
        raise
    return job


__all__ = ["AttemptSpec", "check_script", "checked_attempt", "note", "plan_to_start"]
