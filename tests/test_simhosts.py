"""The simulated hosts fixture: real sshd per host, separate namespaces, real host keys, clean teardown."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import simhosts
from tests.conftest import ROOT, SUPPORT, wait_for
from tests.simhosts import SSHD, SimCluster, SimHostError, namespace_problem, sweep_stale, unavailable
from tests.simnet import _ip_json

pytestmark = pytest.mark.integration
sim_cluster = simhosts.sim_cluster  # until tests/conftest.py exposes it

Make = Callable[..., SimCluster]


def ssh(cluster: SimCluster, host: str, command: str, *options: str) -> subprocess.CompletedProcess[str]:
    argv = cluster.ssh_argv(host, command)
    argv[-2:-2] = options  # after the cluster's -F: for ssh, the last -F wins
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


def isolated(make: Make, n: int, **kwargs: object) -> SimCluster:
    """A cluster with namespaces, or a skip that says why this machine cannot have one."""
    reason = namespace_problem()
    if reason:
        unavailable(f"namespaces not permitted here, isolation not testable: {reason}")
    cluster = make(n, **kwargs)
    assert cluster.isolated and cluster.fallback_reason is None
    return cluster


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if text in cmdline and state != "Z":
                found.append(int(entry))
    return found


def netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def links_of(pid: int) -> list[str]:
    """Names of the links whose alias says process ``pid`` made them."""
    out = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True).stdout
    return [link["ifname"] for link in json.loads(out) if link.get("ifalias") == f"crsim-{pid}"]


def test_three_hosts_answer_by_name_and_resolve_to_their_bridge_address(sim_cluster: Make) -> None:
    cluster = isolated(sim_cluster, 3)
    assert [h.name for h in cluster.hosts] == ["sim1", "sim2", "sim3"]
    assert len({h.address for h in cluster.hosts}) == 3
    for host in cluster.hosts:
        assert host.port == 22 and host.address.startswith(f"10.77.{cluster.subnet}.")
        done = ssh(cluster, host.name, "hostname")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == host.name
        resolved = ssh(cluster, host.name, f"getent hosts {host.name}")
        assert resolved.stdout.split() == [host.address, host.name]
    # The root namespace keeps its own name, /etc/hosts and mounts.
    assert socket.gethostname() not in {h.name for h in cluster.hosts}
    assert "sim1" not in Path("/etc/hosts").read_text().split()
    assert "crsim-run" not in Path("/proc/self/mountinfo").read_text()


def test_client_files_are_laid_out_as_openssh_expects(sim_cluster: Make) -> None:
    cluster = isolated(sim_cluster, 2)
    assert cluster.client_key.stat().st_mode & 0o777 == 0o600
    assert cluster.client_key.parent.stat().st_mode & 0o777 == 0o700
    known = cluster.known_hosts.read_text().splitlines()
    assert [line.split()[0] for line in known] == [f"{h.address},{h.name}" for h in cluster.hosts]
    config = cluster.ssh_config.read_text()
    for line in ("Host sim2", f"HostName {cluster.hosts[1].address}", "User root", "IdentitiesOnly yes",
                 f"IdentityFile {cluster.client_key}", f"UserKnownHostsFile {cluster.known_hosts}",
                 "StrictHostKeyChecking yes"):
        assert line in config


def test_hosts_have_separate_process_trees(sim_cluster: Make) -> None:
    cluster = isolated(sim_cluster, 2)
    sim1, sim2 = cluster.hosts
    marker = f"300.{os.getpid()}"
    started = ssh(cluster, "sim1", f"setsid nohup sleep {marker} </dev/null >/dev/null 2>&1 &")
    assert started.returncode == 0, started.stderr
    on_sim1 = sim1.run("ps", "-eo", "pid=,args=").stdout.splitlines()
    on_sim2 = sim2.run("ps", "-eo", "pid=,args=").stdout.splitlines()
    sleeper = [int(line.split()[0]) for line in on_sim1 if f"sleep {marker}" in line]
    assert len(sleeper) == 1 and sleeper[0] < 1000, on_sim1
    assert not [line for line in on_sim2 if f"sleep {marker}" in line], on_sim2
    # Each host's first process is its own sshd, pid 1 of its PID namespace.
    for host, listing in ((sim1, on_sim1), (sim2, on_sim2)):
        first = next(line.split(None, 1) for line in listing if line.split()[0] == "1")
        assert first[1].startswith("sshd:") and str(cluster.dir / host.name / "sshd_config") in first[1]
        assert Path(f"/proc/{host.pid}/comm").read_text().strip() == "sshd"
    assert processes_mentioning(f"sleep {marker}")
    cluster.close()
    assert processes_mentioning(f"sleep {marker}") == []


def test_hosts_reach_each_other_over_the_bridge_and_nothing_else(sim_cluster: Make) -> None:
    cluster = isolated(sim_cluster, 2)
    sim2 = cluster.hosts[1]
    for target in (sim2.address, "sim2"):
        probe = f"python3 -c \"import socket; socket.create_connection(('{target}', 22), 2); print('connected')\""
        done = ssh(cluster, "sim1", probe)
        assert done.returncode == 0 and done.stdout.strip() == "connected", done.stderr
    routes = cluster.hosts[0].run("ip", "route").stdout
    assert "default" not in routes and f"10.77.{cluster.subnet}.0/24" in routes


def test_host_keys_are_real_and_checked(sim_cluster: Make, tmp_path: Path) -> None:
    cluster = isolated(sim_cluster, 2)
    empty = tmp_path / "empty_known_hosts"
    empty.touch()
    done = ssh(cluster, "sim1", "true", "-o", f"UserKnownHostsFile={empty}", "-o", "StrictHostKeyChecking=yes")
    assert done.returncode == 255 and "Host key verification failed" in done.stderr
    # sim2's key presented for sim1's address must be refused too: every host has its own key.
    sim1, sim2 = cluster.hosts
    swapped = tmp_path / "swapped_known_hosts"
    sim2_key = cluster.known_hosts.read_text().splitlines()[1].split(None, 1)[1]
    swapped.write_text(f"{sim1.address},{sim1.name} {sim2_key}\n")
    done = ssh(cluster, "sim1", "true", "-o", f"UserKnownHostsFile={swapped}")
    assert done.returncode == 255 and "REMOTE HOST IDENTIFICATION HAS CHANGED" in done.stderr


def test_only_the_authorized_key_logs_in(sim_cluster: Make, tmp_path: Path) -> None:
    cluster = isolated(sim_cluster, 1)
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    config = tmp_path / "ssh_config"
    config.write_text(cluster.ssh_config.read_text().replace(str(cluster.client_key), str(stranger)))
    done = ssh(cluster, "sim1", "true", "-F", str(config))
    assert done.returncode == 255 and "Permission denied (publickey)" in done.stderr


def test_sshd_options_override_the_defaults(sim_cluster: Make) -> None:
    cluster = isolated(sim_cluster, 1, sshd_options={"AllowUsers": "nobody", "MaxSessions": "3"})
    config = (cluster.dir / "sim1" / "sshd_config").read_text()
    assert "MaxSessions 3" in config
    done = ssh(cluster, "sim1", "true")
    assert done.returncode == 255 and "Permission denied" in done.stderr


def test_killed_host_is_unreachable_and_close_leaves_nothing(sim_cluster: Make) -> None:
    cluster = isolated(sim_cluster, 2)
    sim1, sim2 = cluster.hosts
    netns = [line.split()[0] for line in netns_list().splitlines() if line.startswith(f"crsim-{os.getpid()}-")]
    assert len(netns) == 2
    assert len(links_of(os.getpid())) == 3  # the bridge and one veth per host
    sim1.kill()
    assert not sim1.alive and not Path(f"/proc/{sim1.pid}").exists()
    done = ssh(cluster, "sim1", "true", "-o", "ConnectTimeout=3")
    assert done.returncode == 255, done.stdout
    assert ssh(cluster, "sim2", "hostname").stdout.strip() == "sim2"
    folder = cluster.dir
    cluster.close()
    assert not set(netns) & set(netns_list().split())
    assert links_of(os.getpid()) == []
    assert processes_mentioning(str(folder)) == []
    assert not folder.exists()
    cluster.close()  # a second close is harmless


def test_clusters_coexist_and_a_new_one_starts_after_close(sim_cluster: Make) -> None:
    first = isolated(sim_cluster, 2)
    second = sim_cluster(2)
    assert first.subnet != second.subnet
    for cluster in (first, second):
        assert ssh(cluster, "sim2", "hostname").stdout.strip() == "sim2"
    bridge = first._bridge
    first.close()
    # its bridge is gone, and with it its subnet (which another test may take at once: pytest -n)
    assert bridge is not None and bridge not in {link["ifname"] for link in _ip_json("link")}
    third = sim_cluster(2)
    assert third.subnet != second.subnet
    assert ssh(third, "sim1", "hostname").stdout.strip() == "sim1"


def test_login_shell_is_replaced_per_host(sim_cluster: Make) -> None:
    if namespace_problem():
        unavailable(f"login_shell needs namespaces: {namespace_problem()}")
    tcsh = shutil.which("tcsh")
    if not tcsh:
        installed = subprocess.run(["sh", str(SUPPORT / "install_sshd.sh"), "tcsh"], capture_output=True, text=True,
                                   timeout=300, check=False)
        tcsh = shutil.which("tcsh")
        if not tcsh:
            reason = f"tcsh could not be installed with apt: {installed.stderr.strip()[-300:]}"
            unavailable(reason)
    cluster = sim_cluster(2, login_shell={"sim1": tcsh})
    assert ssh(cluster, "sim1", "echo $0").stdout.strip() == "tcsh"
    assert ssh(cluster, "sim2", "echo $0").stdout.strip() == "bash"
    assert cluster.hosts[0].run("getent", "passwd", "root").stdout.strip().endswith(f":{tcsh}")
    assert Path("/etc/passwd").read_text().splitlines()[0].endswith(":/bin/bash")


def test_under_ci_a_missing_namespace_fails_instead_of_falling_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI must not pass by testing less than it claims: no silent loopback fallback, no skip."""
    monkeypatch.setattr(simhosts, "namespace_problem", lambda: "unshare refused: Operation not permitted")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(SimHostError, match="CI=true: .* must have namespaces .*unshare refused"):
        SimCluster.start(1)
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        unavailable("no tcsh")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="no tcsh"):
        unavailable("no tcsh")


