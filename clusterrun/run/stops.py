"""How an attempt's nodes are stopped: the owner's order (``StopOrder``) and the one place a stop
request is sent (``stop_node``: the agent's verified stop of one node's attempt).

``Job.stop(order)`` carries the owner's order out on every node still running (fail-fast, a
requested stop, the start-up timeout: ``life.runner.stop_for``). The job's owner and ``down``,
``restart`` and the restart policy (``life.lifecycle.stop_job``) all stop a node through
``stop_node``, which says who stops it: the agent writes that into the node's log before it
signals torchrun (``---- stopped by restart at 11:37:58Z ----``).
"""

from __future__ import annotations

import dataclasses

from clusterrun.agent.wire import node_request
from clusterrun.core.errors import ClusterrunError
from clusterrun.core.events import StartupExpired, StopReport
from clusterrun.core.frozen import frozen
from clusterrun.core.protocol import stop_report
from clusterrun.transports import AgentStream, Transport


@frozen
class StopOrder:
    """Why the owner stops an attempt's nodes: ``reason``, shown on each node as it stops; ``after``:
    the node whose failure the others are stopped after (fail-fast); ``late``: the start-up watch's
    verdict (``StartupExpired``: its ``nodes`` fail the attempt). Neither: a stop asked for (the
    user's, a restart's): the result is ``interrupted`` with ``reason``. ``by``: who stopped it,
    for the mark in the nodes' logs."""

    reason: str
    after: int | None = None
    late: StartupExpired | None = None
    by: str | None = None

    @property
    def asked(self) -> bool:
        return self.after is None and self.late is None


def stop_node(transport: Transport, rank: int, host: str, *, job_id: str, attempt: int, state_dir: str | None,
              grace: float, by: str | None = None, failing: bool = False, failed: bool = False,
              aside: AgentStream | None = None) -> StopReport:
    """The agent's verified stop of node ``rank``'s ``attempt``: its report, with the error that
    kept it away. ``by``: who stops it, for the mark in the node's log (None: ``clusterrun``);
    ``failing``: the attempt fails anyway, so where it has a cgroup its kill is the stop (no grace);
    ``failed``: this node's rank failed first, and its end stays that failure (not a stop).
    ``aside``: the node's follow stream (``asks``): its agent, already running, takes the request
    on the channel it streams on; where it cannot (the stream has ended, or the connection), a
    new agent on ``transport`` does (a channel and an interpreter's start: 0.3-0.5 s on a loaded host)."""
    request = node_request("stop", job=job_id, node=rank, attempt=attempt, state_dir=state_dir, grace=grace, by=by,
                           failing=failing or failed, failed=failed)
    try:
        answer = aside.ask(request) if aside is not None else None
        report = stop_report(host, rank, answer if answer is not None else transport.call(request))
    except ClusterrunError as exc:
        return StopReport(rank, host, error=exc.render(), failed=failed)
    return dataclasses.replace(report, failed=True) if failed else report


__all__ = ["StopOrder", "stop_node"]
