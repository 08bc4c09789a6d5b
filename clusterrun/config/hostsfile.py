"""Parse and validate a hosts file into a frozen ``ClusterSpec``.

The format is documented in ``docs/hosts-file.md``. The file is read with PyYAML's safe
loader, but only as far as ``yaml.compose``: the parser walks the node tree itself so that
every value keeps its line number, duplicate mapping keys (which PyYAML silently collapses)
are caught, and YAML's implicit typing never reaches a field unchecked (``yes`` is a
boolean, ``010`` an octal, ``12:30`` a base-60 number in YAML 1.1).

Every mistake raises ``ConfigError(message, path=, line=, key=, hint=)``; nothing else
escapes. Validation runs in two passes: ``check_tree`` (``hostsyaml.NodeReader``, with the
readers of plain values) looks at every node (tags, key shapes, duplicate keys, secrets), then
``_Parser.parse`` applies the schema. The first error found is raised; ``hosts[i]`` in key
paths counts from 0. ``env`` numbers keep the text as written; booleans and nulls there are
refused with a hint to quote them.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from clusterrun.config.envrules import check_env_entry, check_env_total, looks_secret
from clusterrun.config.hostsyaml import (
    BOOL,
    FLOAT,
    INT,
    NULL,
    STR,
    TIMESTAMP,
    NodeReader,
    compose,
    describe,
    join_key,
    line_of,
)
from clusterrun.config.nodesets import MAX_HOSTS, NodeSetError, expand, is_nodeset, size
from clusterrun.config.restarts import RestartPolicy
from clusterrun.config.watch import Notify, Watch
from clusterrun.config.watchconfig import WATCH_KEYS, restart_policy, watch_settings
from clusterrun.core.errors import ConfigError
from clusterrun.core.frozen import frozen

Transport = Literal["ssh", "local"]

@frozen
class EnvFile:
    """An ``env_file:`` entry: the file's path (relative ones made relative to the hosts file's
    directory) and where the hosts file names it, for messages."""

    path: str
    line: int | None = None
    key: str = "env_file"


@frozen
class HostSpec:
    """One machine as the hosts file describes it, with defaults and env already merged.

    ``nproc`` is resolved: ``len(gpus)`` when GPUs are given, else ``nproc``, else 1.
    ``env`` is merged top-level ``env`` < ``defaults.env`` < the host's own ``env``.
    """

    host: str
    line: int | None = None
    address: str | None = None
    port: int | None = None
    user: str | None = None
    identity_file: str | None = None
    gpus: tuple[str, ...] | None = None
    nproc: int = 1
    python: str | None = None
    workdir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    transport: Transport = "ssh"
    sync: str | None = None  # a local directory copied to ``workdir`` before the start (see clusterrun.sync.copy)
    sync_exclude: tuple[str, ...] = ()  # .gitignore-style patterns, beside the directory's .gitignore files
    # the top level's, then defaults', then the host's own (``environment.resolve`` reads them)
    forward_env: tuple[str, ...] = ()
    env_file: tuple[EnvFile, ...] = ()
    setup: tuple[str, ...] = ()  # shell commands run on the host before torchrun (the host's own, else defaults')


@frozen
class ClusterSpec:
    """A parsed hosts file: the hosts in file order plus cluster-wide settings.

    ``master_port`` None means ``auto`` (a free port is found on node 0 at launch).
    ``state_dir`` None means the agent's default on each host (under the user's home).
    """

    path: str
    hosts: tuple[HostSpec, ...]
    master_addr: str | None = None
    master_port: int | None = None
    state_dir: str | None = None
    ssh_config: str | None = None
    secret_env: tuple[str, ...] = ()  # more names (or glob patterns) whose values are masked
    restart: RestartPolicy = RestartPolicy()  # restarts of the whole job after a failure (none by default)
    watch: Watch = Watch()  # startup_timeout, hang_after, on_hang
    notify: Notify | None = None
    spares: tuple[HostSpec, ...] = ()  # hosts that take a failed host's place in the next attempt

    def with_spares(self, replaced: Mapping[str, str]) -> ClusterSpec:
        """The hosts with each one named in ``replaced`` swapped for the spare named there, in its
        place (its node rank); the spares in use leave the list of spares. ``KeyError`` for a name
        that is not a host or a spare of this file."""
        if not replaced:
            return self
        spares = {s.host: s for s in self.spares}
        hosts = {h.host for h in self.hosts}
        for old, new in replaced.items():
            if old not in hosts or new not in spares:
                raise KeyError(old if old not in hosts else new)
        taken = set(replaced.values())
        return replace(self, hosts=tuple(spares[replaced[h.host]] if h.host in replaced else h for h in self.hosts),
                       spares=tuple(s for s in self.spares if s.host not in taken))


_TOP_KEYS = ("hosts", "defaults", "env", "master", "state_dir", "ssh_config", "forward_env", "env_file",
             "secret_env", "restart", "spares", *WATCH_KEYS)
_SHARED_KEYS = ("port", "user", "identity_file", "gpus", "nproc", "python", "workdir", "env", "transport",
                "sync", "sync_exclude", "forward_env", "env_file", "setup")
_HOST_KEYS = ("host", "address", *_SHARED_KEYS)
_MASTER_KEYS = ("addr", "port")

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ENV_PATTERN = re.compile(r"[A-Za-z0-9_*?]+\Z")  # a name, or a glob of one (forward_env, secret_env)
# No commas: the ids end up joined into CUDA_VISIBLE_DEVICES.
_GPU_ID = re.compile(r"([0-9]+|(GPU|MIG)-[A-Za-z0-9_./-]+)\Z")
MAX_PROCS = 1024  # processes (GPUs) per host


def load_cluster(path: str) -> ClusterSpec:
    """Read, parse and validate the hosts file at ``path``; raise ``ConfigError`` on any mistake."""
    return load_cluster_text(read_hosts_text(path), path)


def read_hosts_text(path: str) -> str:
    """The text of the hosts file at ``path``; ``ConfigError`` when it cannot be read or is not UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as exc:
        hint = "check the path; hosts/example.yaml shows the format"
        raise ConfigError("no such file", path=path, hint=hint) from exc
    except IsADirectoryError as exc:
        raise ConfigError("is a directory, not a hosts file", path=path) from exc
    except OSError as exc:
        raise ConfigError(f"cannot read the file: {exc.strerror or exc}", path=path) from exc
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError("the file is not UTF-8 text", path=path, line=line) from exc
    return text


