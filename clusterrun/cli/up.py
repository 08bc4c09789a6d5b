"""``clusterrun up``: its arguments, the hosts file read and every host's connection started; the
rest (the checks, the start, following the job) is ``cli.launch``, imported once the connections are
under way (their handshakes overlap its imports: docs/benchmarks.md)."""

from __future__ import annotations

import difflib
import os
import shlex
import sys
from collections.abc import Callable
from typing import TypeVar

import click

from clusterrun.cli import (
    EXCLUDE_HELP,
    EXIT_USAGE,
    NODES_HELP,
    Seconds,
    _fail,
    _note,
    accept_new_host_keys_option,
    interrupted_connecting,
    main,
    no_tui_option,
    ssh_config_option,
    ui_lines_option,
)
from clusterrun.config.options import UpOptions, hosts_for_up
from clusterrun.config.restarts import MAX_RESTARTS
from clusterrun.config.watch import ON_HANG
from clusterrun.core import timings
from clusterrun.core.errors import ConfigError
from clusterrun.run.plan import parse_env_overrides
from clusterrun.transports import connect_early, transport_for

F = TypeVar("F", bound=Callable[..., object])
FROM_SLURM_HELP = ("Run inside a Slurm allocation (salloc, sbatch) on its nodes (SLURM_JOB_NODELIST) with one "
                   "srun: one torchrun per node, under Slurm's accounting, limits and cleanup; then HOSTS.yaml is "
                   "left out (SCRIPT comes first) and --slurm-hosts may name one. See docs/slurm.md.")


def from_slurm_options(command: F) -> F:
    """``up``'s Slurm options."""
    command = click.option("--slurm-hosts", type=click.Path(dir_okay=False), metavar="HOSTS.yaml",
                           help="With --from-slurm: a hosts file; each node takes the nproc of its host by Slurm "
                           "node name (Slurm's GPU count wins), every node the first host's python, workdir, env "
                           "and setup.")(command)
    return click.option("--from-slurm", is_flag=True, help=FROM_SLURM_HELP)(command)


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


def _script_of(hosts_file: str, script: str | None, script_args: tuple[str, ...],
               slurm_hosts: str | None) -> tuple[str, tuple[str, ...]]:
    """The script and its arguments of ``up HOSTS.yaml SCRIPT ARGS``, checked (``_check_up_arguments``):
    a usage error, or the message and exit code of a refusal, before anything is read or started."""
    if script is None:
        raise click.UsageError("Missing argument 'SCRIPT'.")
    if slurm_hosts is not None:
        raise click.UsageError("--slurm-hosts goes with --from-slurm (without it, HOSTS.yaml names the hosts file)")
    if script_args[:1] == ("--",):  # click passes the separator on once SCRIPT has been read
        script_args = script_args[1:]
    if script == "--" and script_args:  # `up HOSTS.yaml -- SCRIPT ...`: the script may start with '-'
        return script_args[0], script_args[1:]
    try:
        _check_up_arguments(hosts_file, script, script_args)
    except ConfigError as exc:
        _fail(exc, EXIT_USAGE)
    return script, script_args


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-d", "--detach", is_flag=True, help="Start the job, print its id and return; a background "
              "monitor applies fail-fast until it ends.")
@click.option("--name", help="A name for the job, part of its id; refused while a job of that name is running. "
              "Default: the script's name, or NAME-2, NAME-3... while a job of that name runs.")
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE",
              help="Set an environment variable for every node (repeatable; wins over the hosts file).")
@click.option("--dry-run", is_flag=True, help="Check the hosts as up does (workdir and script included), print "
              "each node's exact command and environment, start nothing.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print the plan as JSON (schema 1, see "
              "docs/json.md).")
@no_tui_option
@ui_lines_option
@click.option("--leave-running", is_flag=True, help="Ctrl-C (SIGINT) stops following but leaves the job "
              "running, owned by a background monitor (default: Ctrl-C stops the job).")
