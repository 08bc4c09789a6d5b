"""The ``clusterrun`` command. The only place that turns exceptions into messages and exit codes.

Exit codes: 0 the job succeeded (``down``: stopped, nothing it could see is left) · 1 the job failed
(a node exited non-zero, was lost or stopped; ``down``: something is still running) · 2 bad input
(hosts file, options, an unknown or ambiguous job) or a bad environment on this machine: the
controller's state directory cannot be read or written (read-only, full, no permission; ``up``:
nothing was started; ``down``: the job was stopped but that could not be recorded) · 3 a host
could not be used, or ``up``'s preflight found a problem (``up``: nothing was started;
``down``: a host could not be reached) · 130 / 143 SIGINT / SIGTERM (``up``: the job was stopped
on every node, or left running with ``--leave-running``) · 129 SIGHUP (``up``: the job was left
running, owned by a monitor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import os
import secrets
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from types import FrameType
from typing import NoReturn

import click

from clusterrun import __version__, doctor
from clusterrun.config import ClusterSpec, load_cluster
from clusterrun.environment import resolve
from clusterrun.errors import ClusterrunError, ConfigError, HostsUnavailable, JobNotFound, StateError
from clusterrun.events import JobResult, JobState
from clusterrun.interfaces import Interface
from clusterrun.joblist import STATES, jobs_json, plan_json, shown, shown_env
from clusterrun.jobs import JobRecord, JobStore
from clusterrun.lifecycle import (
    daemonize,
    follower,
    new_record,
    node_statuses,
    read_logs,
    refresh,
    remove_on_hosts,
    save_seen,
    spec_of,
)
from clusterrun.orchestrator import Job, Reconnect
from clusterrun.plan import LaunchPlan, job_name, make_job_id, parse_env_overrides, plan_from_json
from clusterrun.printer import Printer
from clusterrun.runner import NotStopped, Runner, restart_job, run_monitor, stop_recorded
from clusterrun.session import Session
from clusterrun.sync import source_of, sync_hosts
from clusterrun.syncview import SyncView
from clusterrun.terminal import safe
from clusterrun.transports import transport_for

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_HOSTS = 0, 1, 2, 3
EXIT_TIMEOUT = 124  # `wait --timeout` ran out, as timeout(1) says
EXIT_SIGNAL = {int(signal.SIGINT): 130, int(signal.SIGTERM): 143, int(signal.SIGHUP): 129}


def _fail(error: ClusterrunError, code: int) -> NoReturn:
    click.echo(f"clusterrun: error: {safe(error.render(), colour=False)}", err=True)  # may quote a host
    sys.exit(code)


def _note(text: str) -> None:
    click.echo(f"clusterrun: {safe(text, colour=False)}", err=True)


class _Commands(click.Group):
    """The commands, with the one error every command can meet made an exit code here: the
    controller's own state directory cannot be read or written (``StateError``)."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except StateError as exc:
            _fail(exc, EXIT_USAGE)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="clusterrun")
def main() -> None:
    """Launch PyTorch distributed training on several machines over SSH and watch it.

    \b
    clusterrun up HOSTS.yaml train.py      start a job and follow it
    clusterrun up -d HOSTS.yaml train.py   start it in the background
    clusterrun ps [JOB]                    jobs, or one job's nodes
    clusterrun logs [-f] JOB               a job's logs
    clusterrun attach JOB                  follow a running job again
    clusterrun down JOB                    stop it on every host; says what was verified
    clusterrun restart JOB                 stop it and start it again as a new attempt
    clusterrun wait JOB                    block until it ends; exit 0 if it succeeded
    clusterrun rm JOB... / prune           forget ended jobs (--hosts-too: their logs too)
    clusterrun doctor HOSTS.yaml [SCRIPT]  check every host before the first run
    """
    # A log line may hold bytes that are not UTF-8: print them back as they were, never fail on them.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="surrogateescape")


def _check_script(spec: ClusterSpec, script: str, sync: str | None = None) -> None:
    """For local hosts the script must exist where torchrun will look for it (in the directory
    synced there, for a host with `sync`)."""
    for host in spec.hosts:
        if host.transport != "local":
            continue
        base = os.path.expanduser(host.workdir) if host.workdir else os.getcwd()
        base = source_of(spec, host, sync) or base
        if not os.path.isfile(os.path.join(base, script)):
            raise ConfigError(f"{os.path.join(base, script)} does not exist (needed by local host {host.host!r})",
                              path=script, hint="give the script's path relative to the current directory "
                              "or the host's workdir")


def _option_names(command: click.Command) -> dict[str, bool]:
    """Every option name of ``command`` (``--name``, ``-d``), and whether it takes a value."""
    names: dict[str, bool] = {}
    for param in command.params:
        if isinstance(param, click.Option):
            for name in (*param.opts, *param.secondary_opts):
                names[name] = not param.is_flag
    return names


def _unknown_option(command: click.Command, token: str) -> ConfigError:
    names = _option_names(command)
    close = difflib.get_close_matches(token.partition("=")[0], names, n=1)
    hint = f"did you mean {close[0]}?" if close else f"`clusterrun {command.name} --help` lists the options"
    return ConfigError(f"no such option: {token}", hint=hint)


