"""Slurm from the command line: ``up --from-slurm`` (inside an allocation: one srun, in the
foreground) and ``export --sbatch`` (a batch script for the same job)."""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import socket
import sys
import time
from collections.abc import Container, Sequence
from typing import TYPE_CHECKING, NoReturn

import click

from clusterrun.cli import (
    EXCLUDE_HELP,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_SIGNAL,
    EXIT_USAGE,
    NODES_HELP,
    _fail,
    _note,
    main,
)
from clusterrun.cli.follow import _dashboard, _use_tui
from clusterrun.config.environment import MASK, resolve, secret_names
from clusterrun.config.hostsfile import ClusterSpec
from clusterrun.config.selection import load_hosts
from clusterrun.core.errors import ClusterrunError, ConfigError, JobNotFound
from clusterrun.core.events import JobResult, NodeResult, NodeState
from clusterrun.life.attempt import record_next_attempt
from clusterrun.life.recorder import Recorder
from clusterrun.run.plan import JOB_ID_SHAPE, LaunchPlan, job_name, parse_env_overrides, plan_from_json
from clusterrun.slurm.job import (
    SRUN_MISSING,
    SlurmSession,
    StepNoter,
    allocation_gone,
    fan_out,
    record_end,
    refresh,
    slurm_of,
    slurm_record,
)
from clusterrun.store.jobs import JobRecord, JobStore, is_slurm, process_id
from clusterrun.store.opened import Opened
from clusterrun.views.printer import Printer

# Slurm's modules are imported by the functions that run under Slurm: `up` and `down` of a job over
# SSH, and `ps`, load only this module's light part.
if TYPE_CHECKING:
    from clusterrun.slurm.run import SlurmRun
    from clusterrun.slurm.step import SlurmStep

RESTART_SLACK = 20.0  # s: a restart's wait for the stopped step's `up` to let the job go, twice over


def up_from_slurm(script: str, script_args: tuple[str, ...], *, hosts_file: str | None, name: str | None,
                  env: tuple[str, ...], dry_run: bool, grace: float = 10.0, no_sync: bool = False,
                  no_preflight: bool = False, no_tui: bool = True, ui_lines: int = 10_000,
                  unsupported: Sequence[str] = ()) -> NoReturn:
    """``up --from-slurm``: the step built from this process's Slurm variables, run in the foreground;
    Ctrl-C or SIGTERM cancels the step (SIGTERM, SIGKILL after ``grace``), and the exit code is the
    job's. ``unsupported``: options of up given that mean nothing under Slurm, refused; ``no_sync``:
    a ``sync:`` of the hosts file is left out (else refused); ``no_preflight``: the tasks do not check
    python, the script and torch before torchrun."""
    from clusterrun.slurm.run import allocation_here
    from clusterrun.slurm.step import build_step, launch_plan

    try:
        if script.endswith((".yaml", ".yml")):
            raise ConfigError(f"with --from-slurm the first argument is the script, not a hosts file: {script}",
                              key="--from-slurm", hint=f"give the hosts file as --slurm-hosts {script}")
        if unsupported:
            raise ConfigError(f"{', '.join(unsupported)} cannot go with --from-slurm: the job runs in the foreground "
                              "inside the allocation, on all its nodes; nothing was started",
                              hint="choose the nodes with salloc/sbatch; see docs/slurm.md")
        allocation = allocation_here(os.environ)
        spec = _slurm_hosts(hosts_file)
        overrides = parse_env_overrides(env)
        step = build_step(allocation, spec, script, script_args, name=name, python=sys.executable,
                          env_overrides=overrides, cwd=os.getcwd(), no_sync=no_sync,
                          preflight=not no_preflight)
    except ConfigError as exc:
        _fail(exc, EXIT_USAGE)
    secret = spec.secret_env if spec is not None else ()
    job_id = step.job_id
    if dry_run:
        click.echo(f"job {job_id}: Slurm job {allocation.job_id}, {len(step.nodes)} nodes, world size "
                   f"{step.world_size}, master {step.master_addr}:{step.master_port}")
        click.echo(f"  processes per node ({step.nproc_source}): "
                   + ", ".join(f"{node} {n}" for node, n in zip(step.nodes, step.nprocs, strict=True)))
        click.echo("  env (srun passes it to every task):")
        from clusterrun.views.joblist import shown_env

        shown = shown_env(step.env, secret)
        click.echo("\n".join(f"    {k}={shlex.quote(shown[k])}" for k in sorted(shown)))
        click.echo(f"  command: {shlex.join(step.argv)}")
        sys.exit(EXIT_OK)
    printer = Printer(nnodes=len(step.nodes))
    plan = dataclasses.replace(launch_plan(step),
                               secret_env=tuple(secret), grace=grace)
    printer.set_plan(plan)
    store = JobStore()  # the job's record, owned by this process until the step ends (no monitor under Slurm)
    record = slurm_record(plan, step, allocation=allocation.job_id, hosts_file=hosts_file, env_overrides=overrides,
                          grace=grace)
    store.create(record)
    owner = store.try_own(job_id)
    printer.note(f"job {job_id}: {len(step.nodes)} nodes of Slurm job {allocation.job_id}, world size "
                 f"{step.world_size}, master {step.master_addr}:{step.master_port}"
                 + (f"; secret: {', '.join(secret_names(step.env, secret))}" if secret_names(step.env, secret) else ""))
    _run_step(store, record, plan, step, printer, owner=owner, no_tui=no_tui, ui_lines=ui_lines)


