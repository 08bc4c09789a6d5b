"""The ``clusterrun`` command. The only place that turns exceptions into messages and exit codes.

Exit codes: 0 the job succeeded · 1 the job failed (a node exited non-zero or was lost) ·
2 bad input (hosts file, options) · 3 a host could not be used (nothing was started) ·
130 / 143 stopped by SIGINT / SIGTERM (the job was stopped on every node).
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from types import FrameType

import click

from clusterrun import __version__
from clusterrun.config import ClusterSpec, load_cluster
from clusterrun.errors import ClusterrunError, ConfigError, HostsUnavailable
from clusterrun.orchestrator import Job
from clusterrun.plan import LaunchPlan, job_name, make_job_id, parse_env_overrides
from clusterrun.printer import Printer
from clusterrun.transports import transport_for

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_HOSTS = 0, 1, 2, 3
EXIT_SIGNAL = {int(signal.SIGINT): 130, int(signal.SIGTERM): 143}


def _fail(error: ClusterrunError, code: int) -> None:
    click.echo(f"clusterrun: error: {error.render()}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="clusterrun")
def main() -> None:
    """Launch PyTorch distributed training on several machines over SSH and watch it."""


def _check_script(spec: ClusterSpec, script: str) -> None:
    """For local hosts the script must exist where torchrun will look for it."""
    for host in spec.hosts:
        if host.transport != "local":
            continue
        base = os.path.expanduser(host.workdir) if host.workdir else os.getcwd()
        if not os.path.isfile(os.path.join(base, script)):
            raise ConfigError(f"{os.path.join(base, script)} does not exist (needed by local host {host.host!r})",
                              path=script, hint="give the script's path relative to the current directory "
                              "or the host's workdir")


def _print_plan(plan: LaunchPlan) -> None:
    click.echo(f"job {plan.job_id}: {plan.nnodes} nodes, world size {plan.world_size}, "
               f"master {plan.master_addr}:{plan.master_port}")
    for node in plan.nodes:
        click.echo(f"\nnode{node.rank} {node.host.host} ({node.host.transport}), "
                   f"ranks {node.first_rank}..{node.first_rank + node.nproc - 1}")
        click.echo(f"  cwd: {node.cwd or '(home directory)'}")
        click.echo("  env:")
        for key in sorted(node.env):
            click.echo(f"    {key}={shlex.quote(node.env[key])}")
        click.echo(f"  command: {shlex.join(node.argv)}")


@contextmanager
def _stop_on_signals(job: Job) -> Iterator[dict[str, int]]:
    """SIGINT and SIGTERM ask the job to stop on every node; the exit code says which came."""
    got: dict[str, int] = {}

    def handler(signum: int, frame: FrameType | None) -> None:
        got.setdefault("signal", signum)
        job.request_stop(signal.Signals(signum).name)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--name", help="A name for the job (default: the script's name); part of the job id.")
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE",
              help="Set an environment variable for every node (repeatable; wins over the hosts file).")
@click.option("--dry-run", is_flag=True, help="Print each node's exact command and environment, start nothing.")
@click.option("--no-tui", is_flag=True, help="Print prefixed log lines instead of the dashboard.")
@click.option("--ssh-config", type=click.Path(dir_okay=False), help="An ssh_config file to resolve hosts with "
              "(default: the hosts file's `ssh_config`, else ~/.ssh/config).")
@click.option("--accept-new-host-keys", is_flag=True, help="Record the keys of hosts not yet in known_hosts "
              "(like StrictHostKeyChecking=accept-new); a changed key is still refused.")
@click.option("--grace", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Seconds torchrun gets to stop its workers before they are killed.")
@click.argument("hosts_file", metavar="HOSTS.yaml", type=click.Path(dir_okay=False))
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- ARGS...]")
def up(hosts_file: str, script: str, script_args: tuple[str, ...], name: str | None, env: tuple[str, ...],
       dry_run: bool, no_tui: bool, ssh_config: str | None, accept_new_host_keys: bool, grace: float) -> None:
    """Start SCRIPT with torchrun on every host of HOSTS.yaml and follow it until it ends.

    Options go before HOSTS.yaml; everything after SCRIPT (after `--` if you like) is passed to
    the script verbatim. Ctrl-C stops the job on every host and checks that nothing is left.
    """
    if script_args[:1] == ("--",):  # click passes the separator on once SCRIPT has been read
        script_args = script_args[1:]
    try:
        spec = load_cluster(hosts_file)
        overrides = parse_env_overrides(env)
        _check_script(spec, script)
    except ConfigError as exc:
        _fail(exc, EXIT_USAGE)
    jname = job_name(name, script)
    job_id = make_job_id(jname, time.strftime("%Y%m%d-%H%M%S"), secrets.token_hex(2))
    printer = Printer()
    job = Job(spec, script, script_args, job_id=job_id, name=jname, emit=printer, env_overrides=overrides,
              local_cwd=os.getcwd(), grace=grace,
              transport_factory=partial(transport_for, ssh_config=ssh_config or spec.ssh_config,
                                        accept_new_host_keys=accept_new_host_keys))
    try:
        try:
            plan = job.prepare()
        except HostsUnavailable as exc:
            _fail(exc, EXIT_HOSTS)
        if dry_run:
            _print_plan(plan)
            return
        printer.set_plan(plan)
        printer.note(f"job {plan.job_id}: {plan.nnodes} nodes, world size {plan.world_size}, "
                     f"master {plan.master_addr}:{plan.master_port}")
        with _stop_on_signals(job) as got:
            try:
                job.start()
            except HostsUnavailable as exc:
                _fail(exc, EXIT_HOSTS)
            result = job.run()
    finally:
        job.close()
    if got.get("signal"):
        sys.exit(EXIT_SIGNAL.get(got["signal"], 1))
    sys.exit(EXIT_OK if result.ok else EXIT_FAILED)
