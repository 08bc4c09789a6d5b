"""The SSH transport: paramiko, configured like OpenSSH's ``ssh`` and strict about host keys.

Lifecycle: create → ``connect()`` (resolve the host through ssh_config, open one connection,
check the host key, authenticate) → ``stream()`` / ``call()`` open one session channel each on
that connection → ``close()``. A connection that died is opened again by the next ``stream()``,
and so is one on which a channel could not be opened (see ``SSHTransport.session``): paramiko
cannot tell a connection whose peer vanished (its keepalives ask for no answer; TCP gives up
after some 15 minutes), and requests made on it wait in TCP for the link to return.

- The host is resolved with ``ssh -G`` where the OpenSSH client is installed (so ``Include``,
  ``Match`` and every default behave exactly as for ``ssh``), else with paramiko's parser.
  ``port``, ``user`` and ``identity_file`` from the hosts file win over the config.
- Host keys are checked against ``UserKnownHostsFile`` and ``GlobalKnownHostsFile`` (hashed and
  ``[host]:port`` entries included). An unknown key is refused with the fix in the message; with
  ``accept_new`` it is appended, as OpenSSH's ``StrictHostKeyChecking=accept-new`` does. A key
  that changed is always refused. Jump hosts are checked the same way. A key marked
  ``@revoked`` is refused for every host, naming the file and line; ``@cert-authority`` (host
  certificates) is not supported: a host it names with no key of its own is refused, naming the
  line. Lines that cannot be read are skipped, as OpenSSH does.
- ``ProxyJump`` (any number of hops, each over a ``direct-tcpip`` channel) and ``ProxyCommand``.
- The remote command is constant (``python -S -c BOOTSTRAP``); the job travels on stdin. No pty.
- Every paramiko and socket exception is translated here, in ``map_error``; paramiko's log
  records go nowhere (a ``NullHandler``): without one, Python's last-resort handler prints
  their warnings raw on the user's terminal.
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import hashlib
import logging
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from clusterrun.config import HostSpec
from clusterrun.errors import AuthError, ConnectError, HostKeyError, TransportError
from clusterrun.transports.base import AgentSession, Transport, agent_bundle, agent_command

# paramiko imports invoke (and asyncio: docs/benchmarks.md) only to run `Match exec` in its own
# ssh_config parser, which clusterrun uses only where OpenSSH's `ssh -G` is missing (then `Match
# exec` is reported, see _paramiko_lookup). Hidden while paramiko is imported, and only then.
_hide_invoke = "invoke" not in sys.modules
if _hide_invoke:
    sys.modules["invoke"] = None  # type: ignore[assignment]  # the documented way to block an import
try:
    import paramiko
finally:
    if _hide_invoke:
        del sys.modules["invoke"]
logging.getLogger("paramiko").addHandler(logging.NullHandler())


CONNECT_TIMEOUT = 10.0
# Channel flow control: paramiko's default 32 KB packets make `logs` pay its per-packet Python
# work (MAC, window adjustments, wake-ups) once per 32 KB. The window bounds what a slow reader
# holds in memory per node (16 MB was no faster than 4).
WINDOW_SIZE = 4 * 2**20
MAX_PACKET = 2**17  # OpenSSH sends up to 256 KB per packet
# AES-GCM first: an AEAD cipher, done in one call of `cryptography` per packet, where the
# CTR ciphers paramiko prefers need a separate HMAC in Python's hmac module. Everything else
# paramiko supports stays allowed, after it (servers without GCM still work).
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
MAX_SESSIONS = 8  # sshd's MaxSessions defaults to 10 per connection
CONNECT_ATTEMPTS = 5  # sshd's MaxStartups drops connections under load: retry those
MAX_JUMPS = 5


@dataclass(frozen=True)
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


def _ssh_g(alias: str, config: str | None, port: int | None, user: str | None) -> dict[str, list[str]] | None:
    ssh = shutil.which("ssh")
    if ssh is None:
        return None
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
    values: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        values.setdefault(key.lower(), []).append(value)
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


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


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

    def install(self, keys: paramiko.HostKeys) -> None:
        """Add every entry to ``keys`` but revoked keys: a host with only those has no known key,
        and the policy refuses it."""
        blobs = {m.blob for m in self.revoked}
        for entry in self.entries:
            if entry.key.asbytes() not in blobs:
                for name in entry.hostnames:
                    keys.add(name, entry.key.get_name(), entry.key)

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


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
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


def map_error(host: str, exc: BaseException) -> TransportError:
    """Translate a paramiko or socket exception into clusterrun's error tree."""
    if isinstance(exc, TransportError):
        return exc
    if isinstance(exc, paramiko.BadHostKeyException):
        return HostKeyError(host, f"the host key of {exc.hostname} has CHANGED: it is now {exc.key.get_name()} "
                            f"{fingerprint(exc.key)}, known_hosts expects {fingerprint(exc.expected_key)}",
                            hint="if the machine was reinstalled, remove the old key with "
                                 f"`ssh-keygen -R {shlex.quote(exc.hostname)}`; otherwise someone may be "
                                 "intercepting the "
                                 "connection")
    if isinstance(exc, paramiko.PasswordRequiredException):
        return AuthError(host, f"the private key is encrypted: {exc}",
                         hint="add it to ssh-agent (ssh-add) so clusterrun can use it")
    if isinstance(exc, (paramiko.AuthenticationException, paramiko.ssh_exception.UnableToAuthenticate)):
        return AuthError(host, f"authentication failed: {exc}",
                         hint="check `user` and `identity_file` for this host, or load the key into ssh-agent")
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        return ConnectError(host, f"cannot connect: {exc.strerror or exc}")
    if isinstance(exc, paramiko.ssh_exception.ProxyCommandFailure):
        return ConnectError(host, f"ProxyCommand failed: {exc}")
    if isinstance(exc, paramiko.ChannelException):
        return ConnectError(host, f"the SSH server refused a channel: {exc.text}")
    if isinstance(exc, paramiko.SSHException):
        return ConnectError(host, f"SSH error: {exc}")
    if isinstance(exc, socket.timeout | TimeoutError):
        return ConnectError(host, "timed out", hint="is the host up and reachable on its SSH port?")
    if isinstance(exc, socket.gaierror):
        return ConnectError(host, f"cannot resolve the host name: {exc.strerror}")
    if isinstance(exc, OSError):
        return ConnectError(host, f"cannot connect: {exc.strerror or exc}")
    return ConnectError(host, f"{type(exc).__name__}: {exc}")


