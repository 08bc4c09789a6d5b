"""What ``ps`` lists and what scripts read: which jobs are shown, and the versioned JSON documents.

Pure: records and plans in, lists and JSON data out (the clock is passed in). ``docs/json.md``
specifies the documents (``SCHEMA``); a change that removes or renames a field, or changes its
meaning, raises ``SCHEMA``; adding a field does not. A record's own part of a job's document is
``store.jobjson``'s (a notification sends it too); here it gets what the hosts said.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clusterrun.config.environment import mask_env
from clusterrun.config.nodesets import fold, fold_ranks
from clusterrun.core import events, timings
from clusterrun.core.errors import DamagedRecord
from clusterrun.core.events import JobState, NodeGpus, NodeState
from clusterrun.core.progress import Progress, duration_words
from clusterrun.core.terminal import safe
from clusterrun.run.plan import LaunchPlan
from clusterrun.store.jobjson import SCHEMA, ended_at, iso, node_state, record_json
from clusterrun.store.jobs import JobRecord, NodeRecord
from clusterrun.views.gpus import BROKEN, MISSING
from clusterrun.views.gpus import cell as gpu_cell

if TYPE_CHECKING:
    from clusterrun.run.interfaces import Interface
    from clusterrun.sync.copy import SyncReport
from clusterrun.core.protocol import decode_status
from clusterrun.run.startwatch import waiting_for

RECENT = 24 * 3600  # `ps` shows ended jobs for a day after they ended (`ps -a`: all of them)


def shown(records: Iterable[JobRecord], now: float, *, show_all: bool = False,
          states: Sequence[str] = ()) -> tuple[list[JobRecord], int]:
    """The jobs ``ps`` lists, and how many ended jobs it leaves out. By default: the unfinished
    ones and those that ended in the last ``RECENT`` seconds; ``show_all``: every job; ``states``:
    every job (of any age) in one of these states."""
    kept, hidden = [], 0
    for record in records:
        if states:
            if str(record.state) in states:
                kept.append(record)
            continue
        end = ended_at(record)
        if show_all or end is None or now - end <= RECENT:
            kept.append(record)
        else:
            hidden += 1
    return kept, hidden


def node_state_text(node: NodeRecord, now: float) -> str:
    """``node_state`` in words: ``unreachable since 16:04:05Z`` (``events.unreachable_text``),
    ``hung since 16:10:00Z``."""
    shown = node_state(node)
    if shown == NodeState.HUNG:
        return events.hung_text(node.hung_since, now)
    return events.unreachable_text(node.unreachable_since, now) if shown == NodeState.UNREACHABLE else shown


def exit_text(node: NodeRecord) -> str:
    """``ps JOB``'s EXIT cell: the exit code, or for a node clusterrun stopped the signal it was
    stopped with (``SIGTERM``; ``SIGKILL`` after the grace): its exit code was our doing."""
    if node.state is NodeState.STOPPED and (node.exit_code is not None or node.signal):
        return events.signal_name(node.signal) if node.signal else "SIGTERM"
    if node.signal:
        return events.signal_name(node.signal)
    return "-" if node.exit_code is None else str(node.exit_code)


def outcome_text(record: JobRecord) -> str:
    """How an ended job ended, as ``wait`` says it in its one line: ``job ID failed (attempt 1);
    root cause: <the first line of what ps JOB shows as the root cause>``."""
    last = record.attempts[-1] if record.attempts else None
    cause = last.root_cause.split("\n", 1)[0] if last is not None and last.root_cause else None
    text = f"job {record.job_id} {record.state} (attempt {record.attempt})"
    return text + (f"; root cause: {cause}" if cause else "")


def unreachable_ranks(record: JobRecord) -> list[int]:
    """The nodes of an unfinished job that are shown unreachable (``node_state``), by rank."""
    return [] if record.finished else [n.rank for n in record.nodes if node_state(n) == NodeState.UNREACHABLE]


def job_state_text(record: JobRecord, now: float) -> str:
    """The job's state as ``ps`` and ``wait`` word it: ``running``, or, while nodes of an unfinished
    job are unreachable, ``running; node 1 unreachable since 16:04:05Z`` (``nodes 1, 3 ...``:
    since the first of them); else while the job hangs, ``running; hung since 16:10:00Z``. A
    running attempt with a node failed or lost is ``failing``: its other nodes are being stopped
    (a host that cannot be reached is waited for, ``unreachable.WAIT``)."""
    lost = [record.nodes[rank] for rank in unreachable_ranks(record)]
    state = str(record.state)
    if record.state in (JobState.STARTING, JobState.RUNNING) and any(
            NodeState(n.state).fails_the_attempt for n in record.nodes):
        state = "failing"
    unwatched = (record.slurm or {}).get("unwatched") if not record.finished else None
    if unwatched:  # a Slurm job whose `up` is gone (slurmjob.refresh)
        return f"{record.state}; {unwatched}"
    if record.state is JobState.RESTARTING and record.restart_at is not None:
        return f"restarting: attempt {record.attempt + 1} starts in {max(0, record.restart_at - now):.0f} s"
    hung = [n for n in record.nodes if node_state(n) == NodeState.HUNG] if not record.finished else []
    if hung and not lost:  # the job hangs: every node that runs is hung since the same time
        return f"{state}; {events.hung_text(min(n.hung_since or now for n in hung), now)}"
    if not lost:
        return state
    since = min(n.unreachable_since for n in lost if n.unreachable_since is not None)
    which = f"node {lost[0].rank}" if len(lost) == 1 else f"nodes {', '.join(str(n.rank) for n in lost)}"
    return f"{state}; {which} {events.unreachable_text(since, now)}"


def header_text(record: JobRecord, now: float) -> str:
    """``ps JOB``'s first line: ``job ID (name): running, attempt 2, train.py --lr 3``; during a
    restart's backoff the state names the next attempt (``restarting: attempt 3 starts in 25 s``)."""
    state = job_state_text(record, now)
    attempt = "" if state.startswith("restarting: ") else f", attempt {record.attempt}"
    return f"job {record.job_id} ({record.name}): {state}{attempt}, {record.script} {shlex.join(record.script_args)}" \
        .rstrip()


