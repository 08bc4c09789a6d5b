"""The transport interface: run the node agent on a host with one JSON request.

Lifecycle: create → ``connect()`` → any number of ``call()`` / ``stream()`` → ``close()``.
A transport only moves bytes: what the agent does is the agent's business (``agent.py``), and
the request always travels on the agent's stdin, never on a command line.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from clusterrun.agent import BOOTSTRAP
from clusterrun.config import HostSpec
from clusterrun.errors import AgentError

__all__ = ["AgentStream", "Transport", "agent_command", "agent_stdin"]


@lru_cache(maxsize=1)
def _agent_source() -> bytes:
    return (Path(__file__).resolve().parent.parent / "agent.py").read_bytes()


def agent_stdin(request: dict[str, Any]) -> bytes:
    """What the agent reads: its own source, length-prefixed, then the request as one JSON line."""
    source = _agent_source()
    return b"%d\n" % len(source) + source + json.dumps(request).encode() + b"\n"


def agent_command(python: str) -> list[str]:
    """The constant argv that runs the agent: no job data in it."""
    return [python, "-c", BOOTSTRAP]


class AgentStream:
    """The agent's answer lines as they arrive: iterate for dicts, ``close()`` to stop early."""

    def __init__(self, host: str, lines: Iterator[bytes], closer: Any) -> None:
        self._host = host
        self._lines = lines
        self._closer = closer

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The messages; the stream closes itself when they end (or iteration fails)."""
        try:
            for raw in self._lines:
                if not raw.strip():
                    continue
                try:
                    message = json.loads(raw)
                except ValueError:
                    raise AgentError(self._host, f"the agent answered something that is not JSON: {raw[:200]!r}"
                                     ) from None
                if not isinstance(message, dict):
                    raise AgentError(self._host, f"the agent answered {message!r}")
                yield message
        finally:
            self.close()

    def close(self) -> None:
        """Stop the agent if it is still answering and release the channel (idempotent)."""
        closer, self._closer = self._closer, None
        if closer is not None:
            closer()


class Transport(ABC):
    """One host's way of running the agent."""

    def __init__(self, host: HostSpec) -> None:
        self.host = host

    @property
    def name(self) -> str:
        return self.host.host

    @property
    def address(self) -> str | None:
        """The address the host was reached at, once connected (None where that means nothing)."""
        return None

    @property
    @abstractmethod
    def python(self) -> str:
        """The interpreter that runs the agent and torchrun on the host."""

    @abstractmethod
    def connect(self) -> None:
        """Make the host reachable; raise a ``TransportError`` subclass if it is not."""

    @abstractmethod
    def stream(self, request: dict[str, Any]) -> AgentStream:
        """Start the agent with ``request``; its answer lines arrive on the returned stream."""

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run a one-answer request; raise ``AgentError`` if the agent reports a failure."""
        stream = self.stream(request)
        try:
            for message in stream:
                if not message.get("ok"):
                    raise AgentError(self.name, str(message.get("error") or "the agent failed"))
                return message
        finally:
            stream.close()
        raise AgentError(self.name, f"the agent ended without an answer to {request.get('op')!r}"
                         + self._last_words())

    def _last_words(self) -> str:
        """What the agent said on stderr, for error messages (transports override)."""
        return ""

    def close(self) -> None:  # noqa: B027 - optional hook: a local host has nothing to release
        """Release the connection (nothing to do for a local host)."""
