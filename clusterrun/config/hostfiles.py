"""DeepSpeed and MPI hostfiles read as hosts files, and any ``ClusterSpec`` written back as YAML.

A hostfile has one host a line, ``NAME [slots=N] [max_slots=M]``, with ``#`` comments (DeepSpeed's
format; OpenMPI's ``max_slots=`` and ``user@host`` too, and MPICH's ``NAME:N`` for ``NAME slots=N``).
``slots`` are GPUs, as DeepSpeed reads them: ``worker-1 slots=4`` becomes ``{host: worker-1, gpus: 4}``;
``max_slots`` only bounds ``slots`` (one process per slot never oversubscribes). A file is a
hostfile by its content, whatever its name: no line holds a ``:`` (every YAML hosts file has
``hosts:``) but in ``NAME:N``.

``hostfile_yaml`` turns a hostfile into YAML with one entry a line, so that the YAML parser's
checks (names, node sets, duplicates) apply unchanged and its line numbers map back to the
hostfile's. ``spec_yaml`` writes a parsed spec out whole (each host's settings merged), the text
a job's record keeps when ``up`` ran on a hostfile or on a part of a hosts file (``-w``/``-x``).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import yaml

from clusterrun.config.hostsfile import ClusterSpec, HostSpec, load_cluster_text, read_hosts_text
from clusterrun.core.errors import ConfigError
from clusterrun.core.frozen import frozen

__all__ = ["is_hostfile", "hostfile_yaml", "load_any", "spec_yaml"]

_KEY_VALUE = re.compile(r"([A-Za-z_]+)=(.*)\Z")
_COUNT = re.compile(r"[1-9][0-9]{0,3}\Z")
_MPICH = re.compile(r"([^\s:]+):([0-9]+)\Z")


def _content(line: str) -> str:
    """The line without its comment and surrounding blanks."""
    return line.split("#", 1)[0].strip()


def is_hostfile(text: str) -> bool:
    """Whether ``text`` reads as a hostfile: some host lines, none starting as YAML does, none with
    ``:`` but MPICH's ``host:N``."""
    lines = [c for c in map(_content, text.splitlines()) if c]
    return bool(lines) and not any(c.startswith(("-", "[", "{", "%")) or (":" in c and not _MPICH.match(c))
                                   for c in lines)


@frozen
class _Entry:
    host: str
    user: str | None
    slots: int | None
    line: int


def _entry(text: str, line: int, path: str) -> _Entry:
    if (mpich := _MPICH.match(text)) is not None:  # MPICH's and Intel MPI's host:N
        text = f"{mpich[1]} slots={mpich[2]}"
    words = text.split()
    name, user = words[0], None
    if "@" in name:
        user, _, name = name.rpartition("@")
    values: dict[str, int] = {}
    for word in words[1:]:
        found = _KEY_VALUE.match(word)
        if found is None or found[1] not in ("slots", "max_slots"):
            raise ConfigError(f"expected slots=N or max_slots=N after the host name, got {word!r}", path=path,
                              line=line, hint="a hostfile line is `NAME slots=N` (DeepSpeed, MPI)")
        if not _COUNT.match(found[2]):
            raise ConfigError(f"{found[1]} must be a count from 1 to 9999, got {found[2]!r}", path=path, line=line)
        values[found[1]] = int(found[2])
    slots = values.get("slots")
    if slots is not None and slots > values.get("max_slots", slots):
        raise ConfigError(f"slots={slots} is more than max_slots={values['max_slots']}", path=path, line=line,
                          hint="lower slots, or raise max_slots")
    return _Entry(name, user, slots, line)


def hostfile_yaml(text: str, path: str) -> tuple[str, dict[int, int]]:
    """The YAML hosts file equivalent to hostfile ``text``, and the hostfile line of each YAML line."""
    out = [f"# {os.path.basename(path)} (a DeepSpeed/MPI hostfile) as a clusterrun hosts file: slots=N is gpus: N",
           "hosts:"]
    lines: dict[int, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        content, _, comment = raw.partition("#")
        if not content.strip():
            if comment.strip():
                out.append(f"  # {comment.strip()}")
            continue
        entry = _entry(content.strip(), number, path)
        fields = [f"host: {json.dumps(entry.host)}"]
        if entry.user is not None:
            fields.append(f"user: {json.dumps(entry.user)}")
        if entry.slots is not None:
            fields.append(f"gpus: {entry.slots}")
        out.append("  - {" + ", ".join(fields) + "}" + (f"  # {comment.strip()}" if comment.strip() else ""))
        lines[len(out)] = number
    return "\n".join(out) + "\n", lines


def _from_hostfile(text: str, path: str) -> tuple[ClusterSpec, str]:
    converted, lines = hostfile_yaml(text, path)
    try:
        spec = load_cluster_text(converted, path)
    except ConfigError as exc:
        line = lines.get(exc.line) if exc.line is not None else None
        # "(also at line N)" of a duplicate names a YAML line too
        message = re.sub(r"\bline (\d+)", lambda m: f"line {lines.get(int(m[1]), m[1])}", exc.message)
        raise ConfigError(message, path=path, line=line, hint=exc.hint) from None
    return spec, converted


def load_any(path: str) -> tuple[ClusterSpec, str]:
    """The hosts file or hostfile at ``path`` parsed, and the YAML text that parses to the same spec."""
    text = read_hosts_text(path)
    if is_hostfile(text):
        return _from_hostfile(text, path)
    return load_cluster_text(text, path), text


def _gpus(gpus: tuple[str, ...]) -> int | list[str]:
    return len(gpus) if gpus == tuple(str(i) for i in range(len(gpus))) else list(gpus)


def _host(host: HostSpec) -> dict[str, Any]:
    """One host entry with every setting it has (defaults and the top-level env merged in)."""
    entry: dict[str, Any] = {"host": host.host}
    for name in ("address", "port", "user", "identity_file", "python", "workdir", "sync"):
        if (value := getattr(host, name)) is not None:
            entry[name] = value
    if host.gpus is not None:
        entry["gpus"] = _gpus(host.gpus)
    elif host.nproc != 1:
        entry["nproc"] = host.nproc
    if host.env:
        entry["env"] = dict(host.env)
    if host.transport != "ssh":
        entry["transport"] = host.transport
    for name in ("sync_exclude", "forward_env", "setup"):
        if value := getattr(host, name):
            entry[name] = list(value)
    if host.env_file:
        entry["env_file"] = [os.path.abspath(f.path) for f in host.env_file]  # the record is read from elsewhere
    return entry


def spec_yaml(spec: ClusterSpec, comment: str = "") -> str:
    """A YAML hosts file that parses to ``spec`` (its hosts and settings; lines and comments aside)."""
    data: dict[str, Any] = {}
    master = {k: v for k, v in (("addr", spec.master_addr), ("port", spec.master_port)) if v is not None}
    if master:
        data["master"] = master
    if spec.state_dir is not None:
        data["state_dir"] = spec.state_dir
    if spec.ssh_config is not None:
        data["ssh_config"] = spec.ssh_config
    if spec.secret_env:
        data["secret_env"] = list(spec.secret_env)
    data["hosts"] = [_host(h) for h in spec.hosts]
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    return header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1000)