def _run_step(store: JobStore, record: JobRecord, plan: LaunchPlan, step: SlurmStep, printer: Printer, *,
              owner: int | None, no_tui: bool, ui_lines: int) -> NoReturn:
    """Run the record's current attempt as ``step``, in the dashboard on a terminal, else printed;
    its record and logs kept as it runs; ``owner`` (the job's owner lock) let go at the end. Exits
    with the job's exit code."""
    from clusterrun.slurm.run import SlurmRun
    from clusterrun.store.slurmlogs import LogFiles

    job_id, allocation = record.job_id, slurm_of(record)["job"]
    recorder, noter = Recorder(store, job_id, record.attempt), StepNoter(store, record)
    kept = LogFiles(store, job_id, record.attempt, warn=printer.note)  # `logs JOB` reads them
    session = SlurmSession(store, record, plan, listeners=(kept, recorder, noter)) if _use_tui(no_tui) else None
    run = SlurmRun(step, job_id=job_id, slurm_job=allocation, grace=record.grace,
                   emit=session.emit if session is not None else fan_out(kept, printer, recorder, noter))
    try:
        if session is not None:  # the dashboard: K stops the step; SIGTERM too, SIGHUP as well (no detaching)
            session.run = run
            code = _dashboard(session, ui_lines)
        else:
            code = _in_foreground(run)
    except FileNotFoundError:
        recorder.start_failed(SRUN_MISSING)
        _fail(SRUN_MISSING, EXIT_USAGE)
    finally:
        if session is not None and session.failed_start:
            recorder.start_failed(SRUN_MISSING)
        recorder.flush()
        noter.join()
        kept.close()
        if owner is not None:
            store.release(owner)
    sys.exit(code)


def _mark_restarting(store: JobStore, job_id: str, until: float | None) -> None:
    """Say in the record that this process restarts the job until ``until`` (None: no longer)."""
    mark = {"process": process_id(), "host": socket.gethostname(), "until": until} if until is not None else None
    store.update(job_id, lambda rec: rec.slurm.update(restarting=mark) if rec.slurm is not None else None)


