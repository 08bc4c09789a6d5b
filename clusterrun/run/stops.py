"""The one place a stop request is sent: the agent's verified stop of one node's attempt.

The job's owner (``Job.run``'s fail-fast, a requested stop, the start-up watch) and ``down``,
``restart`` and the restart policy (``life.lifecycle.stop_job``) all stop a node through
``stop_node``, which says who stops it: the agent writes that into the node's log before it
signals torchrun (``---- stopped by restart at 11:37:58Z ----``).
"""

from __future__ import annotations

from clusterrun.agent.wire import node_request
from clusterrun.core.errors import ClusterrunError
from clusterrun.core.events import StopReport
from clusterrun.core.protocol import stop_report
from clusterrun.transports import Transport


def stop_node(transport: Transport, rank: int, host: str, *, job_id: str, attempt: int, state_dir: str | None,
              grace: float, by: str | None = None) -> StopReport:
    """The agent's verified stop of node ``rank``'s ``attempt``: its report, with the error that
    kept it away. ``by``: who stops it, for the mark in the node's log (None: ``clusterrun``)."""
    request = node_request("stop", job=job_id, node=rank, attempt=attempt, state_dir=state_dir, grace=grace, by=by)
    try:
        return stop_report(host, rank, transport.call(request))
    except ClusterrunError as exc:
        return StopReport(rank, host, error=exc.render())


__all__ = ["stop_node"]
