"""The hosts' ``setup`` commands, run on every node before anything of the attempt starts.

``run(job, emit)`` runs every node's ``setup`` in parallel, each in the agent that probed its
host (which keeps the environment it made for the attempt's start), all or nothing as the probe
(``Job.all_or_none``): ``checks`` for ``up``, ``attempt.start`` for the next attempt (once the
last one stopped), ``Job.prepare`` where it is asked to. A host's output may quote the job's
secret values: ``redacted`` masks them in its errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from clusterrun.agent.wire import node_request
from clusterrun.environment import redact
from clusterrun.errors import AgentError
from clusterrun.plan import NodeLaunch

if TYPE_CHECKING:
    from collections.abc import Collection

    from clusterrun.orchestrator import Emit, Job


def redacted(exc: AgentError, launch: NodeLaunch, secret_env: Collection[str]) -> AgentError:
    """``exc`` without the job's secret values: a failing setup's output may quote them."""
    message = redact(exc.message, launch.env, secret_env)
    return exc if message == exc.message else AgentError(exc.host, message, hint=exc.hint)


def setup_node(job: Job, rank: int) -> None:
    """Run node ``rank``'s setup in the agent that probed its host."""
    _, agent, _ = job.probed(rank)
    launch = job.plan.nodes[rank] if job.plan is not None else None
    if launch is None or agent is None:
        raise RuntimeError("setup before the probe")
    request = node_request("setup", job=job.job_id, node=rank, attempt=job.attempt, state_dir=job.spec.state_dir,
                           setup=list(launch.host.setup), env=dict(launch.env), cwd=launch.cwd)
    try:
        agent.call(request)
    except AgentError as exc:
        raise redacted(exc, launch, job.spec.secret_env) from None


def run(job: Job, emit: Emit | None = None) -> None:
    """Run ``setup`` on every node that has some, in parallel; ``HostsUnavailable`` naming every
    node whose setup failed (then nothing starts anywhere)."""
    plan = job.plan
    if plan is None:
        raise RuntimeError("setup before the plan")
    job.all_or_none(lambda rank: setup_node(job, rank), [n.rank for n in plan.nodes if n.host.setup])


__all__ = ["redacted", "run", "setup_node"]
