"""The pieces of a recorded job on its hosts: its hosts file, status, the agents' stop, ``rm``'s removal
(its logs: ``logread``).

Every function here works from the job's record (``jobs.JobRecord``) and talks to the hosts
through the same transports and node agent as ``up``; none of them prints, and none changes the
job's recorded state: the attempt's life (checks, start, stop, its state) is owned by
``attempt.py`` and the owner's loop by ``runner.py``, both built from the pieces here.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from clusterrun.agent.wire import StackAnswer
from clusterrun.config.hostsfile import ClusterSpec, HostSpec
from clusterrun.core import parallel
from clusterrun.core.errors import ClusterrunError
from clusterrun.core.events import JobState, NodeGpus, StopReport
from clusterrun.core.protocol import NodeStatus, decode, decode_status
from clusterrun.life.logread import request as request  # re-exported: the owner (runner, gate) makes its
from clusterrun.life.logread import transport_factory as transport_factory  # transports by this name (a test seam)
from clusterrun.run.orchestrator import Emit, Job, Reconnect
from clusterrun.run.plan import plan_from_json
from clusterrun.run.stops import stop_node
from clusterrun.store.jobs import JobRecord, JobStore, restart_pending
from clusterrun.store.opened import Opened
from clusterrun.transports import Transport
from clusterrun.views.gpus import ask as ask_gpus
from clusterrun.views.gpus import only

if TYPE_CHECKING:  # `stack`'s grouping is imported by the function that uses it
    from clusterrun.diagnose.stacks import StackView


def follower(record: JobRecord, emit: Emit | None, *, owner: bool, follow_logs: bool, attempt: int | None = None,
             offsets: dict[int, int] | None = None, tail: int | None = None,
             ranks: Sequence[int] | None = None, reconnect: Reconnect | None = None, scrollback: int = 0,
             spec: ClusterSpec, transports: Callable[[HostSpec], Transport] | None = None) -> Job:
    """A ``Job`` that follows an attempt of the recorded job (the current one unless given);
    ``scrollback``: with ``offsets``, first the last lines before them (``LogLines(earlier=True)``);
    ``spec``: the record's hosts file (``Opened.spec``), as the command parsed it; ``owner``:
    the job's owner follows it (``--unreachable-timeout`` applies), not a viewer; ``transports``:
    the owner's, lent (``transports.lent``), else new ones."""
    plan = plan_from_json(record.plan, spec)
    job = Job(spec, record.script, record.script_args, job_id=record.job_id, name=record.name, emit=emit,
              grace=record.grace, attempt=attempt or record.attempt,
              transport_factory=transports or transport_factory(record),
              follow_logs=follow_logs, offsets=offsets, tail=tail, ranks=ranks,
              reconnect=reconnect or Reconnect(give_up_after=record.unreachable_timeout if owner else None),
              scrollback=scrollback)
    job.resume(plan)
    current = record.attempts[-1] if record.attempts and not record.finished else None
    if current is not None and current.attempt == job.attempt:  # its start-up watch counts from the start
        job.started_at = current.started
    return job


# -------------------------------------------------------------------------------- the monitor


def daemonize() -> None:
    """Fork once more so that the monitor is no session leader (it can never get a terminal) and
    the process that started it can reap the intermediate at once."""
    if os.fork() > 0:
        os._exit(0)


# ------------------------------------------------------------------------------------ status


def per_node(record: JobRecord, call: Callable[[Transport, int], Any], ranks: Sequence[int] | None = None, *,
             spec: ClusterSpec) -> dict[int, Any]:
    """``call(transport, rank)`` on every node in parallel; an exception is returned as the value.
    ``spec``: the job's hosts (``Opened.spec``), parsed once by the command."""
    factory = transport_factory(record)
    ranks = list(range(len(spec.hosts))) if ranks is None else list(ranks)
    transports = {rank: factory(spec.hosts[rank]) for rank in ranks}

    def one(rank: int) -> Any:
        try:
            transports[rank].connect()
            return call(transports[rank], rank)
        except ClusterrunError as exc:
            return exc
        except OSError as exc:
            return ClusterrunError(f"{spec.hosts[rank].host}: {exc}")
        finally:
            transports[rank].close()

    with parallel.threads(min(32, len(ranks)), "clusterrun-hosts") as pool:
        return dict(zip(ranks, parallel.map_all(pool, one, ranks), strict=True))


def status_of(transport: Transport, record: JobRecord, rank: int) -> NodeStatus:
    """What node ``rank``'s agent says of the current attempt (``absent`` if never started)."""
    answer = transport.call(request(record, rank, "status"))
    return decode_status(transport.name, answer.get("state"), "status answer's state")


def node_statuses(job: Opened, gpus: dict[int, NodeGpus] | None = None) -> dict[int, Any]:
    """Every node's ``status`` answer for the current attempt, or the error that kept it away.
    ``gpus``: filled with each reached node's GPUs (those its ``gpus:`` names), read by the same
    agent after the status."""
    record, spec = job.record, job.spec()

    def look(transport: Transport, rank: int) -> Any:
        if gpus is None:
            return transport.call(request(record, rank, "status"))
        session = transport.session()
        try:
            answer = session.call(request(record, rank, "status"))
            with contextlib.suppress(ClusterrunError, ValueError):  # the status stands; no GPU reading
                gpus[rank] = only(ask_gpus(session, rank), spec.hosts[rank].gpus)
            return answer
        finally:
            session.close()

    return per_node(record, look, spec=spec)