@ssh_config_option
@accept_new_host_keys_option
@click.option("--grace", type=Seconds(), default=10.0, show_default=True,
              help="Seconds torchrun gets to stop its workers before they are killed.")
@click.option("--no-retry-startup", is_flag=True, help="Do not retry a known transient start-up failure "
              "(gloo aborting a rank while connecting; the master port taken before torchrun bound it), which "
              "is otherwise retried once as attempt 2, visibly.")
@click.option("--max-restarts", type=click.IntRange(0, MAX_RESTARTS), metavar="N",
              help="Restart the whole job as a new attempt after a failure, at most N times (default: the hosts "
              "file's restart.max, else 0), after a backoff (restart.backoff, default 30s..10m); never after a stop. "
              "The owner (this up, or the job's monitor) restarts it.")
@click.option("--no-preflight", is_flag=True, help="Skip the costlier checks before the start (GPUs, the same "
              "torch/CUDA/Python on every host, the master port reachable by TCP from every node); the workdir, "
              "the script, disk, clock and logind are always checked.")
@click.option("--unreachable-timeout", type=Seconds(minimum=1), metavar="SECONDS",
              help="Treat a host that cannot be reached for this long as failed (its node lost, fail-fast). "
              "Default: never; losing contact alone never stops a job. Counts the time spent retrying, "
              "not time this machine was paused or asleep.")
@click.option("--startup-timeout", metavar="DURATION", help="Fail the job when a node has not started its "
              "workers this long after the start (90, 45s, 10m; default: the hosts file's startup_timeout, else "
              "5m), naming the nodes that still wait, instead of gloo's 30-minute wait.")
@click.option("--setup-timeout", metavar="DURATION", help="Kill a node's setup commands and fail the start when "
              "they run this long (10m, 1h; default: the hosts file's setup_timeout, else 10m).")
@click.option("--hang-after", metavar="DURATION", help="Show the job as hung once no rank wrote any output this "
              "long (10m; off: never; default: the hosts file's hang_after, else 30m).")
@click.option("--on-hang", type=click.Choice(ON_HANG), help="What the job's owner does when the job hangs: save a "
              "report of every rank's stacks, looked at twice (stack, the default), restart the job (counted "
              "against --max-restarts), or nothing.")
@click.option("--notify", "notify_command", metavar="CMD", help="Run CMD here (sh -c) once per event of the job "
              "(failed, succeeded, hung, restarted; the hosts file's notify.on chooses) with CLUSTERRUN_JOB, "
              "CLUSTERRUN_EVENT, CLUSTERRUN_EVENT_ID, CLUSTERRUN_STATE set and the job as JSON on stdin "
              "(docs/watch.md).")
@click.option("--sync", "sync_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Copy DIR to every host's workdir before the start (only what changed; .gitignore and "
              "sync_exclude honoured, .git left out), over the connections already open: by clusterrun's agent, "
              "or where a host holds older versions of 4 MB of the files and has rsync, by rsync. Wins over "
              "`sync:` in the hosts file. With --dry-run: say what would be copied.")
@click.option("--no-sync", is_flag=True, help="Do not copy anything, whatever `sync:` in the hosts file says.")
@click.option("--timings", "timings_wanted", is_flag=True, help="Once every node started, print how long each "
              "phase took on each host (connect, authenticate, agent, probe, route, preflight, sync, setup, "
              "start), the slowest hosts and what the start waited for (on stderr; with the dashboard, when it "
              "closes).")