def _check_up_arguments(hosts_file: str, script: str, script_args: tuple[str, ...]) -> None:
    """Refuse what would start the wrong job: an unknown option (click takes it for HOSTS.yaml,
    as up passes unknown options on to the script), or options of up written after HOSTS.yaml,
    which click would take for SCRIPT and its arguments."""
    if hosts_file.startswith("-") and hosts_file != "-":
        raise _unknown_option(up, hosts_file)
    if not script.startswith("-"):
        return
    names = _option_names(up)
    tokens = [script, *script_args]
    moved: list[str] = []
    while tokens and tokens[0].startswith("-") and tokens[0] != "--":
        name = tokens[0].partition("=")[0]
        if name not in names:
            if moved:
                break
            raise ConfigError(f"SCRIPT must not start with '-', got {script!r}",
                              hint="options go before HOSTS.yaml; a script named so: write ./" + script)
        takes_value = names[name] and "=" not in tokens[0]
        moved += tokens[:2] if takes_value else tokens[:1]
        tokens = tokens[2:] if takes_value else tokens[1:]
    if tokens[:1] == ["--"]:
        tokens = tokens[1:]
    hint = None
    argv = sys.argv[1:]
    for i in range(len(argv) - 1):  # the command as typed, with the options moved before HOSTS.yaml
        if argv[i] == hosts_file and argv[i + 1] == script and "up" in argv[:i]:
            command = ["clusterrun", *argv[:i], *moved, hosts_file, *tokens]
            hint = f"did you mean: {shlex.join(command)}"
            break
    raise ConfigError(f"options go before HOSTS.yaml: {shlex.join(moved)} after {hosts_file} would be the script "
                      "and its arguments; nothing was started", hint=hint)


def _print_plan(plan: LaunchPlan, fallbacks: Mapping[int, Sequence[str]],
                interfaces: Sequence[Interface] = ()) -> None:
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
        click.echo(f"  command: {shlex.join(node.argv)}")
        click.echo(_guarantee(fallbacks.get(node.rank) or ()))


def _network_note(plan: LaunchPlan, interfaces: Sequence[Interface]) -> str | None:
    """``network: node0 gpu-a eth1, node1 gpu-b eth1``: the interface each node's ranks use, when
    clusterrun chose one (not on a job whose nodes all share this machine's loopback)."""
    if not any(i.name for i in interfaces):
        return None
    return "network: " + ", ".join(f"node{n.rank} {n.host.host} {i.name or 'loopback'}"
                                   for n, i in zip(plan.nodes, interfaces, strict=True))


def _guarantee(fallbacks: Sequence[str], prefix: str = "  ") -> str:
    """How a stop will be verified on a host, and what else it lacks (from its probe or status)."""
    if any(f.startswith("no cgroup") for f in fallbacks):
        text = (f"{prefix}stop: a sweep (no cgroup: processes that leave the job's tree, session and "
                "environment cannot be seen)")
    else:
        text = f"{prefix}stop: verified by the attempt's cgroup"
    return text + "".join(f"\n{prefix}fallback: {f}" for f in fallbacks)


@contextmanager
def _on_signals(handlers: Mapping[signal.Signals, Callable[[int], None]]) -> Iterator[dict[str, int]]:
    """Install ``handlers`` (by signal) for the duration; the dict yielded says which signal came first."""
    got: dict[str, int] = {}

    def handler(signum: int, frame: FrameType | None) -> None:
        got.setdefault("signal", signum)
        handlers[signal.Signals(signum)](signum)

    previous = {s: signal.signal(s, handler) for s in handlers}
    try:
        yield got
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _exit_code(result: JobResult | None, got: dict[str, int]) -> int:
    if got.get("signal"):
        return EXIT_SIGNAL.get(got["signal"], 1)
    return EXIT_OK if result is not None and result.ok else EXIT_FAILED


def _follow_hint(job_id: str) -> str:
    return (f"follow it with `clusterrun attach {job_id}` or `clusterrun logs -f {job_id}`; "
            f"stop it with `clusterrun down {job_id}`")


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-d", "--detach", is_flag=True, help="Start the job, print its id and return; a background "
              "monitor applies fail-fast until it ends.")
@click.option("--name", help="A name for the job (default: the script's name); part of the job id. Refused "
              "while a job of that name is running.")
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE",
              help="Set an environment variable for every node (repeatable; wins over the hosts file).")
@click.option("--dry-run", is_flag=True, help="Check the hosts as up does (workdir and script included), print "
              "each node's exact command and environment, start nothing.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print the plan as JSON (schema 1, see "
              "docs/json.md).")
@click.option("--no-tui", is_flag=True, help="Print prefixed log lines instead of the dashboard.")
@click.option("--ui-lines", type=click.IntRange(min=100), default=10_000, show_default=True, metavar="N",
              help="Lines of each node the dashboard keeps in memory (the whole log stays on the hosts).")
@click.option("--leave-running", is_flag=True, help="Ctrl-C (SIGINT) stops following but leaves the job "
              "running, owned by a background monitor (default: Ctrl-C stops the job).")
@click.option("--ssh-config", type=click.Path(dir_okay=False), help="An ssh_config file to resolve hosts with "
              "(default: the hosts file's `ssh_config`, else ~/.ssh/config).")
@click.option("--accept-new-host-keys", is_flag=True, help="Record the keys of hosts not yet in known_hosts "
              "(like StrictHostKeyChecking=accept-new); a changed key is still refused.")
