"""The commands that look at a job: ``ps``, ``attach``, ``wait`` (``logs`` has a module of its own)."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sys
import time
from collections.abc import Sequence

import click

from clusterrun.cli import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_SIGNAL,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    Seconds,
    _fail,
    _note,
    main,
    no_tui_option,
    ui_lines_option,
)
from clusterrun.cli.follow import (
    Viewer,
    _dashboard,
    _exit_code,
    _follow_hint,
    _use_tui,
    follow_attempts,
    quick_handoffs,
)
from clusterrun.cli.records import _adopt, _guarantee, _open_job, _refresh, hosts_option
from clusterrun.cli.slurm import slurm_rows
from clusterrun.config.watch import Watch
from clusterrun.core.errors import ClusterrunError, DamagedRecord
from clusterrun.core.events import Event, JobFinished, JobState, NodeState
from clusterrun.core.protocol import decode_status
from clusterrun.core.terminal import safe
from clusterrun.life import notify
from clusterrun.life.lifecycle import follower, save_seen
from clusterrun.life.lookup import look
from clusterrun.run.plan import plan_from_json
from clusterrun.run.startwatch import late_after, progress_text
from clusterrun.slurm.job import engine_text
from clusterrun.store import preparing
from clusterrun.store.jobjson import node_state, progress_of
from clusterrun.store.jobs import JobRecord, JobStore, is_slurm
from clusterrun.store.opened import Opened
from clusterrun.views.completion import complete_jobs
from clusterrun.views.gpus import per_gpu
from clusterrun.views.joblist import (
    COMPACT,
    STATES,
    header_text,
    history_rows,
    job_state_text,
    jobs_json,
    node_rows,
    outcome_text,
    phase_lines,
    shown,
    table_text,
    training_text,
    unreachable_ranks,
)
from clusterrun.views.printer import Printer


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


@main.command()
@click.argument("job", required=False, shell_complete=complete_jobs)
@click.option("-a", "--all", "show_all", is_flag=True, help="Every job, also those that ended more than a day ago.")
@click.option("--state", "states", multiple=True, type=click.Choice(STATES), metavar="STATE",
              help=f"Only jobs in this state, of any age (repeatable; {', '.join(STATES)}).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema 1, see docs/json.md) instead of a table.")
@hosts_option
def ps(job: str | None, show_all: bool, states: tuple[str, ...], as_json: bool, hosts_file: str | None) -> None:
    """List jobs, or show one JOB's nodes (JOB: an id, a --name or a unique id prefix).

    Without JOB: the unfinished jobs and those that ended in the last 24 hours (-a: all; --state:
    those in a state, of any age), oldest first. A job nobody follows is first brought up to date
    from its hosts: a node whose processes are gone (the host rebooted, or they were killed)
    shows as lost, never as running. JOB's nodes are shown with their hosts' GPUs (where
    nvidia-smi is); past 16 nodes, consecutive nodes alike share a row."""
    if job is not None:
        checking = [e for e in preparing.live() if job in (e.job_id, e.name)] if not as_json else []
        if checking:  # its `up` still checks the hosts: no record yet, nothing started
            click.echo(_preparing_text(checking[-1], time.time()))
            return
        store, opened = _open_job(job, hosts_file)
        seen = look(store, _refresh(store, opened))
        record, statuses, gpus = seen.record, seen.statuses, seen.gpus
        report = store.hang_report(record.job_id, record.attempt)
        hung = any(node_state(n) == NodeState.HUNG for n in record.nodes) and report.exists()
        if as_json:
            click.echo(json.dumps(jobs_json([record], hosts=statuses, gpus=gpus,
                                            hang_report=str(report) if hung else None), indent=1))
            return
        attempt = record.attempts[-1] if record.attempts else None
        now = time.time()
        click.echo(header_text(record, now))
        errors = {rank: e.one_line() for rank, e in seen.errors.items()}
        if is_slurm(record):
            click.echo(engine_text(record))
        _table(node_rows(record, now, errors, gpus))
        training = training_text(record, progress_of(record, statuses), now)
        if training:
            click.echo(f"progress: {safe(training, colour=False)}")
        if len(record.attempts) > 1:
            click.echo("")
            _table([tuple(safe(c, colour=False) for c in row) for row in history_rows(record, now)])
        for line in phase_lines(record):  # how each attempt came to run: a restart's from the failure
            click.echo(line)
        if not record.finished and attempt is not None:  # the start-up watch: who still waits for what
            waiting = progress_text({n.rank: n.host for n in record.nodes},
                                    {r: decode_status(record.nodes[r].host, a["state"]) for r, a in statuses.items()
                                     if isinstance(a.get("state"), dict)}, attempt.started, now,
                                    late_after(Watch.from_json(record.watch).startup_timeout))
            if waiting is not None and len(statuses) == len(record.nodes):
                click.echo(f"start-up: {waiting}")
        if hung:  # what the ranks were doing: its first lines say what hung and which ranks to look at
            with contextlib.suppress(OSError):
                head = report.read_text(errors="replace").splitlines()[:2]
                click.echo("\n".join([f"hang report: {report}", *(f"  {safe(line, colour=False)}" for line in head)]))
        if attempt is not None and attempt.root_cause:  # its last lines are the rank's output
            click.echo(f"root cause: {safe(attempt.root_cause, colour=False)}")
            if attempt.cause and attempt.fix:
                click.echo(f"cause: {safe(attempt.cause, colour=False)}\nfix: {safe(attempt.fix, colour=False)}")
        for key, notice in notify.notices(record).items():
            if notice.state == "failed":  # the owner said so once on its stderr; the record keeps it
                click.echo(f"notification {record.job_id}:{key}: {safe(notify.failure_text(notice), colour=False)}")
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
            reading = gpus.get(rank)
            if reading is not None and not reading.missing and len(record.nodes) <= COMPACT:
                click.echo(f"{where}GPUs: {safe(' · '.join(per_gpu(reading)), colour=False)}")
        return
    _adopt(hosts_file)
    store = JobStore()
    now = time.time()
    good, damaged = store.scan()
    records, hidden = shown([_refresh(store, Opened(r)).record for r in good], now, show_all=show_all, states=states)
    if as_json:
        click.echo(json.dumps(jobs_json(records, damaged=damaged), indent=1))
        return
    trained = {r.job_id: _short_progress(r) for r in records}
    extra = any(trained.values())  # a PROGRESS column once a listed job has one
    rows = [("JOB", "NAME", "HOSTS", "STATE", "ATTEMPT", "AGE", *(("PROGRESS",) if extra else ()))]
    for r in records:
        rows.append((r.job_id, r.name, _hosts_cell(r.hosts), job_state_text(r, now), str(r.attempt),
                     _age(now - r.created), *((trained[r.job_id] or "-",) if extra else ())))
    for d in damaged if not states else ():
        rows.append((d.job_id, "?", "?", "damaged", "?", "?"))
    if not states or "running" in states:  # up --from-slurm's steps that have no record here
        rows += slurm_rows({r.job_id for r in good})
    checking = preparing.live() if not states or "preparing" in states else []
    rows += [(e.job_id, e.name, _hosts_cell(list(e.hosts)), "preparing", "-", _age(now - e.since)) for e in checking]
    _table(rows)
    for entry in checking:
        click.echo(_preparing_text(entry, now))
    for d in damaged:
        _note(f"error: {d.render()}")
    if hidden:
        _note(f"{hidden} job(s) that ended more than a day ago not shown: `clusterrun ps -a` lists them, "
              "`clusterrun prune` removes every ended job's record")


def _short_progress(record: JobRecord) -> str:
    """``ps``'s PROGRESS cell (``Progress.cell``)."""
    progress = progress_of(record)
    return "" if progress is None else safe(progress.cell(record.finished), colour=False)


