"""The commands about hosts rather than jobs: ``doctor``, ``exec``, ``hosts convert``, ``completion``."""

from __future__ import annotations

import os
import signal
import sys
import threading
from functools import partial

import click

from clusterrun.checks import doctor
from clusterrun.cli import (
    EXCLUDE_HELP,
    EXIT_FAILED,
    EXIT_HOSTS,
    EXIT_OK,
    EXIT_SIGNAL,
    EXIT_USAGE,
    NODES_HELP,
    _fail,
    _note,
    accept_new_host_keys_option,
    main,
    ssh_config_option,
)
from clusterrun.config.environment import resolve
from clusterrun.config.hostsfile import read_hosts_text
from clusterrun.config.selection import load_hosts
from clusterrun.core.errors import ConfigError
from clusterrun.core.terminal import safe, wants_colour
from clusterrun.transports import transport_for
from clusterrun.views.completion import SHELLS, script


@main.command(name="doctor")
@ssh_config_option
@accept_new_host_keys_option
@click.option("-w", "--nodes", metavar="NODESET", help=NODES_HELP)
@click.option("-x", "--exclude", metavar="NODESET", help=EXCLUDE_HELP)
@click.argument("hosts_file", metavar="HOSTS.yaml", type=click.Path(dir_okay=False))
@click.argument("script", required=False)
def doctor_command(hosts_file: str, script: str | None, ssh_config: str | None, accept_new_host_keys: bool,
                   nodes: str | None = None, exclude: str | None = None) -> None:
    """Check that every host of HOSTS.yaml can run a job; start nothing.

    \b
    Per host, in parallel: the connection (reachable, host key, login), the interpreter and its
    Python, torch with its CUDA and NCCL versions (the same on every host, else a warning naming
    the odd ones), the GPUs asked for (nvidia-smi; busy ones warn), the workdir and SCRIPT
    (relative to each host's workdir), free disk in the state dir, the master port free on node 0
    and reachable by TCP from every node (5 s each: a firewall that drops the packets times out), the
    network interface each node would use (as up chooses it, from the same environment: env,
    env_file, forward_env), the clock against this machine, and logind.

    -w/-x check some of the file's hosts, as `up -w/-x` runs on them. Prints one table: ✓ fine,
    ✗ a problem (with its fix), ! a warning (with its fix). Exit 0 when nothing is ✗, 1 when
    something is, 2 for a bad hosts file. `up` runs the same checks before it starts anything
    (the costlier ones not with --no-preflight).
    """
    try:
        # each host's environment as `up` completes it (forward_env, env_file): the interface row
        # honours the GLOO/NCCL_SOCKET_IFNAME set there as `up` does
        spec, env_notes = resolve(load_hosts(hosts_file, nodes, exclude)[0], os.environ)  # a hostfile too
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


@main.command(name="exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-w", "--nodes", metavar="NODESET", help=NODES_HELP)
@click.option("-x", "--exclude", metavar="NODESET", help=EXCLUDE_HELP)
@ssh_config_option
@accept_new_host_keys_option
@click.option("--job-env", is_flag=True, help="Run COMMAND as each node's job would run: in its workdir, with its "
              "env (env_file, forward_env, secrets) and after its setup commands.")
@click.argument("hosts_file", metavar="HOSTS.yaml", type=click.Path(dir_okay=False))
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- COMMAND...")
def exec_command(hosts_file: str, command: tuple[str, ...], nodes: str | None, exclude: str | None,
                 ssh_config: str | None, accept_new_host_keys: bool, job_env: bool = False) -> None:
    """Run COMMAND on every host of HOSTS.yaml at once, each output line prefixed by its host.

    COMMAND is a list of words, run by sh in the login directory on each host (in this directory
    on a local host; `sh -c '...'` for pipes and variables). With --job-env it runs as the job
    would instead: in the host's workdir, with the job's environment and after its setup (secret
    values masked in the output). Then a summary names the hosts where it failed. Exit 0 when it
    succeeded everywhere, 1 when it failed somewhere, 3 when a host could not be reached.
    """
    from clusterrun.checks.execute import exec_on_hosts, summary

    argv = command[1:] if command[:1] == ("--",) else command
    try:
        if not argv:
            raise ConfigError("no command given", hint="clusterrun exec HOSTS.yaml -- nvidia-smi")
        spec, _ = load_hosts(hosts_file, nodes, exclude)
        notes: list[str] = []
        if job_env:  # env_file and forward_env read here, as up reads them
            spec, notes = resolve(spec, os.environ)
    except ConfigError as exc:
        _fail(exc, EXIT_USAGE)
    for text in notes:
        _note(f"warning: {text}")
    colour = wants_colour(sys.stdout)
    lock = threading.Lock()

    def line(host: str, text: str) -> None:
        with lock:
            click.echo(f"{safe(host, colour=False)}: {safe(text, colour=colour)}")

    factory = partial(transport_for, ssh_config=ssh_config or spec.ssh_config,
                      accept_new_host_keys=accept_new_host_keys)
    try:
        outcomes = exec_on_hosts(spec, argv, factory, line, job_env=job_env, local_cwd=os.getcwd())
    except KeyboardInterrupt:
        _note("interrupted")
        sys.exit(EXIT_SIGNAL[signal.SIGINT])
    for text in summary(outcomes):
        _note(f"exec: {text}")
    sys.exit(EXIT_HOSTS if any(o.unreachable for o in outcomes) else
             EXIT_OK if all(o.ok for o in outcomes) else EXIT_FAILED)


@main.group(name="hosts")
def hosts_group() -> None:
    """Hosts files: convert another tool's hostfile."""


@hosts_group.command(name="convert")
@click.argument("hosts_file", metavar="FILE", type=click.Path(dir_okay=False))
def hosts_convert(hosts_file: str) -> None:
    """Print the clusterrun hosts file (YAML) equivalent to FILE, a DeepSpeed or MPI hostfile
    (`worker-1 slots=4`; slots are GPUs). A YAML hosts file is printed with each host spelled out."""
    from clusterrun.config.hostfiles import load_any, spec_yaml

    try:
        spec, text = load_any(hosts_file)
        yaml_text = read_hosts_text(hosts_file)
    except ConfigError as exc:
        _fail(exc, EXIT_USAGE)
    click.echo(text if text != yaml_text else spec_yaml(spec, f"{hosts_file} with each host spelled out"), nl=False)


@main.command(name="completion")
@click.argument("shell", type=click.Choice(SHELLS))
def completion_command(shell: str) -> None:
    """Print the completion script for SHELL: commands, options, hosts files and job ids and names.

    \b
    bash:  source <(clusterrun completion bash)        (in ~/.bashrc)
    zsh:   source <(clusterrun completion zsh)         (in ~/.zshrc, after compinit)
    fish:  clusterrun completion fish > ~/.config/fish/completions/clusterrun.fish
    """
    click.echo(script(main, shell))
