"""The start-up watch: which nodes have started their workers and which still wait, for how long.

A node has started once its host's monitor recorded a worker of torchrun (``NodeStatus.workers``)
or it ended; until then torchrun is starting or waits for the rendezvous (all nodes must join).
``progress_text`` words it for ``up``, ``ps`` and the dashboard: ``node 3 (gpu04): torchrun waits
for the rendezvous for 45 s; nodes 0-2 ready``. Once ``startup_timeout`` has passed with nodes
still waiting, ``Job.run`` reports it (``StartupExpired``, with ``timeout_cause``) and the job's
owner (``life.runner``) fails the attempt with that root cause, instead of waiting for gloo's own
30 minutes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from clusterrun.core.events import Event, EveryNodeJoined, Explanation, JobNote, RootCause, StartupExpired
from clusterrun.core.protocol import HostState, NodeStatus
from clusterrun.core.ranges import ranges_text

FIRST_NOTE = 10.0  # seconds after the start before the first note of nodes still waiting (a third of a shorter timeout)
NOTE_EVERY = 30.0  # seconds between two notes while nothing changes
LATE = 60.0  # seconds after which a start no node has joined is late (torchrun and torch import in ~10 s)

CAUSE = "{nodes} started no workers within {timeout} (startup_timeout): {what}{others}"
JOINED = "torchrun joined the rendezvous, waits for the others"
NOT_JOINED = "torchrun has not joined the rendezvous (no connection to the master port)"
STARTING = "torchrun is starting"
FIX = ("the nodes must reach node 0's master port and each other: `clusterrun doctor HOSTS.yaml` checks "
       "the port from every node; open it in the firewall, set `master.addr` (or node 0's `address:`) to an "
       "address every node reaches, and GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME in `env:` to the interface that "
       "reaches the others; a host slow to start torchrun (a cold filesystem) needs a longer `startup_timeout`")


def waiting_for(status: NodeStatus | None) -> str | None:
    """What a node that has not started its workers is doing, or None once it has (or ended)."""
    if status is None:
        return "not heard from yet"
    if status.workers or status.ended:
        return None
    if status.state is HostState.RUNNING and status.rdzv_joined is not None:
        return JOINED if status.rdzv_joined else NOT_JOINED
    if status.state is HostState.RUNNING:
        return "torchrun waits for the rendezvous"
    if status.state is HostState.ABSENT:
        return "not started on its host"
    return STARTING


def late_after(timeout: float) -> float:
    """When a start that no node has joined is late, for a ``startup_timeout`` of ``timeout``."""
    return min(LATE, timeout / 2)


def seconds_text(seconds: float) -> str:
    """``45 s``, ``3 min 5 s``."""
    return f"{int(seconds)} s" if seconds < 120 else f"{int(seconds // 60)} min {int(seconds % 60)} s"


def nodes_text(ranks: list[int], hosts: Mapping[int, str]) -> str:
    """``node 3 (gpu04)``, ``nodes 0 (a), 1 (b), 2 (c), 3 (d) and 5 more``."""
    names = ", ".join(f"{r} ({hosts[r]})" for r in ranks[:4]) + (f" and {len(ranks) - 4} more" if len(ranks) > 4
                                                                  else "")
    return ("node " if len(ranks) == 1 else "nodes ") + names


def progress_text(hosts: Mapping[int, str], statuses: Mapping[int, NodeStatus | None], started: float,
                  now: float, late: float = LATE) -> str | None:
    """``node 3 (gpu04): torchrun has not joined the rendezvous ... for 45 s; nodes 0-2 ready``; None once every
    node has started its workers. A node not connected to the master port is only starting (importing torch)
    until another node joined or started, or ``late`` seconds have passed: then it is the one to look at."""
    doing = {rank: waiting_for(statuses.get(rank)) for rank in hosts}
    behind = now - started >= late or any(what in (JOINED, None) for what in doing.values())
    waiting: dict[str, list[int]] = {}
    for rank in sorted(hosts, key=lambda r: (doing[r] == JOINED, r)):  # the missing first
        what = doing[rank]
        if what is not None:
            waiting.setdefault(STARTING if what == NOT_JOINED and not behind else what, []).append(rank)
    if not waiting:
        return None
    parts = [f"{nodes_text(ranks, hosts)}: {what} for {seconds_text(max(0.0, now - started))}"
             for what, ranks in waiting.items()]
    ready = [r for r in sorted(hosts) if not any(r in ranks for ranks in waiting.values())]
    if ready:
        parts.append(f"{'node' if len(ready) == 1 else 'nodes'} {ranges_text(ready)} ready")
    return "; ".join(parts)


def blamed(hosts: Mapping[int, str], statuses: Mapping[int, NodeStatus | None]) -> tuple[list[int], list[int]]:
    """The nodes that keep the rendezvous from completing (not joined, or not known to have), and
    those that joined it and wait for them; every waiting node when none is known to have joined."""
    late = [r for r in sorted(hosts) if waiting_for(statuses.get(r)) is not None]
    missing = [r for r in late if waiting_for(statuses.get(r)) != JOINED]
    return (missing, [r for r in late if r not in missing]) if missing else (late, [])


def timeout_cause(hosts: Mapping[int, str], statuses: Mapping[int, NodeStatus | None], timeout: float) -> RootCause:
    """The root cause of an attempt whose nodes did not all start their workers within ``timeout``."""
    named, joined = blamed(hosts, statuses)
    named = named or [min(hosts)]
    first = named[0]
    what = waiting_for(statuses.get(first)) or "no workers"
    them = "it" if len(named) == 1 else "them"
    others = f"; {nodes_text(joined, hosts)} joined and waited for {them}" if joined else ""
    cause = CAUSE.format(nodes=nodes_text(named, hosts), timeout=seconds_text(timeout), what=what, others=others)
    return RootCause(node=first, host=hosts[first], rank=None, local_rank=None, exit_code=None, signal=None,
                     message=f"{what}: no workers after {seconds_text(timeout)} (startup_timeout)",
                     explanation=Explanation("startup-timeout", cause, FIX))


class StartupWatch:
    """The start-up watch of one attempt, in its follower's loop.

    create (the nodes' hosts, the attempt's start as wall-clock time, ``startup_timeout``) →
    ``update(rank, status)`` for every state a node reports → ``poll(now)``: a progress note when
    one is due (the set of ready nodes changed, or ``NOTE_EVERY`` passed), else None → ``expired(now)``:
    True once ``timeout`` has passed with a node still waiting (``step`` emits it once as
    ``StartupExpired``). ``done`` once every node started."""

    def __init__(self, hosts: Mapping[int, str], started: float, timeout: float) -> None:
        self.hosts = dict(hosts)
        self.started = started
        self.timeout = timeout
        self.statuses: dict[int, NodeStatus | None] = {}
        self.done = False
        self._noted_at = started + min(FIRST_NOTE, timeout / 3) - NOTE_EVERY
        self._noted_ready: frozenset[int] | None = None
        self._opened: float | None = None  # the first poll: a viewer attached late hears from every node first
        self.reported = False  # its expiry was emitted

    def update(self, rank: int, status: NodeStatus) -> None:
        self.statuses[rank] = status

    def _ready(self) -> frozenset[int]:
        return frozenset(r for r in self.hosts if waiting_for(self.statuses.get(r)) is None)

    def waiting(self) -> list[int]:
        """The nodes that have not started their workers, by rank."""
        return sorted(set(self.hosts) - self._ready())

    def poll(self, now: float) -> str | None:
        if self.done:
            return None
        self._opened = now if self._opened is None else self._opened
        # A node not heard from yet since this watch began (``attach`` to an attempt 37 s old) is not
        # late: its first status is on its way; it counts once the first note's wait has passed here too.
        unheard = any(self.statuses.get(r) is None for r in self.hosts)
        if unheard and now - self._opened < min(FIRST_NOTE, self.timeout / 3):
            return None
        ready = self._ready()
        if len(ready) == len(self.hosts):
            self.done = True
            return "every node started its workers" if self._noted_ready is not None else None
        if now - self._noted_at < NOTE_EVERY and (self._noted_ready is None or ready == self._noted_ready):
            return None
        self._noted_at, self._noted_ready = now, ready
        return progress_text(self.hosts, self.statuses, self.started, now, late_after(self.timeout))

    def step(self, now: float, emit: Callable[[Event], None]) -> None:
        """One turn of the follower's loop: emit the progress note that is due, and once ``expired``
        the fact (``StartupExpired``, once): whether it fails the attempt is the owner's to decide.
        Once every node started its workers: ``EveryNodeJoined``, once."""
        was_done = self.done
        note = self.poll(now)
        if note is not None:
            emit(JobNote(None, text=note))
        if self.done and not was_done:
            emit(EveryNodeJoined(None, at=now))
        if not self.reported and self.expired(now):
            self.reported = True
            emit(StartupExpired(None, cause=self.cause(), nodes=tuple(blamed(self.hosts, self.statuses)[0])))

    def expired(self, now: float) -> bool:
        return not self.done and now - self.started >= self.timeout and len(self._ready()) < len(self.hosts)

    def cause(self) -> RootCause:
        return timeout_cause(self.hosts, self.statuses, self.timeout)


__all__ = ["StartupWatch", "blamed", "late_after", "nodes_text", "progress_text", "seconds_text", "timeout_cause",
           "waiting_for"]
