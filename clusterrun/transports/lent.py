"""``Lent``: a transport another owner keeps, used through its connection (a job owner's next attempt).

The job's owner keeps one transport per host for the job's life (``life.runner``'s pool): the
next attempt's checks, its start and its follower each use it through a ``Lent`` instead of a new
connection (an SSH handshake, 0.3-0.8 s on a loaded controller). ``close`` leaves it open for the
owner, which closes it at its end. A connection that is gone is made anew by the transport's own
``connect`` (SSH: when its connection is no longer active).

The pool also keeps each host's idle agent that followed the last attempt to its end (``adopt``'s
``idle``): the next attempt's first ``session`` on that host is that agent (its probe, port test
and start go to it: no channel, shell and interpreter to start), or a new one where it no longer
answers (``AgentSession.renewable``).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from clusterrun.config.hostsfile import HostSpec
from clusterrun.transports.base import AgentSession, AgentStream, AnyRequest, Transport


class Lent(Transport):
    """``inner``, shared: every use goes to it; ``close`` does not close it. ``kept``: the
    pool's idle agent on the host, if any, which the first ``session`` takes."""

    def __init__(self, inner: Transport, kept: Callable[[], AgentSession | None] | None = None) -> None:
        super().__init__(inner.host)
        self.inner = inner
        self.files = inner.files
        self._kept = kept

    @property
    def address(self) -> str | None:
        return self.inner.address

    def resolve(self) -> None:
        self.inner.resolve()

    @property
    def python(self) -> str:
        return self.inner.python

    def connect(self) -> None:
        self.inner.connect()

    def expect_ahead(self) -> bool:
        return self.inner.expect_ahead()

    def connect_ahead(self) -> None:
        self.inner.connect_ahead()

    def session(self) -> AgentSession:
        kept = self._kept() if self._kept is not None else None
        return kept.renewable(self.inner.session) if kept is not None else self.inner.session()

    def stream(self, request: AnyRequest) -> AgentStream:
        return self.inner.stream(request)

    def call(self, request: AnyRequest) -> dict[str, Any]:
        return self.inner.call(request)

    def pipe(self, command: str, peer: socket.socket) -> tuple[int, str]:
        return self.inner.pipe(command, peer)

    def close(self) -> None:
        """The owner closes ``inner``, not its borrowers."""


class TransportPool:
    """One transport per host for an owner's life, lent to each of its jobs.

    Create (``make``: a new transport for a host) → ``adopt()`` the transports of a job that
    gave them up (``Job.lend_transports``) and its idle agents (``Job.idle_agents``) → ``lend(host)``
    for every job after it → ``close()``."""

    def __init__(self, make: Callable[[HostSpec], Transport]) -> None:
        self.make = make
        self.kept: dict[str, Transport] = {}
        self.idle: dict[str, AgentSession] = {}  # by host: an agent for the next job's first session there
        self._lock = threading.Lock()

    def adopt(self, transports: Iterable[Transport], idle: Mapping[str, AgentSession] | None = None) -> None:
        """Keep these (a job's, now lent back to it); a host kept already closes the newcomer.
        ``idle``: agents by host for the next job's first session there (one kept before is closed)."""
        spare: list[Transport | AgentSession] = []
        with self._lock:
            for transport in transports:
                if transport.name in self.kept:
                    spare.append(transport)
                else:
                    self.kept[transport.name] = transport
            for host, agent in (idle or {}).items():
                if host in self.idle:
                    spare.append(self.idle[host])
                self.idle[host] = agent
        for item in spare:
            item.close()

    def _take(self, host: str) -> AgentSession | None:
        with self._lock:
            return self.idle.pop(host, None)

    def lend(self, host: HostSpec) -> Transport:
        """The host's transport (made now if none is kept), lent."""
        with self._lock:
            transport = self.kept.get(host.host)
            if transport is None:
                transport = self.kept[host.host] = self.make(host)
        return Lent(transport, kept=lambda: self._take(host.host))

    def close(self) -> None:
        with self._lock:
            kept, self.kept = list(self.kept.values()), {}
            idle, self.idle = list(self.idle.values()), {}
        for agent in idle:  # before their connections
            agent.close()
        for transport in kept:
            transport.close()


__all__ = ["Lent", "TransportPool"]
