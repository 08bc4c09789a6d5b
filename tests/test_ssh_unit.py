"""Pure parts of the SSH transport: error translation (complete), ProxyJump syntax, host keys."""

from __future__ import annotations

import inspect
import socket
import subprocess
import sys
from pathlib import Path

import paramiko
import pytest

from clusterrun.core.errors import AuthError, ConnectError, HostKeyError, TransportError
from clusterrun.transports.ssh import _jump_alias, _jump_user_port
from clusterrun.transports.sshhosts import HostKeyPolicy, KnownHosts, ResolvedHost, known_hosts
from clusterrun.transports.sshlib import fingerprint, map_error


def _key() -> paramiko.PKey:
    return paramiko.RSAKey.generate(1024)


def _instances() -> dict[type[BaseException], BaseException]:
    e = paramiko.ssh_exception
    k1, k2 = _key(), _key()
    return {
        e.SSHException: e.SSHException("Error reading SSH protocol banner"),
        e.AuthenticationException: e.AuthenticationException("Authentication failed."),
        e.PasswordRequiredException: e.PasswordRequiredException("private key file is encrypted"),
        e.BadAuthenticationType: e.BadAuthenticationType("bad type", ["publickey"]),
        e.PartialAuthentication: e.PartialAuthentication(["publickey"]),
        e.UnableToAuthenticate: e.UnableToAuthenticate("no method"),
        e.ChannelException: e.ChannelException(1, "administratively prohibited"),
        e.BadHostKeyException: e.BadHostKeyException("gpu-a", k1, k2),
        e.ProxyCommandFailure: e.ProxyCommandFailure("nc gpu-a 22", "broken pipe"),
        e.NoValidConnectionsError: e.NoValidConnectionsError({("10.0.0.1", 22): ConnectionRefusedError()}),
        e.CouldNotCanonicalize: e.CouldNotCanonicalize("gpu-a"),
        e.ConfigParseError: e.ConfigParseError("bad line"),
        e.MessageOrderError: e.MessageOrderError("out of order"),
        e.IncompatiblePeer: e.IncompatiblePeer("no common kex"),
    }


def test_every_paramiko_exception_is_translated() -> None:
    declared = {cls for _, cls in inspect.getmembers(paramiko.ssh_exception, inspect.isclass)
                if issubclass(cls, Exception) and cls.__module__ == "paramiko.ssh_exception"}
    instances = _instances()
    assert declared == set(instances), "a paramiko exception class is not covered by this test"
    for cls, exc in instances.items():
        mapped = map_error("gpu-a", exc)
        assert isinstance(mapped, TransportError), cls
        assert mapped.host == "gpu-a" and mapped.message, cls
        assert "Traceback" not in mapped.render()


@pytest.mark.parametrize(("exc", "kind", "text"), [
    (paramiko.ssh_exception.BadHostKeyException("gpu-a", _key(), _key()), HostKeyError, "CHANGED"),
    (paramiko.AuthenticationException("nope"), AuthError, "authentication failed"),
    (paramiko.ssh_exception.BadAuthenticationType("x", ["password"]), AuthError, "authentication failed"),
    (paramiko.PasswordRequiredException("enc"), AuthError, "encrypted"),
    (TimeoutError("timed out"), ConnectError, "timed out"),
    (ConnectionRefusedError(111, "Connection refused"), ConnectError, "Connection refused"),
    (socket.gaierror(-2, "Name or service not known"), ConnectError, "cannot resolve"),
    (OSError(113, "No route to host"), ConnectError, "No route to host"),
])
def test_specific_translations(exc: BaseException, kind: type, text: str) -> None:
    mapped = map_error("h", exc)
    assert type(mapped) is kind and text in mapped.render()


def test_changed_key_message_names_both_fingerprints_and_the_fix() -> None:
    got, expected = _key(), _key()
    text = map_error("gpu-a", paramiko.ssh_exception.BadHostKeyException("gpu-a", got, expected)).render()
    assert fingerprint(got) in text and fingerprint(expected) in text and "ssh-keygen -R gpu-a" in text
    assert fingerprint(got).startswith("SHA256:") and not fingerprint(got).endswith("=")


