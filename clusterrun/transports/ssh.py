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
- Every paramiko and socket exception is translated in one place, ``sshlib.map_error``; paramiko
  is imported there, its log records going nowhere (a ``NullHandler``): without one, Python's
  last-resort handler prints their warnings raw on the user's terminal.

This module holds the connection and its channels; ``sshhosts`` resolves the host and checks its key.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import threading
import time
from typing import Any

from clusterrun.config.hostsfile import HostSpec
from clusterrun.core import timings
from clusterrun.core.errors import ConnectError, HostKeyError
from clusterrun.transports.base import AgentReader, AgentSession, Transport, agent_bundle, agent_command
from clusterrun.transports.sshhosts import (
    CONNECT_TIMEOUT,
    HostKeyPolicy,
    ResolvedHost,
    SSHOptions,
    known_hosts,
    resolve,
)
from clusterrun.transports.sshlib import is_throttled, known_hosts_name, map_error, paramiko

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
CLOSE_WAIT = 1.0  # how long close() waits for a connect in progress to let go (see close())
# paramiko's reader thread looks for a close, a keepalive due and a rekey asked for only when a
# read of its socket times out; one that receives something within the timeout never does. Above
# the agent's heartbeat (5 s): a followed connection's reader wakes only for its messages, and
# sends no keepalive (the heartbeats keep the link's NAT and firewall state); an idle one sends
# its keepalive every READER_WAKE seconds (see connect()).
READER_WAKE = 10.0


class SSHTransport(Transport):
    """Runs the agent on a host over one reused SSH connection."""

    def __init__(self, host: HostSpec, options: SSHOptions | None = None) -> None:
        super().__init__(host)
        self.options = options or SSHOptions()
        self._client: paramiko.SSHClient | None = None
        self._jumps: list[paramiko.SSHClient] = []
        self._lock = threading.Lock()
        self._finding = threading.Lock()
        self._sessions = threading.BoundedSemaphore(MAX_SESSIONS)
        self._resolved: ResolvedHost | None = None
        # Clients whose connect is under way (the jump hosts' too), for close() to abort their wait
        # for the banner, the key exchange or the authentication; _closing makes a connect that
        # ends after close() close its own client (a TCP connect cannot be aborted from outside).
        self._connecting: set[paramiko.SSHClient] = set()
        self._closing = False
        self._ahead: _Ahead | None = None  # connect_ahead's work, expected or under way

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
        try:
            known = known_hosts(target.known_hosts)
        except OSError as exc:
            raise HostKeyError(target.alias, f"cannot read {exc.filename}: {exc.strerror or exc}") from None
        known.install(client.get_host_keys(), known_hosts_name(target.hostname, target.port))
        client.set_missing_host_key_policy(HostKeyPolicy(target, self.options.accept_new_host_keys, known))
        keys = [p for p in target.identity_files if os.path.exists(p)]
        began = time.monotonic()
        self._connecting.add(client)
        try:
            self._connect(client, target, keys, sock)
        finally:
            self._connecting.discard(client)
        if self._closing:  # close() came while this connected: nobody will use it
            client.close()
            raise ConnectError(self.name, "the connection was closed while it was being made")
        transport = client.get_transport()
        if transport is not None:
            transport.set_keepalive(5)
            # paramiko's timeout (0.1 s) woke the thread 10 times a second per host while a job is
            # quiet (docs/benchmarks.md, "The cost of watching"). close() does not wait for it: the
            # server's answer to the channels' close wakes it, a dead link's timeout at the latest.
            with contextlib.suppress(AttributeError, OSError):
                transport.sock.settimeout(READER_WAKE)
            kex_done = getattr(transport, "kex_done", None) or began
            timings.record(self.name, "connect", began, kex_done)
            timings.record(self.name, "authenticate", kex_done)
        return client

    def _connect(self, client: paramiko.SSHClient, target: ResolvedHost, keys: list[str], sock: Any) -> None:
        """``client.connect`` to ``target``, again after a while when sshd's MaxStartups dropped it."""
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
                if attempt + 1 < CONNECT_ATTEMPTS and sock is None and is_throttled(exc) and not self._closing:
                    time.sleep(delay)
                    delay *= 2
                    continue
                error = map_error(target.alias, exc, port=target.port)
                if target.alias != self.name:
                    error.message = f"via jump host {target.alias}: {error.message}"
                    error.host = self.name
                raise error from exc

    def resolve(self) -> None:
        """``ssh -G``'s answer for the host (its address, port, user, keys, jumps), once."""
        self._resolve()

    def _resolve(self) -> ResolvedHost:
        with self._finding:  # not the connection's lock: finding a host never waits for its connect
            if self._resolved is None:
                with timings.span(self.name, "resolve"):
                    self._resolved = resolve(self.host, self.options)
            return self._resolved

    def expect_ahead(self) -> bool:
        self._ahead = _Ahead()
        return True

    def connect_ahead(self) -> None:
        """The connection and the agent's channel (its shell and Python started on the host) opened
        in ``connect_early``'s thread while the command loads the rest of itself: the next
        ``connect()`` waits for it and raises its error (a host is not tried twice), and the next
        ``session()`` is that channel."""
        ahead = self._ahead
        if ahead is None:
            return
        ahead.thread = threading.get_ident()
        try:
            self.connect()
            if self._ahead is ahead:  # not closed meanwhile (close() forgets it)
                ahead.session = self.session()
        except BaseException as exc:  # noqa: BLE001 - raised again by the connect() that waits for it
            ahead.error = exc
        finally:
            ahead.done.set()

    def _after_ahead(self, take: bool) -> AgentSession | None:
        """Wait for ``connect_ahead`` if it is expected or under way in another thread; raise its
        error (once); with ``take``, hand over its session (once)."""
        ahead = self._ahead
        if ahead is None or ahead.thread == threading.get_ident():
            return None
        ahead.done.wait()
        if ahead.error is not None or take:
            self._ahead = None
        if ahead.error is not None:
            raise ahead.error
        if not take:
            return None
        session, ahead.session = ahead.session, None
        return session

    def connect(self) -> None:
        self._after_ahead(take=False)
        with self._lock:
            self._closing = False  # a new use after a close()
            if self._client is not None:
                transport = self._client.get_transport()
                if transport is not None and transport.is_active():
                    return
                self._close_clients()
            self._client = self._open(self._resolve())

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
                # Shut the socket down first: paramiko only closes it, which on Linux leaves its reader
                # thread blocked in recv until the server next says something (up to READER_WAKE later)
                sock = getattr(client.get_transport(), "sock", None)
                if isinstance(sock, socket.socket):
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                client.close()
        self._client = None
        self._jumps = []

    # ------------------------------------------------------------------------------- running

    def session(self) -> AgentSession:
        ahead = self._after_ahead(take=True)
        if ahead is not None:
            return ahead
        opened = time.monotonic()  # the agent's phase of the timeline: the channel, shell and Python
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
            return AgentSession(self.name, send, self._reader(channel), close, set_timeout=channel.settimeout,
                                last_words=last_words, bundle=agent_bundle(), opened=opened, asides=True)
        except BaseException:
            self._sessions.release()
            channel.close()
            raise

    _stderr_tail = b""

    # ------------------------------------------------------------------------- commands (sync)

    files = "ssh"

    def _channel(self, command: str) -> tuple[paramiko.Transport, paramiko.Channel]:
        """A new channel on the connection running ``command``, holding one of its
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

    def _reader(self, channel: paramiko.Channel) -> AgentReader:
        def recv() -> bytes:
            try:
                return channel.recv(MAX_PACKET * 4)
            except Exception as exc:  # noqa: BLE001 - a timeout or a dead connection
                raise map_error(self.name, exc) from exc

        return AgentReader(recv)

    def _last_words(self) -> str:
        text = self._stderr_tail.decode(errors="replace").strip()
        return f": {text.splitlines()[-1]}" if text else ""

    def close(self) -> None:
        """Close the connection; one being made is aborted where paramiko waits for the server
        (a TCP connect is not: that connect closes its client when it ends, within ConnectTimeout)."""
        self._closing = True
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.session is not None:  # opened ahead, never used
            ahead.session.close()
        for client in list(self._connecting):
            client.close()  # its connect raises at once
        if self._lock.acquire(timeout=CLOSE_WAIT):
            try:
                self._close_clients()
            finally:
                self._lock.release()


class _Ahead:
    """``connect_ahead``'s work: the thread doing it, when it is done, its error or its session."""

    def __init__(self) -> None:
        self.thread = 0
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.session: AgentSession | None = None


