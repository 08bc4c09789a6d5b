"""An in-memory cluster that answers the agent's protocol: the test seam for a job's policies.

Lifecycle: ``FakeCluster()`` → pass ``cluster.transport`` as the ``transport_factory`` of a
``Job`` (or a job record's owner) → script what the hosts do while the job runs
(``cluster.node(...).write()`` / ``.exit()``, ``cluster.host(name).drop()`` / ``.restore()`` /
``.reboot()``) → nothing to close. It speaks the protocol of ``clusterrun.agent``'s docstring (probe,
start, follow, stop, status, setup, route, remove, jobs; inspect, listen, reach for the doctor) over an
``AgentSession`` as the real transports do, and
``tests/test_transport_contract.py`` holds it to the local and SSH transports, so a policy tested
against it is tested against what the real hosts say. No processes, no clock: a job's "processes"
run until the test says they end.
The hosts' and their nodes' state, and what a test scripts on them, are in ``fakehosts``; what
their agents answer in ``fakeagent``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

from clusterrun.agent.codec import encode
from clusterrun.config.hostsfile import HostSpec
from clusterrun.core.errors import ConnectError
from clusterrun.transports.base import AgentReader, AgentSession, Transport
from clusterrun.transports.fakeagent import FakeAgent
from clusterrun.transports.fakehosts import FakeHost, FakeNode


class FakeCluster(FakeAgent):
    """Fake hosts by name, made on first use; ``transport`` is a ``transport_factory``."""

    def __init__(self) -> None:
        super().__init__()
        self.hosts: dict[str, FakeHost] = {}

    def host(self, name: str) -> FakeHost:
        with self.changed:
            if name not in self.hosts:
                self.hosts[name] = FakeHost(name, self)
            return self.hosts[name]

    def transport(self, spec: HostSpec, **_: Any) -> FakeTransport:
        return FakeTransport(spec, self)

    def node(self, job: str, node: int, attempt: int = 1) -> FakeNode:
        return self.nodes[(job, node, attempt)]

    def wait(self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "the fake cluster") -> None:
        """Block until ``predicate()`` (checked whenever the cluster changes), or fail."""
        with self.changed:
            if not self.changed.wait_for(predicate, timeout):
                raise AssertionError(f"timed out waiting for {what}")

    def wait_started(self, job: str, node: int, attempt: int = 1, timeout: float = 10.0) -> FakeNode:
        self.wait(lambda: (job, node, attempt) in self.nodes, timeout, f"{job} node {node} attempt {attempt}")
        return self.nodes[(job, node, attempt)]

    def ops(self, op: str, host: str | None = None) -> list[dict[str, Any]]:
        """The requests ``op`` received so far (by ``host`` if given)."""
        with self.changed:
            return [r for h, r in self.requests if r.get("op") == op and (host is None or h == host)]


class FakeTransport(Transport):
    """A transport to one host of a ``FakeCluster``: sessions answer from memory."""

    def __init__(self, host: HostSpec, cluster: FakeCluster) -> None:
        super().__init__(host)
        self.cluster = cluster

    @property
    def python(self) -> str:
        return self.host.python or "python3"

    @property
    def address(self) -> str | None:
        return self.host.address or self.host.host

    def connect(self) -> None:
        fake = self.cluster.host(self.name)
        with self.cluster.changed:
            fake.connects += 1
            self.cluster.changed.notify_all()
            if not fake.reachable:
                raise ConnectError(self.name, "cannot connect: connection refused (fake)")

    def session(self) -> AgentSession:
        self.connect()
        fake = self.cluster.host(self.name)
        requests: list[dict[str, Any]] = []
        closed = threading.Event()
        with self.cluster.changed:
            epoch = fake._epoch

        def send(data: bytes) -> None:
            requests.append(json.loads(data))

        listened: list[int] = []  # the listeners this agent opened: they end with it, as the agent's

        def lines() -> Iterator[bytes]:
            while requests and not closed.is_set():
                for answer in self.cluster._answers(fake, requests.pop(0), epoch):
                    if closed.is_set():
                        return
                    opened = answer.get("listen", answer)
                    if isinstance(opened, dict) and opened.get("listening"):
                        listened.append(int(opened["port"]))
                    yield encode(answer)  # as the agent writes it: a log's bytes raw after its line
                    if answer.get("t") in ("end", "eof"):
                        return

        def close() -> None:
            closed.set()
            with self.cluster.changed:
                for port in listened:
                    if self.cluster.listeners.get(port, (None,))[0] is fake:
                        del self.cluster.listeners[port]
                self.cluster.changed.notify_all()
            if fake.close_error is not None:
                raise fake.close_error

        answers = _Lines(lines)
        return AgentSession(self.name, send, AgentReader(lambda: next(answers, b"")), close)


class _Lines:
    """An iterator over a session's answers, as the agent writes them, that picks up requests sent
    after it was made (the session's one ``AgentReader`` reads it for every request)."""

    def __init__(self, make: Callable[[], Iterator[bytes]]) -> None:
        self._make = make
        self._current: Iterator[bytes] | None = None

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        while True:
            if self._current is None:
                self._current = self._make()
            try:
                return next(self._current)
            except StopIteration:
                self._current = None
                raise