def stacks_of(record: JobRecord, nodes: Sequence[int] | None = None, ranks: Sequence[int] | None = None, *,
              native: bool = False, timeout: float = 10.0, looks: int = 1,
              apart: float = 3.0, spec: ClusterSpec) -> dict[int, StackAnswer | ClusterrunError]:
    """Every node's ``stack`` answer for the current attempt (``ranks``: only these global ranks),
    in parallel, or the error that kept it away; ``looks`` 2: each rank looked at twice, ``apart``
    seconds apart (whether its stacks moved, its CPU meanwhile); ``spec``: as ``per_node``'s."""
    wanted = None if ranks is None else list(ranks)

    def one(transport: Transport, rank: int) -> StackAnswer:
        answer = transport.call(request(record, rank, "stack", ranks=wanted, native=native, timeout=timeout,
                                        looks=looks, apart=apart))
        return decode(transport.name, StackAnswer, answer, "stack answer")

    return per_node(record, one, ranks=nodes, spec=spec)


def stacks_view(job: Opened, nodes: Sequence[int] | None = None, ranks: Sequence[int] | None = None, *,
                native: bool = False, timeout: float = 10.0) -> StackView:
    """The grouped stacks of the current attempt: of ``nodes`` (default all), only ``ranks``
    (default all: a node that holds none of them is not asked)."""
    record = job.record
    if ranks is not None:
        plan = plan_from_json(record.plan, job.spec())
        holding = [n.rank for n in plan.nodes if set(n.ranks) & set(ranks)]
        nodes = [n for n in (nodes if nodes is not None else holding) if n in holding]
    from clusterrun.diagnose.stacks import group

    answers = stacks_of(record, nodes, ranks, native=native, timeout=timeout, spec=job.spec()) if nodes != [] else {}
    return group(answers, {n.rank: n.host for n in record.nodes})


# ------------------------------------------------------------------------------- down, restart


def stop_job(record: JobRecord, *, spec: ClusterSpec, grace: float | None = None,
             by: str | None = None, ranks: Sequence[int] | None = None) -> dict[int, StopReport]:
    """The agent's verified stop of the current attempt on every node (or ``ranks``), in parallel
    (the piece ``attempt.stop`` records); ``spec``: the job's hosts file, parsed once by the
    command; ``by``: who, for the mark in the nodes' logs."""
    wait = record.grace if grace is None else grace
    state_dir = record.plan.get("state_dir")

    def one(transport: Transport, rank: int) -> StopReport:
        return stop_node(transport, rank, record.nodes[rank].host, job_id=record.job_id, attempt=record.attempt,
                         state_dir=state_dir, grace=wait, by=by)

    answers = per_node(record, one, ranks, spec=spec)
    return {rank: answer if isinstance(answer, StopReport) else StopReport(rank, record.nodes[rank].host,
                                                                           error=answer.render())
            for rank, answer in answers.items()}


POLL = 0.5  # how often a viewer reads the record while the job's owner decides and starts the next attempt


def after_attempt(look: Callable[[], JobRecord], attempt: int, restarting: Callable[[JobRecord], None],
                  gone: Callable[[], bool]) -> JobRecord | None:
    """What became of a job whose ``attempt`` a viewer followed to its end, as the job's owner decides:
    the record once the next attempt has started (``record.attempt > attempt``: the restart policy, a
    ``restart``, also one of a Slurm job that stopped its step first: ``restart_pending``) or the job
    has ended (``record.finished``); None when ``gone()`` first (the viewer
    left). ``look()``: the record as the viewer reads it now; ``restarting(record)``: once, as soon as
    the job goes on (its backoff begins, or the next attempt has started)."""
    said = False
    while not gone():
        record = look()
        if record.attempt > attempt or record.state is JobState.RESTARTING or restart_pending(record):
            if not said:
                restarting(record)
                said = True
            if record.attempt > attempt:
                return record
        elif record.finished:
            return record
        time.sleep(POLL)
    return None


def save_seen(store: JobStore, job_id: str, attempt: int, offsets: dict[int, int]) -> None:
    """Remember how much of each node's log a viewer has shown, for the next ``attach``."""
    def change(rec: JobRecord) -> None:
        if rec.attempt == attempt:
            for rank, offset in offsets.items():
                rec.nodes[rank].seen = max(rec.nodes[rank].seen, offset)

    store.update(job_id, change)


def remove_on_hosts(job: Opened) -> dict[int, dict[str, Any] | ClusterrunError]:
    """Delete every node's state and logs of the job on its host (the agent's ``remove``, which
    refuses while anything of the job runs there): each node's answer, or the error."""
    record = job.record
    return per_node(record, lambda t, rank: t.call(request(record, rank, "remove")), spec=job.spec())
