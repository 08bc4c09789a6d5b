"""A job's record as the versioned JSON document scripts read: one job of ``ps --json``, and what a
notification's command gets on stdin.

Pure: a record in, JSON data out. ``docs/json.md`` specifies the document (``SCHEMA``); a change
that removes or renames a field, or changes its meaning, raises ``SCHEMA``; adding a field does
not. ``views.joblist`` adds what the hosts said (``ps JOB --json``) to each node.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clusterrun.core import events
from clusterrun.core.events import JobState, NodeState
from clusterrun.core.progress import Progress
from clusterrun.store.jobs import JobRecord, NodeRecord

SCHEMA = 1


def ended_at(record: JobRecord) -> float | None:
    """When the job ended (its last attempt's end; its creation for a record that lacks it), or
    None while it is unfinished."""
    if not record.finished:
        return None
    last = record.attempts[-1] if record.attempts else None
    return (last.ended if last is not None else None) or record.created


def iso(timestamp: float | None) -> str | None:
    """``2026-11-23T16:04:05Z`` (``events.iso``), or None."""
    return None if timestamp is None else events.iso(timestamp)


def node_state(node: NodeRecord) -> str:
    """The node's state as ``ps`` and ``ps --json`` give it: ``unreachable`` while its host could
    not be reached when last asked and it had not ended (whatever it was doing then is not known
    now), else its state in the record."""
    if node.unreachable_since is not None and not NodeState(node.state).is_terminal:
        return str(NodeState.UNREACHABLE)
    if node.hung_since is not None and node.state is NodeState.RUNNING:
        return str(NodeState.HUNG)
    return str(node.state)


def progress_of(record: JobRecord, hosts: Mapping[int, Mapping[str, Any]] | None = None) -> Progress | None:
    """The training's progress: what node 0's host says now (``hosts``, ``ps JOB``), else the record's last
    reading, which may come from an earlier attempt (a resumed run goes on from its step); with the loss
    curves of the attempts before (the record's)."""
    state = (hosts or {}).get(0, {}).get("state")
    fresh = Progress.from_json(state.get("progress"), record.attempt) if isinstance(state, dict) else None
    recorded = Progress.from_json(record.progress)
    return fresh.after(recorded) if fresh is not None else recorded


def record_json(record: JobRecord, hosts: Mapping[int, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """One job of ``ps --json`` as its record has it. The environment is left out on purpose (it may
    hold secrets); so are the record's internals (the plan, viewers' offsets, the hosts file's text).
    ``hosts``: what each node's host said of it, by rank (node 0's progress is read from it)."""
    return {
        "id": record.job_id,
        "name": record.name,
        "state": str(record.state),
        "attempt": record.attempt,
        "created": iso(record.created),
        "ended": iso(ended_at(record)),
        "hosts_file": record.hosts_file,
        "engine": record.engine,
        "slurm": ({k: record.slurm.get(k) for k in ("job", "step", "controller", "unwatched")}
                  if record.slurm is not None else None),
        "script": record.script,
        "args": list(record.script_args),
        "restart_at": iso(record.restart_at) if record.state is JobState.RESTARTING else None,
        "attempts": [{"attempt": a.attempt, "state": str(a.state), "started": iso(a.started),
                      "ended": iso(a.ended), "master_port": a.master_port, "root_cause": a.root_cause,
                      "cause": a.cause, "fix": a.fix, "restarted": a.restart, "replaced": a.replaced,
                      "duration": round(a.ended - a.started, 3) if a.ended is not None else None,
                      "phases": {k: round(v, 3) for k, v in (a.phases or {}).items()}}  # time.time()
                     for a in record.attempts],
        "nodes": [{"rank": n.rank, "host": n.host, "state": node_state(n), "pid": n.pid, "exit_code": n.exit_code,
                   "signal": n.signal, "error": n.error, "unreachable_since": iso(n.unreachable_since),
                   "hung_since": iso(n.hung_since), "last_state": str(n.state)} for n in record.nodes],
        "notifications": [{"id": f"{record.job_id}:{key}", "state": n.get("state"), "exit_code": n.get("code"),
                           "error": n.get("error") or None} for key, n in record.notices.items()],
        "progress": _progress_json(progress_of(record, hosts)),
    }


def _progress_json(progress: Progress | None) -> dict[str, Any] | None:
    if progress is None:
        return None
    shown = progress.to_json()
    del shown["curve"], shown["earlier"]  # as one series: [[attempt, step, loss], ...], the earliest first
    curve = [[a, int(step) if step == int(step) else step, loss] for a, step, loss in progress.series]
    return dict(shown, updated=iso(progress.updated), loss_curve=curve)
