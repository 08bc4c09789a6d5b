"""What the pages show, read as ``ps``, ``ps JOB`` and ``logs`` read it (blocking: run in a worker thread).

The documents are ``ps --json``'s and ``ps JOB --json``'s (``views.joblist``), so a field added there
reaches the page's JSON without a change here; the texts beside them (the state and the training's
progress in words, stop guarantees, the start-up watch) are ``ps`` and ``ps JOB``'s.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from clusterrun.core.errors import ClusterrunError, DamagedRecord, JobNotFound, StateError
from clusterrun.core.protocol import decode_status
from clusterrun.core.terminal import safe
from clusterrun.diagnose.rootcause import split_rank
from clusterrun.life.down import Downed, down
from clusterrun.life.logread import read_log_chunks
from clusterrun.life.lookup import look
from clusterrun.life.recorder import refresh
from clusterrun.run.startwatch import progress_text
from clusterrun.slurm.job import refresh as slurm_refresh
from clusterrun.store.jobjson import progress_of
from clusterrun.store.jobs import JobRecord, JobStore, is_slurm
from clusterrun.store.opened import Opened
from clusterrun.views.joblist import job_state_text, jobs_json, shown, stop_guarantee, training_text
from clusterrun.views.printer import stop_caveat, stop_text

SEARCH_LIMIT = 500  # matching lines a search shows (the last ones)
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class Opener:
    """The jobs the server shows, each opened once for its life: a record read again keeps its
    parsed hosts file (``Opened.with_record``). From any thread."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._kept: dict[str, Opened] = {}
        self._lock = threading.Lock()

    def open(self, job_id: str) -> Opened:
        """The job of this id, its record read now (a page's address names its job by id only)."""
        return self.keep(load(self.store, job_id))

    def keep(self, record: JobRecord) -> Opened:
        with self._lock:
            kept = self._kept.get(record.job_id)
            opened = self._kept[record.job_id] = kept.with_record(record) if kept is not None else Opened(record)
        return opened


def current(store: JobStore, job: Opened) -> Opened:
    """The job brought up to date as ``ps`` does (a job nobody owns is reconciled with its hosts)."""
    try:
        return job.with_record(slurm_refresh(store, job.record)) if is_slurm(job.record) else refresh(store, job)
    except DamagedRecord:
        raise
    except StateError:  # shown as last recorded, as ps does
        return job


def job_list(jobs: Opener, show_all: bool = False) -> dict[str, Any]:
    """The ``ps --json`` document of the jobs ``ps`` (``-a``) lists, with each job's state in words."""
    store = jobs.store
    good, damaged = store.scan()
    now = time.time()
    records, hidden = shown([current(store, jobs.keep(r)).record for r in good], now, show_all=show_all)
    document = jobs_json(records, damaged=damaged)
    for job, record in zip(document["jobs"], records, strict=True):
        job["state_text"] = job_state_text(record, now)
        job["training"] = training_text(record, progress_of(record), now)
    document["hidden"] = hidden
    return document


def load(store: JobStore, job_id: str) -> JobRecord:
    """The job of this id (a page's address names its job by id only: a link stays that job's)."""
    if not JOB_ID.fullmatch(job_id):
        raise JobNotFound(f"no job {job_id!r}")
    return store.load(job_id)


