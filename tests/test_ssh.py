"""SSH hosts for real: OpenSSH sshd on simulated machines (own network, PID, mount and UTS
namespaces), reached with the paramiko transport, running real torchrun with gloo."""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests.conftest import ROOT, SUPPORT, hosts_python, job_id_of, run_up, up_argv, wait_for
from tests.simhosts import SimCluster, SimHost

pytestmark = pytest.mark.integration
MakeCluster = Callable[..., SimCluster]


def ssh_hosts(folder: Path, cluster: SimCluster, nprocs: Sequence[int], state_dir: Path,
              names: Sequence[str] | None = None, ssh_config: Path | None = None) -> Path:
    """A hosts file naming the simulated hosts by their ssh_config aliases."""
    lines = [f"state_dir: {state_dir}", f"ssh_config: {ssh_config or cluster.ssh_config}", "defaults:",
             f"  python: {hosts_python()}", f"  workdir: {ROOT}", "hosts:"]
    for name, n in zip(names or [h.name for h in cluster.hosts], nprocs, strict=True):
        lines += [f"  - host: {name}", f"    nproc: {n}"]
    path = folder / "hosts.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def job_processes(host: SimHost) -> list[str]:
    """Processes of clusterrun jobs still alive inside the host's own PID namespace."""
    out = host.run("ps", "-eo", "pid=,args=").stdout
    return [line.strip() for line in out.splitlines()
            if ("torch" in line or "agent" in line or "_support" in line or "examples/" in line)
            and "ps -eo" not in line]


def check_ranks(stdout: str, layout: Sequence[tuple[str, int]]) -> None:
    """Every rank printed its place in the world exactly once, from the right (simulated) host."""
    world = sum(n for _, n in layout)
    rank = 0
    for node, (host, n) in enumerate(layout):
        for local in range(n):
            pattern = (rf"^node{node} {host} +rank{rank} +\| rank={rank} local_rank={local} world_size={world} "
                       rf"node_rank={node} host={host} backend=gloo$")
            assert len(re.findall(pattern, stdout, re.M)) == 1, (pattern, stdout)
            rank += 1
    total = world * (world + 1) // 2
    assert stdout.count(f"allreduce sum={total} expected={total} OK") == world


