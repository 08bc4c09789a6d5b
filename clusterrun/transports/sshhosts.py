"""An SSH host resolved the way OpenSSH does (``ssh -G``, else paramiko's parser) and its host key
checked against the known_hosts files (``KnownHosts``, ``HostKeyPolicy``).
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from clusterrun.config.hostsfile import HostSpec
from clusterrun.core.errors import ConnectError, HostKeyError
from clusterrun.core.frozen import frozen
from clusterrun.transports import sshgcache
from clusterrun.transports.sshlib import fingerprint, paramiko

CONNECT_TIMEOUT = 10.0


@frozen
class SSHOptions:
    """Settings for every SSH host of a run (from the hosts file and the command line)."""

    ssh_config: str | None = None
    accept_new_host_keys: bool = False


@dataclass
class ResolvedHost:
    """What ``ssh -G`` says about a host, with the hosts file's values applied."""

    alias: str
    hostname: str
    port: int = 22
    user: str | None = None
    identity_files: list[str] = field(default_factory=list)
    identities_only: bool = False
    proxy_jump: str | None = None
    proxy_command: str | None = None
    known_hosts: list[str] = field(default_factory=list)
    connect_timeout: float = CONNECT_TIMEOUT


# `ssh -G`'s answers, reused for a while: a run resolves a jump host once for all the hosts behind
# it, and a long-lived monitor still sees a configuration edited since. Between runs they are kept
# on disk while the configuration files are unchanged (sshgcache, which reads those files as often).
SSH_G_REUSE = 60.0
_answers: dict[tuple[str, str | None, int | None, str | None], tuple[float, dict[str, list[str]] | None]] = {}
_answers_lock = threading.Lock()


def _ssh_g(alias: str, config: str | None, port: int | None, user: str | None) -> dict[str, list[str]] | None:
    key = (alias, config, port, user)
    with _answers_lock:
        found = _answers.get(key)
    if found is not None and time.monotonic() - found[0] < SSH_G_REUSE:
        return found[1]
    values = _run_ssh_g(alias, config, port, user)
    with _answers_lock:
        _answers[key] = (time.monotonic(), values)
    return values


def _run_ssh_g(alias: str, config: str | None, port: int | None, user: str | None) -> dict[str, list[str]] | None:
    ssh = shutil.which("ssh")
    if ssh is None:
        return None
    kept, values = sshgcache.load(alias, config, port, user, ssh, reuse=SSH_G_REUSE)
    if values is not None:
        return values
    argv = [ssh, "-G"]
    if config:
        argv += ["-F", os.path.expanduser(config)]
    if port:
        argv += ["-p", str(port)]
    if user:
        argv += ["-l", user]
    argv += ["--", alias]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        raise ConnectError(alias, f"ssh -G could not read the ssh configuration: {proc.stderr.strip()}",
                           hint="check the ssh_config file named in the hosts file or by --ssh-config")
    values = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        values.setdefault(key.lower(), []).append(value)
    if kept is not None:
        sshgcache.store(kept, values)
    return values


def _paramiko_lookup(alias: str, config: str | None) -> dict[str, list[str]]:
    path = os.path.expanduser(config or "~/.ssh/config")
    values: dict[str, list[str]] = {}
    if os.path.exists(path):
        try:
            found = paramiko.SSHConfig.from_path(path).lookup(alias)
        except (OSError, paramiko.ssh_exception.ConfigParseError) as exc:
            raise ConnectError(alias, f"cannot read {path}: {exc}") from None
        except ImportError:  # `Match exec`: see the import of paramiko above
            raise ConnectError(alias, f"{path} uses `Match exec`, which clusterrun evaluates with OpenSSH's "
                               "`ssh -G`, and no `ssh` command was found",
                               hint="install the OpenSSH client (Debian: openssh-client)") from None
        for key, value in found.items():
            values[key] = list(value) if isinstance(value, list) else [str(value)]
    return values


def resolve(host: HostSpec, options: SSHOptions, alias: str | None = None) -> ResolvedHost:
    """Resolve ``host`` (or a jump host ``alias``) the way OpenSSH would."""
    name = alias or host.host
    port = host.port if alias is None else None
    user = host.user if alias is None else None
    values = _ssh_g(name, options.ssh_config, port, user)
    if values is None:
        values = _paramiko_lookup(name, options.ssh_config)

    def first(key: str) -> str | None:
        found = values.get(key)
        return found[0] if found else None

    identity = [os.path.expanduser(p) for p in values.get("identityfile", [])]
    if alias is None and host.identity_file:
        identity.insert(0, os.path.expanduser(host.identity_file))
    known = []
    for key in ("userknownhostsfile", "globalknownhostsfile"):
        for item in values.get(key, []):
            known += [os.path.expanduser(p) for p in item.split()]
    if not known:
        known = [os.path.expanduser("~/.ssh/known_hosts"), "/etc/ssh/ssh_known_hosts"]
    jump = first("proxyjump")
    command = first("proxycommand")
    timeout = first("connecttimeout")
    return ResolvedHost(
        alias=name,
        hostname=first("hostname") or name,
        port=port or int(first("port") or 22),
        user=user or first("user") or None,
        identity_files=identity,
        identities_only=(first("identitiesonly") or "no").lower() == "yes",
        proxy_jump=None if jump in (None, "none") else jump,
        proxy_command=None if command in (None, "none") else command,
        known_hosts=known,
        connect_timeout=float(timeout) if timeout and timeout.isdigit() else CONNECT_TIMEOUT,
    )