class _Transport(paramiko.Transport):
    """paramiko's Transport, noting when the key exchange is done (``up --timings``)."""

    kex_done: float | None = None

    def start_client(self, event: threading.Event | None = None, timeout: float | None = None) -> None:
        super().start_client(event, timeout)
        self.kex_done = time.monotonic()

    def _parse_global_request(self, m: paramiko.Message) -> None:  # private: pinned in tests/test_ssh.py
        """sshd's notice of its host keys, right after the authentication: ACKed at once."""
        super()._parse_global_request(m)  # type: ignore[misc]  # not in the stubs
        _ack_at_once(self.sock)


def _ack_at_once(sock: Any) -> None:
    """ACK the packet just read at once, not after the delayed ACK's wait (up to 40 ms on Linux).
    After the authentication sshd sends its host keys' notice (a global request without reply) and,
    Nagle's algorithm on its side, holds its next packet (the first channel's confirmation) until
    that notice is ACKed: 40 ms at every connection's start (docs/benchmarks.md). Linux only; not
    on a proxied link (the proxy's own TCP connection is not ours)."""
    if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError, AttributeError):  # AttributeError: no TCP_QUICKACK here
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)


def _transport(sock: Any, **kwargs: Any) -> paramiko.Transport:
    """paramiko's Transport with the ciphers in the order of PREFERRED_CIPHERS, on a TCP socket
    without Nagle's algorithm: the client's small packets sent back to back (NEWKEYS, then the
    service request) otherwise wait for the server's delayed ACK, 40 ms of every connection's start
    on Linux (docs/benchmarks.md; the other such wait: ``_ack_at_once``)."""
    if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    transport = _Transport(sock, **kwargs)
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
