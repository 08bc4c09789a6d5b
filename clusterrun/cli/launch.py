"""``clusterrun up`` once its hosts are found and their connections started (``cli.up``): the
checks (``checks.check_new``), the start (``Runner``, ``attempt.start``), what it prints and its exit
codes. Imported after the connections started, so that their handshakes overlap these imports."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import click

from clusterrun.cli import EXIT_FAILED, EXIT_HOSTS, EXIT_SIGNAL, EXIT_USAGE, _fail, _note
from clusterrun.cli.follow import _dashboard, _exit_code, _follow_hint, _on_signals, _use_tui, quick_handoffs
from clusterrun.cli.records import _guarantee, _refresh
from clusterrun.cli.up import interrupted_connecting
from clusterrun.config.hostsfile import ClusterSpec
from clusterrun.config.nodesets import FOLD_PAST, alike_lines
from clusterrun.core.errors import ClusterrunError, ConfigError, HostsUnavailable, StateError
from clusterrun.core.events import Event, JobNote
from clusterrun.core.frozen import frozen
from clusterrun.life.gate import check_new, check_script
from clusterrun.life.recorder import new_record
from clusterrun.life.runner import Runner
from clusterrun.run.interfaces import Interface
from clusterrun.run.orchestrator import Job, Reconnect
from clusterrun.run.plan import MAX_NAME, LaunchPlan, job_name, make_job_id
from clusterrun.store.jobs import JobStore
from clusterrun.store.opened import Opened
from clusterrun.store.preparing import Preparing, live
from clusterrun.sync.copy import SyncReport
from clusterrun.sync.view import SyncView
from clusterrun.transports import Transport, made
from clusterrun.views.printer import Printer


@frozen
class UpArgs:
    """What ``up`` read and checked before its hosts' connections started: its options, the hosts
    file's spec (and YAML text), the ``--env`` overrides, and the transports already connecting."""

    spec: ClusterSpec
    hosts_file: str
    hosts_text: str
    script: str
    script_args: tuple[str, ...]
    overrides: dict[str, str]
    transports: Sequence[Transport]
    ssh_config: str | None
    show_timings: Callable[[], None]
    name: str | None
    dry_run: bool
    as_json: bool
    detach: bool
    no_tui: bool
    ui_lines: int
    leave_running: bool
    grace: float
    sync_dir: str | None
    no_preflight: bool
    no_retry_startup: bool
    max_restarts: int | None
    unreachable_timeout: float | None