def _is_throttled(exc: BaseException) -> bool:
    """sshd's MaxStartups closes surplus connections before the banner: worth retrying."""
    text = str(exc)
    return isinstance(exc, paramiko.SSHException) and not isinstance(exc, paramiko.AuthenticationException) and (
        "banner" in text or "reset" in text.lower() or "closed" in text.lower())


class SSHTransport(Transport):
    """Runs the agent on a host over one reused SSH connection."""

    def __init__(self, host: HostSpec, options: SSHOptions | None = None) -> None:
        super().__init__(host)
        self.options = options or SSHOptions()
        self._client: paramiko.SSHClient | None = None
        self._jumps: list[paramiko.SSHClient] = []
        self._lock = threading.Lock()
        self._sessions = threading.BoundedSemaphore(MAX_SESSIONS)
        self._resolved: ResolvedHost | None = None

    @property
    def python(self) -> str:
        return self.host.python or "python3"

    @property
    def address(self) -> str | None:
        return self._resolved.hostname if self._resolved else None

    # ---------------------------------------------------------------------------- connecting

    def _open(self, target: ResolvedHost, depth: int = 0) -> paramiko.SSHClient:
        sock: Any = None
        if target.proxy_jump:
            if depth >= MAX_JUMPS:
                raise ConnectError(self.name, f"more than {MAX_JUMPS} ProxyJump hops")
            hops = target.proxy_jump.split(",")
            jump = resolve(self.host, self.options, alias=_jump_alias(hops[-1]))
            if len(hops) > 1:
                jump.proxy_jump = ",".join(hops[:-1])
            spec_user, spec_port = _jump_user_port(hops[-1])
            jump.user = spec_user or jump.user
            jump.port = spec_port or jump.port
            jump_client = self._open(jump, depth + 1)
            self._jumps.append(jump_client)
            transport = jump_client.get_transport()
            if transport is None:
                raise ConnectError(self.name, f"jump host {jump.alias} closed the connection")
            try:
                sock = transport.open_channel("direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0),
                                              timeout=target.connect_timeout)
            except Exception as exc:  # noqa: BLE001 - translated right here
                raise map_error(self.name, exc) from exc
        elif target.proxy_command:
            command = (target.proxy_command.replace("%h", target.hostname).replace("%p", str(target.port))
                       .replace("%r", target.user or "").replace("%%", "%"))
            sock = paramiko.ProxyCommand(command)
        client = paramiko.SSHClient()
        known = KnownHosts()
        for path in target.known_hosts:
            if os.path.exists(path):
                try:
                    known.read(path)
                except OSError as exc:
                    raise HostKeyError(target.alias, f"cannot read {path}: {exc.strerror or exc}") from None
        known.install(client.get_host_keys())
        client.set_missing_host_key_policy(_HostKeyPolicy(target, self.options.accept_new_host_keys, known))
        keys = [p for p in target.identity_files if os.path.exists(p)]
        delay = 0.2
        for attempt in range(CONNECT_ATTEMPTS):
            try:
                client.connect(
                    target.hostname, port=target.port, username=target.user,
                    key_filename=keys or None,  # type: ignore[arg-type]  # a list is documented and works
                    allow_agent=not (target.identities_only and keys), look_for_keys=False, sock=sock,
                    timeout=target.connect_timeout, banner_timeout=target.connect_timeout,
                    auth_timeout=target.connect_timeout, channel_timeout=target.connect_timeout,
                    transport_factory=_transport,
                )
                break
            except Exception as exc:  # noqa: BLE001 - every failure is translated by map_error
                client.close()
                if attempt + 1 < CONNECT_ATTEMPTS and sock is None and _is_throttled(exc):
                    time.sleep(delay)
                    delay *= 2
                    continue
                error = map_error(target.alias, exc)
                if target.alias != self.name:
                    error.message = f"via jump host {target.alias}: {error.message}"
                    error.host = self.name
                raise error from exc
        transport = client.get_transport()
        if transport is not None:
            transport.set_keepalive(5)
        return client

    def connect(self) -> None:
        with self._lock:
            if self._client is not None:
                transport = self._client.get_transport()
                if transport is not None and transport.is_active():
                    return
                self._close_clients()
            self._resolved = resolve(self.host, self.options)
            self._client = self._open(self._resolved)

    def _drop(self, client: paramiko.SSHClient | None) -> None:
        """Close ``client``'s connection, unless another one has replaced it already: no channel
        opened on it in time, so its peer is gone or cut off. Kept, it would queue every later
        request in TCP; paramiko forgets a channel whose opening timed out, and when the link
        returns sshd would open each of them for nobody until its MaxSessions (10 by default)
        refused all the others on that connection."""
        with self._lock:
            if client is not None and client is self._client:
                self._close_clients()

    def _close_clients(self) -> None:
        for client in [self._client, *reversed(self._jumps)]:
            if client is not None:
                client.close()
        self._client = None
        self._jumps = []

    # ------------------------------------------------------------------------------- running

    def session(self) -> AgentSession:
        transport, channel = self._channel(shlex.join(agent_command(self.python)))  # constant: no job data
        released = threading.Event()

        def send(data: bytes) -> None:
            try:
                channel.sendall(data)
            except Exception as exc:  # noqa: BLE001 - translated by map_error
                if transport.is_active() and (channel.closed or channel.exit_status_ready()):
                    return  # the command ended (e.g. no such python): reading says so, with its stderr
                raise map_error(self.name, exc) from exc

        def drain_stderr() -> None:
            try:
                while channel.recv_stderr_ready():
                    self._stderr_tail = (self._stderr_tail + channel.recv_stderr(65536))[-2000:]
            except (OSError, paramiko.SSHException):
                pass

        def close() -> None:
            if released.is_set():
                return
            released.set()
            drain_stderr()
            try:
                channel.close()
            except (EOFError, OSError, paramiko.SSHException):
                pass  # the connection is dead already (paramiko raises EOFError sending the close)
            finally:
                self._sessions.release()

        def last_words() -> str:
            drain_stderr()
            return self._last_words()

        try:  # sends the agent's loader and the sha256 of its zip at once
            return AgentSession(self.name, send, self._lines(channel), close, set_timeout=channel.settimeout,
                                last_words=last_words, bundle=agent_bundle())
        except BaseException:
            self._sessions.release()
            channel.close()
            raise

    _stderr_tail = b""

    # ------------------------------------------------------------------- commands and SFTP (sync)

    files = "ssh"

    def _channel(self, command: str | None = None) -> tuple[paramiko.Transport, paramiko.Channel]:
        """A new channel on the connection running ``command`` (if any), holding one of its
        ``MAX_SESSIONS`` until ``_done``. A channel that cannot be opened drops the connection
        (``_drop``), unless sshd refused it: then the connection works."""
        self.connect()
        client = self._client
        transport = client.get_transport() if client is not None else None
        if transport is None:
            raise ConnectError(self.name, "the connection closed")
        self._sessions.acquire()
        try:
            channel = transport.open_session(window_size=WINDOW_SIZE, max_packet_size=MAX_PACKET,
                                             timeout=CONNECT_TIMEOUT)
            if command is not None:
                channel.exec_command(command)
        except Exception as exc:  # noqa: BLE001 - translated by map_error
            self._sessions.release()
            if not isinstance(exc, paramiko.ChannelException):
                self._drop(client)
            raise map_error(self.name, exc) from exc
        return transport, channel

    def _done(self, channel: paramiko.Channel) -> None:
        try:
            channel.close()
        except (EOFError, OSError, paramiko.SSHException):
            pass
        finally:
            self._sessions.release()

    def pipe(self, command: str, peer: socket.socket) -> tuple[int, str]:
        _, channel = self._channel(command)
        stderr: list[bytes] = []

        def upstream() -> None:  # the local side's bytes to the command's stdin, then its EOF
            try:
                while data := peer.recv(MAX_PACKET):
                    channel.sendall(data)
                channel.shutdown_write()
            except (OSError, EOFError, paramiko.SSHException):
                pass

        def errors() -> None:
            try:
                while data := channel.recv_stderr(65536):
                    stderr.append(data)
            except (OSError, EOFError, paramiko.SSHException):
                pass

        try:
            threads = [threading.Thread(target=upstream, daemon=True, name=f"pipe-in-{self.name}"),
                       threading.Thread(target=errors, daemon=True, name=f"pipe-err-{self.name}")]
            for thread in threads:
                thread.start()
            try:
                while data := channel.recv(MAX_PACKET * 4):
                    peer.sendall(data)
                peer.shutdown(socket.SHUT_WR)
            except (OSError, EOFError, paramiko.SSHException):
                pass  # the local side is gone: its exit says why
            status = channel.recv_exit_status()  # -1: the connection ended without one
            threads[1].join(timeout=5)
            return status, b"".join(stderr)[-4000:].decode(errors="replace")
        finally:
            self._done(channel)

    @contextmanager
    def sftp(self) -> Iterator[paramiko.SFTPClient | None]:
        """paramiko's SFTP client on the connection; None when the server has no usable SFTP
        subsystem. paramiko's own errors in the block are translated (``map_error``)."""
        transport, channel = self._channel()
        try:
            try:
                channel.invoke_subsystem("sftp")
            except Exception as exc:  # noqa: BLE001 - a refusal, or a dead connection (map_error)
                if transport.is_active() and not isinstance(exc, socket.timeout | TimeoutError):
                    yield None
                    return
                raise map_error(self.name, exc) from exc
            try:
                client = paramiko.SFTPClient(channel)
            except (paramiko.SSHException, paramiko.SFTPError, EOFError, OSError):  # a login shell printing into it
                yield None
                return
            try:
                yield client
            except (paramiko.SSHException, paramiko.SFTPError, EOFError) as exc:  # the connection died under it
                raise map_error(self.name, exc) from exc
        finally:
            self._done(channel)

    def _lines(self, channel: paramiko.Channel) -> Iterator[bytes]:
        # A log message is one line of up to a few MB: keep its pieces in a list and look for the
        # newline only in what just arrived (not in the whole line again at every read).
        pieces: list[bytes] = []
        while True:
            try:
                data = channel.recv(MAX_PACKET * 4)
            except Exception as exc:  # noqa: BLE001 - a timeout or a dead connection
                raise map_error(self.name, exc) from exc
            if not data:
                if pieces:
                    yield b"".join(pieces)
                return
            if b"\n" not in data:
                pieces.append(data)
                continue
            first, *lines, rest = data.split(b"\n")
            pieces.append(first)
            yield b"".join(pieces)
            yield from lines
            pieces = [rest] if rest else []

    def _last_words(self) -> str:
        text = self._stderr_tail.decode(errors="replace").strip()
        return f": {text.splitlines()[-1]}" if text else ""

    def close(self) -> None:
        with self._lock:
            self._close_clients()


def _transport(sock: Any, **kwargs: Any) -> paramiko.Transport:
    """paramiko's Transport with the ciphers in the order of PREFERRED_CIPHERS."""
    transport = paramiko.Transport(sock, **kwargs)
    options = transport.get_security_options()
    known = tuple(options.ciphers)
    options.ciphers = tuple(c for c in PREFERRED_CIPHERS if c in known) + tuple(
        c for c in known if c not in PREFERRED_CIPHERS)
    return transport


def _jump_alias(hop: str) -> str:
    """``user@host:port`` → ``host`` (ProxyJump syntax)."""
    hop = hop.split("@", 1)[-1]
    if hop.startswith("["):
        return hop[1:].split("]", 1)[0]
    return hop.rsplit(":", 1)[0] if hop.count(":") == 1 else hop


def _jump_user_port(hop: str) -> tuple[str | None, int | None]:
    user = hop.split("@", 1)[0] if "@" in hop else None
    rest = hop.split("@", 1)[-1]
    port = None
    if rest.startswith("[") and "]:" in rest:
        port = int(rest.rsplit(":", 1)[1])
    elif rest.count(":") == 1:
        port = int(rest.rsplit(":", 1)[1])
    return user, port
