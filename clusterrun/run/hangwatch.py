"""The hang watch: a job hangs when none of its ranks has written anything for ``hang_after``.

Each node's host records since when its ranks have written nothing, once that has lasted
``hang_after`` (``NodeStatus.quiet_since``: ``agent/hangwatch.py``, which sees only its own node's
log). Whether the job hangs is decided here, where every node's silence is known: usually only
rank 0 prints, so the other nodes are quiet for the whole run while rank 0's node prints, and no
single node can tell a hang from that. The job is silent once every node that has not ended is
quiet, since the last output anywhere (the latest ``quiet_since``). The decision is taken in the
loop that follows the nodes' states (``Job.run``), not from the log lines it may see: the
background monitor that owns a detached job follows the states only, and ``up`` and ``attach``
must reach the same verdict from the same facts. Only the job's owner acts on it (``on_hang``).

CPU is no condition: gloo's and NCCL's threads poll, and CUDA's spin-wait holds a core, in ranks
that wait for ever. It is evidence in the report the owner takes then (``diagnose/hangreport.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from clusterrun.core.events import JobHung
from clusterrun.core.protocol import NodeStatus


def silent_since(statuses: Mapping[int, NodeStatus | None]) -> float | None:
    """Since when the job's ranks have written nothing (wall clock), once that has lasted
    ``hang_after``: the latest ``quiet_since`` of the nodes that have not ended. None while a node
    has not been heard from, has written within ``hang_after``, has no living rank (starting, or
    restarting its workers), or when every node has ended. Another sign of life (progress read
    from the logs) would be one more time in the ``max``."""
    live = [s for s in statuses.values() if s is None or not s.ended]
    if not live or any(s is None or s.quiet_since is None for s in live):
        return None
    return max(s.quiet_since for s in live if s is not None and s.quiet_since is not None)


class HangWatch:
    """The hang watch of one attempt, in its follower's loop.

    create (the nodes' ranks, ``hang_after``) → ``update(rank, status)`` for every state a node
    reports → ``poll()`` then and between updates: ``JobHung`` when the verdict changed (hung since
    when, on which nodes; or active again), else None. A node's end is its ranks' last sign of life
    (rank 0 done, the others still in their teardown are not hung at once). A hang keeps the time
    it began until a rank writes again, also when a node ends meanwhile."""

    def __init__(self, ranks: Sequence[int], hang_after: float, clock: Callable[[], float] = time.time) -> None:
        self.statuses: dict[int, NodeStatus | None] = dict.fromkeys(ranks)
        self.hang_after, self.clock = hang_after, clock
        self.ended: dict[int, float] = {}  # when this watch saw each ended node end (its own clock)
        self.since: float | None = None
        self.nodes: tuple[int, ...] = ()  # the nodes shown hung: those that had not ended
        self._updated = True  # a status came since the last poll: the verdict may have changed

    def update(self, rank: int, status: NodeStatus) -> None:
        self.statuses[rank] = status
        self._updated = True
        if status.ended:
            self.ended.setdefault(rank, self.clock())

    @property
    def waiting(self) -> bool:
        """Whether ``poll()`` may change its verdict with time alone (a node's end ageing), not
        only after an ``update``."""
        return self.since is None and bool(self.ended)

    def poll(self) -> JobHung | None:
        # The loop polls at every round, log chunks alone too (a round per message when they come
        # sparsely): the verdict is looked at again (every node's status) only where a status came
        # or time alone may change it.
        if not (self._updated or self.waiting):
            return None
        self._updated = False
        since = silent_since(self.statuses)
        if since is not None and self.since is None and self.ended:
            last_end = max(self.ended.values())
            since = max(since, last_end) if self.clock() - last_end >= self.hang_after else None
        if (since is None) == (self.since is None):
            return None
        if since is None and all(s is not None and s.ended for s in self.statuses.values()):
            return None  # the job ended hung: its nodes' ends say the rest
        if since is None:
            nodes, self.nodes = self.nodes, ()
        else:
            self.nodes = nodes = tuple(r for r, s in sorted(self.statuses.items()) if s is not None and not s.ended)
        self.since = since
        return JobHung(None, since=since, nodes=nodes)


__all__ = ["HangWatch", "silent_since"]
