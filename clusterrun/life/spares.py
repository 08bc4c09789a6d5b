"""Spare hosts (``spares:`` in the hosts file): which one takes the place of a host that failed.

The owner replaces a host when an attempt failed because of the host rather than the script (its
node was lost: unreachable, or its processes gone with a reboot; its kernel logged a GPU's
hardware Xid, a machine check or an uncorrectable ECC error; or the start-up watch blamed its
node for never joining the rendezvous); ``restart JOB -x HOST`` and
``--replace HOST=SPARE`` do it by hand. The spare takes the node's rank; the next attempt's
checks and preflight run on it as on any host.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from clusterrun.config.hostsfile import ClusterSpec
from clusterrun.core.errors import ConfigError
from clusterrun.core.events import JobResult, NodeState
from clusterrun.store.jobs import JobRecord

HOST_FAILURES = (NodeState.LOST, NodeState.UNREACHABLE)  # the host went away, not the script


def failed_hosts(result: JobResult, late: Collection[int] = ()) -> list[str]:
    """The hosts whose node the attempt lost (``HOST_FAILURES``), whose kernel logged a failing
    machine (a GPU's hardware Xid, a machine check, an uncorrectable ECC error) or whose node the
    start-up watch blamed for never joining the rendezvous (``late``), in rank order. When every
    peer of node 0 (two or more) never joined, what they share is the blame (node 0's master port
    behind a firewall, a wrong ``master.addr``): none of them is replaced for it."""
    peers = {n.node for n in result.nodes if n.node != 0}
    if len(peers) > 1 and peers <= set(late):
        late = ()
    return [n.host for n in sorted(result.nodes, key=lambda n: n.node)
            if n.state in HOST_FAILURES or n.hardware or n.node in late]


def why(result: JobResult, hosts: list[str]) -> str:
    """``gpu02 (the host went away)``, ``gpu03 (its kernel logged: NVRM: Xid ...)``, joined."""
    by_host = {n.host: n for n in result.nodes}

    def one(host: str) -> str:
        node = by_host[host]
        if node.hardware:
            return f"{host} (its kernel logged: {node.hardware[-1]})"
        return f"{host} (the host went away)" if node.state in HOST_FAILURES else f"{host} (it never joined)"

    return ", ".join(one(h) for h in hosts)


def free_spares(spec: ClusterSpec, record: JobRecord) -> list[str]:
    """The spares of ``spec`` (the current attempt's: those in use are hosts there) that never
    failed in this job, in the file's order."""
    failed = {old for a in record.attempts for old in (a.replaced or {})}
    return [s.host for s in spec.spares if s.host not in failed]


def pick(spec: ClusterSpec, record: JobRecord, out: Sequence[str],
         chosen: Mapping[str, str] | None = None) -> dict[str, str]:
    """Which spare takes the place of each host of ``out`` (hosts of the current attempt):
    ``chosen``'s where given, else the first free spare with as many processes. ``ConfigError``
    naming the host when no spare fits."""
    hosts = {h.host: h for h in spec.hosts}
    spares = {s.host: s for s in spec.spares}
    chosen = dict(chosen or {})
    free = [s for s in free_spares(spec, record) if s not in chosen.values()]
    listed = ", ".join(spares) or "none"
    result: dict[str, str] = {}
    for host in [*out, *(h for h in chosen if h not in out)]:
        if host not in hosts:
            raise ConfigError(f"{host} is not a host of job {record.job_id}'s attempt {record.attempt}",
                              hint=f"its hosts: {', '.join(hosts)}")
        spare = chosen.get(host)
        if spare is None:
            spare = next((s for s in free if spares[s].nproc == hosts[host].nproc and s not in result.values()), None)
            if spare is None:
                raise ConfigError(f"no spare left for {host} ({hosts[host].nproc} processes); spares: {listed}",
                                  hint="add hosts under `spares:` in the hosts file of a new job")
        elif spare not in spares:
            raise ConfigError(f"{spare} is not a free spare of job {record.job_id}", hint=f"its spares: {listed}")
        elif spares[spare].nproc != hosts[host].nproc:
            raise ConfigError(f"{spare} runs {spares[spare].nproc} processes, {host} {hosts[host].nproc}: the "
                              "job's world size would change", hint="choose a spare with as many GPUs (or nproc)")
        result[host] = spare
    return result


__all__ = ["HOST_FAILURES", "failed_hosts", "free_spares", "pick", "why"]