def job_view(jobs: Opener, job_id: str) -> dict[str, Any]:
    """``ps JOB --json``'s document of the job, with what ``ps JOB`` prints beside it: its state in
    words, each node's stop guarantee and trouble, and the start-up watch."""
    seen = look(jobs.store, current(jobs.store, jobs.open(job_id)))
    record, now = seen.record, time.time()
    document: dict[str, Any] = jobs_json([record], hosts=seen.statuses, gpus=seen.gpus)["jobs"][0]
    document["state_text"] = job_state_text(record, now)
    document["training"] = training_text(record, progress_of(record, seen.statuses), now)  # as ps JOB words it
    notes: dict[int, list[str]] = {}
    for rank, error in seen.errors.items():
        notes.setdefault(rank, []).append(safe(error.one_line(), colour=False))
    for rank, answer in seen.statuses.items():
        if (answer.get("state") or {}).get("state") == "absent":
            continue
        if answer.get("records_gone"):
            notes.setdefault(rank, []).append(safe(str(answer["state"].get("error")), colour=False))
            continue
        notes.setdefault(rank, []).extend(stop_guarantee(answer.get("fallbacks") or ()))
        if answer.get("degraded"):
            notes[rank].append(f"degraded: {answer['degraded']}")
    document["notes"] = {str(rank): lines for rank, lines in sorted(notes.items())}
    attempt = record.attempts[-1] if record.attempts else None
    document["startup"] = None
    if not record.finished and attempt is not None and len(seen.statuses) == len(record.nodes):
        document["startup"] = progress_text(
            {n.rank: n.host for n in record.nodes},
            {r: decode_status(record.nodes[r].host, a["state"]) for r, a in seen.statuses.items()
             if isinstance(a.get("state"), dict)}, attempt.started, now)
    return document


def progress_view(store: JobStore, job_id: str) -> dict[str, Any]:
    """The training's progress as the record keeps it (no host asked: read at every change the owner
    records), with ``training`` worded as ``ps`` words it: what the progress fragment shows."""
    record, now = load(store, job_id), time.time()
    return {"id": record.job_id, "progress": jobs_json([record])["jobs"][0]["progress"],
            "training": training_text(record, progress_of(record), now)}


def marks(record: JobRecord) -> tuple[tuple[Any, ...], Any]:
    """What a job page's stream compares to tell a change of the job's state (its summary is read
    again), a new attempt, or new progress only (its fragment alone is)."""
    nodes = tuple((n.state, n.exit_code, n.hung_since, n.unreachable_since) for n in record.nodes)
    last = record.attempts[-1] if record.attempts else None
    shown = (record.state, record.attempt, nodes, last.state if last else None, last.root_cause if last else None,
             record.restart_at)
    return shown, record.progress


def marks_digest(record: JobRecord) -> str:
    """A short name of ``marks``: a page carries the one it showed to its stream, which tells the page
    at once if the job changed between the page's reading and the stream's start."""
    return hashlib.sha256(repr(marks(record)).encode()).hexdigest()[:16]


def log_search(job: Opened, attempt: int, nodes: Sequence[int], query: str,
               ranks: Iterable[int] | None = None, limit: int = SEARCH_LIMIT) -> list[tuple[int, str]]:
    """The last ``limit`` lines of the attempt's logs (of ``nodes``; of ``ranks`` if given) that hold
    ``query`` (case-insensitive), read from the whole log as ``logs`` reads it."""
    wanted = query.lower()
    keep = None if ranks is None else frozenset(ranks)
    found: list[tuple[int, str]] = []
    for node in nodes:
        try:
            for chunk in read_log_chunks(job, node, attempt):
                for line in chunk.data.splitlines():
                    if wanted in line.lower() and (keep is None or split_rank(line)[0] in keep):
                        found.append((node, safe(line, colour=False)))
        except ClusterrunError as exc:
            found.append((node, f"(node {node}: {safe(exc.one_line(), colour=False)})"))
        del found[:-limit]
    return found[-limit:]


def stop(jobs: Opener, job_id: str) -> tuple[Downed, list[str]]:
    """``clusterrun down JOB``'s stop (``life.down``), with each node's report as ``down`` prints it."""
    downed = down(jobs.store, jobs.open(job_id))
    reports = [downed.reports[rank] for rank in sorted(downed.reports)]
    lines = [stop_text(report) for report in reports]
    lines += [caveat for caveat in (stop_caveat(r) for r in reports) if caveat is not None][:1]  # once, as `down`
    return downed, [safe(line, colour=False) for line in lines]