@click.option("--grace", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Seconds torchrun gets to stop its workers before they are killed.")
@click.option("--no-retry-startup", is_flag=True, help="Do not retry a known transient start-up failure "
              "(gloo aborting a rank while connecting; the master port taken before torchrun bound it), which "
              "is otherwise retried once as attempt 2, visibly.")
@click.option("--no-preflight", is_flag=True, help="Skip the costlier checks before the start (GPUs, the same "
              "torch/CUDA/Python on every host, the master port reachable by TCP from every node); the workdir, "
              "the script, disk, clock and logind are always checked.")
@click.option("--unreachable-timeout", type=click.FloatRange(min=1), metavar="SECONDS",
              help="Treat a host that cannot be reached for this long as failed (its node lost, fail-fast). "
              "Default: never; losing contact alone never stops a job. Counts the time spent retrying, "
              "not time this machine was paused or asleep.")
@click.option("--sync", "sync_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Copy DIR to every host's workdir before the start (only what changed; .gitignore and "
              "sync_exclude honoured, .git left out), over the connections already open: by rsync where both "
              "ends have it, else SFTP, else clusterrun's agent. Wins over `sync:` in the hosts file. With "
              "--dry-run: say what would be copied.")
@click.option("--no-sync", is_flag=True, help="Do not copy anything, whatever `sync:` in the hosts file says.")
@click.argument("hosts_file", metavar="HOSTS.yaml", type=click.Path(dir_okay=False))
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- ARGS...]")
def up(hosts_file: str, script: str, script_args: tuple[str, ...], detach: bool, name: str | None,
       env: tuple[str, ...], dry_run: bool, as_json: bool, no_tui: bool, ui_lines: int, leave_running: bool,
       ssh_config: str | None,
       accept_new_host_keys: bool, grace: float, unreachable_timeout: float | None, no_retry_startup: bool,
       no_preflight: bool, sync_dir: str | None = None, no_sync: bool = False) -> None:
    """Start SCRIPT with torchrun on every host of HOSTS.yaml and follow it until it ends.

    Options go before HOSTS.yaml; everything after SCRIPT (after `--` if you like) is passed to
    the script verbatim. An option of up written after HOSTS.yaml, or a SCRIPT starting with
    `-`, is refused before anything starts. The job runs detached on its hosts: closing the terminal (SIGHUP) or
    losing the connection never stops it, and a background monitor takes over. Ctrl-C (or
    SIGTERM) stops the job on every host and checks that nothing is left; with --leave-running
    Ctrl-C only stops following.
    """
    if script_args[:1] == ("--",):  # click passes the separator on once SCRIPT has been read
        script_args = script_args[1:]
    try:
        if script == "--" and script_args:  # `up HOSTS.yaml -- SCRIPT ...`: the script may start with '-'
            script, script_args = script_args[0], script_args[1:]
        else:
            _check_up_arguments(hosts_file, script, script_args)
        spec = load_cluster(hosts_file)
        with open(hosts_file, encoding="utf-8", errors="surrogateescape") as f:
            hosts_text = f.read()
        overrides = parse_env_overrides(env)
        if no_sync:
            spec = _without_sync(spec)
        spec, env_notes = resolve(spec, os.environ)
        _check_script(spec, script, sync_dir)
        if as_json and not dry_run:
            raise ConfigError("--json goes with --dry-run (a job's state as JSON: `clusterrun ps --json`)",
                              key="--json", hint="add --dry-run to print the plan as JSON; nothing was started")
    except ConfigError as exc:
        _fail(exc, EXIT_USAGE)
    for text in env_notes:
        _note(f"warning: {text}")
    jname = job_name(name, script)
    store = JobStore()
    if not dry_run:
        _check_name_free(store, jname, given=name is not None)
    job_id = make_job_id(jname, time.strftime("%Y%m%d-%H%M%S"), secrets.token_hex(2))
    printer = Printer()
    ssh_config = ssh_config or spec.ssh_config
    job = Job(spec, script, script_args, job_id=job_id, name=jname, emit=None, env_overrides=overrides,
              local_cwd=os.getcwd(), grace=grace, reconnect=Reconnect(give_up_after=unreachable_timeout),
              transport_factory=partial(transport_for, ssh_config=ssh_config,
                                        accept_new_host_keys=accept_new_host_keys))
    try:
        try:
            plan = job.prepare(run_setup=not dry_run)
        except HostsUnavailable as exc:
            _fail(exc, EXIT_HOSTS)
        except KeyboardInterrupt:  # Ctrl-C while connecting: close every connection (finally), start nothing
            _note("interrupted while connecting to the hosts; nothing was started")
            sys.exit(EXIT_SIGNAL[signal.SIGINT])
        _sync(spec, job, sync_dir, dry_run)  # first: the preflight looks for the script it copies
        synced = {rank for rank, h in enumerate(spec.hosts) if sync_dir is not None or h.sync} if dry_run else set()
        _preflight(job, plan, spec, script, full=not no_preflight, synced=synced)
        if dry_run and as_json:
            click.echo(json.dumps(plan_json(plan, job.host_fallbacks), indent=1))
            return
        if dry_run:
            _print_plan(plan, job.host_fallbacks, job.interfaces)
            return
        record = new_record(plan, hosts_file=hosts_file, hosts_text=hosts_text, env_overrides=overrides,
                            local_cwd=os.getcwd(), ssh_config=ssh_config, unreachable_timeout=unreachable_timeout,
                            retry_startup=not no_retry_startup)
        try:
            store.create(record)  # before anything starts: a job nobody could find again must not run
        except StateError as exc:
            exc.message += "; nothing was started"
            _fail(exc, EXIT_USAGE)
        owner = store.try_own(job_id)
        if owner is None:  # cannot happen to a job created just now, unless its directory is shared
            _fail(ClusterrunError(f"job {job_id} is owned by another process already"), EXIT_FAILED)
        tui = not detach and _use_tui(no_tui)
        runner = Runner(store, record, job, owner, None if tui else printer, retry_startup=not no_retry_startup)
        if tui:
            sys.exit(_dashboard(Session(store, record, runner=runner), ui_lines))
        printer.set_plan(plan)
        printer.note(f"job {plan.job_id}: {plan.nnodes} nodes, world size {plan.world_size}, "
                     f"master {plan.master_addr}:{plan.master_port}")
        if (network := _network_note(plan, job.interfaces)) is not None:
            printer.note(network)

        def stop(signum: int) -> None:
            runner.request_stop(signal.Signals(signum).name)

        handlers = {signal.SIGINT: (lambda s: runner.request_hand_over()) if leave_running else stop,
                    signal.SIGTERM: stop, signal.SIGHUP: lambda s: runner.request_hand_over()}
        with _on_signals(handlers) as got:
            try:
                runner.start()
            except HostsUnavailable as exc:
                _fail(exc, EXIT_HOSTS)
            if detach:
                runner.hand_over()
                click.echo(job_id)
                _note(f"job {job_id} started; {_follow_hint(job_id)}")
                return
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
        job.close()
    sys.exit(_exit_code(result, got))