def restart_slurm(job: Opened, grace: float | None, script_args: Sequence[str]) -> NoReturn:
    """``restart JOB`` for a job of ``up --from-slurm``: its step stopped (``down``'s stop) if it
    runs, then the next attempt as a new step of the same srun in the same allocation, run here
    in the foreground as ``up --from-slurm`` runs it. Refused, with nothing stopped, where the
    allocation has ended (or cannot be asked about) or a secret's value is not in this shell."""
    from clusterrun.slurm.step import SlurmStep

    store = JobStore()
    record = refresh(store, job.record)  # its `up` may be gone, and its step with it
    job_id, allocation = record.job_id, slurm_of(record).get("job")
    untouched = "nothing was stopped" if not record.finished else "nothing was started"
    if script_args:
        _fail(ConfigError(f"job {job_id} runs under Slurm: a restart there keeps its arguments; {untouched}",
                          hint="stop it and run `up --from-slurm` with the new arguments"), EXIT_USAGE)
    gone = allocation_gone(record)
    if gone is not None:
        _fail(ConfigError(f"job {job_id} cannot be restarted: {gone}; {untouched}",
                          hint=f"run `up --from-slurm {record.script}` in a new allocation (salloc, sbatch)"),
              EXIT_FAILED)
    plan = plan_from_json(record.plan, job.with_record(record).spec())
    env = dict(plan.nodes[0].env)
    missing = [name for name, value in env.items() if value == MASK and name not in os.environ]
    if missing:
        _fail(ConfigError(f"job {job_id}: the secret {', '.join(missing)} is not in this shell's environment; "
                          f"{untouched}", hint=f"export {missing[0]}=... and restart again"), EXIT_USAGE)
    env.update({name: os.environ[name] for name, value in env.items() if value == MASK})
    if not record.finished:  # its viewers wait for the next attempt instead of ending with this one
        _mark_restarting(store, job_id, time.time() + (record.grace if grace is None else grace) + RESTART_SLACK)
        if down_slurm_step(job_id, grace) is None:
            _mark_restarting(store, job_id, None)
            _fail(ConfigError(f"job {job_id}: its step could not be found to stop it"), EXIT_FAILED)
    owner = store.wait_own(job_id, RESTART_SLACK / 2)
    record = store.load(job_id)
    if owner is None or not record.finished:
        _mark_restarting(store, job_id, None)
        _fail(ConfigError(f"job {job_id} is {record.state} and owned by another clusterrun: not restarted",
                          hint=f"`clusterrun ps {job_id}`; try again once it has ended"), EXIT_FAILED)
    try:
        record = record_next_attempt(Recorder(store, job_id, record.attempt + 1), plan, record.script_args)
        fresh = {"step": None, "unwatched": None, "root_cause": None, "pid": os.getpid(), "restarting": None,
                 "controller": socket.gethostname()}  # this process runs the new step
        record = store.update(job_id, lambda rec: rec.slurm.update(fresh) if rec.slurm is not None else None)
    except ClusterrunError as exc:
        _mark_restarting(store, job_id, None)
        store.release(owner)
        _fail(exc, EXIT_FAILED)
    step = SlurmStep(job_id=job_id, name=plan.name, script=plan.script, script_args=plan.script_args,
                     argv=tuple(plan.nodes[0].argv), env=env, nodes=tuple(record.hosts),
                     nprocs=tuple(n.nproc for n in plan.nodes), master_addr=plan.master_addr,
                     master_port=plan.master_port)
    printer = Printer(nnodes=len(step.nodes))
    printer.set_plan(plan)
    printer.note(f"job {job_id}: attempt {record.attempt}, a new step in Slurm job {allocation}, on "
                 f"{len(step.nodes)} nodes; it runs while this command does (Ctrl-C stops it)")
    _run_step(store, record, plan, step, printer, owner=owner, no_tui=False, ui_lines=10_000)


def _in_foreground(run: SlurmRun) -> int:
    """Run the step with its output printed; Ctrl-C, SIGTERM or SIGHUP stop it. The exit code."""
    got: dict[str, int] = {}

    def stop(signum: int, frame: object) -> None:
        got.setdefault("signal", signum)
        run.request_stop(signal.Signals(signum).name)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        run.start()
        result = run.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if "signal" in got:
        return EXIT_SIGNAL.get(got["signal"], EXIT_FAILED)
    return EXIT_OK if result.ok else EXIT_FAILED


def _slurm_hosts(path: str | None) -> ClusterSpec | None:
    if path is None:
        return None
    spec, _text = load_hosts(path)
    spec, notes = resolve(spec, os.environ)
    for text in notes:
        _note(f"warning: {text}")
    return spec


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--sbatch", "sbatch", is_flag=True, help="Write a Slurm batch script (the only format so far).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), metavar="FILE",
              help="Write the script to FILE (default: standard output).")
@click.option("--name", help="The job's name (default: the script's name).")
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE",
              help="Set an environment variable for every node (repeatable; a secret one is referred to by name, "
              "not written).")
@click.option("-w", "--nodes", metavar="NODESET", help=NODES_HELP)
@click.option("-x", "--exclude", metavar="NODESET", help=EXCLUDE_HELP)
@click.argument("hosts_file", metavar="HOSTS.yaml", type=click.Path(dir_okay=False))
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- ARGS...]")
def export(hosts_file: str, script: str, script_args: tuple[str, ...], sbatch: bool, output: str | None,
           name: str | None, env: tuple[str, ...], nodes: str | None, exclude: str | None) -> None:
    """Write a batch script that runs SCRIPT as `up HOSTS.yaml SCRIPT` would, under Slurm.

    #SBATCH --nodes is the number of hosts, one task per node, --gpus-per-node from their `gpus`;
    srun starts torchrun on every node with the rendezvous on the allocation's first node. Values
    of `env:` and --env are written into the script; secrets, `forward_env` and `env_file` are
    not: the script takes them from the environment sbatch runs in (or reads the file on the node)
    and says so. Submit it with `sbatch FILE`."""
    from clusterrun.slurm.step import sbatch_script

    if script_args[:1] == ("--",):
        script_args = script_args[1:]
    try:
        if not sbatch:
            raise ConfigError("say which format: --sbatch", hint="clusterrun export --sbatch HOSTS.yaml SCRIPT")
        spec, _text = load_hosts(hosts_file, nodes, exclude)
        overrides = parse_env_overrides(env)
        text = sbatch_script(spec, script, script_args, name=job_name(name, script), env_overrides=overrides,
                             hosts_file=hosts_file)
    except ConfigError as exc:
        _fail(exc, EXIT_USAGE)
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(output, 0o755)
    except OSError as exc:
        _fail(ConfigError(f"cannot write {output}: {exc.strerror or exc}", key="--output",
                          hint="choose a writable path"), EXIT_USAGE)
    secret = secret_names(overrides, spec.secret_env)
    _note(f"wrote {output}; submit it with `sbatch {output}`"
          + (f"; set {', '.join(secret)} in sbatch's environment (secret: not written)" if secret else ""))