def _preparing_text(entry: preparing.Entry, now: float) -> str:
    return (f"job {entry.job_id} ({entry.name}): preparing for {_age(now - entry.since)}, nothing started yet "
            f"(its up checks the hosts): {safe(entry.said, colour=False)}")


def _table(rows: Sequence[Sequence[str]]) -> None:
    for line in table_text(rows):
        click.echo(line)


@main.command()
@click.argument("job", shell_complete=complete_jobs)
@click.option("--tail", type=click.IntRange(min=0), metavar="N",
              help="Also show the last N lines of each node before where the last viewer stopped, above a "
              "separator (default: a screenful in the dashboard, none in the prefixed stream).")
@no_tui_option
@ui_lines_option
@hosts_option
def attach(job: str, tail: int | None, no_tui: bool, ui_lines: int, hosts_file: str | None) -> None:
    """Follow JOB live again: every node's log and state, from where you last left it, with no
    line lost or repeated; the lines just before that point are shown above a separator (--tail N).
    Ctrl-C (d in the dashboard), SIGTERM or SIGHUP detach and leave the job running; K in the
    dashboard or `clusterrun down` stops it. A job of `up --from-slurm`: the log files its up keeps
    on this machine, followed (see docs/slurm.md)."""
    store, opened = _open_job(job, hosts_file)
    opened = _refresh(store, opened)
    record = opened.record
    printer = Printer()
    offsets = {n.rank: n.seen for n in record.nodes}
    slurm = is_slurm(record)  # srun's output reaches only its `up`: a viewer follows the files that `up` keeps
    if _use_tui(no_tui):
        from clusterrun.life.session import Session
        from clusterrun.slurm.view import SlurmView

        scrollback = tail if tail is not None else shutil.get_terminal_size().lines  # a screenful
        session = SlurmView(store, opened, offsets) if slurm else Session(store, record, offsets=offsets,
                                                                          scrollback=scrollback, opened=opened)
        sys.exit(_dashboard(session, ui_lines, term_stops=False))

    def viewer(opened: Opened, offsets: dict[int, int], scrollback: int) -> Viewer:
        record = opened.record
        printer.set_plan(plan_from_json(record.plan, opened.spec()))  # a restart's may have a spare's host
        if slurm:
            from clusterrun.store.slurmlogs import SlurmFollower

            return SlurmFollower(store, record, without_end, attempt=record.attempt, ranks=range(len(record.nodes)),
                                 tail=None, offsets=offsets,
                                 reload=lambda: _refresh(store, opened.with_record(store.load(record.job_id))).record)
        return follower(record, without_end, owner=False, follow_logs=True, offsets=offsets, scrollback=scrollback,
                        spec=opened.spec())

    def without_end(event: Event) -> None:  # an attempt's end is summed up once its owner decided (a restart?)
        if not isinstance(event, JobFinished):
            printer(event)

    def saved(viewer: Viewer) -> None:
        save_seen(store, record.job_id, viewer.attempt, viewer.offsets)

    quick_handoffs()  # the nodes' followers are threads beside the one printing
    first = viewer(opened, offsets, tail or 0)
    printer.note(f"attached to job {record.job_id} (attempt {record.attempt}, {record.state}); "
                 + ("it has ended: its lines since you last looked, then how it ended" if record.finished
                    else "Ctrl-C detaches, the job keeps running"))
    result, got = follow_attempts(store, opened, first, printer.summary,
                                  lambda opened: viewer(opened, {}, 0),  # the next attempt from its start
                                  [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], done=saved)
    if result is None:
        with contextlib.suppress(OSError):
            printer.note(f"detached; job {record.job_id} keeps running. {_follow_hint(record.job_id)}")
        sys.exit(EXIT_SIGNAL.get(got.get("signal", 0), EXIT_OK))
    sys.exit(_exit_code(result, {}))


