"""Ways to run the node agent on a host: ``local`` (a process here) and ``ssh`` (paramiko)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from clusterrun.config.hostsfile import HostSpec
from clusterrun.transports.base import AgentSession, AgentStream, Transport


def transport_for(host: HostSpec, *, ssh_config: str | None = None, accept_new_host_keys: bool = False) -> Transport:
    """The transport the hosts file asks for; paramiko is imported only for SSH hosts."""
    if host.transport == "local":
        from clusterrun.transports.local import LocalTransport

        return LocalTransport(host)
    from clusterrun.transports.ssh import SSHTransport
    from clusterrun.transports.sshhosts import SSHOptions

    return SSHTransport(host, SSHOptions(ssh_config=ssh_config, accept_new_host_keys=accept_new_host_keys))


def connect_early(transports: Sequence[Transport], workers: int = 32) -> None:
    """Start connecting to the hosts now, at most ``workers`` at once in threads of their own, while
    the caller goes on (``Transport.connect_ahead``); a command that ends meanwhile does not wait for
    them (daemon threads, as a connect to a silent host ends only at its ConnectTimeout)."""
    pending = [t for t in transports if t.expect_ahead()]
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not pending:
                    return
                transport = pending.pop(0)
            transport.connect_ahead()

    for _ in range(min(workers, len(pending))):
        threading.Thread(target=work, name="clusterrun-connect", daemon=True).start()


def made(transports: Sequence[Transport]) -> Callable[[HostSpec], Transport]:
    """A transport factory (``Job``'s) that hands out the transports made already for these hosts
    (``connect_early``'s), each for the ``HostSpec`` it was made for."""
    by_host = {id(t.host): t for t in transports}
    return lambda host: by_host[id(host)]


__all__ = ["AgentSession", "AgentStream", "Transport", "connect_early", "made", "transport_for"]
