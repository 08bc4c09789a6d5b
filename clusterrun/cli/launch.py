"""``clusterrun up`` once its hosts are found and their connections started (``cli.up``): the job
made (``life.launch``: checked, named, recorded, owned) and shown, its start (``Runner``), following
it, and the exit codes. Imported after the connections started, so that their handshakes overlap these imports."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
from collections.abc import Callable, Mapping, Sequence

import click

from clusterrun.cli import EXIT_FAILED, EXIT_HOSTS, EXIT_SIGNAL, EXIT_USAGE, _fail, _note, interrupted_connecting
from clusterrun.cli.follow import _dashboard, _exit_code, _follow_hint, _on_signals, _use_tui, quick_handoffs
from clusterrun.cli.records import _guarantee, _refresh
from clusterrun.config.hostsfile import ClusterSpec
from clusterrun.core.errors import ClusterrunError, ConfigError, DamagedRecord, HostsUnavailable, StateError
from clusterrun.core.frozen import frozen
from clusterrun.life.launch import Checked, Holder, NewJob, first_attempt
from clusterrun.run.interfaces import Interface
from clusterrun.run.plan import LaunchPlan
from clusterrun.store.jobs import JobStore
from clusterrun.store.opened import Opened
from clusterrun.store.preparing import live
from clusterrun.sync.copy import SyncReport
from clusterrun.transports import Transport
from clusterrun.views.printer import Printer, network_text
from clusterrun.views.sync import SyncView


@frozen
class UpArgs:
    """What ``up`` read and checked before its hosts' connections started: the job to make
    (``new``), the hosts file's spec, the transports already connecting, and how it is shown."""

    new: NewJob
    spec: ClusterSpec
    transports: Sequence[Transport]
    show_timings: Callable[[], None]
    as_json: bool
    detach: bool
    no_tui: bool
    ui_lines: int
    leave_running: bool


def launch(a: UpArgs) -> None:
    """``up`` from its checks on: the job checked, named, recorded and owned (``life.launch``), or
    the dry run's plan printed; then the start, and following the job (see ``up``); the hosts'
    connections are under way already."""
    store, printer = JobStore(), Printer()
    tui = not a.detach and _use_tui(a.no_tui)
    shown = _Shown(store, a)
    try:
        launched = first_attempt(a.new, a.spec, a.transports, store, shown, None if tui else printer)
    except HostsUnavailable as exc:
        _fail(exc, EXIT_HOSTS)
    except DamagedRecord:  # a record in the way of the name: the command's answer to it (exit 1)
        raise
    except (ConfigError, StateError) as exc:
        _fail(exc, EXIT_USAGE)
    except ClusterrunError as exc:
        _fail(exc, EXIT_FAILED)
    except KeyboardInterrupt:  # nothing started; the connections close with the program
        interrupted_connecting()
    if launched is None:  # the dry run
        return
    runner, plan = launched.runner, launched.plan
    job, job_id = runner.job, plan.job_id
    try:
        if tui:
            from clusterrun.life.session import Session  # the dashboard's: `up --no-tui` and `-d` need none

            session = Session(store, runner.record, runner=runner)
            code = _dashboard(session, a.ui_lines)
            a.show_timings()
            sys.exit(code)
        printer.set_plan(plan)
        printer.note(f"job {job_id}: {plan.nnodes} nodes, world size {plan.world_size}, "
                     f"master {plan.master_addr}:{plan.master_port}")
        if (network := network_text(plan, job.interfaces)) is not None:
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
        printer.flush()  # status lines still held when up ends another way (an error): never lost
        runner.close()  # the current attempt's job (a restart replaced the first) and the pooled connections
    sys.exit(_exit_code(result, got))


class _Shown:
    """What ``up`` shows of its job's launch (``life.launch.LaunchView``): notes and the sync on
    stderr, the dry run's plan on stdout; and who holds a job name, its record brought up to date."""

    def __init__(self, store: JobStore, a: UpArgs) -> None:
        self.store, self.as_json, self.dry_run, self.hosts = store, a.as_json, a.new.dry_run, len(a.spec.hosts)
        self._sync: SyncView | None = None  # made when the sync begins

    def note(self, text: str) -> None:
        _note(text)

    def syncing(self) -> SyncView:
        self._sync = SyncView(live=None if not self.dry_run else False, hosts=self.hosts)
        return self._sync

    def synced(self, reports: Mapping[int, SyncReport]) -> None:
        if self._sync is not None:
            self._sync.report(reports)

    def planned(self, checked: Checked) -> None:
        job = checked.job
        if self.as_json:
            from clusterrun.views.joblist import plan_json

            click.echo(json.dumps(plan_json(checked.plan, job.host_fallbacks, job.interfaces, checked.reports,
                                             job.set_up, job.setup_skipped), indent=1))
            return
        _print_plan(checked.plan, job.host_fallbacks, job.interfaces, job.set_up, job.setup_skipped)

    def holder(self, name: str) -> Holder | None:
        """The unfinished job called ``name`` (its record brought up to date from its hosts first), or
        the ``up`` still preparing one: its id, its state (``preparing``) and what that ``up`` last
        said."""
        for record in self.store.named(name):
            if not record.finished:
                record = _refresh(self.store, Opened(record)).record
            if not record.finished:
                return Holder(record.job_id, str(record.state))
        for entry in live():  # another `up` still checking its hosts: no record yet, only its note
            if entry.name == name:
                return Holder(entry.job_id, "preparing", entry.said)
        return None


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