def launch(a: UpArgs) -> None:
    """``up`` from its checks on: the script, the name, the hosts' checks (or the dry run's plan), the
    start, then following the job (see ``up``); the hosts' connections are under way already."""
    try:
        try:
            check_script(a.spec, a.script, os.getcwd(), a.sync_dir)
        except ConfigError as exc:
            _fail(exc, EXIT_USAGE)
        jname = job_name(a.name, a.script)
        store = JobStore()
        if not a.dry_run and a.name is not None:
            _check_name_free(store, jname)
        elif not a.dry_run:
            jname = _free_name(store, jname)
        job_id = make_job_id(jname, time.strftime("%Y%m%d-%H%M%S"), secrets.token_hex(2))
        printer = Printer()
        job = Job(a.spec, a.script, a.script_args, job_id=job_id, name=jname, emit=None, env_overrides=a.overrides,
                  local_cwd=os.getcwd(), grace=a.grace, reconnect=Reconnect(give_up_after=a.unreachable_timeout),
                  transport_factory=made(a.transports), follow_logs=not a.detach)  # -d shows no log line
        prep = None if a.dry_run else Preparing(job_id, jname, [h.host for h in a.spec.hosts])  # listed by `ps`
    except KeyboardInterrupt:  # the hosts are connecting already
        interrupted_connecting()
    try:
        plan, syncs = _checked(job, a.spec, a.script, a.sync_dir, full=not a.no_preflight, dry_run=a.dry_run, prep=prep)
        if a.dry_run and a.as_json:
            from clusterrun.views.joblist import plan_json

            click.echo(json.dumps(plan_json(plan, job.host_fallbacks, job.interfaces, syncs, job.set_up,
                                             job.setup_skipped), indent=1))
            return
        if a.dry_run:
            _print_plan(plan, job.host_fallbacks, job.interfaces, job.set_up, job.setup_skipped)
            return
        record = new_record(plan, hosts_file=a.hosts_file, hosts_text=a.hosts_text, env_overrides=a.overrides,
                            local_cwd=os.getcwd(), ssh_config=a.ssh_config, unreachable_timeout=a.unreachable_timeout,
                            retry_startup=not a.no_retry_startup, max_restarts=a.max_restarts, watch=a.spec.watch,
                            notify=a.spec.notify)
        tui = not a.detach and _use_tui(a.no_tui)
        try:
            runner = Runner.create(store, record, job, None if tui else printer, retry_startup=not a.no_retry_startup,
                                   policy=a.spec.restart.with_max(a.max_restarts))
        except StateError as exc:
            exc.message += "; nothing was started"
            _fail(exc, EXIT_USAGE)
        except ClusterrunError as exc:
            _fail(exc, EXIT_FAILED)
        finally:
            if prep is not None:  # the record tells of the job now, or nothing started
                prep.close()
        if tui:
            from clusterrun.life.session import Session  # the dashboard's: `up --no-tui` and `-d` need none

            code = _dashboard(Session(store, record, runner=runner), a.ui_lines)
            a.show_timings()
            sys.exit(code)
        printer.set_plan(plan)
        printer.note(f"job {plan.job_id}: {plan.nnodes} nodes, world size {plan.world_size}, "
                     f"master {plan.master_addr}:{plan.master_port}")
        if (network := _network_note(plan, job.interfaces)) is not None:
            printer.note(network)

        def stop(signum: int) -> None:
            runner.request_stop(signal.Signals(signum).name)

        handlers = {signal.SIGINT: (lambda s: runner.request_hand_over()) if a.leave_running else stop,
                    signal.SIGTERM: stop, signal.SIGHUP: lambda s: runner.request_hand_over()}
        with _on_signals(handlers) as got:
            try:
                runner.start()
            except HostsUnavailable as exc:
                printer.flush()  # the stop reports of the nodes that had started, before the error
                _fail(exc, EXIT_HOSTS)
            a.show_timings()
            if a.detach:
                runner.hand_over()
                click.echo(job_id)
                _note(f"job {job_id} started; {_follow_hint(job_id)}")
                return
            quick_handoffs()  # the nodes' followers are threads beside the one printing
            result = runner.follow()
            if result is None:  # SIGHUP, or Ctrl-C with --leave-running: a monitor owns the job now
                runner.hand_over()
                with contextlib.suppress(OSError):  # the terminal may be gone
                    if got.get("signal") != signal.SIGHUP:
                        printer.note(f"job {job_id} left running; {_follow_hint(job_id)}")
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(EXIT_SIGNAL.get(got.get("signal", 0), 1))  # its followers may still wait on the hosts
    finally:
        if prep is not None:
            prep.close()
        printer.flush()  # status lines still held when up ends another way (an error): never lost
        job.close()
    sys.exit(_exit_code(result, got))


def _print_plan(plan: LaunchPlan, fallbacks: Mapping[int, Sequence[str]],
                interfaces: Sequence[Interface] = (), setup: Mapping[int, str] | None = None,
                skipped: Mapping[int, str] | None = None) -> None:
    """The dry run's text; ``setup``: the job's interpreter after the setup each node ran,
    ``skipped``: why a node's setup did not run."""
    from clusterrun.views.joblist import shown_env  # ps's module: only the dry run shows an environment

    click.echo(f"job {plan.job_id}: {plan.nnodes} nodes, world size {plan.world_size}, "
               f"master {plan.master_addr}:{plan.master_port}")
    for node in plan.nodes:
        click.echo(f"\nnode{node.rank} {node.host.host} ({node.host.transport}), "
                   f"ranks {node.first_rank}..{node.first_rank + node.nproc - 1}")
        click.echo(f"  cwd: {node.cwd or '(home directory)'}")
        if node.rank < len(interfaces):
            click.echo(f"  network: {interfaces[node.rank].describe()}")
        click.echo("  env:")
        env = shown_env(node.env, plan.secret_env)
        for key in sorted(env):
            click.echo(f"    {key}={shlex.quote(env[key])}")
        if node.host.setup:
            click.echo("  setup (bash, in cwd, before torchrun; what it exports reaches torchrun):")
            for command in node.host.setup:
                click.echo("\n".join(f"    {line}" for line in command.rstrip("\n").split("\n")))
            if setup and node.rank in setup:
                click.echo(f"  setup ran; the job runs {setup[node.rank]}")
            elif skipped and node.rank in skipped:
                click.echo(f"  setup not run: {skipped[node.rank]} (up runs it after the sync); the checks were of "
                           "the interpreter without it")
        click.echo(f"  command: {shlex.join(node.argv)}")
        click.echo(_guarantee(fallbacks.get(node.rank) or ()))