def training_text(record: JobRecord, progress: Progress | None, now: float) -> str | None:
    """``step 450/1000 (45%), 45 steps/s, loss 2.31, ETA 12 s``, and how old the reading is when it is
    not the current attempt's or the job has ended (``ps JOB``, the summary)."""
    if progress is None:
        return None
    text = progress.text() if not record.finished else dataclasses.replace(progress, eta_seconds=None).text()
    if progress.attempt is not None and progress.attempt != record.attempt:
        text += f" (attempt {progress.attempt})"
    elif progress.updated is not None and not record.finished and now - progress.updated >= 60:
        text += f" (read {duration_words(now - progress.updated)} ago)"
    return text


COMPACT = 16  # `ps JOB` of more nodes than this shows each run of nodes alike as one row


def node_rows(record: JobRecord, now: float, errors: Mapping[int, str],
              gpus: Mapping[int, NodeGpus] | None = None) -> list[tuple[str, ...]]:
    """``ps JOB``'s node table, its header first: a row per node, or, past ``COMPACT`` nodes, a
    row per run of consecutive nodes alike (state, exit, error; a GPU mark) with their ranks and
    hosts as node sets (``0-61``, ``sim[01-62]``). The GPUS column is there once a host has nvidia-smi."""
    gpus = gpus or {}
    with_gpus = any(not g.missing for g in gpus.values())
    rows = [("NODE", "HOST", "STATE", "PID", "EXIT", "ERROR", *(("GPUS",) if with_gpus else ()))]
    runs: list[tuple[tuple[str, ...], list[NodeRecord]]] = []
    for n in record.nodes:
        use = gpu_cell(gpus.get(n.rank))
        kind = use if use in ("", MISSING, BROKEN) else "read"
        alike = (node_state_text(n, now), exit_text(n),
                 n.error or errors.get(n.rank, ""), kind)
        if runs and len(record.nodes) > COMPACT and runs[-1][0] == alike:
            runs[-1][1].append(n)
        else:
            runs.append((alike, [n]))
    for (state, exit_code, error, _kind), nodes in runs:
        first = nodes[0]
        ranks = [n.rank for n in nodes]
        readings = [gpus[r] for r in ranks if r in gpus]
        use = gpu_cell(readings[0]) if len(readings) == 1 else gpu_cell(merged(readings)) if readings else ""
        one = len(nodes) == 1
        rows.append((fold_ranks(ranks).split(" ", 1)[1], first.host if one else fold([n.host for n in nodes]),
                     state, str(first.pid or "-") if one else "-", exit_code, safe(error, colour=False),
                     *((use,) if with_gpus else ())))
    return rows