@click.option("-w", "--nodes", metavar="NODESET", help=NODES_HELP)
@click.option("-x", "--exclude", metavar="NODESET", help=EXCLUDE_HELP)
@from_slurm_options
@click.argument("hosts_file", metavar="HOSTS.yaml", type=click.Path(dir_okay=False))
@click.argument("script", required=False, metavar="SCRIPT")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- ARGS...]")
def up(hosts_file: str, script: str | None, script_args: tuple[str, ...], detach: bool, name: str | None,
       env: tuple[str, ...], dry_run: bool, as_json: bool, no_tui: bool, ui_lines: int, leave_running: bool,
       ssh_config: str | None,
       accept_new_host_keys: bool, grace: float, unreachable_timeout: float | None, no_retry_startup: bool,
       no_preflight: bool, sync_dir: str | None = None, no_sync: bool = False, nodes: str | None = None,
       exclude: str | None = None, max_restarts: int | None = None, startup_timeout: str | None = None,
       hang_after: str | None = None, on_hang: str | None = None, notify_command: str | None = None,
       setup_timeout: str | None = None, from_slurm: bool = False, slurm_hosts: str | None = None,
       timings_wanted: bool = False) -> None:
    """Start SCRIPT with torchrun on every host of HOSTS.yaml and follow it until it ends.

    Options go before HOSTS.yaml; everything after SCRIPT (after `--` if you like) is passed to
    the script verbatim. An option of up written after HOSTS.yaml, or a SCRIPT starting with
    `-`, is refused before anything starts. The job runs detached on its hosts: closing the terminal (SIGHUP) or
    losing the connection never stops it, and a background monitor takes over. Ctrl-C (or
    SIGTERM) stops the job on every host and checks that nothing is left; with --leave-running
    Ctrl-C only stops following. Inside a Slurm allocation: `up --from-slurm SCRIPT [ARGS]`.
    """
    if not from_slurm:
        script, script_args = _script_of(hosts_file, script, script_args, slurm_hosts)
    else:  # no HOSTS.yaml: the first word is the script
        words = [hosts_file, *([script] if script is not None else []), *script_args]
        given = {"--detach": detach, "--leave-running": leave_running, "--sync": sync_dir is not None,
                 "--nodes": nodes is not None, "--exclude": exclude is not None, "--json": as_json}
        from clusterrun.cli.slurm import up_from_slurm  # Slurm's modules only when asked for

        up_from_slurm(words[0], tuple(words[2:] if words[1:2] == ["--"] else words[1:]), hosts_file=slurm_hosts,
                      name=name, env=env, dry_run=dry_run, grace=grace, no_sync=no_sync,
                      no_preflight=no_preflight, no_tui=no_tui, ui_lines=ui_lines,
                      unsupported=[k for k, v in given.items() if v])
    show_timings = timings.begin(_note) if timings_wanted else lambda: None
    try:
        found = hosts_for_up(hosts_file, UpOptions(nodes, exclude, startup_timeout, setup_timeout, hang_after, on_hang,
                                                   notify_command, no_sync), os.environ)
        spec, hosts_text = found.spec, found.text  # a hostfile too; the record keeps the YAML
        overrides = parse_env_overrides(env)
        if as_json and not dry_run:
            raise ConfigError("--json goes with --dry-run (a job's state as JSON: `clusterrun ps --json`)",
                              key="--json", hint="add --dry-run to print the plan as JSON; nothing was started")
    except ConfigError as exc:
        _fail(exc, EXIT_USAGE)
    for text in found.notes:
        _note(f"warning: {text}")
    ssh_config = ssh_config or spec.ssh_config
    transports = [transport_for(h, ssh_config=ssh_config, accept_new_host_keys=accept_new_host_keys)
                  for h in spec.hosts]
    connect_early(transports)
    try:
        from clusterrun.cli.launch import UpArgs, launch  # the rest, imported while the hosts connect
        from clusterrun.life.launch import NewJob
    except KeyboardInterrupt:
        interrupted_connecting()

    launch(UpArgs(NewJob(hosts_file=hosts_file, hosts_text=hosts_text, script=script, script_args=tuple(script_args),
                         overrides=overrides, local_cwd=os.getcwd(), ssh_config=ssh_config, name=name,
                         dry_run=dry_run, follow_logs=not detach, grace=grace, sync_dir=sync_dir,
                         full=not no_preflight, retry_startup=not no_retry_startup, max_restarts=max_restarts,
                         unreachable_timeout=unreachable_timeout),
                  spec=spec, transports=transports, show_timings=show_timings, as_json=as_json, detach=detach,
                  no_tui=no_tui, ui_lines=ui_lines, leave_running=leave_running))