def _without_sync(spec: ClusterSpec) -> ClusterSpec:
    return dataclasses.replace(spec, hosts=tuple(dataclasses.replace(h, sync=None) for h in spec.hosts))


def _sync(spec: ClusterSpec, job: Job, sync_dir: str | None, dry_run: bool) -> None:
    """Copy the project to the hosts that want it, after the probe and before anything starts;
    a failure on any host starts nothing anywhere (exit 3)."""
    view = SyncView(live=None if not dry_run else False)
    try:
        with view:
            reports = sync_hosts(spec, job.agents, view, override=sync_dir, dry_run=dry_run)
    except HostsUnavailable as exc:
        _fail(exc, EXIT_HOSTS)
    except ConfigError as exc:
        _fail(exc, EXIT_USAGE)
    except KeyboardInterrupt:
        _note("interrupted while copying files to the hosts; nothing was started")
        sys.exit(EXIT_SIGNAL[signal.SIGINT])
    view.report(reports)

@main.command(name="doctor")
@click.option("--ssh-config", type=click.Path(dir_okay=False), help="An ssh_config file to resolve hosts with "
              "(default: the hosts file's `ssh_config`, else ~/.ssh/config).")
@click.option("--accept-new-host-keys", is_flag=True, help="Record the keys of hosts not yet in known_hosts "
              "(like StrictHostKeyChecking=accept-new); a changed key is still refused.")
@click.argument("hosts_file", metavar="HOSTS.yaml", type=click.Path(dir_okay=False))
@click.argument("script", required=False)
def doctor_command(hosts_file: str, script: str | None, ssh_config: str | None, accept_new_host_keys: bool) -> None:
    """Check that every host of HOSTS.yaml can run a job; start nothing.

    \b
    Per host, in parallel: the connection (reachable, host key, login), the interpreter and its
    Python, torch with its CUDA and NCCL versions (the same on every host, else a warning naming
    the odd ones), the GPUs asked for (nvidia-smi; busy ones warn), the workdir and SCRIPT
    (relative to each host's workdir), free disk in the state dir, the master port free on node 0
    and reachable by TCP from every node (5 s each: a firewall that drops the packets times out), the
    network interface each node would use (as up chooses it, from the same environment: env,
    env_file, forward_env), the clock against this machine, and logind.

    Prints one table: ✓ fine, ✗ a problem (with its fix), ! a warning (with its fix). Exit 0 when
    nothing is ✗, 1 when something is, 2 for a bad hosts file. `up` runs the same checks before it
    starts anything (the costlier ones not with --no-preflight).
    """
    try:
        # each host's environment as `up` completes it (forward_env, env_file): the interface row
        # honours the GLOO/NCCL_SOCKET_IFNAME set there as `up` does
        spec, env_notes = resolve(load_cluster(hosts_file), os.environ)
    except ConfigError as exc:
        _fail(exc, EXIT_USAGE)
    for text in env_notes:
        _note(f"warning: {text}")
    factory = partial(transport_for, ssh_config=ssh_config or spec.ssh_config,
                      accept_new_host_keys=accept_new_host_keys)
    try:
        report = doctor.run_doctor(spec, script, factory, local_cwd=os.getcwd())
    except KeyboardInterrupt:
        _note("interrupted")
        sys.exit(EXIT_SIGNAL[signal.SIGINT])
    click.echo(safe(report.render(), colour=False))
    sys.exit(EXIT_FAILED if report.failed else EXIT_OK)


def _preflight(job: Job, plan: LaunchPlan, spec: ClusterSpec, script: str, *, full: bool,
               synced: Collection[int] = ()) -> None:
    """``doctor``'s checks on the probed hosts before anything starts (see doctor.py): exit 3 on a
    problem, with one line and a fix for each; warnings are printed and the job goes on."""
    report = doctor.preflight([job.probed(rank) for rank in range(plan.nnodes)], spec, script,
                              addr=plan.master_addr, port=plan.master_port, local_cwd=os.getcwd(), full=full,
                              synced=synced)
    refused = doctor.refusal(report)
    if refused is not None:
        _fail(refused, EXIT_HOSTS)
    for warning in doctor.warnings(report):
        _note(f"warning: {warning}")


def _check_name_free(store: JobStore, name: str, given: bool) -> None:
    """Refuse a name that an unfinished job has (its record brought up to date from its hosts
    first), so that every job can still be named: two running jobs of one name would make the
    name ambiguous for `ps`, `logs`, `down`..."""
    for record in store.named(name):
        if not record.finished:
            record = _refresh(store, record)
        if not record.finished:
            how = "named" if given else "named after the script,"
            _fail(ConfigError(f"job {record.job_id}, {how} {name!r}, is {record.state}; nothing was started",
                              key="--name", hint=f"stop it first (`clusterrun down {record.job_id}`), or name this "
                              "job otherwise with --name NAME"), EXIT_USAGE)


def _use_tui(no_tui: bool) -> bool:
    """The dashboard unless --no-tui, and never without a terminal on stdin and stdout."""
    return not no_tui and sys.stdout.isatty() and sys.stdin.isatty() and os.environ.get("TERM") != "dumb"


def _dashboard(session: Session, ring: int) -> int:
    """Run the dashboard over ``session``; afterwards print what happened; the exit code."""
    from clusterrun.tui import Dashboard  # Textual is loaded only for the dashboard

    app = Dashboard(session, ring=ring)
    printer = Printer()

    def hand_over(signum: int) -> None:  # the terminal is gone: leave the job to a monitor
        session.detach()
        os._exit(EXIT_SIGNAL.get(signum, 1))

    def terminate(signum: int) -> None:  # stop the job, show its stop, then leave
        app.quit_when_ended = True
        session.kill()

    with _on_signals({signal.SIGHUP: hand_over, signal.SIGTERM: terminate}) as got:
        code = app.run()
    if session.failed_start and session.error is not None:
        _fail(session.error, EXIT_HOSTS)
    if session.error is not None:
        printer.note(f"error: {session.error.render()}")
    job_id = session.job_id
    if app.outcome in ("detached", "left") or (code is None and session.running):
        if session.running:
            session.detach()
        printer.note(f"detached; job {job_id} keeps running. {_follow_hint(job_id)}")
        return EXIT_OK
    session.wait(timeout=60)
    if session.result is not None:
        for report in session.result.stops:
            printer.report(report)
        printer.summary(session.result)
    if got.get("signal"):
        return EXIT_SIGNAL.get(got["signal"], 1)
    return code if code is not None else app.exit_code_of()