def load_cluster_text(text: str, path: str = "<string>") -> ClusterSpec:
    """Parse and validate hosts-file ``text``; ``path`` is only used in error messages."""
    root = compose(text, path)
    parser = _Parser(path)
    if root is None or (isinstance(root, ScalarNode) and root.tag == NULL):
        raise ConfigError("the file is empty", path=path, hint="a hosts file needs at least 'hosts: [node1]'")
    parser.check_tree(root)
    return parser.parse(root)


@dataclass
class _Settings:
    """What one host entry or ``defaults`` sets (keys of ``_SHARED_KEYS``), and the node of each value."""

    values: dict[str, Any] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)


class _Parser(NodeReader):
    """One file's validation: create → check_tree(root) → parse(root)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.secret_env: tuple[str, ...] = ()
        self.top_forward: tuple[str, ...] = ()
        self.top_files: tuple[EnvFile, ...] = ()

    # -- pass 2: the schema -------------------------------------------------------------------

    def port(self, node: Node, key: str) -> int:
        return self.integer(node, key, "a port number from 1 to 65535", 1, 65535)

    def gpus(self, node: Node, key: str) -> tuple[str, ...]:
        no_gpus = "to run without GPUs, remove 'gpus' and set 'nproc'"
        if isinstance(node, ScalarNode) and node.tag == INT:
            count = self.integer(node, key, f"a GPU count from 1 to {MAX_PROCS}", 1, MAX_PROCS, no_gpus)
            return tuple(str(i) for i in range(count))
        if not isinstance(node, SequenceNode):
            raise self.expected("a list of GPU ids or a count", node, key, "e.g. 'gpus: 4' or 'gpus: [0, 1]'")
        if not node.value:
            raise self.expected("a list of GPU ids or a count", node, key, no_gpus)
        ids: dict[str, Node] = {}
        for i, item in enumerate(node.value):
            ikey = f"{key}[{i}]"
            what = "a GPU index (0, 1, ...) or UUID ('GPU-...', 'MIG-...')"
            if isinstance(item, ScalarNode) and item.tag == INT:
                gpu = str(self.integer(item, ikey, what, 0))
            elif isinstance(item, ScalarNode) and item.tag == STR and _GPU_ID.match(str(item.value)):
                gpu = str(item.value)
            else:
                raise self.expected(what, item, ikey)
            if gpu in ids:
                raise self.error(f"GPU '{gpu}' is listed twice (also at line {line_of(ids[gpu])})", item, ikey)
            ids[gpu] = item
            if len(ids) > MAX_PROCS:
                raise self.error(f"more than {MAX_PROCS} GPUs for one host", item, ikey)
        return tuple(ids)

    def env(self, node: Node, key: str) -> dict[str, str]:
        if not isinstance(node, MappingNode):
            raise self.expected("a mapping of NAME: value", node, key)
        env: dict[str, str] = {}
        for knode, vnode in node.value:
            name = str(knode.value)
            nkey = f"{key}.{name}"
            if not _ENV_NAME.match(name):
                raise self.error(f"invalid environment variable name {name!r}", knode, nkey,
                                 "use letters, digits and '_', not starting with a digit")
            if looks_secret(name, self.secret_env):
                raise self.error(f"{name} looks secret: its value would be kept in the job's record and shown",
                                 knode, nkey, f"keep secrets out of the hosts file: put {name}=... in an env_file "
                                 f"(not committed), or export it and add it to forward_env")
            if isinstance(vnode, ScalarNode) and vnode.tag in (STR, INT, FLOAT, TIMESTAMP):
                # Numbers keep the text as written: str(int('010')) would be '8' under YAML 1.1.
                env[name] = str(vnode.value)
                if (problem := check_env_entry(name, env[name])) is not None:
                    raise self.error(problem, vnode, nkey, "pass large data in a file on the hosts")
            elif isinstance(vnode, ScalarNode) and vnode.tag in (BOOL, NULL):
                text = "" if vnode.tag == NULL and vnode.value == "~" else str(vnode.value)
                raise self.expected("a string or number", vnode, nkey, f'quote the value: {name}: "{text}"')
            else:
                raise self.expected("a string or number", vnode, nkey)
        return env

    def exclude_patterns(self, node: Node, key: str) -> tuple[str, ...]:
        """A list of .gitignore-style patterns (``sync_exclude``)."""
        if not isinstance(node, SequenceNode):
            raise self.expected("a list of patterns", node, key, "e.g. 'sync_exclude: [data/, \"*.ckpt\"]'")
        return tuple(self.string(item, f"{key}[{i}]") for i, item in enumerate(node.value))

    def patterns(self, node: Node, key: str) -> tuple[str, ...]:
        """``forward_env`` / ``secret_env``: variable names or glob patterns of them (``NCCL_*``)."""
        result: list[str] = []
        for i, (text, item) in enumerate(self.strings(node, key, "a list of variable names or patterns")):
            ikey = f"{key}[{i}]" if isinstance(node, SequenceNode) else key
            if not _ENV_PATTERN.match(text):
                raise self.error(f"expected a variable name or a glob pattern of one, got {text!r}", item, ikey,
                                 "letters, digits, '_' and the wildcards '*' and '?', e.g. NCCL_* or HF_TOKEN")
            if text not in result:
                result.append(text)
        return tuple(result)

    def env_files(self, node: Node, key: str) -> tuple[EnvFile, ...]:
        base = os.path.dirname(self.path) if not self.path.startswith("<") else ""
        result = []
        for i, (text, item) in enumerate(self.strings(node, key, "a file name or a list of them")):
            ikey = f"{key}[{i}]" if isinstance(node, SequenceNode) else key
            if "\n" in text or "\r" in text:
                raise self.error("must be a single line of text", item, ikey)
            result.append(EnvFile(os.path.join(base, os.path.expanduser(text)), line_of(item), ikey))
        return tuple(result)

    def setup(self, node: Node, key: str) -> tuple[str, ...]:
        return tuple(text for text, _ in self.strings(node, key, "a shell command or a list of them"))

    def transport(self, node: Node, key: str) -> Transport:
        value = node.value if isinstance(node, ScalarNode) and node.tag == STR else None
        if value == "ssh":
            return "ssh"
        if value == "local":
            return "local"
        close = difflib.get_close_matches(str(value), ("ssh", "local"), n=1) if value else []
        raise self.expected("'ssh' or 'local'", node, key, f"did you mean '{close[0]}'?" if close else None)

    def settings(self, entries: dict[str, Node], prefix: str) -> _Settings:
        """The keys shared by host entries and ``defaults``, typed and checked."""
        parsers: dict[str, Callable[[Node, str], object]] = {
            "port": self.port, "user": lambda node, key: self.string(node, key, name_like=True),
            "identity_file": self.string, "python": self.string, "workdir": self.string, "gpus": self.gpus,
            "nproc": lambda node, key: self.integer(node, key, f"a number of processes from 1 to {MAX_PROCS}", 1,
                                                    MAX_PROCS),
            "env": self.env, "transport": self.transport, "sync": self.string, "sync_exclude": self.exclude_patterns,
            "forward_env": self.patterns, "env_file": self.env_files, "setup": self.setup,
        }
        result = _Settings()
        for name, vnode in entries.items():
            if name in parsers:
                result.values[name] = parsers[name](vnode, join_key(prefix, name))
                result.nodes[name] = vnode
        return result

    def parse(self, root: Node) -> ClusterSpec:
        if not isinstance(root, MappingNode):
            raise self.error(f"the top level must be a mapping with a 'hosts' key, got {describe(root)}",
                             root, None, "start the file with 'hosts:'")
        top = self.fields(root, "", _TOP_KEYS, "a mapping")
        if "hosts" not in top:
            raise self.error("missing required key 'hosts'", None, None, "list the machines: 'hosts: [node1, node2]'")
        self.secret_env = self.patterns(top["secret_env"], "secret_env") if "secret_env" in top else ()
        self.top_forward = self.patterns(top["forward_env"], "forward_env") if "forward_env" in top else ()
        self.top_files = self.env_files(top["env_file"], "env_file") if "env_file" in top else ()
        env = self.env(top["env"], "env") if "env" in top else {}
        defaults = _Settings()
        if "defaults" in top:
            defaults = self.settings(self.fields(top["defaults"], "defaults", _SHARED_KEYS, "a mapping"), "defaults")
        master = {}
        if "master" in top:
            master = self.fields(top["master"], "master", _MASTER_KEYS, "a mapping with 'addr' and/or 'port'")
        watch, notify = watch_settings(self, top)
        seen: dict[tuple[str, int | None], Node] = {}  # a spare is no host of the file too
        hosts = self.hosts(top["hosts"], defaults, env, "hosts", seen)
        spares = self.hosts(top["spares"], defaults, env, "spares", seen, len(hosts)) if "spares" in top else ()
        return ClusterSpec(
            path=self.path,
            hosts=hosts,
            spares=spares,
            master_addr=self.string(master["addr"], "master.addr", name_like=True) if "addr" in master else None,
            master_port=self.master_port(master["port"]) if "port" in master else None,
            state_dir=self.string(top["state_dir"], "state_dir") if "state_dir" in top else None,
            ssh_config=self.string(top["ssh_config"], "ssh_config") if "ssh_config" in top else None,
            secret_env=self.secret_env,
            restart=restart_policy(self, top["restart"]) if "restart" in top else RestartPolicy(),
            watch=watch,
            notify=notify,
        )

    def master_port(self, node: Node) -> int | None:
        if isinstance(node, ScalarNode) and node.tag == STR and node.value == "auto":
            return None
        if isinstance(node, ScalarNode) and node.tag == INT:
            return self.port(node, "master.port")
        raise self.expected("'auto' or a port number from 1 to 65535", node, "master.port")

    def hosts(self, node: Node, defaults: _Settings, env: dict[str, str], what: str,
              seen: dict[tuple[str, int | None], Node], before: int = 0) -> tuple[HostSpec, ...]:
        """The entries of ``hosts:`` or ``spares:`` (``what``); ``seen``: every host listed so far
        (names ignore case, as DNS and ssh do); ``before``: how many, against ``MAX_HOSTS``."""
        if not isinstance(node, SequenceNode) or not node.value:
            hint = "write each host as a list item: '- node1'" if isinstance(node, MappingNode) else None
            raise self.expected(f"a non-empty list of {what}", node, what, hint)
        specs: list[HostSpec] = []
        for i, entry in enumerate(node.value):
            key = f"{what}[{i}]"
            name_node: Node = entry
            address, own = None, _Settings()
            if isinstance(entry, MappingNode):
                entries = self.fields(entry, key, _HOST_KEYS, "a mapping")
                if "host" not in entries:
                    raise self.error("missing required key 'host'", entry, key,
                                     "every entry needs 'host: <name or address>'; '- node1' also works")
                name_node = entries["host"]
                if "address" in entries:
                    address = self.string(entries["address"], f"{key}.address", name_like=True)
                own = self.settings(entries, key)
            elif not (isinstance(entry, ScalarNode) and entry.tag == STR):
                raise self.expected("a host name or a mapping with 'host'", entry, key)
            for host in self.host_names(name_node, key, address, MAX_HOSTS - before - len(specs)):
                spec = self.host_spec(host, address, entry, own, defaults, env, key)
                other = seen.setdefault((host.lower(), spec.port), name_node)
                if other is not name_node:
                    on_port = f" on port {spec.port}" if spec.port is not None else ""
                    as_ = f", as '{other.value}'" if isinstance(other, ScalarNode) and other.value != host else ""
                    raise self.error(f"host '{host}'{on_port} is listed twice (also at line {line_of(other)}{as_})",
                                     name_node, f"{key}.host",
                                     "list each machine once (host names ignore case); use gpus or nproc for more "
                                     "processes")
                if (problem := check_env_total(spec.env)) is not None:
                    raise self.error(f"{problem}: env, defaults.env and the host's own env together", entry, key,
                                     "pass large data in a file on the hosts")
                specs.append(spec)
        return tuple(specs)

    def host_names(self, node: Node, key: str, address: str | None, room: int) -> list[str]:
        """The entry's host, or the hosts of its node set (``gpu[01-04]``) in order; a file of more
        than ``MAX_HOSTS`` hosts (``room``: how many more it may have) is refused before expanding."""
        host = self.string(node, f"{key}.host", name_like=True)
        count = size(host) if is_nodeset(host) else 1
        if count > room:
            what = f"is {count:,} hosts" if room == MAX_HOSTS else f"makes {MAX_HOSTS - room + count:,} hosts in all"
            raise self.error(f"{host!r} {what}; a hosts file may have at most {MAX_HOSTS:,}", node, f"{key}.host")
        if not is_nodeset(host):
            return [host]
        try:
            names = expand(host)
        except NodeSetError as exc:
            raise self.error(f"invalid node set: {exc.reason} at position {exc.column} of {host!r}", node,
                             f"{key}.host", "node sets look like gpu[01-08], gpu[01-04,07] or rack[1-2]-n[1-4]"
                             ) from None
        if address is not None and len(names) > 1:
            raise self.error(f"'address' names one machine, but {host!r} is {len(names)} hosts", node,
                             f"{key}.address", "give each host with its own address its own entry")
        return names

    def host_spec(self, host: str, address: str | None, entry: Node, own: _Settings, defaults: _Settings,
                  env: dict[str, str], key: str) -> HostSpec:
        """Merge one entry over ``defaults`` (the entry's own value wins) and resolve ``nproc``."""
        merged = {**defaults.values, **own.values}
        merged["env"] = {**env, **defaults.values.get("env", {}), **own.values.get("env", {})}
        forward = (*self.top_forward, *defaults.values.get("forward_env", ()), *own.values.get("forward_env", ()))
        merged["forward_env"] = tuple(dict.fromkeys(forward))
        merged["env_file"] = (*self.top_files, *defaults.values.get("env_file", ()), *own.values.get("env_file", ()))
        gpus, nproc = merged.get("gpus"), merged.pop("nproc", None)
        if gpus is not None and nproc is not None and nproc != len(gpus):
            def origin(name: str) -> tuple[str, Node | None]:
                if name in own.nodes:
                    return "", own.nodes[name]
                return f" (from defaults, line {line_of(defaults.nodes[name])})", None

            g_from, g_node = origin("gpus")
            n_from, n_node = origin("nproc")
            raise self.error(f"gpus{g_from} gives {len(gpus)} processes but nproc{n_from} is {nproc}",
                             n_node or g_node or entry, key,
                             "one process runs per GPU: drop nproc, or make it equal the number of GPUs")
        nproc = len(gpus) if gpus is not None else nproc or 1
        if merged.get("sync") is not None and merged.get("workdir") is None:
            where = own.nodes.get("sync") or defaults.nodes.get("sync") or entry
            raise self.error("sync needs a workdir: the directory on the host that the files are copied to",
                             where, f"{key}.sync", "set `workdir:` for this host (or in defaults)")
        return HostSpec(host=host, line=line_of(entry), address=address, nproc=nproc, **merged)