class _Marked(NamedTuple):
    """A ``@revoked`` or ``@cert-authority`` line of a known_hosts file."""

    where: str  # path:line
    patterns: str
    blob: bytes  # the key's wire format


@dataclass
class KnownHosts:
    """What the known_hosts files say: plain entries, revoked keys, CA lines. ``read`` each file,
    then ``install`` the entries whose key is not revoked into a client's host keys."""

    entries: list[paramiko.hostkeys.HostKeyEntry] = field(default_factory=list)
    revoked: list[_Marked] = field(default_factory=list)
    authorities: list[_Marked] = field(default_factory=list)

    def read(self, path: str) -> None:
        """Keep the entries and marked lines of ``path``. Unreadable lines are skipped (as OpenSSH
        does); paramiko would refuse the whole file for one of them."""
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("@"):
                fields = line.split()
                if len(fields) >= 4 and fields[0] in ("@revoked", "@cert-authority"):
                    try:
                        blob = base64.b64decode(fields[3], validate=True)
                    except binascii.Error:
                        continue
                    mark = _Marked(f"{path}:{number}", fields[1], blob)
                    (self.revoked if fields[0] == "@revoked" else self.authorities).append(mark)
                continue
            try:
                entry = paramiko.hostkeys.HostKeyEntry.from_line(line, number)
            except (paramiko.hostkeys.InvalidHostKey, paramiko.SSHException, ValueError):
                continue
            if entry is not None and entry.key is not None:
                self.entries.append(entry)

    def install(self, keys: paramiko.HostKeys, name: str) -> None:
        """Add to ``keys`` the entries paramiko would find for ``name`` (the host, or ``[host]:port``:
        that name or a hashed one), but revoked keys: a host with only those has no known key, and
        the policy refuses it. Not every entry: paramiko's ``add`` scans all it holds, and each of N
        connections would hold the N hosts' keys."""
        blobs = {m.blob for m in self.revoked}
        for entry in self.entries:
            if any(h == name or h.startswith("|1|") for h in entry.hostnames) and entry.key.asbytes() not in blobs:
                for each in entry.hostnames:
                    keys.add(each, entry.key.get_name(), entry.key)

    def revocation(self, key: paramiko.PKey) -> _Marked | None:
        blob = key.asbytes()
        return next((m for m in self.revoked if m.blob == blob), None)

    def authority_for(self, hostname: str) -> _Marked | None:
        """A ``@cert-authority`` line whose host patterns match ``hostname`` (``[host]:port`` too)."""
        for mark in self.authorities:
            allowed = False
            for pattern in mark.patterns.split(","):
                negated = pattern.startswith("!")
                if fnmatch.fnmatchcase(hostname.lower(), pattern.lstrip("!").lower()):
                    if negated:
                        allowed = False
                        break
                    allowed = True
            if allowed:
                return mark
        return None


_known: dict[tuple[tuple[str, int, int, int], ...], KnownHosts] = {}
_known_lock = threading.Lock()


def known_hosts(paths: list[str]) -> KnownHosts:
    """The ``KnownHosts`` of the files at ``paths`` that exist, read once for all connections
    while none of them changes (their inode, size and mtime); ``OSError`` when one cannot be read."""
    stats = []
    for path in paths:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        stats.append((path, st.st_ino, st.st_size, st.st_mtime_ns))
    key = tuple(stats)
    with _known_lock:
        found = _known.get(key)
        if found is None:
            found = KnownHosts()
            for path, *_ in stats:
                found.read(path)
            if len(_known) >= 8:  # files edited during a long run (a monitor's): keep the last few
                _known.clear()
            _known[key] = found
    return found


class HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse unknown keys (saying how to fix it), or record them when the user opted in; never
    accept a revoked key."""

    def __init__(self, target: ResolvedHost, accept_new: bool, known: KnownHosts | None = None) -> None:
        self.target = target
        self.accept_new = accept_new
        self.known = known or KnownHosts()

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        t = self.target
        revoked = self.known.revocation(key)
        if revoked is not None:
            raise HostKeyError(
                t.alias, f"the host key of {hostname} ({key.get_name()} {fingerprint(key)}) is REVOKED "
                f"({revoked.where}: @revoked); nothing was started",
                hint="the key must never be accepted: ask the host's administrator for its new key")
        authority = self.known.authority_for(hostname)
        if authority is not None and not self.accept_new:
            raise HostKeyError(
                t.alias, f"no key of {hostname} is known, and host certificates ({authority.where}: "
                f"@cert-authority) are not supported by clusterrun; nothing was started",
                hint=f"check the fingerprint ({key.get_name()} {fingerprint(key)}), then add the host's own key: "
                     f"`{_keyscan(t)} >> ~/.ssh/known_hosts`")
        if not self.accept_new:
            raise HostKeyError(
                t.alias, f"unknown host key for {hostname} ({key.get_name()} {fingerprint(key)}); nothing was started",
                hint=f"check the fingerprint, then `{_keyscan(t)} >> ~/.ssh/known_hosts`, "
                     "or run again with --accept-new-host-keys to record it")
        path = t.known_hosts[0]
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


def _keyscan(t: ResolvedHost) -> str:
    return f"ssh-keyscan -p {t.port} {t.hostname}" if t.port != 22 else f"ssh-keyscan {t.hostname}"


__all__ = ["CONNECT_TIMEOUT", "HostKeyPolicy", "KnownHosts", "ResolvedHost", "SSHOptions", "known_hosts", "resolve"]