def test_loopback_fallback_serves_every_host_on_its_own_port(sim_cluster: Make) -> None:
    cluster = sim_cluster(2, isolated=False)
    assert not cluster.isolated and cluster.fallback_reason
    assert [h.address for h in cluster.hosts] == ["127.0.0.11", "127.0.0.12"]
    assert len({h.port for h in cluster.hosts}) == 2 and 22 not in {h.port for h in cluster.hosts}
    known = [line.split()[0] for line in cluster.known_hosts.read_text().splitlines()]
    assert known == [f"[{h.address}]:{h.port},[{h.name}]:{h.port}" for h in cluster.hosts]
    for host in cluster.hosts:
        done = ssh(cluster, host.name, "echo $SSH_CONNECTION")
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[2:] == [host.address, str(host.port)]
        assert Path(f"/proc/{host.pid}/exe").resolve() == Path(SSHD).resolve()
    cluster.hosts[0].kill()
    assert ssh(cluster, "sim1", "true").returncode == 255
    folder = cluster.dir
    cluster.close()
    assert processes_mentioning(str(folder)) == []


def test_a_signal_while_a_host_starts_leaves_no_host_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGHUP that comes just after sshd's fork, before Popen returned (a benchmark's close_on_signals)."""
    launched: list[subprocess.Popen[bytes]] = []
    real = subprocess.Popen

    def popen(argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        proc = real(argv, **kwargs)  # type: ignore[call-overload]
        if argv[:2] == [SSHD, "-D"]:  # a host's sshd, not a version check
            launched.append(proc)
            signal.raise_signal(signal.SIGHUP)  # runs the handler now, as a signal during Popen's wait would
        return proc

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    monkeypatch.setattr(subprocess, "Popen", popen)
    before = signal.signal(signal.SIGHUP, leave)
    try:
        with pytest.raises(SystemExit) as ended:
            SimCluster.start(2, isolated=False)
    finally:
        signal.signal(signal.SIGHUP, before)
        for proc in launched:
            if proc.poll() is None:
                proc.kill()
    assert ended.value.code == 128 + signal.SIGHUP
    assert len(launched) == 1 and launched[0].returncode == -signal.SIGKILL  # killed by close, not by the finally


def test_leftovers_of_a_crashed_run_are_swept(tmp_path: Path) -> None:
    if namespace_problem():
        unavailable(f"namespaces not permitted here: {namespace_problem()}")
    script = "from tests.simhosts import SimCluster; c = SimCluster.start(2); print(c.dir, flush=True); input()"
    crashed = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        folder = (crashed.stdout.readline() if crashed.stdout else "").strip()
    finally:
        crashed.send_signal(signal.SIGKILL)  # no atexit, no close: a crash
        crashed.communicate(timeout=10)
    assert folder and Path(folder).is_dir()
    prefix = f"crsim-{crashed.pid}-"
    assert [ns for ns in netns_list().split() if ns.startswith(prefix)]
    assert len(links_of(crashed.pid)) == 3
    assert processes_mentioning(folder)
    sweep_stale()
    assert not [ns for ns in netns_list().split() if ns.startswith(prefix)]
    assert links_of(crashed.pid) == []
    # SIGKILL is delivered asynchronously to the orphaned hosts
    wait_for(lambda: processes_mentioning(folder) == [], timeout=30, what="the crashed run's hosts to die")
    assert not Path(folder).exists()


def test_fixture_closes_its_clusters_when_the_test_fails(tmp_path: Path) -> None:
    if namespace_problem():
        unavailable(f"namespaces not permitted here: {namespace_problem()}")
    failing = tmp_path / "test_failing.py"
    # test_after checks the fixture's teardown itself, before the interpreter's exit could clean up instead.
    failing.write_text(textwrap.dedent("""\
        import os
        from tests.simhosts import sim_cluster  # noqa: F401
        made = []

        def test_fails(sim_cluster):
            made.append(sim_cluster(2))
            print("DIR", made[0].dir, flush=True)
            assert False, "this test fails on purpose"

        def test_after():
            assert not made[0].dir.exists()
            assert not [ns for ns in os.listdir("/run/netns") if ns.startswith(f"crsim-{os.getpid()}-")]
        """))
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(failing)],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 1 and "this test fails on purpose" in out and "1 failed, 1 passed" in out, out
    folder = next(line.split()[1] for line in out.splitlines() if line.startswith("DIR "))
    assert not Path(folder).exists()
    assert not [ns for ns in netns_list().split() if ns.startswith(f"crsim-{run.pid}-")]
    assert links_of(run.pid) == []
    assert processes_mentioning(folder) == []


@pytest.mark.parametrize("mode", [None, False], ids=["isolated-if-permitted", "loopback"])
def test_paramiko_accepts_the_generated_files(sim_cluster: Make, mode: bool | None) -> None:
    paramiko = pytest.importorskip("paramiko")
    cluster = sim_cluster(1, isolated=mode)
    settings = paramiko.SSHConfig.from_path(str(cluster.ssh_config)).lookup("sim1")
    client = paramiko.SSHClient()
    client.load_host_keys(str(cluster.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect(settings["hostname"], port=int(settings["port"]), username=settings["user"],
                       key_filename=settings["identityfile"][0], look_for_keys=False, allow_agent=False, timeout=10)
        _, stdout, _ = client.exec_command("echo $SSH_CONNECTION")
        assert stdout.read().decode().split()[2:] == [cluster.hosts[0].address, str(cluster.hosts[0].port)]
    finally:
        client.close()


@pytest.mark.parametrize("end", ["close", "kill"])
def test_the_attempt_cgroups_a_killed_host_could_not_remove_are_removed(end: str) -> None:
    """A host killed with a job on it leaves the attempt's cgroup (on this machine's hierarchy,
    which the hosts mount) without its supervisor to remove it: closing the cluster removes it,
    and so does killing the host in the middle of a test (``host.kill``, ``reboot``)."""
    if namespace_problem():
        unavailable(f"no simulated hosts here: {namespace_problem()}")
    cluster = SimCluster.start(1, isolated=True)
    try:
        job = f"/sys/fs/cgroup/clusterrun-crtest{os.getpid()}-n0-a1/job"
        made = cluster.hosts[0].run("sh", "-c", f"mkdir -p {job} && setsid sh -c 'echo $$ > {job}/cgroup.procs && "
                                    "exec sleep 600' </dev/null >/dev/null 2>&1 &")
        assert made.returncode == 0, made.stderr
        # (other test runs on this machine may make attempt cgroups meanwhile: only this one is checked)
        left = {p for p in simhosts._attempt_cgroups() - cluster._cgroups_before
                if Path(p).name == f"clusterrun-crtest{os.getpid()}-n0-a1"}
        assert len(left) == 1
        cgroup = Path(next(iter(left)))
        wait_for(lambda: "populated 1" in (cgroup / "cgroup.events").read_text(), 10, what="the job in its cgroup")
        if end == "kill":
            cluster.hosts[0].kill()
            assert not left & simhosts._attempt_cgroups()
    finally:
        cluster.close()
    assert not left & simhosts._attempt_cgroups()
