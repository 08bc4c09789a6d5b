"""Ways to run the node agent on a host: ``local`` (a process here) and ``ssh`` (paramiko)."""

from __future__ import annotations

from clusterrun.config import HostSpec
from clusterrun.transports.base import AgentSession, AgentStream, Transport


def transport_for(host: HostSpec, *, ssh_config: str | None = None, accept_new_host_keys: bool = False) -> Transport:
    """The transport the hosts file asks for; paramiko is imported only for SSH hosts."""
    if host.transport == "local":
        from clusterrun.transports.local import LocalTransport

        return LocalTransport(host)
    from clusterrun.transports.ssh import SSHTransport
    from clusterrun.transports.sshhosts import SSHOptions

    return SSHTransport(host, SSHOptions(ssh_config=ssh_config, accept_new_host_keys=accept_new_host_keys))


__all__ = ["AgentSession", "AgentStream", "Transport", "transport_for"]
