"""Jobs found again on their hosts: ``ps/logs/attach/down/wait/restart/rm --hosts HOSTS.yaml`` on a
controller that has no record of them (another machine, another ``XDG_STATE_HOME``, a record removed).

Every host of the hosts file is asked for the jobs under its state dir (the agent's ``jobs``);
a job is adopted when each node rank K of it is on host K of the file (the file that started it,
or one listing the same hosts in the same order) and its hosts said what it runs (``about``,
kept by ``start``). The record made from their answers is the one ``up`` would have written, with
``adopted`` set: this controller does not start a monitor for it (the controller that started it
may still be watching it, and two owners could both start a retry) until it starts an attempt of
it itself (``restart``).

``ask_hosts`` talks to the hosts; ``records_from`` is pure.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from clusterrun.agent.wire import JobsRequest
from clusterrun.config.hostsfile import ClusterSpec
from clusterrun.core import parallel
from clusterrun.core.errors import ClusterrunError
from clusterrun.core.events import JobState, NodeState
from clusterrun.core.protocol import ProtocolError, decode_status
from clusterrun.run.orchestrator import node_state_of
from clusterrun.store.jobs import AttemptRecord, JobRecord, NodeRecord
from clusterrun.transports import transport_for

Answer = dict[str, Any] | ClusterrunError


def ask_hosts(spec: ClusterSpec, ssh_config: str | None) -> dict[int, Answer]:
    """Each host's ``jobs`` answer, by its rank in the hosts file, or the error that kept it away."""
    def one(rank: int) -> Answer:
        transport = transport_for(spec.hosts[rank], ssh_config=ssh_config)
        try:
            transport.connect()
            return transport.call(JobsRequest(state_dir=spec.state_dir))
        except ClusterrunError as exc:
            return exc
        except OSError as exc:
            return ClusterrunError(f"{spec.hosts[rank].host}: {exc}")
        finally:
            transport.close()

    ranks = range(len(spec.hosts))
    with parallel.threads(min(32, len(spec.hosts)), "clusterrun-discover") as pool:
        return dict(zip(ranks, parallel.map_all(pool, one, ranks), strict=True))


def _node_state(host: str, entry: Mapping[str, Any]) -> NodeState:
    try:
        return node_state_of(decode_status(host, entry.get("state"), "jobs answer's state"))
    except ProtocolError:
        return NodeState.LOST


def _job_state(states: list[NodeState]) -> JobState:
    state = JobState.of_nodes(states)
    if state is not None:
        return state
    return JobState.RUNNING if NodeState.RUNNING in states else JobState.STARTING


def records_from(spec: ClusterSpec, hosts_file: str, hosts_text: str, answers: Mapping[int, Answer], *,
                 known: set[str], local_cwd: str, ssh_config: str | None) -> tuple[list[JobRecord], list[str]]:
    """The records of the jobs found on the hosts that this controller does not know (``known``),
    and a line for each job found that could not be adopted (and for each host that did not answer)."""
    n = len(spec.hosts)
    notes = [f"{spec.hosts[rank].host}: could not be asked for its jobs: {a.render()}"
             for rank, a in sorted(answers.items()) if isinstance(a, ClusterrunError)]
    # job -> rank -> attempt -> entry, keeping only node K as found on host K
    found: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    foreign: dict[str, set[int]] = {}
    listed: set[str] = set()
    for rank, answer in answers.items():
        if isinstance(answer, ClusterrunError):
            continue
        for entry in answer.get("jobs") or []:
            job, node, attempt = entry.get("job"), entry.get("node"), entry.get("attempt")
            if not isinstance(job, str) or not isinstance(node, int) or not isinstance(attempt, int):
                continue
            listed.add(job)
            if node >= n:
                foreign.setdefault(job, set()).add(node)
            elif node == rank:
                found.setdefault(job, {}).setdefault(rank, {})[attempt] = entry
    records = []
    unreachable = [rank for rank, a in answers.items() if isinstance(a, ClusterrunError)]
    for job in sorted(listed):
        if job in known:
            continue
        nodes = found.get(job, {})
        missing = sorted(set(range(n)) - set(nodes))
        if job in foreign:
            notes.append(f"job {job}: has node {max(foreign[job])}, more nodes than {hosts_file} lists; not adopted")
            continue
        if missing and set(missing) <= set(unreachable):
            notes.append(f"job {job}: node(s) {', '.join(map(str, missing))} on unreachable hosts; not adopted")
            continue
        if missing:
            notes.append(f"job {job}: no node {missing[0]} on {spec.hosts[missing[0]].host}: started with another "
                         f"hosts file than {hosts_file}; not adopted")
            continue
        attempt = max(max(attempts) for attempts in nodes.values())
        current = {rank: attempts.get(attempt) for rank, attempts in nodes.items()}
        first = current[0]
        about = first.get("about") if first else None
        if not isinstance(about, dict) or about.get("nnodes") != n or any(e is None for e in current.values()):
            notes.append(f"job {job}: its hosts do not say how it was started (an older clusterrun, or an attempt "
                         "still starting); not adopted")
            continue
        records.append(_record(spec, hosts_file, hosts_text, job, attempt, nodes, about,
                               local_cwd=local_cwd, ssh_config=ssh_config))
    return records, notes