def merged(readings: Sequence[NodeGpus]) -> NodeGpus:
    """The readings of several nodes as one (``ps``'s row of a run of nodes): every GPU; a mark if one has one."""
    first = readings[0]
    return NodeGpus(first.node, host=first.host, gpus=tuple(g for r in readings for g in r.gpus),
                    missing=any(r.missing for r in readings),
                    problem=next((r.problem for r in readings if r.problem), ""))


def job_json(record: JobRecord, hosts: Mapping[int, Mapping[str, Any]] | None = None,
             gpus: Mapping[int, NodeGpus] | None = None, hang_report: str | None = None) -> dict[str, Any]:
    """One job of ``ps --json`` (schema ``SCHEMA``): the record's document (``jobjson.record_json``)
    with what each node's host said of it (``hosts``, ``ps JOB --json``, by rank), its GPUs
    (``gpus``) and ``hang_report``, the file with the attempt's hang report, if one was saved."""
    document = record_json(record, hosts)
    for node, n in zip(document["nodes"], record.nodes, strict=True):
        if hosts is not None and n.rank in hosts:
            answer = hosts[n.rank]
            node["containment"] = answer.get("containment")
            node["fallbacks"] = list(answer.get("fallbacks") or [])
            node["degraded"] = answer.get("degraded")
            node["waiting"] = waiting_for(decode_status(n.host, answer["state"])) if answer.get("state") else None
            node["hang_report"] = hang_report if n.hung_since is not None else None
        if gpus is not None and n.rank in gpus:  # a host whose GPU reading failed still said how its node is
            reading = gpus[n.rank]
            node["gpus"] = {"found": not reading.missing, "problem": reading.problem,
                            "gpus": [dataclasses.asdict(g) for g in reading.gpus]}
    return document


def stop_guarantee(fallbacks: Sequence[str]) -> list[str]:
    """How a stop will be verified on a host, then what else the host lacks (its probe's or status's fallbacks)."""
    if any(f.startswith("no cgroup") for f in fallbacks):
        first = ("a stop sweeps (no cgroup: processes that leave the job's tree, session and environment "
                 "cannot be seen)")
    else:
        first = "a stop is verified by the attempt's cgroup"
    return [first, *(f"fallback: {f}" for f in fallbacks)]


def history_rows(record: JobRecord, now: float) -> list[tuple[str, ...]]:
    """``ps JOB``'s table of the job's attempts: when each started, for how long it ran, how it
    ended, who restarted it (the policy, the start-up retry, ``on_hang``, the user) and its root cause."""
    spared = any(a.replaced for a in record.attempts)  # the column only where a spare ran
    rows: list[tuple[str, ...]] = [("ATTEMPT", "STARTED", "DURATION", "STATE", "RESTARTED",
                                    *(("SPARES",) if spared else ()), "ROOT CAUSE")]
    for a in record.attempts:
        duration = (a.ended if a.ended is not None else now) - a.started
        cause = (a.root_cause or "").split("\n", 1)[0]
        swaps = ", ".join(f"{new} for {old}" for old, new in (a.replaced or {}).items()) or "-"
        rows.append((str(a.attempt), iso(a.started) or "-", f"{duration:.0f} s", str(a.state), a.restart or "-",
                     *((swaps,) if spared else ()), cause or "-"))
    return rows


