"""The commands that change a job: ``down``/``stop``, ``rm``, ``prune``, ``restart``, and the
hidden ``_monitor`` that owns a job in the background and ``_notify`` that sends one notification."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import click

from clusterrun.cli import EXIT_FAILED, EXIT_HOSTS, EXIT_OK, EXIT_USAGE, Seconds, _fail, _note, main
from clusterrun.cli.follow import _follow_hint
from clusterrun.cli.records import _adopt, _find, _open_job, _refresh, hosts_option
from clusterrun.cli.slurm import down_slurm_step, restart_slurm
from clusterrun.core.errors import (
    ClusterrunError,
    ConfigError,
    DamagedRecord,
    HostsUnavailable,
    JobNotFound,
    StateError,
)
from clusterrun.life import notify, spares
from clusterrun.life.attempt import NextAttempt, NotStopped
from clusterrun.life.down import Verdict
from clusterrun.life.down import down as stop_verified
from clusterrun.life.lifecycle import daemonize, remove_on_hosts
from clusterrun.life.runner import run_monitor
from clusterrun.store.jobs import JobRecord, JobStore, is_slurm
from clusterrun.store.opened import Opened
from clusterrun.views.completion import complete_jobs
from clusterrun.views.printer import Printer

hosts_too_option = click.option(
    "--hosts-too", is_flag=True, help="Also delete the jobs' state and logs on their hosts (asks first).")
yes_option = click.option(
    "-y", "--yes", is_flag=True, help="Do not ask before deleting on the hosts (needed without a terminal).")
stop_grace_option = click.option(
    "--grace", type=Seconds(),
    help="Seconds torchrun gets to stop its workers (default: the job's --grace).")


def _not_recorded(record: JobRecord, error: StateError) -> None:
    _note(f"error: {error.render()}")
    _note(f"the stop of job {record.job_id} above was NOT recorded: its record may show it as it was "
          "before; run `clusterrun down` again once the directory can be written")


@main.command()
@click.argument("job", shell_complete=complete_jobs)
@stop_grace_option
@hosts_option
def down(job: str, grace: float | None, hosts_file: str | None) -> None:
    """Stop JOB on every host (idempotent). Also `stop`.

    Each host's report says which guarantee held: verified by the attempt's cgroup (nothing of
    the job is left), or a sweep where the host has no cgroup for it (a process that left the
    job's tree, session and environment could not be seen). A job of `up --from-slurm`: its
    Slurm step is stopped (see docs/slurm.md)."""
    if (code := down_slurm_step(job, grace)) is not None:
        sys.exit(code)
    store, opened = _open_job(job, hosts_file)
    record = opened.record
    if not record.finished:
        _note(f"stopping job {record.job_id} (attempt {record.attempt}) on {len(record.nodes)} hosts")
    downed = stop_verified(store, opened, grace)  # a finished job too: its hosts confirm it
    verdict, summary = downed.verdict, downed.summary()
    if verdict is Verdict.ALREADY:
        _note(summary or "")
        return
    Printer().reports([downed.reports[rank] for rank in sorted(downed.reports)], len(record.nodes))
    if downed.unrecorded is not None:
        _not_recorded(record, downed.unrecorded)
    if summary is not None:
        _note(summary)
    sys.exit({Verdict.UNREACHABLE: EXIT_HOSTS, Verdict.LEFT: EXIT_FAILED, Verdict.UNRECORDED: EXIT_USAGE}
             .get(verdict, EXIT_OK))


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


def _remove(store: JobStore, records: Sequence[Opened], hosts_too: bool) -> tuple[int, int]:
    """Remove the records (and with ``hosts_too`` first the jobs' directories on their hosts): the
    exit code and how many were removed."""
    code, removed = EXIT_OK, 0
    for opened in records:
        record = opened.record
        if hosts_too and not is_slurm(record):  # a Slurm job's logs are in its directory here
            answers = remove_on_hosts(opened)
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


def _remove_damaged(store: JobStore, damaged: Iterable[DamagedRecord], hosts_too: bool) -> bool:
    """Remove the directories of jobs whose record is damaged (what ``rm`` is for them: the fix
    their error names), unless a live process owns the job. True if one was refused."""
    refused = False
    for exc in damaged:
        if store.owned(exc.job_id):
            _note(f"error: job {exc.job_id} is owned by a running clusterrun process (its monitor.pid says which): "
                  "its damaged record is not removed; try again once that process has exited")
            refused = True
            continue
        store.remove(exc.job_id)
        click.echo(exc.job_id)
        _note(f"removed the damaged record of job {exc.job_id}" + (
            "; its hosts cannot be read from it, so nothing was deleted on them (`clusterrun rm --hosts HOSTS.yaml "
            f"--hosts-too {exc.job_id}` adopts it from its hosts and deletes it there)" if hosts_too else ""))
    return refused


@main.command(name="rm")
@click.argument("jobs", nargs=-1, required=True, metavar="JOB...", shell_complete=complete_jobs)
@hosts_too_option
@yes_option
@hosts_option
def rm(jobs: tuple[str, ...], hosts_too: bool, yes: bool, hosts_file: str | None) -> None:
    """Remove the records of ended jobs from this controller (their logs stay on the hosts unless
    --hosts-too). A job that has not ended is refused: `clusterrun down` it first.

    Prints each removed id. Exit codes: 0 all removed, 1 a job was refused (not ended), 2 no such
    job, 3 a host could not be reached (that job's record is kept)."""
    _adopt(hosts_file)
    store = JobStore()
    records: list[JobRecord] = []
    damaged: dict[str, DamagedRecord] = {}
    for ref in dict.fromkeys(jobs):
        try:
            record = store.load(_find(store, ref))
        except DamagedRecord as exc:
            damaged[exc.job_id] = exc
            continue
        except JobNotFound as exc:
            _fail(exc, EXIT_USAGE)
        if record.job_id not in {r.job_id for r in records}:
            records.append(record)
    ready: list[Opened] = []
    refused = _remove_damaged(store, damaged.values(), hosts_too)
    for record in records:
        opened = _refresh(store, Opened(record))
        why = _removable(store, opened.record)
        if why is not None:
            _note(f"error: {why}")
            refused = True
        else:
            ready.append(opened)
    if hosts_too and ready:
        _confirm_hosts([o.record for o in ready], yes)
    code, _ = _remove(store, ready, hosts_too)
    sys.exit(code if code != EXIT_OK else EXIT_FAILED if refused else EXIT_OK)


@main.command()
@hosts_too_option
@yes_option
def prune(hosts_too: bool, yes: bool) -> None:
    """Remove the records of every ended job (succeeded, failed, stopped, lost) from this
    controller; unfinished jobs stay. Their logs stay on the hosts unless --hosts-too.

    Prints each removed id. Exit codes: 0 done, 3 a host could not be reached (that job's record is kept)."""
    store = JobStore()
    good, damaged = store.scan()
    ready = [Opened(r) for r in good if r.finished and _removable(store, r) is None]
    if hosts_too and ready:
        _confirm_hosts([o.record for o in ready], yes)
    code, removed = _remove(store, ready, hosts_too)
    _note(f"removed the records of {removed} ended job(s)"
          + ("" if hosts_too else "; their logs stay on the hosts"))
    for d in damaged:  # whether its job has ended cannot be read: only `rm ID` removes it
        _note(f"kept the damaged record of job {d.job_id}: {d.render()}")
    sys.exit(code)


@main.command()
@click.argument("job", shell_complete=complete_jobs)
@stop_grace_option
@click.option("--no-preflight", is_flag=True, help="Skip the costlier checks before the stop (GPUs, the same "
              "torch/CUDA/Python on every host, the master port reachable by TCP from every node), as up does.")
@hosts_option
@click.option("-x", "--exclude", "exclude", multiple=True, metavar="HOST", help="Run the next attempt on the "
              "first free spare (`spares:` in the hosts file, as many processes) instead of HOST, in its node rank.")
@click.option("--replace", "replace", multiple=True, metavar="HOST=SPARE", help="Run the next attempt on the spare "
              "SPARE instead of HOST.")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- ARGS...]")
def restart(job: str, grace: float | None, no_preflight: bool, hosts_file: str | None,
            exclude: tuple[str, ...] = (), replace: tuple[str, ...] = (), script_args: tuple[str, ...] = ()) -> None:
    """Check JOB's next attempt as up does, then stop JOB (verified) and start it again with the
    same hosts file, script, arguments and environment, as a new attempt with logs of its own;
    returns once it runs (like up -d). `restart JOB -- ARGS...` gives the script new arguments
    from this attempt on (the record keeps them; `ps JOB` shows them). A check that fails (a
    secret --env value not in this shell's environment, the script, the preflight) stops nothing:
    exit 2 or 3, the job runs on. A job waiting to be restarted by its restart policy is
    restarted now. This controller owns the new attempt (its monitor), an adopted job's too.
    A job of `up --from-slurm`: a new step in the same allocation, run in the foreground as up
    runs it (refused once the allocation has ended; see docs/slurm.md)."""
    store, opened = _open_job(job, hosts_file)
    record = opened.record
    if is_slurm(record):  # a new step in its allocation, run here in the foreground
        if exclude or replace:
            _fail(ConfigError("-x and --replace: a Slurm job's hosts are its allocation's",
                              hint="ask Slurm for other nodes (`up --from-slurm` in a new allocation)"), EXIT_USAGE)
        restart_slurm(opened, grace, script_args)
    printer = Printer(nnodes=len(record.nodes))
    try:
        recorded = opened.spec()  # parsed once, for the spares and the checks
        swaps = spares.pick(recorded, record, exclude, _chosen(replace)) if exclude or replace else {}
        attempt = NextAttempt(record, printer, full_preflight=not no_preflight,
                              script_args=script_args if script_args else None, recorded=recorded, replace=swaps)
    except ConfigError as exc:
        exc.message += f"; job {record.job_id} was not restarted, attempt {record.attempt} runs on untouched"
        _fail(exc, EXIT_USAGE)
    except HostsUnavailable as exc:
        exc.message = (f"{exc.message.removesuffix('; nothing was started')}; job {record.job_id} was not "
                       f"restarted, attempt {record.attempt} runs on untouched")
        _fail(exc, EXIT_HOSTS)
    try:
        record = attempt.replace(store, grace=grace)
    except ClusterrunError as exc:
        printer.flush()  # the stop and start lines held so far go before the error
        _fail(exc, EXIT_HOSTS if isinstance(exc, HostsUnavailable) or isinstance(exc, NotStopped) and exc.unreachable
              else EXIT_USAGE if isinstance(exc, StateError) else EXIT_FAILED)
    finally:
        attempt.close()
    printer.flush()
    _note(f"job {record.job_id} restarted as attempt {record.attempt}; {_follow_hint(record.job_id)}")


def _chosen(replace: tuple[str, ...]) -> dict[str, str]:
    """``restart``'s ``--replace HOST=SPARE`` options, as a host → spare mapping."""
    chosen = {}
    for item in replace:
        host, equals, spare = item.partition("=")
        if not equals or not host or not spare:
            raise ConfigError(f"--replace {item!r}: expected HOST=SPARE", hint="e.g. --replace gpu03=spare01")
        chosen[host] = spare
    return chosen


@main.command(name="_monitor", hidden=True)
@click.argument("job_id")
def monitor(job_id: str) -> None:
    """Own JOB_ID in the background until it ends (started by `up -d` and friends)."""
    daemonize()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    store = JobStore()
    printer = Printer(colour=False)
    printer.note(f"monitor {os.getpid()} for job {job_id} started")
    try:
        sys.exit(run_monitor(store, job_id, printer))
    except ClusterrunError as exc:  # e.g. its record damaged: what still runs of the job runs on, unowned
        printer.note(f"error: {exc.render()}")
        printer.note(f"monitor {os.getpid()} for job {job_id} exits")
        sys.exit(EXIT_FAILED)


@main.command(name="_notify", hidden=True)
@click.option("--root", required=True, help="The job store's directory.")
@click.argument("job_id")
@click.argument("key")
@click.argument("starter")
def notify_sender(root: str, job_id: str, key: str, starter: str) -> None:
    """Send JOB_ID's notification KEY that process STARTER claimed (started by `notify.start`)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sys.exit(notify.sender(JobStore(Path(root)), job_id, key, starter))