def _record(spec: ClusterSpec, hosts_file: str, hosts_text: str, job: str, attempt: int,
            nodes: Mapping[int, Mapping[int, dict[str, Any]]], about: Mapping[str, Any], *,
            local_cwd: str, ssh_config: str | None) -> JobRecord:
    """The record ``up`` would have written for the job, from its hosts' answers."""
    n = len(spec.hosts)
    current = [nodes[rank][attempt] for rank in range(n)]
    attempts = []
    for k in range(1, attempt + 1):
        entries = [nodes[rank][k] for rank in range(n) if k in nodes[rank]]
        states = [_node_state(spec.hosts[e["node"]].host, e) for e in entries]
        state = _job_state(states) if len(entries) == n else JobState.FAILED  # a node never started
        started = min((e.get("started") or 0.0 for e in entries), default=0.0)
        ends = [(e.get("state") or {}).get("ended_at") for e in entries]
        ended = max((t for t in ends if isinstance(t, (int, float))), default=None) if state.is_terminal else None
        port = (entries[0].get("about") or {}).get("master_port") if entries else None
        attempts.append(AttemptRecord(k, started=started, master_port=int(port or 0), state=state,
                                      ended=ended if ended is not None or not state.is_terminal else started))
    node_records = []
    for rank, entry in enumerate(current):
        status = entry.get("state") or {}
        node_records.append(NodeRecord(rank, spec.hosts[rank].host, _node_state(spec.hosts[rank].host, entry),
                                       pid=(status.get("torchrun") or {}).get("pid"),
                                       exit_code=status.get("exit_code"), signal=status.get("signal"),
                                       error=status.get("error")))
    env0 = current[0].get("env") or {}
    name, script = str(about.get("name") or job), str(about.get("script") or "")
    script_args, grace = [str(a) for a in about.get("script_args") or []], float(about.get("grace") or 10.0)
    plan: dict[str, Any] = {
        "job_id": job, "name": name, "master_addr": about.get("master_addr"),
        "master_port": int(about.get("master_port") or 0), "state_dir": spec.state_dir,
        "grace": grace, "script": script, "script_args": script_args,
        "nodes": [{"rank": rank, "host": spec.hosts[rank].host, "nproc": spec.hosts[rank].nproc,
                   "first_rank": int(e.get("first_rank") or 0), "argv": list(e.get("argv") or []),
                   "env": dict(e.get("env") or {}), "cwd": e.get("cwd")} for rank, e in enumerate(current)]}
    return JobRecord(
        job_id=job, name=name, created=attempts[0].started, hosts_file=os.path.abspath(hosts_file),
        hosts_text=hosts_text, script=script, script_args=script_args,
        env_overrides={k: env0[k] for k in about.get("env_overrides") or [] if k in env0}, local_cwd=local_cwd,
        grace=grace, ssh_config=ssh_config, plan=plan, attempt=attempt, state=attempts[-1].state,
        attempts=attempts, nodes=node_records, adopted=True)