def down_slurm_step(ref: str, grace: float | None) -> int | None:
    """``down`` for a job of ``up --from-slurm``: its running step, found by name (the job id, or
    its start) among this user's, stopped as ``up`` stops it; the step's allocation marked so that
    the ``up`` following it records and reports it stopped. A recorded Slurm job that has ended is
    said so. None where ``ref`` is a job over SSH, or names no job here and no step of that name
    runs (``down`` goes on as usual)."""
    store = JobStore()
    try:
        record: JobRecord | None = store.load(store.resolve(ref))
    except JobNotFound:
        record = None
    if record is not None and not is_slurm(record):
        return None
    if record is not None:  # its `up` may be gone, and its step with it
        record = refresh(store, record)
    if record is not None and record.finished:
        _note(f"job {record.job_id} already finished ({record.state}); nothing to stop")
        return EXIT_OK
    from clusterrun.slurm.run import mark_stopped, my_steps, step_gone, stop_step  # Slurm's, or squeue's

    steps = [s for s in my_steps() if s.name == ref or s.name.startswith(ref)]
    steps = [s for s in steps if s.name == (record.job_id if record is not None else ref)] or steps
    if not steps and record is not None:
        _fail(ConfigError(f"job {record.job_id} is {record.state} in its record, but its Slurm step cannot be found "
                          "here (no Slurm configuration, or `squeue --steps --me` does not list it)",
                          hint=f"run `clusterrun down {record.job_id}` where Slurm's commands work, or "
                          f"`scancel {slurm_of(record).get('step') or slurm_of(record).get('job')}`"), EXIT_FAILED)
    if not steps:
        return None
    if len(steps) > 1:
        _fail(ConfigError(f"{ref!r} names several Slurm steps: {', '.join(f'{s.name} ({s.step})' for s in steps)}",
                          hint="give the whole job id"), EXIT_USAGE)
    step, name = steps[0].step, steps[0].name
    _note(f"stopping job {name}: Slurm step {step}")
    mark_stopped(step.split(".")[0], name)
    _note(stop_step(step, 10.0 if grace is None else grace, step_gone(step)))
    if record is not None:
        _record_stopped(store, record.job_id)
    _note(f"job {name} stopped; Slurm ended every process of its step on every node")
    return EXIT_OK


def _record_stopped(store: JobStore, job_id: str) -> None:
    """Wait for the ``up`` running the step to record its end; where that ``up`` is gone, record the stop here."""
    owner = store.wait_own(job_id, 10.0)
    if owner is None:
        _note(f"warning: the `up` of job {job_id} has not recorded the stop yet")
        return
    try:
        record = store.load(job_id)
        if not record.finished:
            nodes = tuple(NodeResult(n.rank, n.host, NodeState.STOPPED, error="stopped by clusterrun down")
                          for n in record.nodes)
            record_end(store, record, JobResult(job_id, nodes, interrupted="clusterrun down"))
    finally:
        store.release(owner)


def slurm_rows(recorded: Container[str] = ()) -> list[tuple[str, str, str, str, str, str]]:
    """``ps``'s rows for the running jobs of ``up --from-slurm`` that have no record here (``recorded``:
    the ids of those that have): this user's Slurm steps named like a clusterrun job id (JOB, NAME,
    HOSTS, STATE, ATTEMPT, AGE)."""
    from clusterrun.slurm.run import my_steps

    return [(s.name, JOB_ID_SHAPE.sub("", s.name), s.nodes, f"running (Slurm step {s.step})", "1", s.elapsed)
            for s in my_steps() if JOB_ID_SHAPE.search(s.name) and s.name not in recorded]