# ------------------------------------------------------------------------------- job commands


HOSTS_HELP = ("Also find the jobs on the hosts of HOSTS.yaml (their state dirs) and adopt those this machine has no "
              "record of (jobs started from another machine or XDG_STATE_HOME).")


def _adopt(hosts_file: str | None) -> None:
    """With ``--hosts HOSTS.yaml``: make a record here for every job found on those hosts that this
    controller does not know (``discover``); say which were adopted and what could not be."""
    if hosts_file is None:
        return
    from clusterrun.discover import ask_hosts, records_from

    try:
        spec = load_cluster(hosts_file)
        with open(hosts_file, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
    except ConfigError as exc:
        _fail(exc, EXIT_USAGE)
    store = JobStore()
    ssh_config = spec.ssh_config
    known = {r.job_id for r in store.all()}
    records, notes = records_from(spec, hosts_file, text, ask_hosts(spec, ssh_config), known=known,
                                  local_cwd=os.getcwd(), ssh_config=ssh_config)
    for note in notes:
        _note(note)
    for record in records:
        store.create(record)
        _note(f"adopted job {record.job_id} ({record.state}) from the hosts of {hosts_file}")


def _open_job(ref: str, hosts_file: str | None = None) -> tuple[JobStore, JobRecord]:
    _adopt(hosts_file)
    store = JobStore()
    try:
        record = store.load(store.resolve(ref))
    except JobNotFound as exc:
        _fail(exc, EXIT_USAGE)
    if os.path.isdir(record.local_cwd):
        os.chdir(record.local_cwd)  # relative paths in the job's hosts file are relative to it
    return store, record


def _hosts_cell(hosts: Sequence[str], width: int = 40) -> str:
    """The hosts of a job for the job list: all of them if they fit in ``width`` characters, else
    the first ones and how many more (``ps JOB`` lists every node)."""
    text = ",".join(hosts)
    if len(text) <= width or len(hosts) == 1:
        return text
    shown = [hosts[0]]
    for host in hosts[1:]:
        if len(",".join([*shown, host])) > width - 8:
            break
        shown.append(host)
    return ",".join(shown) + f",… +{len(hosts) - len(shown)}"


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def _refresh(store: JobStore, record: JobRecord) -> JobRecord:
    try:
        return refresh(store, record)
    except ConfigError as exc:
        _fail(exc, EXIT_USAGE)
    except StateError as exc:  # the record could not be brought up to date: show it as it is
        _note(f"warning: job {record.job_id} shows its last recorded state: {exc.render()}")
        return record


def _not_recorded(record: JobRecord, error: StateError) -> None:
    _note(f"error: {error.render()}")
    _note(f"the stop of job {record.job_id} above was NOT recorded: its record may show it as it was "
          "before; run `clusterrun down` again once the directory can be written")


@main.command()
@click.argument("job", required=False)
@click.option("-a", "--all", "show_all", is_flag=True, help="Every job, also those that ended more than a day ago.")
@click.option("--state", "states", multiple=True, type=click.Choice(STATES), metavar="STATE",
              help=f"Only jobs in this state, of any age (repeatable; {', '.join(STATES)}).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema 1, see docs/json.md) instead of a table.")
@click.option("--hosts", "hosts_file", metavar="HOSTS.yaml", type=click.Path(dir_okay=False), help=HOSTS_HELP)
def ps(job: str | None, show_all: bool, states: tuple[str, ...], as_json: bool, hosts_file: str | None) -> None:
    """List jobs, or show one JOB's nodes (JOB: an id, a --name or a unique id prefix).

    Without JOB: the unfinished jobs and those that ended in the last 24 hours (-a: all; --state:
    those in a state, of any age), oldest first. A job nobody follows is first brought up to date
    from its hosts: a node whose processes are gone (the host rebooted, or they were killed)
    shows as lost, never as running."""
    if job is not None:
        store, record = _open_job(job, hosts_file)
        record = _refresh(store, record)
        try:
            answers = node_statuses(record)
        except ClusterrunError:  # the recorded hosts file cannot be read: the record alone is shown
            answers = {}
        statuses = {rank: a for rank, a in answers.items() if not isinstance(a, ClusterrunError)}
        if as_json:
            click.echo(json.dumps(jobs_json([record], hosts=statuses), indent=1))
            return
        attempt = record.attempts[-1] if record.attempts else None
        click.echo(f"job {record.job_id} ({record.name}): {record.state}, attempt {record.attempt}, "
                   f"{record.script} {shlex.join(record.script_args)}".rstrip())
        rows = [("NODE", "HOST", "STATE", "PID", "EXIT", "ERROR")]
        for n in record.nodes:
            rows.append((str(n.rank), n.host, n.state, str(n.pid or "-"),
                         "-" if n.exit_code is None else str(n.exit_code), safe(n.error or "", colour=False)))
        _table(rows)
        if attempt is not None and attempt.root_cause:  # its last lines are the rank's output
            click.echo(f"root cause: {safe(attempt.root_cause, colour=False)}")
            if attempt.cause and attempt.fix:
                click.echo(f"cause: {safe(attempt.cause, colour=False)}\nfix: {safe(attempt.fix, colour=False)}")
        for rank, answer in sorted(statuses.items()):
            if answer.get("state", {}).get("state") == "absent":
                continue
            where = f"node{rank} {record.nodes[rank].host}: "
            if answer.get("records_gone"):  # its directory on the host was deleted while its processes run
                click.echo(f"{where}{safe(str(answer['state'].get('error')), colour=False)}")
                continue
            click.echo(_guarantee(answer.get("fallbacks") or (), prefix=where))
            if answer.get("degraded"):
                click.echo(f"{where}degraded: {answer['degraded']}")
        return
    _adopt(hosts_file)
    store = JobStore()
    now = time.time()
    records, hidden = shown([_refresh(store, r) for r in store.all()], now, show_all=show_all, states=states)
    if as_json:
        click.echo(json.dumps(jobs_json(records), indent=1))
        return
    rows = [("JOB", "NAME", "HOSTS", "STATE", "ATTEMPT", "AGE")]
    for r in records:
        rows.append((r.job_id, r.name, _hosts_cell(r.hosts), r.state, str(r.attempt), _age(now - r.created)))
    _table(rows)
    if hidden:
        _note(f"{hidden} job(s) that ended more than a day ago not shown: `clusterrun ps -a` lists them, "
              "`clusterrun prune` removes every ended job's record")


def _table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _select_ranks(record: JobRecord, node: tuple[int, ...]) -> list[int]:
    ranks = list(node) or list(range(len(record.nodes)))
    bad = [r for r in ranks if not 0 <= r < len(record.nodes)]
    if bad:
        _fail(ConfigError(f"job {record.job_id} has nodes 0..{len(record.nodes) - 1}, not {bad[0]}", key="--node"),
              EXIT_USAGE)
    return ranks


def _check_attempt(record: JobRecord, attempt: int | None) -> int:
    if attempt is None:
        return record.attempt
    if not 1 <= attempt <= record.attempt:
        _fail(ConfigError(f"job {record.job_id} has attempts 1..{record.attempt}, not {attempt}", key="--attempt"),
              EXIT_USAGE)
    return attempt


@main.command()
@click.argument("job")
@click.option("-n", "--node", type=int, multiple=True, metavar="N", help="Only node N (repeatable).")
@click.option("-f", "--follow", is_flag=True, help="Keep following until the job ends.")
@click.option("--tail", type=click.IntRange(min=0), metavar="N", help="Start at the last N lines of each node.")
@click.option("--attempt", type=click.IntRange(min=1), metavar="K", help="An earlier attempt (default: the last).")
@click.option("--prefix/--no-prefix", default=None,
              help="Prefix each line with its node (default: only when several nodes are shown).")
@click.option("--hosts", "hosts_file", metavar="HOSTS.yaml", type=click.Path(dir_okay=False), help=HOSTS_HELP)
def logs(job: str, node: tuple[int, ...], follow: bool, tail: int | None, attempt: int | None,
         prefix: bool | None, hosts_file: str | None) -> None:
    """Print JOB's logs from its hosts' log files: every node's lines with a prefix, or one node's
    exactly as written with --node N. Works during and after the job, from any controller that
    has its record.

    Lines shown with a prefix (or of a one-node job) are made safe for a terminal: colours pass
    (dropped with NO_COLOR, TERM=dumb or when not a terminal), other escape sequences and control
    characters are shown escaped (`\x1b]52;...`). --node N without --prefix prints the node's file
    byte for byte, escape sequences included, as `cat` would: redirect it to a file, or pipe it to
    `cat -v`, to look at output you do not trust."""
    store, record = _open_job(job, hosts_file)
    ranks = _select_ranks(record, node)
    attempt = _check_attempt(record, attempt)
    record = _refresh(store, record)
    raw = len(ranks) == 1 and bool(node) and not prefix
    printer = Printer(prefix=len(ranks) > 1 if prefix is None else prefix, quiet=True, raw=raw)
    spec = spec_of(record)
    printer.set_plan(plan_from_json(record.plan, spec))
    if not follow:
        failed = False
        for rank, item in read_logs(record, ranks, attempt, tail):
            if isinstance(item, ClusterrunError):
                failed = True
                _note(f"node{rank} {record.nodes[rank].host}: {item.render()}")
            else:
                printer.write_log(rank, record.nodes[rank].host, item)
        sys.exit(EXIT_HOSTS if failed else EXIT_OK)
    follower_job = follower(record, printer, fail_fast=False, follow_logs=True, attempt=attempt, tail=tail,
                            ranks=ranks)
    with _on_signals({signal.SIGINT: lambda s: follower_job.detach(),
                      signal.SIGTERM: lambda s: follower_job.detach()}) as got:
        try:
            follower_job.run()
        finally:
            follower_job.close()
    sys.exit(EXIT_SIGNAL[got["signal"]] if got.get("signal") else EXIT_OK)


@main.command()
@click.argument("job")
@click.option("--tail", type=click.IntRange(min=0), metavar="N",
              help="Also show the last N lines of each node before where the last viewer stopped, above a "
              "separator (default: a screenful in the dashboard, none in the prefixed stream).")
@click.option("--no-tui", is_flag=True, help="Print prefixed log lines instead of the dashboard.")
@click.option("--ui-lines", type=click.IntRange(min=100), default=10_000, show_default=True, metavar="N",
              help="Lines of each node the dashboard keeps in memory (the whole log stays on the hosts).")
@click.option("--hosts", "hosts_file", metavar="HOSTS.yaml", type=click.Path(dir_okay=False), help=HOSTS_HELP)
def attach(job: str, tail: int | None, no_tui: bool, ui_lines: int, hosts_file: str | None) -> None:
    """Follow JOB live again: every node's log and state, from where you last left it, with no
    line lost or repeated; the lines just before that point are shown above a separator (--tail N).
    Ctrl-C detaches and leaves the job running."""
    store, record = _open_job(job, hosts_file)
    record = _refresh(store, record)
    printer = Printer()
    offsets = {n.rank: n.seen for n in record.nodes}
    if _use_tui(no_tui):
        scrollback = tail if tail is not None else shutil.get_terminal_size().lines  # a screenful
        sys.exit(_dashboard(Session(store, record, offsets=offsets, scrollback=scrollback), ui_lines))
    viewer = follower(record, printer, fail_fast=False, follow_logs=True, offsets=offsets, scrollback=tail or 0)
    printer.set_plan(plan_from_json(record.plan, spec_of(record)))
    printer.note(f"attached to job {record.job_id} (attempt {record.attempt}, {record.state}); "
                 "Ctrl-C detaches, the job keeps running")
    with _on_signals({signal.SIGINT: lambda s: viewer.detach(), signal.SIGTERM: lambda s: viewer.detach(),
                      signal.SIGHUP: lambda s: viewer.detach()}) as got:
        try:
            result = viewer.run()
        finally:
            save_seen(store, record.job_id, record.attempt, viewer.offsets)
            viewer.close()
    if result is None:
        with contextlib.suppress(OSError):
            printer.note(f"detached; job {record.job_id} keeps running. {_follow_hint(record.job_id)}")
        sys.exit(EXIT_SIGNAL.get(got.get("signal", 0), EXIT_OK))
    sys.exit(_exit_code(result, {}))


@main.command()
@click.argument("job")
@click.option("--grace", type=click.FloatRange(min=0), help="Seconds torchrun gets to stop its workers "
              "(default: the job's --grace).")
@click.option("--hosts", "hosts_file", metavar="HOSTS.yaml", type=click.Path(dir_okay=False), help=HOSTS_HELP)
def down(job: str, grace: float | None, hosts_file: str | None) -> None:
    """Stop JOB on every host (idempotent). Also `stop`.

    Each host's report says which guarantee held: verified by the attempt's cgroup (nothing of
    the job is left), or a sweep where the host has no cgroup for it (a process that left the
    job's tree, session and environment could not be seen)."""
    store, record = _open_job(job, hosts_file)
    ended = record.state if record.finished else None
    if ended is None:
        _note(f"stopping job {record.job_id} (attempt {record.attempt}) on {len(record.nodes)} hosts")
    reports, unrecorded = stop_recorded(store, record, grace)  # a finished job too: its hosts confirm it
    if ended is not None and all(r.ok and not r.killed for r in reports.values()) and unrecorded is None:
        _note(f"job {record.job_id} already finished ({ended}); nothing to stop")
        return
    printer = Printer()
    for rank in sorted(reports):
        printer.report(reports[rank])
    if unrecorded is not None:
        _not_recorded(record, unrecorded)
    if any(r.error for r in reports.values()):
        _note(f"job {record.job_id} is NOT marked stopped: a host could not be reached, it may still run there")
        sys.exit(EXIT_HOSTS)
    if any(r.left for r in reports.values()):
        sys.exit(EXIT_FAILED)
    swept = [r.host for r in reports.values() if not r.complete]
    if swept:
        _note(f"job {record.job_id} stopped; swept without a cgroup on {', '.join(swept)}: processes that left "
              "the job's tree, session and environment could not be seen there")
    else:
        _note(f"job {record.job_id} stopped; nothing of it is left on any host (verified by cgroup)")
    if unrecorded is not None:
        sys.exit(EXIT_USAGE)


main.add_command(down, name="stop")


def _removable(store: JobStore, record: JobRecord) -> str | None:
    """Why the job's record may not be removed (it has not ended, or a process still owns it), or None."""
    if not record.finished:
        return f"job {record.job_id} is {record.state}: not removed; stop it first (`clusterrun down {record.job_id}`)"
    if store.owned(record.job_id):
        return f"job {record.job_id} is still owned by a clusterrun process (it is just ending): not removed; try again"
    return None


def _confirm_hosts(records: Sequence[JobRecord], yes: bool) -> None:
    """Ask before deleting logs on the hosts; without a terminal to ask on, only -y/--yes will do."""
    if yes:
        return
    hosts = sorted({h for r in records for h in r.hosts})
    what = f"the state and logs of {len(records)} job(s) on {', '.join(hosts)}"
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        _fail(ConfigError(f"--hosts-too would delete {what}, and there is no terminal to confirm on; nothing was "
                          "removed", key="--hosts-too", hint="add -y/--yes to confirm"), EXIT_USAGE)
    for record in records:
        click.echo(f"  {record.job_id} ({record.state}) on {', '.join(record.hosts)}", err=True)
    if not click.confirm(f"Delete {what}, and their records here?", default=False, err=True):
        _note("nothing was removed")
        sys.exit(EXIT_FAILED)


def _remove(store: JobStore, records: Sequence[JobRecord], hosts_too: bool) -> tuple[int, int]:
    """Remove the records (and with ``hosts_too`` first the jobs' directories on their hosts): the
    exit code and how many were removed."""
    code, removed = EXIT_OK, 0
    for record in records:
        if hosts_too:
            answers = remove_on_hosts(record)
            failed = False
            for rank, answer in sorted(answers.items()):
                where = f"node{rank} {record.nodes[rank].host}"
                if isinstance(answer, ClusterrunError):
                    failed = True
                    _note(f"{record.job_id}: {where}: not removed: {answer.render()}")
                elif answer.get("removed"):
                    _note(f"{record.job_id}: {where}: removed {answer['removed']} ({answer.get('bytes', 0)} bytes)")
                else:
                    _note(f"{record.job_id}: {where}: nothing of the job there")
            if failed:
                _note(f"job {record.job_id}: its record is kept (it names what is left on the hosts); "
                      "`clusterrun rm --hosts-too` again once they can be reached")
                code = EXIT_HOSTS
                continue
        store.remove(record.job_id)
        removed += 1
        click.echo(record.job_id)
    return code, removed


@main.command(name="rm")
@click.argument("jobs", nargs=-1, required=True, metavar="JOB...")
@click.option("--hosts-too", is_flag=True, help="Also delete the jobs' state and logs on their hosts (asks first).")
@click.option("-y", "--yes", is_flag=True, help="Do not ask before deleting on the hosts (needed without a terminal).")
@click.option("--hosts", "hosts_file", metavar="HOSTS.yaml", type=click.Path(dir_okay=False), help=HOSTS_HELP)
def rm(jobs: tuple[str, ...], hosts_too: bool, yes: bool, hosts_file: str | None) -> None:
    """Remove the records of ended jobs from this controller (their logs stay on the hosts unless
    --hosts-too). A job that has not ended is refused: `clusterrun down` it first.

    Prints each removed id. Exit codes: 0 all removed, 1 a job was refused (not ended), 2 no such
    job, 3 a host could not be reached (that job's record is kept)."""
    _adopt(hosts_file)
    store = JobStore()
    records: list[JobRecord] = []
    for ref in dict.fromkeys(jobs):
        try:
            record = store.load(store.resolve(ref))
        except JobNotFound as exc:
            _fail(exc, EXIT_USAGE)
        if record.job_id not in {r.job_id for r in records}:
            records.append(record)
    ready, refused = [], False
    for record in records:
        record = _refresh(store, record)
        why = _removable(store, record)
        if why is not None:
            _note(f"error: {why}")
            refused = True
        else:
            ready.append(record)
    if hosts_too and ready:
        _confirm_hosts(ready, yes)
    code, _ = _remove(store, ready, hosts_too)
    sys.exit(code if code != EXIT_OK else EXIT_FAILED if refused else EXIT_OK)


@main.command()
@click.option("--hosts-too", is_flag=True, help="Also delete the jobs' state and logs on their hosts (asks first).")
@click.option("-y", "--yes", is_flag=True, help="Do not ask before deleting on the hosts (needed without a terminal).")
def prune(hosts_too: bool, yes: bool) -> None:
    """Remove the records of every ended job (succeeded, failed, stopped, lost) from this
    controller; unfinished jobs stay. Their logs stay on the hosts unless --hosts-too.

    Prints each removed id. Exit codes: 0 done, 3 a host could not be reached (that job's record is kept)."""
    store = JobStore()
    ready = [r for r in store.all() if r.finished and _removable(store, r) is None]
    if hosts_too and ready:
        _confirm_hosts(ready, yes)
    code, removed = _remove(store, ready, hosts_too)
    _note(f"removed the records of {removed} ended job(s)"
          + ("" if hosts_too else "; their logs stay on the hosts"))
    sys.exit(code)


@main.command()
@click.argument("job")
@click.option("--grace", type=click.FloatRange(min=0), help="Seconds torchrun gets to stop its workers "
              "(default: the job's --grace).")
@click.option("--hosts", "hosts_file", metavar="HOSTS.yaml", type=click.Path(dir_okay=False), help=HOSTS_HELP)
def restart(job: str, grace: float | None, hosts_file: str | None) -> None:
    """Stop JOB (verified) and start it again with the same hosts file, script, arguments and
    environment, as a new attempt with logs of its own; returns once it runs (like up -d).
    This controller owns the new attempt (its monitor), an adopted job's too."""
    store, record = _open_job(job, hosts_file)
    try:
        record = restart_job(store, record, Printer(), grace=grace)
    except NotStopped as exc:
        _fail(exc, EXIT_HOSTS if exc.unreachable else EXIT_FAILED)
    except HostsUnavailable as exc:
        _fail(exc, EXIT_HOSTS)
    except StateError as exc:
        _fail(exc, EXIT_USAGE)
    except ClusterrunError as exc:
        _fail(exc, EXIT_FAILED)
    _note(f"job {record.job_id} restarted as attempt {record.attempt}; {_follow_hint(record.job_id)}")


@main.command(name="wait")
@click.argument("job")
@click.option("--timeout", type=click.FloatRange(min=0), metavar="SECONDS",
              help="Give up after this long (exit 124); the job runs on.")
@click.option("--hosts", "hosts_file", metavar="HOSTS.yaml", type=click.Path(dir_okay=False), help=HOSTS_HELP)
def wait_job(job: str, timeout: float | None, hosts_file: str | None) -> None:
    """Block until JOB has ended, then exit with its outcome: 0 succeeded, 1 failed, stopped or
    lost (for scripts and CI). Waits through a start-up retry (a new attempt) too, except for a
    job adopted with --hosts: its hosts are asked how its attempt ended, and a retry that its own
    controller starts after that is not waited for. Nothing is printed but one line on stderr at
    the end (and what --hosts adopted)."""
    store, record = _open_job(job, hosts_file)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            record = _refresh(store, store.load(record.job_id))  # a job nobody owns gets a monitor again
        except ClusterrunError as exc:  # the record went away (removed) or cannot be read
            _fail(exc, EXIT_USAGE)
        if record.finished:
            break
        if deadline is not None and time.monotonic() >= deadline:
            _note(f"job {record.job_id} is still {record.state} after {timeout:g} s")
            sys.exit(EXIT_TIMEOUT)
        # the job's owner writes its record and this process only reads it; an adopted job's is
        # brought up to date from its hosts by every refresh (a connection to each host)
        time.sleep(2.0 if record.adopted else 0.5)
    _note(f"job {record.job_id} {record.state} (attempt {record.attempt})")
    sys.exit(EXIT_OK if record.state == JobState.SUCCEEDED else EXIT_FAILED)


@main.command(name="_monitor", hidden=True)
@click.argument("job_id")
def monitor(job_id: str) -> None:
    """Own JOB_ID in the background until it ends (started by `up -d` and friends)."""
    daemonize()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    store = JobStore()
    printer = Printer(colour=False)
    printer.note(f"monitor {os.getpid()} for job {job_id} started")
    sys.exit(run_monitor(store, job_id, printer))