@main.command(name="wait")
@click.argument("job", shell_complete=complete_jobs)
@click.option("--timeout", type=Seconds(), metavar="SECONDS",
              help="Give up after this long (exit 124); the job runs on.")
@hosts_option
def wait_job(job: str, timeout: float | None, hosts_file: str | None) -> None:
    """Block until JOB has ended, then exit with its outcome: 0 succeeded, 1 failed, stopped or
    lost (for scripts and CI). Waits through a start-up retry (a new attempt) too, except for a
    job adopted with --hosts: its hosts are asked how its attempt ended, and a retry that its own
    controller starts after that is not waited for. Nothing is printed but one line on stderr at
    the end (and what --hosts adopted), and one whenever the nodes whose host cannot be reached
    change (`running; node 1 unreachable since 16:04:05Z`, as ps says it)."""
    store, opened = _open_job(job, hosts_file)
    record = opened.record
    deadline = None if timeout is None else time.monotonic() + timeout
    unreachable: list[int] = []
    while True:
        try:
            opened = _refresh(store, opened.with_record(store.load(record.job_id)))  # nobody owns it: a monitor again
            record = opened.record
        except DamagedRecord as exc:  # its outcome can no longer be known here
            _fail(exc, EXIT_FAILED)
        except ClusterrunError as exc:  # the record went away (removed) or cannot be read
            _fail(exc, EXIT_USAGE)
        if record.finished:
            break
        if deadline is not None and time.monotonic() >= deadline:
            _note(f"job {record.job_id} is still {job_state_text(record, time.time())} after {timeout:g} s")
            sys.exit(EXIT_TIMEOUT)
        if unreachable_ranks(record) != unreachable:
            unreachable = unreachable_ranks(record)
            _note(f"job {record.job_id} is {job_state_text(record, time.time())}"
                  + ("" if unreachable else ": every host can be reached again"))
        # the job's owner writes its record and this process only reads it; an adopted job's is
        # brought up to date from its hosts by every refresh (a connection to each host); a
        # --timeout ends the wait when it says, not at the next look after it
        pause = 2.0 if record.adopted else 0.5
        time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - time.monotonic())))
    _note(outcome_text(record))
    sys.exit(EXIT_OK if record.state == JobState.SUCCEEDED else EXIT_FAILED)