def _network_note(plan: LaunchPlan, interfaces: Sequence[Interface]) -> str | None:
    """``network: node0 gpu-a eth1, node1 gpu-b eth1``: the interface each node's ranks use, when
    clusterrun chose one (not on a job whose nodes all share this machine's loopback)."""
    if not any(i.name for i in interfaces):
        return None
    if plan.nnodes > FOLD_PAST:  # nodes alike share a part: ``64 nodes 0-63 (gpu[01-64]): eth0``
        return "network: " + "; ".join(alike_lines([(n.rank, n.host.host, i.name or "loopback", i.name or "loopback")
                                                    for n, i in zip(plan.nodes, interfaces, strict=True)], plan.nnodes))
    return "network: " + ", ".join(f"node{n.rank} {n.host.host} {i.name or 'loopback'}"
                                   for n, i in zip(plan.nodes, interfaces, strict=True))


def _show_note(prep: Preparing | None, event: Event) -> None:
    if isinstance(event, JobNote):  # the setups still running: here and in `ps`
        _note(event.text)
        if prep is not None:
            prep.say(event.text)


def _checked(job: Job, spec: ClusterSpec, script: str, sync_dir: str | None, *, full: bool,
             dry_run: bool, prep: Preparing | None = None) -> tuple[LaunchPlan, Mapping[int, SyncReport]]:
    """``checks.check_new``, shown: the probe, the sync (its progress and report), the hosts'
    setup, the preflight (see doctor.py); a problem on any host starts nothing anywhere: exit 3
    (2 for a bad ``--sync``), with one line and a fix for each; warnings are printed."""
    view = SyncView(live=None if not dry_run else False, hosts=len(spec.hosts))
    try:
        with view:
            plan, reports, warnings = check_new(job, spec, script, os.getcwd(), full=full, dry_run=dry_run,
                                                sync_dir=sync_dir, progress=view, emit=partial(_show_note, prep))
    except HostsUnavailable as exc:
        _fail(exc, EXIT_HOSTS)
    except ConfigError as exc:
        _fail(exc, EXIT_USAGE)
    except KeyboardInterrupt:  # close every connection (the caller's finally), start nothing
        interrupted_connecting()
    view.report(reports)
    for warning in warnings:
        _note(f"warning: {warning}")
    return plan, reports


def _holder(store: JobStore, name: str) -> tuple[str, str, str] | None:
    """The unfinished job called ``name`` (its record brought up to date from its hosts first), or
    the ``up`` still preparing one: its id, its state (``preparing``) and what that ``up`` last
    said; None when the name is free."""
    for record in store.named(name):
        if not record.finished:
            record = _refresh(store, Opened(record)).record
        if not record.finished:
            return record.job_id, str(record.state), ""
    for entry in live():  # another `up` still checking its hosts: no record yet, only its note
        if entry.name == name:
            return entry.job_id, "preparing", entry.said
    return None


def _check_name_free(store: JobStore, name: str) -> None:
    """Refuse a ``--name`` that an unfinished job has, so that every job can still be named: two
    running jobs of one name would make the name ambiguous for `ps`, `logs`, `down`..."""
    held = _holder(store, name)
    if held is None:
        return
    job_id, state, said = held
    if state != "preparing":
        _fail(ConfigError(f"job {job_id}, named {name!r}, is {state}; nothing was started", key="--name",
                          hint=f"stop it first (`clusterrun down {job_id}`), or name this job otherwise with "
                          "--name NAME"), EXIT_USAGE)
    _fail(ConfigError(f"job {job_id}, named {name!r}, is being prepared by another `clusterrun up` (it said: "
                      f"{said}); nothing was started", key="--name",
                      hint="wait for that start to end (`clusterrun ps`), or name this job otherwise with --name NAME"),
          EXIT_USAGE)


def _free_name(store: JobStore, name: str) -> str:
    """The script's name for a job without ``--name``, else the first of ``NAME-2``, ``NAME-3``...
    that no unfinished job has: two runs of one script (two learning rates) need no names of their own."""
    held = _holder(store, name)
    if held is None:
        return name
    number = 1
    while True:
        number += 1
        candidate = name[:MAX_NAME - len(str(number)) - 1].rstrip("-.") + f"-{number}"
        if _holder(store, candidate) is None:
            _note(f"{name!r} is {held[1]} (job {held[0]}): this job is named {candidate!r}")
            return candidate
