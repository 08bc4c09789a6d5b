"""``clusterrun logs``: a job's logs read from its hosts, or followed with ``-f``.

Apart from the other commands that look at a job (``jobs``) so that ``logs`` of an ended job imports
only what reads a log (``life.logread``): its start-up is most of what it takes beside ``ssh HOST cat``
(docs/benchmarks.md, "Logs"); its hosts connect while it imports the printer; following (``-f``) imports
the orchestrator's follower when it starts.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from typing import TYPE_CHECKING

import click

from clusterrun.cli import EXIT_HOSTS, EXIT_OK, EXIT_SIGNAL, EXIT_USAGE, _fail, _note, main
from clusterrun.cli.records import _open_job, _refresh, hosts_option
from clusterrun.core.errors import ClusterrunError, ConfigError
from clusterrun.core.ranges import parse_ranges
from clusterrun.life.logread import hosts_ahead, read_log_chunks, read_logs
from clusterrun.run.startwatch import seconds_text
from clusterrun.store.jobs import JobRecord, is_slurm
from clusterrun.views.completion import complete_jobs

if TYPE_CHECKING:  # the followers of ``-f``: imported where one is made
    from clusterrun.core.events import JobResult
    from clusterrun.run.plan import LaunchPlan
    from clusterrun.store.opened import Opened


def _select_ranks(record: JobRecord, node: tuple[int, ...]) -> list[int]:
    ranks = list(node) or list(range(len(record.nodes)))
    bad = [r for r in ranks if not 0 <= r < len(record.nodes)]
    if bad:
        _fail(ConfigError(f"job {record.job_id} has nodes 0..{len(record.nodes) - 1}, not {bad[0]}", key="--node"),
              EXIT_USAGE)
    return ranks


def _global_ranks(plan: LaunchPlan, text: str | None) -> frozenset[int] | None:
    """``logs --rank``'s ranks (``0,4-7``), checked against the job's world size; None without it."""
    if text is None:
        return None
    try:
        ranks = frozenset(parse_ranges(text))
    except ValueError as exc:
        _fail(ConfigError(str(exc), key="--rank"), EXIT_USAGE)
    beyond = sorted(r for r in ranks if r >= plan.world_size)
    if beyond:
        _fail(ConfigError(f"job {plan.job_id} has ranks 0..{plan.world_size - 1}, not {beyond[0]}", key="--rank"),
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
@click.argument("job", shell_complete=complete_jobs)
@click.option("-n", "--node", type=int, multiple=True, metavar="N", help="Only node N (repeatable).")
@click.option("-r", "--rank", "rank_text", metavar="RANKS", help="Only the lines of these global ranks: 3, or "
              "0,4-7 (from the nodes that hold them; torchrun's own lines left out). --tail counts a node's lines "
              "before this filter.")
@click.option("-f", "--follow", is_flag=True, help="Keep following until the job ends.")
@click.option("--tail", type=click.IntRange(min=0), metavar="N", help="Start at the last N lines of each node.")
@click.option("--attempt", type=click.IntRange(min=1), metavar="K", help="An earlier attempt (default: the last).")
@click.option("--prefix/--no-prefix", default=None,
              help="Prefix each line with its node (default: only when several nodes are shown).")
@click.option("--by-node", is_flag=True,
              help="Node after node (default: the nodes' lines interleaved in the order they were written).")
@hosts_option
def logs(job: str, node: tuple[int, ...], rank_text: str | None, follow: bool, tail: int | None,
         attempt: int | None, prefix: bool | None, by_node: bool, hosts_file: str | None) -> None:
    """Print JOB's logs from its hosts' log files: every node's lines with a prefix, interleaved
    in the order they were written by the hosts' clocks (--by-node: node after node), or one
    node's exactly as written with --node N. Works during and after the job, from any controller
    that has its record. With -f, ends when the job does, through its restarts (each next attempt
    from its start), with its summary and exit code as `up` (0 succeeded, 1 failed or stopped).

    Lines shown with a prefix (or of a one-node job) are made safe for a terminal: colours pass
    (dropped with NO_COLOR, TERM=dumb or when not a terminal), other escape sequences and control
    characters are shown escaped (`\x1b]52;...`). --node N without --prefix prints the node's file
    byte for byte, escape sequences included, as `cat` would: redirect it to a file, or pipe it to
    `cat -v`, to look at output you do not trust."""
    store, opened = _open_job(job, hosts_file)
    ranks = _select_ranks(opened.record, node)
    explicit = attempt is not None
    attempt = _check_attempt(opened.record, attempt)
    ahead = hosts_ahead(opened, ranks, attempt) if not follow and rank_text is None else {}
    # Imported while those hosts connect: the printer's modules are most of what is left to load
    from clusterrun.cli.follow import Viewer, _exit_code, follow_attempts, quick_handoffs
    from clusterrun.run.plan import plan_from_json
    from clusterrun.views.interleave import interleaved
    from clusterrun.views.printer import Printer

    opened = _refresh(store, opened)
    record = opened.record
    plan = plan_from_json(record.plan, opened.spec())
    global_ranks = _global_ranks(plan, rank_text)
    if global_ranks is not None:
        ranks = [r for r in ranks if set(plan.nodes[r].ranks) & global_ranks]
        if not ranks:
            _fail(ConfigError(f"ranks {rank_text} are not on node {', '.join(map(str, node))}", key="--rank",
                              hint="leave out --node, or see which node holds a rank: `clusterrun ps JOB`"), EXIT_USAGE)
    raw = len(ranks) == 1 and bool(node) and not prefix
    printer = Printer(prefix=len(ranks) > 1 if prefix is None else prefix, quiet=True, raw=raw, ranks=global_ranks)
    printer.set_plan(plan)
    quick_handoffs()  # the nodes' readers or followers are threads beside the one printing
    if not follow:
        failed = printed = False
        if by_node or len(ranks) == 1:
            chunks = read_logs(opened, ranks, attempt, tail, ahead=ahead)
        else:
            chunks = interleaved(ranks, lambda rank: read_log_chunks(opened, rank, attempt, tail, ahead.get(rank)))
        for rank, item in chunks:
            if isinstance(item, ClusterrunError):
                failed = True
                _note(f"node{rank} {record.nodes[rank].host}: {item.render()}")
            else:
                printed = printed or bool(item)
                printer.write_log(rank, record.nodes[rank].host, item)
        if not printed and not failed and tail != 0:  # silence would look like a broken command
            _note(_no_output_text(record, attempt, time.time()))
        sys.exit(EXIT_HOSTS if failed else EXIT_OK)

    def viewer(opened: Opened, attempt: int, tail: int | None) -> Viewer:
        record = opened.record
        printer.set_plan(plan_from_json(record.plan, opened.spec()))  # a restart's may have a spare's host
        if is_slurm(record):  # its files on this machine, as its `up` writes them
            from clusterrun.store.slurmlogs import SlurmFollower

            return SlurmFollower(store, record, printer, attempt=attempt, ranks=ranks, tail=tail,
                                 reload=lambda: _refresh(store, opened.with_record(store.load(record.job_id))).record)
        from clusterrun.life.lifecycle import follower

        return follower(record, printer, owner=False, follow_logs=True, attempt=attempt, tail=tail, ranks=ranks,
                        spec=opened.spec(attempt))

    def shown(result: JobResult) -> JobResult:  # the outcome of the nodes shown
        return dataclasses.replace(result, nodes=tuple(n for n in result.nodes if n.node in ranks))

    def summary(result: JobResult, restarting: bool) -> None:  # as `up --no-tui` ends
        Printer().summary(shown(result), restarting=restarting)

    # the attempt asked for, else every attempt from the current one on, each next one from its start
    result, got = follow_attempts(store, opened, viewer(opened, attempt, tail), summary,
                                  None if explicit else (lambda opened: viewer(opened, opened.record.attempt, None)),
                                  [signal.SIGINT, signal.SIGTERM])
    sys.exit(_exit_code(shown(result), got) if result is not None else EXIT_SIGNAL.get(got.get("signal", 0), EXIT_OK))


def _no_output_text(record: JobRecord, attempt: int, now: float) -> str:
    """What ``logs`` says when the nodes asked for have written nothing: ``no output yet (running
    for 4 s)``, or that the attempt ended without any."""
    shown = next((a for a in record.attempts if a.attempt == attempt), None)
    if shown is None:
        return "no output"
    if attempt == record.attempt and not record.finished:
        return f"no output yet ({record.state} for {seconds_text(max(0.0, now - shown.started))})"
    return f"no output: attempt {attempt} ended ({shown.state}) without writing any"
