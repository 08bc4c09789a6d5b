"""A part of a hosts file's hosts, chosen on the command line: ``-w/--nodes`` and ``-x/--exclude``.

The letters are pdsh's and clush's. Both take node sets (``gpu[01-04]``, see ``nodesets``), whose
names must be hosts of the file (a typo is refused, not ignored). ``HOST:GPU`` chooses or drops one
GPU of a host (``gpu01:3``, ``gpu[01-02]:[0-1]``; DeepSpeed#662): with ``-w`` only the GPUs named
are used, with ``-x`` those are left out, and a host left without GPUs is left out. The hosts
keep the file's order (node 0 is the first one left). Pure: a spec in, a spec out.
"""

from __future__ import annotations

import dataclasses

from clusterrun.config.hostfiles import load_any, spec_yaml
from clusterrun.config.hostsfile import ClusterSpec, HostSpec
from clusterrun.config.nodesets import MAX_HOSTS, NodeSetError, expand, fold, size
from clusterrun.core.errors import ConfigError
from clusterrun.core.frozen import frozen

__all__ = ["load_hosts", "select"]


@frozen
class _Choice:
    """What one option names: whole hosts (by index) and GPUs of hosts (index → ids)."""

    hosts: frozenset[int]
    gpus: dict[int, tuple[str, ...]]


def _parse(expression: str, option: str, spec: ClusterSpec) -> _Choice:
    if (count := size(expression)) > MAX_HOSTS:  # before ClusterShell expands it
        raise ConfigError(f"{expression!r} is {count:,} names; a node set may have at most {MAX_HOSTS:,}",
                          key=option)
    try:
        names = expand(expression)
    except NodeSetError as exc:
        raise ConfigError(f"invalid node set: {exc.reason} at position {exc.column} of {expression!r}", key=option,
                          hint="node sets look like gpu[01-08], gpu[01-04,07] or rack[1-2]-n[1-4]; "
                               "HOST:GPU names one GPU") from None
    index = {h.host.lower(): i for i, h in enumerate(spec.hosts)}
    hosts: set[int] = set()
    gpus: dict[int, tuple[str, ...]] = {}
    for name in names:
        if name.lower() in index:
            hosts.add(index[name.lower()])
            continue
        host, colon, gpu = name.rpartition(":")
        if colon and host.lower() in index:
            i = index[host.lower()]
            given = spec.hosts[i].gpus
            if given is None:
                raise ConfigError(f"{name}: host {host} has no gpus in {spec.path}", key=option,
                                  hint="HOST:GPU needs the host's `gpus:` (or `slots=` in a hostfile)")
            if gpu not in given:
                raise ConfigError(f"{name}: GPU {gpu} is not one of {host}'s gpus ({', '.join(given)})",
                                  key=option)
            gpus[i] = (*gpus.get(i, ()), gpu)
            continue
        raise ConfigError(f"{name} is not a host of {spec.path}", key=option,
                          hint=f"its hosts: {fold([h.host for h in spec.hosts])}")
    return _Choice(frozenset(hosts), gpus)


def _with_gpus(host: HostSpec, gpus: tuple[str, ...]) -> HostSpec:
    return dataclasses.replace(host, gpus=gpus, nproc=len(gpus))


def select(spec: ClusterSpec, nodes: str | None = None, exclude: str | None = None) -> ClusterSpec:
    """``spec`` with only the hosts (and GPUs) ``nodes`` names, less those ``exclude`` names."""
    if nodes is None and exclude is None:
        return spec
    hosts: list[HostSpec | None] = list(spec.hosts)
    if nodes is not None:
        keep = _parse(nodes, "--nodes", spec)
        for i, host in enumerate(spec.hosts):
            if i in keep.hosts:
                continue
            chosen = keep.gpus.get(i)
            hosts[i] = None if chosen is None else _with_gpus(host, tuple(g for g in host.gpus or () if g in chosen))
    if exclude is not None:
        drop = _parse(exclude, "--exclude", spec)
        for i, kept in enumerate(hosts):
            if kept is None or i in drop.hosts:
                hosts[i] = None
            elif i in drop.gpus:
                left = tuple(g for g in kept.gpus or () if g not in drop.gpus[i])
                hosts[i] = _with_gpus(kept, left) if left else None
    chosen_hosts = tuple(h for h in hosts if h is not None)
    if not chosen_hosts:
        option = "--nodes" if exclude is None else "--exclude"
        raise ConfigError(f"no host of {spec.path} is left to run on", key=option,
                          hint="check -w/--nodes and -x/--exclude")
    return dataclasses.replace(spec, hosts=chosen_hosts)


def load_hosts(path: str, nodes: str | None = None, exclude: str | None = None) -> tuple[ClusterSpec, str]:
    """The hosts file (or hostfile) at ``path`` with ``-w``/``-x`` applied, and the YAML text a
    job's record keeps: the file's own text when it was used whole, else the chosen part as YAML."""
    spec, text = load_any(path)
    chosen = select(spec, nodes, exclude)
    if chosen is spec:
        return spec, text
    given = " ".join(f"{flag} {value}" for flag, value in (("-w", nodes), ("-x", exclude)) if value is not None)
    return chosen, spec_yaml(chosen, f"the hosts of {path} that `{given}` chose")
