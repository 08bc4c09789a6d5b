"""A job's record for the commands that name one: found by reference (adopted from its hosts
with ``--hosts``), brought up to date from its hosts; the text of a host's stop guarantee."""

from __future__ import annotations

import os
from collections.abc import Sequence

import click

from clusterrun.cli import EXIT_USAGE, _fail, _note
from clusterrun.core.errors import ConfigError, DamagedRecord, JobNotFound, StateError
from clusterrun.store.jobs import JobRecord, JobStore, is_slurm
from clusterrun.store.opened import Opened


def _guarantee(fallbacks: Sequence[str], prefix: str = "  ") -> str:
    """How a stop will be verified on a host, and what else it lacks, each line after ``prefix``."""
    from clusterrun.views.joblist import stop_guarantee  # ps's module: not on `down`'s path

    return "\n".join(prefix + line for line in stop_guarantee(fallbacks))


HOSTS_HELP = ("Also find the jobs on the hosts of HOSTS.yaml (their state dirs) and adopt those this machine has no "
              "record of (jobs started from another machine or XDG_STATE_HOME).")
hosts_option = click.option(
    "--hosts", "hosts_file", metavar="HOSTS.yaml", type=click.Path(dir_okay=False), help=HOSTS_HELP)


def _adopt(hosts_file: str | None) -> None:
    """With ``--hosts HOSTS.yaml``: make a record here for every job found on those hosts that this
    controller does not know (``discover``); say which were adopted and what could not be."""
    if hosts_file is None:
        return
    from clusterrun.config.selection import load_hosts  # these, only with --hosts
    from clusterrun.life.discover import ask_hosts, records_from

    try:
        spec, text = load_hosts(hosts_file)  # a DeepSpeed/MPI hostfile too: its text as YAML
    except ConfigError as exc:
        _fail(exc, EXIT_USAGE)
    store = JobStore()
    ssh_config = spec.ssh_config
    good, damaged = store.scan()
    known = {r.job_id for r in good} | {d.job_id for d in damaged}  # a damaged record's job is not adopted over it
    records, notes = records_from(spec, hosts_file, text, ask_hosts(spec, ssh_config), known=known,
                                  local_cwd=os.getcwd(), ssh_config=ssh_config)
    for note in notes:
        _note(note)
    for record in records:
        store.create(record)
        _note(f"adopted job {record.job_id} ({record.state}) from the hosts of {hosts_file}")


def _open_job(ref: str, hosts_file: str | None = None) -> tuple[JobStore, Opened]:
    """The job ``ref`` names, opened once for the command: its record, and its hosts file parsed
    when first needed (``Opened``), carried to whatever the command does with it."""
    _adopt(hosts_file)
    store = JobStore()
    try:
        record = store.load(_find(store, ref))
    except JobNotFound as exc:
        _fail(exc, EXIT_USAGE)
    if os.path.isdir(record.local_cwd):
        os.chdir(record.local_cwd)  # relative paths in the job's hosts file are relative to it
    return store, Opened(record)


def _find(store: JobStore, ref: str) -> str:
    """The id of the job ``ref`` names (``JobStore.find``), saying on stderr which job a name
    several jobs have had means."""
    found = store.find(ref)
    if found.note is not None:
        _note(found.note)
    return found.job_id


def _refresh(store: JobStore, job: Opened) -> Opened:
    """The job brought up to date (``recorder.refresh``), its hosts file parsed no more than once.
    An ended job with no notifications to send is as recorded: for it neither the recorder nor Slurm's
    modules are imported (``logs`` of an ended job beside ``ssh cat``: docs/benchmarks.md, "Logs")."""
    record = job.record
    if record.finished and record.notify is None:
        return job
    from clusterrun.life.recorder import refresh
    from clusterrun.slurm.job import refresh as slurm_refresh

    try:
        if is_slurm(record):  # no agent and no monitor: its `up` records it, else Slurm is asked
            return job.with_record(slurm_refresh(store, record))
        return refresh(store, job)
    except ConfigError as exc:
        _fail(exc, EXIT_USAGE)
    except DamagedRecord:  # not a record to show: exit 1 (``_Commands``)
        raise
    except StateError as exc:  # the record could not be brought up to date: show it as it is
        _note(f"warning: job {record.job_id} shows its last recorded state: {exc.render()}")
        return job


def _not_under_slurm(record: JobRecord, what: str, instead: str) -> None:
    """Refuse ``what`` for a job of ``up --from-slurm`` (no agent runs its nodes), naming what works."""
    if is_slurm(record):
        _fail(ConfigError(f"job {record.job_id} runs under Slurm (one srun, no clusterrun agent on its nodes): "
                          f"{what}", hint=instead), EXIT_USAGE)