@pytest.mark.parametrize(("hop", "alias", "user", "port"), [
    ("bastion", "bastion", None, None),
    ("admin@bastion", "bastion", "admin", None),
    ("admin@bastion:2222", "bastion", "admin", 2222),
    ("[10.0.0.1]:2222", "10.0.0.1", None, 2222),
])
def test_proxyjump_syntax(hop: str, alias: str, user: str | None, port: int | None) -> None:
    assert _jump_alias(hop) == alias
    assert _jump_user_port(hop) == (user, port)


def test_no_permissive_host_key_policy_anywhere() -> None:
    from pathlib import Path

    for path in (Path(__file__).resolve().parent.parent / "clusterrun").rglob("*.py"):
        text = path.read_text()
        assert "AutoAddPolicy" not in text and "WarningPolicy" not in text, path


MATCH_EXEC = """
import shutil, sys
import clusterrun.transports.ssh
from clusterrun.transports import sshhosts as ssh
from clusterrun.config.hostsfile import HostSpec
from clusterrun.core.errors import ConnectError
assert "invoke" not in sys.modules
shutil.which = lambda name: None  # no OpenSSH client: paramiko's own parser reads the config
try:
    ssh.resolve(HostSpec(host="box"), ssh.SSHOptions(ssh_config=sys.argv[1]))
except ConnectError as exc:
    print(exc.render())
import importlib.util
if importlib.util.find_spec("invoke"):  # a ValueError if still hidden; paramiko < 4 may come without it
    import invoke  # hidden only while paramiko was imported
"""


