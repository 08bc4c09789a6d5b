"""The ``clusterrun`` command. The only place that turns exceptions into messages and exit codes.

Exit codes: 0 the job succeeded (``down``: stopped, nothing it could see is left; ``stack``: every
rank's stack taken) · 1 the job failed (a node exited non-zero, was lost or stopped; ``down``:
something is still running; ``stack``: a rank could not be looked at, or the job has ended), or its record
is damaged (``DamagedRecord``: the message names the file and the fix) · 2 bad input
(hosts file, options, an unknown or ambiguous job) or a bad environment on this machine: the
controller's state directory cannot be read or written (read-only, full, no permission; ``up``:
nothing was started; ``down``: the job was stopped but that could not be recorded; ``restart``:
a check refused the next attempt, e.g. a secret ``--env`` value missing here, and nothing was
stopped) · 3 a host could not be used, or the preflight found a problem (``up``: nothing was
started; ``restart``: nothing was stopped; ``down``: a host could not be reached) · 130 / 143
SIGINT / SIGTERM (``up``: the job was stopped on every node, or left running with
``--leave-running``) · 129 SIGHUP (``up``: the job was left running, owned by a monitor).

The commands are in the modules of this package, which register them on ``main`` when imported:
``up``; ``jobs`` (ps, attach, wait); ``logs``; ``manage`` (down/stop, rm, prune, restart, _monitor);
``stack``; ``web`` (the web page, an optional extra); ``tools`` (doctor, exec, hosts convert,
completion); ``slurm`` (export); ``follow`` and ``records`` hold what they share. ``main`` imports a
command's module only when that command runs (``COMMANDS``): ``ps`` does not pay for ``up``'s
imports, nor ``up`` for the dashboard's.
"""

from __future__ import annotations

import importlib
import re
import signal
import sys
from typing import TYPE_CHECKING, NoReturn

import click

from clusterrun import __version__
from clusterrun.core.durations import parse_duration
from clusterrun.core.errors import ClusterrunError, DamagedRecord, HostError, HostsUnavailable, StateError
from clusterrun.core.terminal import safe

if TYPE_CHECKING:
    from click.shell_completion import CompletionItem

NODES_HELP = ("Only these hosts of the file, a node set: gpu[01-04],gpu07; HOST:GPU only that GPU of a host "
              "(see docs/hosts-file.md).")
EXCLUDE_HELP = "Leave out these hosts of the file, a node set; HOST:GPU leaves out one GPU of a host."
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_HOSTS = 0, 1, 2, 3
EXIT_TIMEOUT = 124  # `wait --timeout` ran out, as timeout(1) says
EXIT_SIGNAL = {int(signal.SIGINT): 130, int(signal.SIGTERM): 143, int(signal.SIGHUP): 129}

class Seconds(click.ParamType):  # type: ignore[type-arg,unused-ignore]  # generic from click 8.2 on
    """A duration option: seconds (``10``, ``2.5``) or ``30s``/``10m``/``6h``/``2d``; finite (``nan`` and
    ``inf`` are usage errors, exit 2), at least ``minimum``."""

    name = "seconds"

    def __init__(self, minimum: float = 0.0) -> None:
        self.minimum = minimum

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        try:
            return parse_duration(str(value), minimum=self.minimum)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


# Options of several commands, written once so that their help cannot drift apart.
ssh_config_option = click.option(
    "--ssh-config", type=click.Path(dir_okay=False),
    help="An ssh_config file to resolve hosts with (default: the hosts file's `ssh_config`, else ~/.ssh/config).")
accept_new_host_keys_option = click.option(
    "--accept-new-host-keys", is_flag=True, help="Record the keys of hosts not yet in known_hosts "
    "(like StrictHostKeyChecking=accept-new); a changed key is still refused.")
no_tui_option = click.option("--no-tui", is_flag=True, help="Print prefixed log lines instead of the dashboard.")
ui_lines_option = click.option(
    "--ui-lines", type=click.IntRange(min=100), default=10_000, show_default=True, metavar="N",
    help="Lines of each node the dashboard keeps in memory (the whole log stays on the hosts).")


def interrupted_connecting() -> NoReturn:
    """Ctrl-C of ``up`` once the connections started and before the start: every connection closes
    with the program (``__main__``), nothing started anywhere."""
    _note("interrupted while connecting to the hosts, copying files or checking them; nothing was started")
    sys.exit(EXIT_SIGNAL[signal.SIGINT])  # the program leaves without its host threads (__main__)


def _fail(error: ClusterrunError, code: int) -> NoReturn:
    text = _hosts_unavailable(error) if isinstance(error, HostsUnavailable) else error.render()
    click.echo(f"clusterrun: error: {safe(text, colour=False)}", err=True)  # may quote a host
    sys.exit(code)


def _hosts_unavailable(error: HostsUnavailable) -> str:
    """``error.render()``; past ``FOLD_PAST`` hosts the hosts of one problem (and fix) share a line:
    ``63 hosts gpu[01-17,19-64]: setup failed: ...``."""
    from clusterrun.config.nodesets import FOLD_PAST, hosts_alike  # ClusterShell only when a host failed

    if len(error.errors) <= FOLD_PAST:
        return error.render()
    problems = [e for e in error.errors if isinstance(e, HostError)]
    others = [e.render() for e in error.errors if not isinstance(e, HostError)]
    # a folded line names hosts, not nodes: "node 3: " (setups.py) would make every host's text its own
    return "\n".join([error.message, *others, *hosts_alike(
        [(e.host, re.sub(r"^node \d+: ", "", e.render().removeprefix(f"{e.host}: "))) for e in problems],
        len(error.errors))])