def test_two_hosts_two_procs_over_ssh(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = sim_cluster(2)
    state = tmp_path / "state"
    proc = run_up(ssh_hosts(tmp_path, cluster, [2, 2], state), "examples/allreduce.py")
    assert proc.returncode == 0, proc.stderr
    check_ranks(proc.stdout, [("sim1", 2), ("sim2", 2)])
    master = re.search(r"master (\S+):\d+", proc.stderr)
    assert master and master.group(1) == cluster.hosts[0].address  # the HostName, not the alias
    # every node's log arrived complete: what was printed is what the host's file holds
    job = job_id_of(proc.stderr)
    for node in (0, 1):
        log = (state / "jobs" / job / f"node{node}" / "attempt1" / "output.log").read_text()
        printed = [line.split("| ", 1)[1] for line in proc.stdout.splitlines()
                   if line.startswith(f"node{node} ")]
        from clusterrun.diagnose.rootcause import split_rank

        assert printed == [split_rank(line)[1] for line in log.splitlines()]
    for host in cluster.hosts:
        assert job_processes(host) == []


def test_three_hosts_uneven(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = sim_cluster(3)
    proc = run_up(ssh_hosts(tmp_path, cluster, [1, 3, 2], tmp_path / "state"), "examples/allreduce.py")
    assert proc.returncode == 0, proc.stderr
    check_ranks(proc.stdout, [("sim1", 1), ("sim2", 3), ("sim3", 2)])


def test_proxyjump_reaches_a_host_only_the_jump_host_can_resolve(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = sim_cluster(2)
    sim1, sim2 = cluster.hosts
    config = tmp_path / "ssh_config"
    # "inner" is sim2 under a name only the simulated hosts resolve (their shared /etc/hosts): the
    # controller cannot reach it without going through sim1.
    config.write_text(cluster.ssh_config.read_text() + (
        f"\nHost inner\n  HostName sim2\n  Port {sim2.port}\n  User root\n  IdentityFile {cluster.client_key}\n"
        f"  IdentitiesOnly yes\n  UserKnownHostsFile {cluster.known_hosts}\n  ProxyJump sim1\n"))
    with cluster.known_hosts.open("a") as f:  # the key of sim2, under the name the jump resolves
        line = next(line for line in cluster.known_hosts.read_text().splitlines() if line.startswith(sim2.address))
        f.write("sim2" + line[len(sim2.address):] + "\n")
    proc = run_up(ssh_hosts(tmp_path, cluster, [1, 1], tmp_path / "state", names=["sim1", "inner"],
                            ssh_config=config), "examples/allreduce.py")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^node1 inner +rank1 +\| rank=1 .* host=sim2 ", proc.stdout, re.M), proc.stdout


def _keys_without(cluster: SimCluster, address: str) -> str:
    """known_hosts without any entry for ``address`` (lines look like ``addr,name type key``)."""
    addresses = {h.name: h.address for h in cluster.hosts}
    kept = []
    for line in cluster.known_hosts.read_text().splitlines():
        names = {n.strip("[").split("]")[0] for n in line.split(" ", 1)[0].split(",")}
        if address not in {addresses.get(n, n) for n in names}:
            kept.append(line + "\n")
    return "".join(kept)


@pytest.mark.fake_torchrun
def test_unknown_host_key_is_refused_then_accepted_when_asked(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = sim_cluster(2)
    sim2 = cluster.hosts[1]
    cluster.known_hosts.write_text(_keys_without(cluster, sim2.address))
    hosts = ssh_hosts(tmp_path, cluster, [1, 1], tmp_path / "state")
    job = (SUPPORT / "counter.py", "3", "0")  # the host keys are the point: the fake torchrun, no torch import
    proc = run_up(hosts, *job)
    assert proc.returncode == 3, proc.stderr
    assert "sim2: unknown host key for" in proc.stderr and "SHA256:" in proc.stderr
    assert "ssh-keyscan" in proc.stderr and "--accept-new-host-keys" in proc.stderr
    assert "sim1:" not in proc.stderr  # one line for the failing host only
    assert not (tmp_path / "state" / "jobs").exists()  # nothing started anywhere
    proc = run_up("--accept-new-host-keys", hosts, *job)
    assert proc.returncode == 0, proc.stderr
    assert sim2.address in cluster.known_hosts.read_text()
    proc = run_up(hosts, *job)  # recorded: no opt-in needed any more
    assert proc.returncode == 0, proc.stderr


def test_changed_host_key_is_refused_even_with_accept_new(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = sim_cluster(2)
    sim1, sim2 = cluster.hosts
    lines = cluster.known_hosts.read_text().splitlines()
    key_of_sim1 = next(line.split(" ", 1)[1] for line in lines if line.startswith(sim1.address))
    cluster.known_hosts.write_text(_keys_without(cluster, sim2.address) + f"{sim2.address} {key_of_sim1}\n")
    proc = run_up("--accept-new-host-keys", ssh_hosts(tmp_path, cluster, [1, 1], tmp_path / "state"),
                  "examples/allreduce.py")
    assert proc.returncode == 3, proc.stderr
    assert "sim2: the host key of" in proc.stderr and "CHANGED" in proc.stderr
    assert not (tmp_path / "state" / "jobs").exists()


def test_a_changed_host_key_on_another_port_than_22_names_the_known_hosts_entry_to_remove(
        sim_cluster: MakeCluster, tmp_path: Path) -> None:
    """known_hosts keys a host on port 2222 as [addr]:2222: that is what `ssh-keygen -R` must be given."""
    cluster = sim_cluster(2, isolated=False)  # one sshd per loopback address, each on a port of its own
    sim1, sim2 = cluster.hosts
    assert sim2.port != 22
    key_of_sim1 = next(line.split(" ", 1)[1] for line in cluster.known_hosts.read_text().splitlines()
                       if line.startswith(f"[{sim1.address}]"))
    entry = f"[{sim2.address}]:{sim2.port}"
    cluster.known_hosts.write_text(_keys_without(cluster, sim2.address) + f"{entry} {key_of_sim1}\n")
    hosts = ssh_hosts(tmp_path, cluster, [1, 1], tmp_path / "state")
    done = subprocess.run([sys.executable, "-m", "clusterrun", "exec", str(hosts), "--", "true"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 3, done.stderr
    assert f"sim2: the host key of {entry} has CHANGED" in done.stderr, done.stderr
    assert f"`ssh-keygen -R '{entry}'`" in done.stderr, done.stderr
    removed = subprocess.run(["ssh-keygen", "-R", entry, "-f", str(cluster.known_hosts)], capture_output=True,
                             text=True)
    assert removed.returncode == 0 and entry not in cluster.known_hosts.read_text(), removed.stderr


def test_a_revoked_host_key_is_refused_naming_the_line(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = sim_cluster(2)
    sim2 = cluster.hosts[1]
    text = cluster.known_hosts.read_text()
    key_of_sim2 = next(line.split(" ", 1)[1] for line in text.splitlines() if line.startswith(sim2.address))
    cluster.known_hosts.write_text(text + f"@cert-authority *.example.com {key_of_sim2}\n@revoked * {key_of_sim2}\n")
    line = len(text.splitlines()) + 2
    proc = run_up("--accept-new-host-keys", ssh_hosts(tmp_path, cluster, [1, 1], tmp_path / "state"),
                  "examples/allreduce.py")
    assert proc.returncode == 3, proc.stderr
    assert f"sim2: the host key of {sim2.address}" in proc.stderr, proc.stderr
    assert f"is REVOKED ({cluster.known_hosts}:{line}: @revoked)" in proc.stderr and "Traceback" not in proc.stderr
    assert "sim1:" not in proc.stderr
    assert not (tmp_path / "state" / "jobs").exists()


@pytest.mark.fake_torchrun
def test_hashed_known_hosts_entries_are_honoured(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = sim_cluster(1)
    hashed = subprocess.run(["ssh-keygen", "-H", "-f", str(cluster.known_hosts)], capture_output=True, text=True)
    assert hashed.returncode == 0, hashed.stderr
    assert all(line.startswith("|1|") for line in cluster.known_hosts.read_text().splitlines() if line)
    proc = run_up(ssh_hosts(tmp_path, cluster, [1], tmp_path / "state"), SUPPORT / "counter.py", "3", "0")
    assert proc.returncode == 0, proc.stderr


def test_wrong_key_on_one_of_three_hosts(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = sim_cluster(3)
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    config = tmp_path / "ssh_config"
    text = cluster.ssh_config.read_text()
    # sim2 offers a key its sshd does not accept
    blocks = re.split(r"(?m)^(?=Host )", text)
    blocks = [b.replace(str(cluster.client_key), str(other)) if b.startswith("Host sim2\n") else b for b in blocks]
    config.write_text("".join(blocks))
    proc = run_up(ssh_hosts(tmp_path, cluster, [1, 1, 1], tmp_path / "state", ssh_config=config),
                  "examples/allreduce.py")
    assert proc.returncode == 3, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if re.match(r"^sim\d: ", line)]
    assert len(errors) == 1 and errors[0].startswith("sim2: authentication failed"), proc.stderr
    assert not (tmp_path / "state" / "jobs").exists()
    for host in cluster.hosts:
        assert job_processes(host) == []


def test_remote_state_is_private_under_umask_022(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = sim_cluster(1)
    assert cluster.hosts[0].run("sh", "-c", "umask").stdout.strip() == "0022"
    state = tmp_path / "state"  # does not exist yet: the agent creates all of it on the host
    proc = run_up(ssh_hosts(tmp_path, cluster, [1], state), "examples/allreduce.py")
    assert proc.returncode == 0, proc.stderr
    paths = [state, *state.rglob("*")]
    assert any(p.name == "output.log" for p in paths) and any(p.name == "state.json" for p in paths)
    for path in paths:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


def test_a_host_dying_mid_run_fails_fast_and_is_named(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    """Silence is a failure only when asked for (--unreachable-timeout): then the dead host's node
    is lost, the other one stopped. (counter.py has no collectives that would fail by themselves.)"""
    cluster = sim_cluster(2)
    hosts = ssh_hosts(tmp_path, cluster, [1, 1], tmp_path / "state")
    with subprocess.Popen(up_argv("--grace", "3", "--unreachable-timeout", "5", hosts, SUPPORT / "counter.py",
                                  "1000", "0.1"), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        wait_for(lambda: "line 3" in proc.stdout.readline(), timeout=90, what="output from the job")
        began = time.monotonic()
        cluster.hosts[1].kill()
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert time.monotonic() - began < 60
    assert "node1 sim2: lost" in err
    assert re.search(r"root cause: node 1 \(sim2\): the host went away at \d\d:\d\d:\d\dZ and has not answered "
                     r"since \(unreachable for 5 s \(--unreachable-timeout\)", err), err
    # The attempt had failed: its cgroup killed at once, torchrun first (no SIGTERM, no grace).
    assert re.search(r"node0 sim1: stopped torchrun \(pid \d+\) and 1 other process at once \(SIGKILL, the attempt "
                     r"had failed\); nothing left \(verified by cgroup\)", err), err
    assert job_processes(cluster.hosts[0]) == []


@pytest.mark.fake_torchrun
def test_sixteen_hosts_in_parallel(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = sim_cluster(16)
    hosts = ssh_hosts(tmp_path, cluster, [1] * 16, tmp_path / "state")
    proc = run_up("--dry-run", hosts, "examples/allreduce.py", timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("command: ") == 16
    # a real start on all of them, with a job that needs no torch import in the workers
    proc = run_up(hosts, SUPPORT / "counter.py", "3", "0", timeout=300)
    assert proc.returncode == 0, proc.stderr
    for rank in range(16):
        assert f"rank {rank} done" in proc.stdout


@pytest.fixture(scope="module")
def login_shells() -> dict[str, str]:
    """fish and tcsh, installed with apt by the test setup when missing."""
    subprocess.run(["sh", str(SUPPORT / "install_sshd.sh"), "tcsh", "fish"], check=True, capture_output=True)
    import shutil

    found = {name: shutil.which(name) for name in ("tcsh", "fish")}
    missing = [name for name, path in found.items() if not path]
    assert not missing, f"could not install {missing}"
    return {name: str(path) for name, path in found.items()}


HOSTILE = ["'; touch /tmp/clusterrun-pwned #", "$(id)", "`id`", "a\nb", "x y", '"q"', "!!", "%h"]


@pytest.mark.parametrize("shell", ["tcsh", "fish"])
@pytest.mark.fake_torchrun
def test_fish_and_tcsh_login_shells_change_nothing(sim_cluster: MakeCluster, tmp_path: Path, shell: str,
                                                   login_shells: dict[str, str]) -> None:
    cluster = sim_cluster(1, login_shell=login_shells[shell])
    assert cluster.hosts[0].run("sh", "-c", "getent passwd root").stdout.rstrip().endswith(login_shells[shell])
    value = "v " + " ".join(HOSTILE)
    hosts = ssh_hosts(tmp_path, cluster, [1], tmp_path / "state")
    proc = run_up("--env", f"FROM_CLI={value}", "--env", "ECHO_ENV=FROM_CLI", hosts, SUPPORT / "echo_args.py",
                  "--", *HOSTILE)
    assert proc.returncode == 0, proc.stderr
    echoed = [line.split("ECHO ", 1)[1] for line in proc.stdout.splitlines() if "| ECHO " in line]
    assert len(echoed) == 1
    data = json.loads(echoed[0])
    assert data["argv"] == HOSTILE and data["env"] == {"FROM_CLI": value}
    assert not Path("/tmp/clusterrun-pwned").exists()


def test_missing_torch_or_python_on_a_host_is_one_line_and_nothing_starts(sim_cluster: MakeCluster,
                                                                          tmp_path: Path) -> None:
    cluster = sim_cluster(3)
    hosts = ssh_hosts(tmp_path, cluster, [1, 1, 1], tmp_path / "state")
    text = hosts.read_text()
    # sim2: an interpreter without torch; sim3: no such interpreter at all
    text = text.replace("  - host: sim2\n", "  - host: sim2\n    python: /usr/bin/python3\n")
    text = text.replace("  - host: sim3\n", "  - host: sim3\n    python: /opt/nowhere/python3\n")
    hosts.write_text(text)
    proc = run_up(hosts, "examples/allreduce.py")
    assert proc.returncode == 3, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if re.match(r"^sim\d: ", line)]
    assert len(lines) == 2, proc.stderr
    assert lines[0] == "sim2: torch is not installed for /usr/bin/python3"
    assert lines[1].startswith("sim3: ") and "/opt/nowhere/python3" in lines[1]
    assert not (tmp_path / "state" / "jobs").exists()


def test_an_agent_that_cannot_start_is_reported_with_its_stderr_even_after_its_channel_closed(
        sim_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """No such interpreter: the remote command ends at once. Sending the agent after that (slow
    link, busy controller) must not turn into a connection error: the answer quotes the shell."""
    from clusterrun.config.hostsfile import HostSpec
    from clusterrun.core.errors import AgentError
    from clusterrun.transports import ssh, sshhosts
    from clusterrun.transports.bundle import AgentBundle

    cluster = sim_cluster(1)
    bundle = ssh.agent_bundle()

    def late() -> AgentBundle:
        time.sleep(1.0)  # by now the shell has said "not found" and the channel is closed
        return bundle

    monkeypatch.setattr(ssh, "agent_bundle", late)
    transport = ssh.SSHTransport(HostSpec(host="sim1", python="/opt/nowhere/python3"),
                                 sshhosts.SSHOptions(ssh_config=str(cluster.ssh_config)))
    try:
        with pytest.raises(AgentError) as caught:
            transport.call({"op": "probe", "free_port": False, "state_dir": None})
    finally:
        transport.close()
    assert "ended without an answer" in caught.value.message and "/opt/nowhere/python3" in caught.value.message


def test_channel_opens_that_timed_out_in_an_outage_leave_nothing_to_refuse_later_ones(
        sim_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """sim1's cable is out while requests keep being made (a follower retrying): opening a channel
    times out, again and again. paramiko forgets a channel whose opening timed out, but its request
    waits in TCP; on a connection kept, the link back delivers them all and sshd opens each one for
    nobody ("Success for unrequested channel!") until its MaxSessions (here 2, 10 by default)
    refuses every later channel. The transport drops a connection whose channel did not open: once
    the link is back, a request works, and no channel was opened for nobody."""
    from clusterrun.config.hostsfile import HostSpec
    from clusterrun.core.errors import ConnectError
    from clusterrun.transports import ssh, sshhosts

    cluster = sim_cluster(1, sshd_options={"MaxSessions": "2"})
    host = cluster.hosts[0]
    monkeypatch.setattr(ssh, "CONNECT_TIMEOUT", 1.0)  # timed-out opens in seconds, not in minutes
    transport = ssh.SSHTransport(HostSpec(host="sim1", python=sys.executable),
                                 sshhosts.SSHOptions(ssh_config=str(cluster.ssh_config)))
    probe = {"op": "probe", "free_port": False, "state_dir": None}

    def answers() -> bool:
        try:
            return bool(transport.call(probe)["ok"])
        except ConnectError:
            return False

    try:
        assert transport.call(probe)["ok"]
        cluster.set_link(host, up=False)
        try:
            for _ in range(4):  # more than sshd's MaxSessions
                with pytest.raises(ConnectError):
                    transport.call(probe)
        finally:
            cluster.set_link(host, up=True)
        wait_for(answers, timeout=60, interval=0.5, what="a request to sim1 to work again")
    finally:
        transport.close()
    assert not [r for r in caplog.records if "unrequested" in r.getMessage()]


def test_the_connection_waits_for_no_delayed_ack(sim_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two of Linux's 40 ms delayed ACKs used to hold every connection's start (docs/benchmarks.md):
    the client's socket sends its small packets at once (TCP_NODELAY), and sshd's notice of its
    host keys after the authentication is ACKed at once, through paramiko's handler of global
    requests (a private method of paramiko's: if an upgrade stops calling it, this fails)."""
    import socket

    from clusterrun.config.hostsfile import HostSpec
    from clusterrun.transports import ssh, sshhosts

    cluster = sim_cluster(1)
    acked: list[bool] = []
    monkeypatch.setattr(ssh, "_ack_at_once", lambda sock: acked.append(isinstance(sock, socket.socket)))
    transport = ssh.SSHTransport(HostSpec(host="sim1", python=sys.executable),
                                 sshhosts.SSHOptions(ssh_config=str(cluster.ssh_config)))
    try:
        assert transport.call({"op": "probe", "free_port": False, "state_dir": None})["ok"]
        client = transport._client
        assert client is not None
        sock = client.get_transport().sock  # type: ignore[union-attr]
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert acked and all(acked)  # sshd's hostkeys-00@openssh.com notice went through the hook
    finally:
        transport.close()


def test_a_quiet_connection_wakes_paramiko_less_often_than_the_heartbeat_and_still_closes(
        sim_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """paramiko's reader thread wakes at every timeout of its socket (0.1 s by default: ten times a
    second per host while a job is quiet, docs/benchmarks.md); once connected it waits longer than
    the agent's heartbeat, so a followed link wakes it only with messages. close() does not wait
    for it, and the thread still ends before its next wake (here an hour away)."""
    from clusterrun.agent.follow import HEARTBEAT
    from clusterrun.config.hostsfile import HostSpec
    from clusterrun.transports import ssh, sshhosts

    assert ssh.READER_WAKE > HEARTBEAT
    monkeypatch.setattr(ssh, "READER_WAKE", 3600.0)
    cluster = sim_cluster(1)
    transport = ssh.SSHTransport(HostSpec(host="sim1", python=sys.executable),
                                 sshhosts.SSHOptions(ssh_config=str(cluster.ssh_config)))
    try:
        assert transport.call({"op": "probe", "free_port": False, "state_dir": None})["ok"]
        assert transport._client is not None
        reader = transport._client.get_transport()
        assert reader is not None and reader.is_alive()
        assert reader.sock.gettimeout() == 3600.0
        # The probe's channel closed both ways: the server has nothing more to say that would wake the reader
        wait_for(lambda: not reader._channels.values(), timeout=30, what="the channel's close")
    finally:
        transport.close()
    wait_for(lambda: not reader.is_alive(), timeout=30, what="paramiko's reader thread to end")


def test_the_agent_channel_opened_ahead_is_the_one_the_probe_uses(sim_cluster: MakeCluster) -> None:
    """`up` opens each host's connection and agent channel ahead (``transports.connect_early``) while it
    imports the rest of itself; the probe then goes on that channel: one agent on the host, not two."""
    from clusterrun.agent.wire import ProbeRequest
    from clusterrun.config.hostsfile import HostSpec
    from clusterrun.transports import connect_early, ssh, sshhosts

    cluster = sim_cluster(1)
    transport = ssh.SSHTransport(HostSpec(host="sim1", python=sys.executable),
                                 sshhosts.SSHOptions(ssh_config=str(cluster.ssh_config)))
    try:
        connect_early([transport])
        transport.connect()
        session = transport.session()
        assert session.call(ProbeRequest(state_dir=None, free_port=False))["ok"]
        listing = cluster.hosts[0].run("ps", "-ww", "-eo", "pid,args").stdout.splitlines()
        agents = [line for line in listing if "sys.stdin.buffer" in line and "grep" not in line]
        assert len(agents) == 1, listing
        session.close()
    finally:
        transport.close()
