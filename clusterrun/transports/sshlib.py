"""paramiko for the SSH transport: imported here once (without invoke, its log records silenced),
and its exceptions translated into clusterrun's, in one place (``map_error``).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import shlex
import socket
import sys

from clusterrun.core.errors import AuthError, ConnectError, HostKeyError, TransportError

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


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_name(hostname: str, port: int | None) -> str:
    """How known_hosts names the host: ``10.0.0.5``, or ``[10.0.0.5]:2222`` on a port other than 22."""
    if port is None or port == 22 or hostname.startswith("["):
        return hostname
    return f"[{hostname}]:{port}"


def map_error(host: str, exc: BaseException, port: int | None = None) -> TransportError:
    """Translate a paramiko or socket exception into clusterrun's error tree; ``port``: the SSH
    port connected to (paramiko's ``BadHostKeyException`` names the host without it)."""
    if isinstance(exc, TransportError):
        return exc
    if isinstance(exc, paramiko.BadHostKeyException):
        entry = known_hosts_name(exc.hostname, port)
        return HostKeyError(host, f"the host key of {entry} has CHANGED: it is now {exc.key.get_name()} "
                            f"{fingerprint(exc.key)}, known_hosts expects {fingerprint(exc.expected_key)}",
                            hint="if the machine was reinstalled, remove the old key with "
                                 f"`ssh-keygen -R {shlex.quote(entry)}`; otherwise someone may be "
                                 "intercepting the connection")
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


def is_throttled(exc: BaseException) -> bool:
    """sshd's MaxStartups closes surplus connections before the banner: worth retrying."""
    text = str(exc)
    return isinstance(exc, paramiko.SSHException) and not isinstance(exc, paramiko.AuthenticationException) and (
        "banner" in text or "reset" in text.lower() or "closed" in text.lower())


__all__ = ["fingerprint", "is_throttled", "known_hosts_name", "map_error", "paramiko"]