def phase_lines(record: JobRecord) -> list[str]:
    """``ps JOB``'s lines on how each attempt came to run (``timings.phases_text``), a restart's
    from its last attempt's failure: ``attempt 2: failure seen → stopped 0.21 s → ...``."""
    return [f"attempt {a.attempt}: {text}" for a in record.attempts
            if (text := timings.phases_text(a.phases, a.started)) is not None]


def table_text(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as aligned text lines, the first the header (``ps``'s tables, the dashboard's history)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def jobs_json(records: Iterable[JobRecord], hosts: Mapping[int, Mapping[str, Any]] | None = None,
              damaged: Iterable[DamagedRecord] = (), gpus: Mapping[int, NodeGpus] | None = None,
              hang_report: str | None = None) -> dict[str, Any]:
    """The ``ps --json`` document: ``{"schema": SCHEMA, "jobs": [...], "damaged": [...]}``, the
    damaged records with their path, what is wrong and the fix."""
    return {"schema": SCHEMA, "jobs": [job_json(r, hosts, gpus, hang_report) for r in records],
            "damaged": [{"id": d.job_id, "path": d.path, "reason": d.reason, "fix": d.hint} for d in damaged]}


def shown_env(env: Mapping[str, str], secret_env: Iterable[str] = ()) -> dict[str, str]:
    """The environment as output may show it (``up --dry-run``, text and JSON): secret values
    masked (``environment.mask_env``)."""
    return mask_env(env, secret_env)


def _sync_json(report: SyncReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {"source": report.source, "to": report.root, "files": report.copied, "bytes": report.bytes,
            "touched": report.touched, "other": report.other, "unchanged": report.unchanged, "via": report.via or None}


def plan_json(plan: LaunchPlan, fallbacks: Mapping[int, Sequence[str]], interfaces: Sequence[Interface] = (),
              syncs: Mapping[int, SyncReport] | None = None, set_up: Mapping[int, str] | None = None,
              skipped: Mapping[int, str] | None = None) -> dict[str, Any]:
    """The ``up --dry-run --json`` document (schema ``SCHEMA``): what each node would run, with what
    the text form shows besides: its setup (and whether it ran: the job's interpreter after it,
    ``set_up``, or why not, ``skipped``), its network interface and what a sync would copy."""
    def setup_ran(rank: int) -> dict[str, Any] | None:
        if set_up and rank in set_up:
            return {"ran": True, "python": set_up[rank], "why_not": None}
        return {"ran": False, "python": None, "why_not": skipped[rank]} if skipped and rank in skipped else None

    def network(rank: int) -> dict[str, Any] | None:
        if rank >= len(interfaces):
            return None
        i = interfaces[rank]
        return {"interface": i.name, "address": i.address, "why": i.why, "sets": sorted(i.env),
                "yours": sorted(i.user_set)}

    return {
        "schema": SCHEMA,
        "job": plan.job_id,
        "name": plan.name,
        "script": plan.script,
        "args": list(plan.script_args),
        "master": {"addr": plan.master_addr, "port": plan.master_port},
        "world_size": plan.world_size,
        "nodes": [{"rank": n.rank, "host": n.host.host, "transport": n.host.transport, "nproc": n.nproc,
                   "ranks": [n.first_rank, n.first_rank + n.nproc - 1], "cwd": n.cwd,
                   "env": shown_env(n.env, plan.secret_env), "argv": list(n.argv),
                   "stop": "sweep" if any(f.startswith("no cgroup") for f in fallbacks.get(n.rank) or ())
                   else "cgroup",
                   "fallbacks": list(fallbacks.get(n.rank) or ()), "setup": list(n.host.setup),
                   "setup_ran": setup_ran(n.rank), "network": network(n.rank),
                   "sync": _sync_json((syncs or {}).get(n.rank))} for n in plan.nodes],
    }


STATES = [str(s) for s in JobState]
