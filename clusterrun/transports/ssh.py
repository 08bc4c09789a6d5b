"""The SSH transport (paramiko). Not available yet: every SSH host is refused up front, before
anything starts anywhere, with a message that says what works today."""

from __future__ import annotations

from typing import Any

from clusterrun.errors import ConnectError
from clusterrun.transports.base import AgentStream, Transport


class SSHTransport(Transport):
    @property
    def python(self) -> str:
        return self.host.python or "python3"

    def connect(self) -> None:
        raise ConnectError(self.name, "SSH hosts are not supported by this version of clusterrun yet",
                           hint="use `transport: local` for hosts on this machine")

    def stream(self, request: dict[str, Any]) -> AgentStream:
        self.connect()
        raise AssertionError("unreachable")