def _note(text: str) -> None:
    click.echo(f"clusterrun: {safe(text, colour=False)}", err=True)


# Each command: the module of this package that registers it, and its short help (the first sentence of
# its docstring, which `--help` and shell completion show without importing the module; a test holds
# them equal). A name starting with "_" is hidden: run by clusterrun itself, never listed.
COMMANDS: dict[str, tuple[str, str]] = {
    "_monitor": ("manage", "Own JOB_ID in the background until it ends (started by `up -d` and friends)."),
    "_notify": ("manage", "Send JOB_ID's notification KEY that process STARTER claimed (started by `notify.start`)."),
    "attach": ("jobs", "Follow JOB live again: every node's log and state, from where you last left it, with no "
                       "line lost or repeated; the lines just before that point are shown above a separator "
                       "(--tail N)."),
    "completion": ("tools", "Print the completion script for SHELL: commands, options, hosts files and job ids "
                            "and names."),
    "doctor": ("tools", "Check that every host of HOSTS.yaml can run a job; start nothing."),
    "down": ("manage", "Stop JOB on every host (idempotent)."),
    "exec": ("tools", "Run COMMAND on every host of HOSTS.yaml at once, each output line prefixed by its host."),
    "export": ("slurm", "Write a batch script that runs SCRIPT as `up HOSTS.yaml SCRIPT` would, under Slurm."),
    "hosts": ("tools", "Hosts files: convert another tool's hostfile."),
    "logs": ("logs", "Print JOB's logs from its hosts' log files: every node's lines with a prefix, interleaved "
                     "in the order they were written by the hosts' clocks (--by-node: node after node), or one "
                     "node's exactly as written with --node N."),
    "prune": ("manage", "Remove the records of every ended job (succeeded, failed, stopped, lost) from this "
                        "controller; unfinished jobs stay."),
    "ps": ("jobs", "List jobs, or show one JOB's nodes (JOB: an id, a --name or a unique id prefix)."),
    "restart": ("manage", "Check JOB's next attempt as up does, then stop JOB (verified) and start it again with "
                          "the same hosts file, script, arguments and environment, as a new attempt with logs of "
                          "its own; returns once it runs (like up -d)."),
    "rm": ("manage", "Remove the records of ended jobs from this controller (their logs stay on the hosts unless "
                     "--hosts-too)."),
    "stack": ("stack", "Print the Python stack of every rank of JOB, taken on every host at once by py-spy; "
                       "identical stacks are shown once with their ranks:"),
    "stop": ("manage", "Stop JOB on every host (idempotent)."),
    "up": ("up", "Start SCRIPT with torchrun on every host of HOSTS.yaml and follow it until it ends."),
    "web": ("web", "Serve every job of this controller as a web page: nodes, attempts, root cause and each "
                   "node's log, live."),
    "wait": ("jobs", "Block until JOB has ended, then exit with its outcome: 0 succeeded, 1 failed, stopped or "
                     "lost (for scripts and CI)."),
}


def _short_help(name: str, limit: int = 45) -> str:
    """The command's short help cut to ``limit`` as click cuts it (a stand-in command: its own cut is public)."""
    return click.Command(name, help=COMMANDS[name][1]).get_short_help_str(limit)


class _Commands(click.Group):
    """The commands, loaded on demand (click's lazy group: ``get_command`` imports the one module that
    registers the command; ``--help`` and completion list them from ``COMMANDS``), with the errors
    every command can meet made exit codes here: a job's record is damaged (``DamagedRecord``: exit 1,
    as for a job that cannot be used), or the controller's own state directory cannot be read or
    written (``StateError``: exit 2)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS and cmd_name not in self.commands:
            importlib.import_module(f"{__name__}.{COMMANDS[cmd_name][0]}")
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """As click's, from ``COMMANDS``: the same rows without importing every command."""
        shown = [name for name in self.list_commands(ctx) if not name.startswith("_")]
        limit = formatter.width - 6 - max(len(name) for name in shown)
        with formatter.section("Commands"):
            formatter.write_dl([(name, _short_help(name, limit)) for name in shown])

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[CompletionItem]:
        """As click's, from ``COMMANDS``: the commands that start with ``incomplete``, then the options."""
        from click.shell_completion import CompletionItem

        items = [CompletionItem(name, help=_short_help(name)) for name in self.list_commands(ctx)
                 if name.startswith(incomplete) and not name.startswith("_")]
        return items + click.Command.shell_complete(self, ctx, incomplete)

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except DamagedRecord as exc:
            _fail(exc, EXIT_FAILED)
        except StateError as exc:
            _fail(exc, EXIT_USAGE)
        except KeyboardInterrupt:  # one the command did not handle itself: click would say "Aborted!", exit 1
            _note("interrupted")
            sys.exit(EXIT_SIGNAL[signal.SIGINT])  # the program leaves without its host threads (__main__)


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
    clusterrun restart JOB [-- ARGS]       stop it and start it again as a new attempt
    clusterrun wait JOB                    block until it ends; exit 0 if it succeeded
    clusterrun stack JOB                   every rank's Python stack, grouped (py-spy)
    clusterrun web [--control]             every job in a browser, live (pip: clusterrun[web])
    clusterrun rm JOB... / prune           forget ended jobs (--hosts-too: their logs too)
    clusterrun doctor HOSTS.yaml [SCRIPT]  check every host before the first run
    clusterrun exec HOSTS.yaml -- CMD...   a command on every host, output by host
    clusterrun hosts convert HOSTFILE      a DeepSpeed/MPI hostfile as a hosts file
    clusterrun completion bash|zsh|fish    the shell completion script
    """
    # A log line may hold bytes that are not UTF-8: print them back as they were, never fail on them.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="surrogateescape")