def test_paramiko_is_imported_without_invoke_and_match_exec_says_what_to_install(tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text('Match exec "true"\n  Port 2222\n')
    done = subprocess.run([sys.executable, "-c", MATCH_EXEC, str(config)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "uses `Match exec`" in done.stdout and "openssh-client" in done.stdout, done.stdout


def _resolved(port: int = 22) -> ResolvedHost:
    return ResolvedHost(alias="gpu-a", hostname="10.0.0.5", port=port, known_hosts=[])


def test_changed_key_hint_names_host_and_port_when_the_port_is_not_22() -> None:
    """paramiko names the host without its port; known_hosts keys a non-22 port as [host]:port."""
    changed = paramiko.ssh_exception.BadHostKeyException("10.0.0.5", _key(), _key())
    text = map_error("gpu-a", changed, port=2222).render()
    assert "the host key of [10.0.0.5]:2222 has CHANGED" in text and "ssh-keygen -R '[10.0.0.5]:2222'" in text
    assert "ssh-keygen -R 10.0.0.5`" in map_error("gpu-a", changed, port=22).render()


def test_known_hosts_with_revoked_and_cert_authority_lines(tmp_path: Path) -> None:
    good, bad, other = _key(), _key(), _key()
    path = tmp_path / "known_hosts"
    path.write_text(
        "# comment\n"
        f"10.0.0.5 {good.get_name()} {good.get_base64()}\n"
        f"@revoked * {bad.get_name()} {bad.get_base64()}\n"
        f"[10.0.0.5]:2222 {bad.get_name()} {bad.get_base64()}\n"
        f"@cert-authority *.example.com,!skip.example.com {other.get_name()} {other.get_base64()}\n"
        "10.0.0.9 ssh-ed25519 not-base64!\n"
        "garbage\n")
    client = paramiko.SSHClient()
    known = KnownHosts()
    known.read(str(path))  # paramiko alone raises InvalidHostKey for this file
    known.install(client.get_host_keys(), "10.0.0.5")
    assert client.get_host_keys().check("10.0.0.5", good)
    known.install(client.get_host_keys(), "[10.0.0.5]:2222")
    assert not client.get_host_keys().check("[10.0.0.5]:2222", bad)  # revoked: never a known key
    policy = HostKeyPolicy(_resolved(2222), accept_new=True, known=known)
    with pytest.raises(HostKeyError) as revoked:
        policy.missing_host_key(client, "[10.0.0.5]:2222", bad)
    assert f"REVOKED ({path}:3: @revoked)" in revoked.value.render()
    policy = HostKeyPolicy(_resolved(), accept_new=False, known=known)
    with pytest.raises(HostKeyError) as authority:
        policy.missing_host_key(client, "gpu.example.com", other)
    text = authority.value.render()
    assert f"host certificates ({path}:5: @cert-authority) are not supported" in text and "ssh-keyscan" in text
    with pytest.raises(HostKeyError) as unknown:  # negated by the pattern list: the usual unknown-key message
        policy.missing_host_key(client, "skip.example.com", other)
    assert "unknown host key for skip.example.com" in unknown.value.render()


def test_known_hosts_are_read_once_until_a_file_changes(tmp_path: Path) -> None:
    key = _key()
    path = tmp_path / "known_hosts"
    path.write_text(f"10.0.0.5 {key.get_name()} {key.get_base64()}\n")
    paths = [str(path), str(tmp_path / "absent")]
    first = known_hosts(paths)
    assert known_hosts(paths) is first and len(first.entries) == 1  # one parse for every connection
    with path.open("a") as f:
        f.write(f"10.0.0.6 {key.get_name()} {key.get_base64()}\n")  # as --accept-new-host-keys does
    again = known_hosts(paths)
    assert again is not first and len(again.entries) == 2


def test_a_connection_holds_only_the_keys_of_its_host(tmp_path: Path) -> None:
    mine, other, hashed = _key(), _key(), _key()
    also_mine = paramiko.ECDSAKey.generate()
    path = tmp_path / "known_hosts"
    path.write_text(f"10.0.0.5,gpu1 {mine.get_name()} {mine.get_base64()}\n"
                    f"10.0.0.6 {other.get_name()} {other.get_base64()}\n"
                    f"10.0.0.5 {also_mine.get_name()} {also_mine.get_base64()}\n"
                    f"{paramiko.HostKeys.hash_host('10.0.0.7')} {hashed.get_name()} {hashed.get_base64()}\n")
    known = KnownHosts()
    known.read(str(path))
    keys = paramiko.HostKeys()
    known.install(keys, "10.0.0.5")
    assert keys.check("10.0.0.5", mine) and keys.check("10.0.0.5", also_mine) and keys.lookup("10.0.0.6") is None
    known.install(keys, "10.0.0.7")
    assert keys.check("10.0.0.7", hashed)  # a hashed name may be anybody's: kept


PARAMIKO_NOISE = """
import logging
import clusterrun.transports.ssh
logging.getLogger("paramiko.transport").warning("Success for unrequested channel! [??]")
logging.getLogger("paramiko.transport").error("Secsh channel 10 open FAILED: open failed: Connect failed")
"""


def test_paramiko_logs_nothing_on_the_terminal() -> None:
    """paramiko logs what it does not expect (a late channel confirmation, a refused channel);
    nobody configures logging in clusterrun, so without a handler of its own Python's last-resort
    handler would print those records raw on stderr, between clusterrun's notices."""
    done = subprocess.run([sys.executable, "-c", PARAMIKO_NOISE], capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "", done.stderr


class _Connection:
    """A paramiko client whose connection opens no channel: it raises ``error`` instead."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.closed = False

    def get_transport(self) -> _Connection:
        return self

    def is_active(self) -> bool:
        return not self.closed

    def open_session(self, **_: object) -> None:
        raise self.error

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(("error", "dropped"), [
    (paramiko.SSHException("Timeout opening channel."), True),  # no answer: the peer is gone or cut off
    (EOFError(), True),
    (paramiko.ChannelException(1, "administratively prohibited"), False),  # sshd answered: the connection works
])
def test_a_connection_on_which_no_channel_opened_is_replaced(monkeypatch: pytest.MonkeyPatch, error: Exception,
                                                             dropped: bool) -> None:
    """A channel that did not open in time leaves its request queued on a connection paramiko
    still calls active; the next session must not queue another one there (see test_ssh.py's
    test of channel opens that timed out in an outage)."""
    from clusterrun.config.hostsfile import HostSpec
    from clusterrun.transports import ssh

    opened: list[_Connection] = []

    def open_connection(self: ssh.SSHTransport, target: ResolvedHost, depth: int = 0) -> _Connection:
        opened.append(_Connection(error))
        return opened[-1]

    monkeypatch.setattr(ssh.SSHTransport, "_open", open_connection)
    monkeypatch.setattr(ssh, "resolve", lambda host, options, alias=None: _resolved())
    transport = ssh.SSHTransport(HostSpec(host="gpu-a"))
    for _ in range(2):
        with pytest.raises(ConnectError):
            transport.session()
    assert len(opened) == (2 if dropped else 1)
    assert opened[0].closed is dropped


FIRST, SECOND = b'{"ok": true, "n": 1}\n', b'{"ok": true, "n": 2}\n'


@pytest.mark.parametrize("lines", [
    [b"Welcome to the cluster!\n", b"\n", b"conda: base activated\n", FIRST, SECOND],
    [b"Last login: Mon" + FIRST, SECOND],  # a greeting without a newline
])
def test_what_a_login_shell_prints_before_the_agent_is_not_taken_for_its_answer(lines: list[bytes]) -> None:
    from clusterrun.transports.base import AgentReader, AgentSession

    received = iter(lines)  # as the channel's receives
    session = AgentSession("gpu-a", lambda data: None, AgentReader(lambda: next(received, b"")), lambda: None)
    assert session.call({"op": "probe"})["n"] == 1
    assert session.call({"op": "probe"})["n"] == 2


def test_a_line_that_is_not_json_after_the_agent_spoke_is_still_an_error() -> None:
    from clusterrun.core.errors import AgentError
    from clusterrun.transports.base import AgentReader, AgentSession

    received = iter([b'{"ok": true}\n', b"garbage\n"])
    session = AgentSession("gpu-a", lambda data: None, AgentReader(lambda: next(received, b"")), lambda: None)
    session.call({"op": "probe"})
    with pytest.raises(AgentError, match="not JSON"):
        session.call({"op": "probe"})


def test_ssh_g_runs_once_per_host_in_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hosts behind one jump host resolve it once; another alias, or the same one a while later
    (a long-lived monitor, the config edited since), runs `ssh -G` again."""
    from clusterrun.config.hostsfile import HostSpec
    from clusterrun.transports import sshhosts

    log = tmp_path / "calls"
    fake = tmp_path / "ssh"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\nprintf "hostname 10.0.0.9\\nport 2222\\nuser u\\n"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(sshhosts, "_answers", {})
    options = sshhosts.SSHOptions(ssh_config=str(tmp_path / "config"))
    first = [sshhosts.resolve(HostSpec(host=f"gpu{i}"), options, alias="bastion") for i in range(3)]
    assert {(r.hostname, r.port, r.user) for r in first} == {("10.0.0.9", 2222, "u")}
    sshhosts.resolve(HostSpec(host="gpu1"), options)
    assert log.read_text().count("bastion") == 1 and log.read_text().count("gpu1") == 1
    monkeypatch.setattr(sshhosts, "SSH_G_REUSE", 0.0)  # as if the answer were older than that
    (tmp_path / "config").write_text("Host bastion\n    Port 2222\n")  # and the configuration edited since
    sshhosts.resolve(HostSpec(host="gpu2"), options, alias="bastion")
    assert log.read_text().count("bastion") == 2


def test_ssh_g_answers_are_kept_between_runs_while_the_configuration_is_unchanged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later run (the answers in memory gone) reads the kept answer; an edit of the file, or of
    a file it includes, asks `ssh -G` again; a configuration that runs commands is never kept."""
    from clusterrun.config.hostsfile import HostSpec
    from clusterrun.transports import sshgcache, sshhosts

    log = tmp_path / "calls"
    fake = tmp_path / "ssh"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\nprintf "hostname 10.0.0.9\\nport 2222\\nuser u\\n"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config, included = tmp_path / "config", tmp_path / "more.conf"
    config.write_text(f"Include {included}\nHost gpu*\n    User u\n")
    included.write_text("Host gpu1\n    Port 2222\n")
    options = sshhosts.SSHOptions(ssh_config=str(config))

    def run() -> int:
        monkeypatch.setattr(sshhosts, "_answers", {})  # a new run
        monkeypatch.setattr(sshgcache, "_signatures", {})
        assert sshhosts.resolve(HostSpec(host="gpu1"), options).hostname == "10.0.0.9"
        return log.read_text().count("gpu1")

    assert run() == 1 and run() == 1
    included.write_text("Host gpu1\n    Port 2223\n")
    assert run() == 2 and run() == 2
    config.write_text("Match exec true\n    User u\n")
    assert run() == 3 and run() == 4
    config.write_text("Host gpu1\n    IdentityFile ${KEYS}/id\n")  # the environment may change it
    assert run() == 5 and run() == 6


def test_the_configuration_is_read_once_for_all_the_hosts_of_a_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache's key holds the configuration's files: read for the first host, not again for
    each of the others (N hosts of a block each: N times a file of N blocks), and again once the
    answers are as old as `SSH_G_REUSE`."""
    from clusterrun.config.hostsfile import HostSpec
    from clusterrun.transports import sshgcache, sshhosts

    fake = tmp_path / "ssh"
    fake.write_text('#!/bin/sh\nprintf "hostname 10.0.0.9\\nport 22\\nuser u\\n"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sshhosts, "_answers", {})
    monkeypatch.setattr(sshgcache, "_signatures", {})
    config = tmp_path / "config"
    config.write_text("".join(f"Host gpu{i}\n    User u\n" for i in range(8)))
    reads: list[str | None] = []
    read = sshgcache.config_signature
    monkeypatch.setattr(sshgcache, "config_signature", lambda path: reads.append(path) or read(path))
    options = sshhosts.SSHOptions(ssh_config=str(config))
    assert {sshhosts.resolve(HostSpec(host=f"gpu{i}"), options).hostname for i in range(8)} == {"10.0.0.9"}
    assert reads == [str(config)]
    monkeypatch.setattr(sshhosts, "SSH_G_REUSE", 0.0)
    sshhosts.resolve(HostSpec(host="gpu9"), options)
    assert reads == [str(config)] * 2


def test_a_connection_made_ahead_is_waited_for_and_its_error_raised_not_tried_again(tmp_path: Path) -> None:
    """``connect_early``: the next ``connect()`` waits for the one made ahead and raises its error; a
    host is tried once, not twice (a ConnectTimeout would count double); the one after that tries again."""
    import threading

    from clusterrun.config.hostsfile import HostSpec
    from clusterrun.transports import connect_early
    from clusterrun.transports.ssh import SSHTransport
    from clusterrun.transports.sshhosts import SSHOptions

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []

    def serve() -> None:  # not sshd: SSH 1 (not a MaxStartups drop, which would be retried)
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.sendall(b"SSH-1.5-old\r\n")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    config = tmp_path / "ssh_config"
    config.write_text(f"Host box\n  HostName 127.0.0.1\n  Port {server.getsockname()[1]}\n"
                      "  UserKnownHostsFile /dev/null\n  IdentityFile /dev/null\n")
    transport = SSHTransport(HostSpec(host="box"), SSHOptions(ssh_config=str(config)))
    try:
        connect_early([transport])
        with pytest.raises(TransportError) as first:
            transport.connect()
        assert "version" in str(first.value) and len(accepted) == 1
        with pytest.raises(TransportError):
            transport.session()  # after the error: the usual, a connection of its own
        assert len(accepted) == 2
    finally:
        transport.close()
        server.close()
