"""``clusterrun stack``: every rank's Python stack, identical stacks shown once with their ranks."""

from __future__ import annotations

import json

import click

from clusterrun.cli import EXIT_FAILED, EXIT_HOSTS, EXIT_OK, EXIT_USAGE, Seconds, _fail, main
from clusterrun.cli.records import _not_under_slurm, _open_job, _refresh, hosts_option
from clusterrun.core.errors import ClusterrunError, ConfigError
from clusterrun.core.terminal import safe
from clusterrun.diagnose.stacks import parse_ranks, render, view_json
from clusterrun.life.lifecycle import stacks_view
from clusterrun.views.completion import complete_jobs


@main.command(name="stack")
@click.argument("job", shell_complete=complete_jobs)
@click.option("-n", "--node", type=int, multiple=True, metavar="N", help="Only node N (repeatable).")
@click.option("-r", "--rank", "rank_text", metavar="RANKS", help="Only these global ranks: 7, or 0,4-7.")
@click.option("--native", is_flag=True, help="Also the native frames (C, C++, CUDA calls): py-spy's --native.")
@click.option("--timeout", type=Seconds(minimum=1), default=10.0, show_default=True, metavar="SECONDS",
              help="How long py-spy may take for each rank.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema 1, see docs/json.md) instead of text.")
@hosts_option
def stack_command(job: str, node: tuple[int, ...], rank_text: str | None, native: bool, timeout: float,
                  as_json: bool, hosts_file: str | None) -> None:
    """Print the Python stack of every rank of JOB, taken on every host at once by py-spy;
    identical stacks are shown once with their ranks:

    \b
      ranks 0-6,8-15: all_reduce in step at train.py:42 · rank 7: __next__ at dataset.py:88

    (where a rank waits inside a library: the call, and the job's own frame that made it), then
    each group's frames, innermost first. A rank blocked in a collective shows where; the
    odd one out is usually the one the others wait for. py-spy must be on the host (beside the
    job's Python, on its PATH, or in ~/.local/bin): where it is not, the command that installs it
    there is shown. Where the kernel refuses to let py-spy look (another user's process,
    kernel.yama.ptrace_scope, a container without SYS_PTRACE), the reason and its fix are shown.

    Exit 0 when every rank's stack was taken, 1 when some could not be (or the job is not
    running), 3 when a host could not be reached."""
    store, opened = _open_job(job, hosts_file)
    record = opened.record
    _not_under_slurm(record, "its stacks cannot be taken by clusterrun", "run py-spy in the step: "
                     "`srun --overlap --jobid=ALLOCATION py-spy dump --pid PID`")
    nodes = list(node) or None
    bad = [n for n in nodes or () if not 0 <= n < len(record.nodes)]
    if bad:
        _fail(ConfigError(f"job {record.job_id} has nodes 0..{len(record.nodes) - 1}, not {bad[0]}", key="--node"),
              EXIT_USAGE)
    try:
        ranks = None if rank_text is None else parse_ranks(rank_text)
    except ValueError as exc:
        _fail(ConfigError(str(exc), key="--rank"), EXIT_USAGE)
    opened = _refresh(store, opened)
    record = opened.record
    if record.finished:
        _fail(ClusterrunError(f"job {record.job_id} has ended ({record.state}): it runs no rank to look at",
                              hint=f"clusterrun logs {record.job_id} shows how it ended"), EXIT_FAILED)
    try:
        view = stacks_view(opened, nodes, ranks, native=native, timeout=timeout)
    except ClusterrunError as exc:  # the recorded hosts file cannot be read
        _fail(exc, EXIT_USAGE)
    if not view.groups and not view.problems and not view.idle:
        _fail(ConfigError(f"job {record.job_id} has no rank {rank_text} on the nodes asked", key="--rank"),
              EXIT_USAGE)
    if as_json:
        click.echo(json.dumps(view_json(view, record.job_id, record.attempt), indent=1))
    else:
        for line in render(view):
            click.echo(safe(line, colour=False))
    raise SystemExit(EXIT_HOSTS if view.unreachable else EXIT_OK if view.ok else EXIT_FAILED)
