"""What ``ps`` lists and what scripts read: which jobs are shown, and the versioned JSON documents.

Pure: records and plans in, lists and JSON data out (the clock is passed in). ``docs/json.md``
specifies the documents (``SCHEMA``); a change that removes or renames a field, or changes its
meaning, raises ``SCHEMA``; adding a field does not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from clusterrun import events
from clusterrun.environment import mask_env
from clusterrun.errors import DamagedRecord
from clusterrun.events import JobState, NodeState
from clusterrun.jobs import JobRecord, NodeRecord
from clusterrun.plan import LaunchPlan
from clusterrun.protocol import decode_status
from clusterrun.startwatch import waiting_for

SCHEMA = 1
RECENT = 24 * 3600  # `ps` shows ended jobs for a day after they ended (`ps -a`: all of them)


def ended_at(record: JobRecord) -> float | None:
    """When the job ended (its last attempt's end; its creation for a record that lacks it), or
    None while it is unfinished."""
    if not record.finished:
        return None
    last = record.attempts[-1] if record.attempts else None
    return (last.ended if last is not None else None) or record.created


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


def node_state_text(node: NodeRecord, now: float) -> str:
    """``node_state`` in words: ``unreachable since 16:04:05Z`` (``events.unreachable_text``),
    ``hung since 16:10:00Z``."""
    shown = node_state(node)
    if shown == NodeState.HUNG:
        return events.hung_text(node.hung_since, now)
    return events.unreachable_text(node.unreachable_since, now) if shown == NodeState.UNREACHABLE else shown


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
    since the first of them); else while some are hung, ``running; node 1 hung since 16:10:00Z``."""
    lost = [record.nodes[rank] for rank in unreachable_ranks(record)]
    hung = [n for n in record.nodes if node_state(n) == NodeState.HUNG] if not record.finished else []
    if hung and not lost:
        which = f"node {hung[0].rank}" if len(hung) == 1 else f"nodes {', '.join(str(n.rank) for n in hung)}"
        return f"{record.state}; {which} {events.hung_text(min(n.hung_since or now for n in hung), now)}"
    if not lost:
        return str(record.state)
    since = min(n.unreachable_since for n in lost if n.unreachable_since is not None)
    which = f"node {lost[0].rank}" if len(lost) == 1 else f"nodes {', '.join(str(n.rank) for n in lost)}"
    return f"{record.state}; {which} {events.unreachable_text(since, now)}"


def job_json(record: JobRecord, hosts: Mapping[int, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """One job of ``ps --json`` (schema ``SCHEMA``). The environment is left out on purpose (it may
    hold secrets); so are the record's internals (the plan, viewers' offsets, the hosts file's text).
    ``hosts``: what each node's host said of it (``ps JOB --json``), by rank."""
    nodes = []
    for n in record.nodes:
        node: dict[str, Any] = {"rank": n.rank, "host": n.host, "state": node_state(n), "pid": n.pid,
                                "exit_code": n.exit_code, "signal": n.signal, "error": n.error,
                                "unreachable_since": iso(n.unreachable_since), "hung_since": iso(n.hung_since),
                                "last_state": str(n.state)}
        if hosts is not None and n.rank in hosts:
            answer = hosts[n.rank]
            node["containment"] = answer.get("containment")
            node["fallbacks"] = list(answer.get("fallbacks") or [])
            node["degraded"] = answer.get("degraded")
            node["waiting"] = waiting_for(decode_status(n.host, answer["state"])) if answer.get("state") else None
            node["hang_report"] = (answer.get("state") or {}).get("hang_report")
        nodes.append(node)
    return {
        "id": record.job_id,
        "name": record.name,
        "state": str(record.state),
        "attempt": record.attempt,
        "created": iso(record.created),
        "ended": iso(ended_at(record)),
        "hosts_file": record.hosts_file,
        "script": record.script,
        "args": list(record.script_args),
        "attempts": [{"attempt": a.attempt, "state": str(a.state), "started": iso(a.started),
                      "ended": iso(a.ended), "master_port": a.master_port, "root_cause": a.root_cause,
                      "cause": a.cause, "fix": a.fix}
                     for a in record.attempts],
        "nodes": nodes,
    }


def jobs_json(records: Iterable[JobRecord], hosts: Mapping[int, Mapping[str, Any]] | None = None,
              damaged: Iterable[DamagedRecord] = ()) -> dict[str, Any]:
    """The ``ps --json`` document: ``{"schema": SCHEMA, "jobs": [...], "damaged": [...]}``, the
    damaged records with their path, what is wrong and the fix."""
    return {"schema": SCHEMA, "jobs": [job_json(r, hosts) for r in records],
            "damaged": [{"id": d.job_id, "path": d.path, "reason": d.reason, "fix": d.hint} for d in damaged]}


def shown_env(env: Mapping[str, str], secret_env: Iterable[str] = ()) -> dict[str, str]:
    """The environment as output may show it (``up --dry-run``, text and JSON): secret values
    masked (``environment.mask_env``)."""
    return mask_env(env, secret_env)


def plan_json(plan: LaunchPlan, fallbacks: Mapping[int, Sequence[str]]) -> dict[str, Any]:
    """The ``up --dry-run --json`` document (schema ``SCHEMA``): what each node would run."""
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
                   "fallbacks": list(fallbacks.get(n.rank) or ())} for n in plan.nodes],
    }


STATES = [str(s) for s in JobState]
