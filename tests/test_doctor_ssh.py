"""`clusterrun doctor` and `up`'s preflight on simulated SSH hosts (real sshd, real agents, real TCP),
and on a local host with a fake `nvidia-smi`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import ROOT, SUPPORT, run_up, up_argv
from tests.simhosts import NFT, SimCluster, SimHost, namespace_problem, unavailable
from tests.test_ssh import job_processes, ssh_hosts

pytestmark = pytest.mark.integration
MakeCluster = Callable[..., SimCluster]
SCRIPT = "examples/allreduce.py"


def run_doctor(hosts: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterrun", "doctor", str(hosts), *args], capture_output=True,
                          text=True, timeout=180, cwd=ROOT, env=env)


def rows(stdout: str, host: str) -> dict[str, str]:
    """The doctor's rows of ``host``: check name → the verdict and what follows it (and its fix line)."""
    found: dict[str, str] = {}
    current = None
    last = ""
    for line in stdout.splitlines():
        if line.startswith("node"):
            current = line.split()[1]
            line = line[len(line.split("  ")[0]):]
        if current != host:
            continue
        text = line.strip()
        if text.startswith("fix: ") and last:
            found[last] += "\n" + text
        elif text[:1] in ("✓", "✗", "!"):
            verdict, rest = text[0], text[2:]
            name, _, detail = rest.partition("  ")
            last = name.strip()
            found[last] = f"{verdict} {detail.strip()}"
    return found


def set_host(hosts: Path, name: str, *lines: str) -> None:
    """Add ``lines`` (``key: value``) to host ``name`` in the hosts file."""
    text = hosts.read_text()
    entry = f"  - host: {name}\n"
    hosts.write_text(text.replace(entry, entry + "".join(f"    {line}\n" for line in lines)))


def assert_nothing_started(proc: subprocess.CompletedProcess[str], state: Path, cluster: SimCluster,
                           xdg: Path) -> None:
    assert proc.returncode == 3, proc.stderr
    assert "nothing was started" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (state / "jobs").exists()  # no node started anywhere
    assert not list(xdg.glob("clusterrun/jobs/*"))  # no record: `ps` shows nothing
    for host in cluster.hosts:
        assert job_processes(host) == []


@contextmanager
def listener_on(host: SimHost, port: int) -> Iterator[None]:
    """Something else holding TCP ``port`` on ``host`` (inside its network namespace)."""
    code = ("import socket, sys; s = socket.socket(); s.bind(('', int(sys.argv[1]))); s.listen(); "
            "print('ready', flush=True); sys.stdin.read()")
    enter = ["nsenter", f"--target={host.pid}", "--net"] if host.isolated else []
    proc = subprocess.Popen([*enter, sys.executable, "-c", code, str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_doctor_passes_on_healthy_hosts_and_names_a_missing_script_and_python(
        sim_cluster: MakeCluster, tmp_path: Path, controller_state: Path) -> None:
    cluster = sim_cluster(3)
    state = tmp_path / "state"
    hosts = ssh_hosts(tmp_path, cluster, [1, 1, 1], state)
    proc = run_doctor(hosts, SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for host in ("sim1", "sim2", "sim3"):
        found = rows(proc.stdout, host)
        assert {name: v[0] for name, v in found.items()} == {
            "connection": "✓", "python": "✓", "torch": "✓", "workdir": "✓", "script": "✓", "state disk": "✓",
            "clock": "✓", "logind": "✓", "interface": "✓", "master port": "✓", "same versions": "✓",
            "imports": "✓"}, proc.stdout
    assert rows(proc.stdout, "sim2")["master port"].startswith(f"✓ {cluster.hosts[0].address}:")
    assert rows(proc.stdout, "sim2")["interface"].startswith(f"✓ eth0 {cluster.hosts[1].address} (routes to the master")

    # sim2: the script is not under its workdir; sim3: no such interpreter
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    set_host(hosts, "sim2", f"workdir: {elsewhere}")
    set_host(hosts, "sim3", "python: /opt/nowhere/python3")
    proc = run_doctor(hosts, SCRIPT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "✗" not in "".join(rows(proc.stdout, "sim1").values())
    script = rows(proc.stdout, "sim2")["script"]
    assert script == (f"✗ {SCRIPT} is missing in {elsewhere} (SCRIPT is relative to the host's workdir)\n"
                      f"fix: copy {SCRIPT} to {elsewhere} on sim2 (`sync: .` in the hosts file copies the project "
                      "before each start), or fix workdir: for this host")
    python = rows(proc.stdout, "sim3")
    assert list(python) == ["connection", "python"]
    assert python["python"].startswith("✗ cannot run /opt/nowhere/python3: ")
    assert "/opt/nowhere/python3: No such file or directory" in python["python"]
    assert python["python"].endswith("fix: install Python >= 3.8 there, or set `python:` for this host to an "
                                     "interpreter that exists")
    assert "2 problem(s) (✗) on sim2, sim3" in proc.stdout

    # up refuses before anything starts anywhere, naming the host and the path
    proc = run_up(hosts, SCRIPT)
    assert_nothing_started(proc, state, cluster, controller_state)
    proc = run_up("--dry-run", hosts, SCRIPT)
    assert proc.returncode == 3 and "job " not in proc.stdout, proc.stdout + proc.stderr


def test_up_refuses_a_missing_script_or_workdir_on_one_host_and_leaves_no_record(
        sim_cluster: MakeCluster, tmp_path: Path, controller_state: Path) -> None:
    cluster = sim_cluster(2)
    state = tmp_path / "state"
    hosts = ssh_hosts(tmp_path, cluster, [1, 1], state)
    text = hosts.read_text()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    set_host(hosts, "sim2", f"workdir: {elsewhere}")
    proc = run_up(hosts, SCRIPT)
    assert_nothing_started(proc, state, cluster, controller_state)
    assert (f"sim2: script: {SCRIPT} is missing in {elsewhere} (SCRIPT is relative to the host's workdir)\n"
            f"  hint: copy {SCRIPT} to {elsewhere} on sim2 (`sync: .` in the hosts file copies the project before "
            "each start), or fix workdir: for this host") in proc.stderr
    assert "sim1:" not in proc.stderr

    hosts.write_text(text)
    set_host(hosts, "sim2", "workdir: /root/no-such-project")
    for args in ((), ("--no-preflight",), ("--dry-run",)):  # the cheap checks always run
        proc = run_up(*args, hosts, SCRIPT)
        assert_nothing_started(proc, state, cluster, controller_state)
        assert "sim2: workdir: /root/no-such-project does not exist" in proc.stderr, proc.stderr


def test_a_blocked_master_port_is_found_by_doctor_and_refused_by_up(
        sim_cluster: MakeCluster, tmp_path: Path, controller_state: Path) -> None:
    cluster = sim_cluster(2)
    state = tmp_path / "state"
    hosts = ssh_hosts(tmp_path, cluster, [1, 1], state)
    text = hosts.read_text()
    port = 29417

    # taken on node 0 by another program
    hosts.write_text(text + f"master:\n  port: {port}\n")
    with listener_on(cluster.hosts[0], port):
        proc = run_doctor(hosts)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert rows(proc.stdout, "sim1")["master port"] == (
            f"✗ {port} cannot be opened on sim1: Address already in use\n"
            "fix: choose another master.port, or `port: auto`")
        proc = run_up(hosts, SCRIPT)
        assert_nothing_started(proc, state, cluster, controller_state)
        assert f"sim1: master port: {port} cannot be opened on sim1: Address already in use" in proc.stderr

    # free on node 0, but not reachable from node 1 at the master address (a loopback address here)
    hosts.write_text(text + f"master:\n  addr: 127.0.0.1\n  port: {port}\n")
    proc = run_doctor(hosts)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert rows(proc.stdout, "sim1")["master port"].startswith(f"✓ 127.0.0.1:{port} on sim1 reached by TCP")
    assert rows(proc.stdout, "sim2")["master port"] == (
        f"✗ 127.0.0.1:{port} on sim1 not reached by TCP: Connection refused\n"
        f"fix: allow TCP to port {port} on sim1 from sim2 (firewall), or set master.addr (or node 0's address:) to "
        "an address every node reaches")
    loopback = "sim2: the master 127.0.0.1 is a loopback address: this host's ranks would not reach node 0 (sim1)"
    assert rows(proc.stdout, "sim2")["interface"].startswith("✗ the master 127.0.0.1 is a loopback address")
    # `up` finds it before its preflight, when it chooses each node's interface (--dry-run and
    # --no-preflight too: that choice is no extra round trip)
    for args in ((), ("--dry-run",), ("--dry-run", "--no-preflight")):
        proc = run_up(*args, hosts, SCRIPT)
        assert_nothing_started(proc, state, cluster, controller_state)
        assert loopback in proc.stderr, proc.stderr


def nft_ruleset() -> str:
    """This machine's own nftables ruleset (the simulated hosts' firewalls must never show here)."""
    return subprocess.run([NFT, "list", "ruleset"], capture_output=True, text=True, check=True).stdout


def test_a_master_port_firewalled_on_node_0_is_found_by_doctor_and_refused_by_up(
        sim_cluster: MakeCluster, tmp_path: Path, controller_state: Path) -> None:
    """A real firewall rule (nftables in node 0's network namespace) against incoming TCP to the
    master port from the other hosts: dropped (the doctor's test times out, and says so) or rejected."""
    installed = subprocess.run(["sh", str(SUPPORT / "install_sshd.sh"), "nftables:nft"], capture_output=True,
                               text=True, timeout=900, check=False)
    if not os.path.exists(NFT):
        unavailable(f"nft (package nftables) is not installed: {installed.stdout}{installed.stderr}".strip())
    if namespace_problem():
        unavailable(f"a firewall of its own per host needs namespaces: {namespace_problem()}")
    cluster = sim_cluster(2)
    sim1 = cluster.hosts[0]
    state = tmp_path / "state"
    hosts = ssh_hosts(tmp_path, cluster, [1, 1], state)
    port = 29418
    hosts.write_text(hosts.read_text() + f"master:\n  port: {port}\n")
    ours = nft_ruleset()
    where = f"{sim1.address}:{port} on sim1"
    fix = (f"fix: allow TCP to port {port} on sim1 from sim2 (firewall), or set master.addr (or node 0's "
           "address:) to an address every node reaches")
    dropped = "timed out after 5 s: no answer at all (packets dropped on the way, as a firewall's DROP does)"
    for verdict, error in (("drop", dropped), ("reject with icmpx type admin-prohibited", "No route to host"),
                           ("reject", "Connection refused")):
        sim1.block_tcp(port, verdict)
        try:
            assert nft_ruleset() == ours  # the rule is in sim1's namespace only
            proc = run_doctor(hosts)
            assert proc.returncode == 1, proc.stdout + proc.stderr
            assert rows(proc.stdout, "sim1")["master port"] == f"✓ {where} reached by TCP (free there)"
            assert rows(proc.stdout, "sim2")["master port"] == f"✗ {where} not reached by TCP: {error}\n{fix}"
            assert rows(proc.stdout, "sim2")["interface"].startswith("✓ eth0 ")  # the route is fine: a firewall
            assert "1 problem(s) (✗) on sim2, 0 warning(s) (!): the job cannot run" in proc.stdout
            proc = run_up(hosts, SCRIPT)
            assert_nothing_started(proc, state, cluster, controller_state)
            assert (f"clusterrun: error: 1 host(s) cannot run the job (preflight); nothing was started\n"
                    f"sim2: master port: {where} not reached by TCP: {error}\n  hint: {fix[5:]}") in proc.stderr
            listed = subprocess.run([sys.executable, "-m", "clusterrun", "ps", "-a", "--json"], capture_output=True,
                                    text=True, timeout=60, cwd=ROOT)
            assert listed.returncode == 0 and json.loads(listed.stdout)["jobs"] == [], listed.stdout + listed.stderr
        finally:
            sim1.unblock_tcp()
    proc = run_doctor(hosts)  # the rule was all that stood in the way
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rows(proc.stdout, "sim2")["master port"] == f"✓ {where} reached by TCP"


def test_a_host_with_another_torch_is_named_in_a_warning(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = sim_cluster(2)
    hosts = ssh_hosts(tmp_path, cluster, [1, 1], tmp_path / "state")
    # sim2's interpreter finds a torch that says it is 2.12.0 first on its path
    stub = tmp_path / "stub"
    (stub / "torch").mkdir(parents=True)
    (stub / "torch" / "version.py").write_text("__version__ = '2.12.0'\ncuda = None\n")
    (stub / "torch" / "__init__.py").write_text(
        "from torch import version\n__version__ = version.__version__\n"
        "class cuda:\n    is_available = staticmethod(lambda: False)\n")
    python = tmp_path / "python-old-torch"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={stub} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    set_host(hosts, "sim2", f"python: {python}")
    proc = run_doctor(hosts, SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # a warning, not a problem
    import torch

    assert rows(proc.stdout, "sim2")["torch"] == "✓ 2.12.0, CUDA none, NCCL none"
    assert rows(proc.stdout, "sim2")["same versions"] == (
        f"! torch 2.12.0 here, {torch.__version__} on sim1\n"
        "fix: install the same versions on every host (mismatches hang or crash collectives)")
    assert rows(proc.stdout, "sim1")["same versions"].startswith("✓")
    # up warns with the same words (here with --dry-run: the stub could not train)
    proc = run_up("--dry-run", hosts, SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert f"clusterrun: warning: sim2: same versions: torch 2.12.0 here, {torch.__version__} on sim1" in proc.stderr
    assert os.path.exists(python)


FAKE_SMI = """#!/bin/sh
case "$1" in
  -L) printf 'GPU 0: NVIDIA Fake 80GB (UUID: GPU-aaaa)\\nGPU 1: NVIDIA Fake 80GB (UUID: GPU-bbbb)\\n' ;;
  --query-compute-apps=*) printf 'GPU-bbbb, 4242, /usr/bin/python3\\n' ;;
  *) exit 2 ;;
esac
"""


def fake_cuda_torch(folder: Path, devices: int) -> Path:
    """A stand-in torch (for the preflight's and the doctor's look only) whose CUDA sees ``devices``."""
    torch = folder / "torch"
    (torch / "distributed").mkdir(parents=True)
    (torch / "distributed" / "run.py").write_text("")
    (torch / "version.py").write_text("__version__ = '2.13.0+cu124'\ncuda = '12.4'\n")
    (torch / "__init__.py").write_text(
        "__version__ = '2.13.0+cu124'\nclass version:\n    cuda = '12.4'\nclass cuda:\n"
        f"    is_available = staticmethod(lambda: True)\n    device_count = staticmethod(lambda: {devices})\n"
        "    class nccl:\n        version = staticmethod(lambda: (2, 21, 5))\n")
    return folder


def test_gpus_against_a_fake_nvidia_smi(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    cuda = fake_cuda_torch(tmp_path / "cuda2", 2)  # a CUDA torch that sees both GPUs
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join([str(cuda), os.environ.get("PYTHONPATH", "")]))
    hosts = tmp_path / "hosts.yaml"

    def up(gpus: str, environ: dict[str, str] = env) -> subprocess.CompletedProcess[str]:
        hosts.write_text(f"state_dir: {tmp_path / 'state'}\nhosts:\n  - host: local-a\n    transport: local\n"
                         f"    gpus: {gpus}\n")
        return subprocess.run(up_argv("--dry-run", hosts, SCRIPT), capture_output=True, text=True, timeout=120,
                              cwd=ROOT, env=environ)

    proc = up("[0, GPU-bbbb]")  # by index and by UUID; GPU 1 runs someone else's process
    assert proc.returncode == 0, proc.stderr
    assert ("clusterrun: warning: local-a: gpus: busy: GPU GPU-bbbb: pid 4242 python3 (fix: stop those processes "
            "on local-a or choose other gpus:)") in proc.stderr
    proc = up("[0, 3]")
    assert proc.returncode == 3, proc.stderr
    assert "local-a: gpus: GPU 3 asked for; nvidia-smi sees 0, 1\n  hint: fix gpus: for this host" in proc.stderr
    assert not (tmp_path / "state" / "jobs").exists()
    # torch sees fewer CUDA devices than the hosts file declares (minGPT: "Unable to locate 2 gpus"):
    # refused before the start, as by the doctor
    one = dict(env, PYTHONPATH=os.pathsep.join([str(fake_cuda_torch(tmp_path / "cuda1", 1)),
                                                os.environ.get("PYTHONPATH", "")]))
    proc = up("[0, 1]", one)
    assert proc.returncode == 3, proc.stderr
    assert "local-a: gpus: torch sees 1 CUDA device(s), the hosts file asks for 2" in proc.stderr
    # the real torch here is a CPU build
    cpu = dict(env, PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    assert "torch sees 0 CUDA device(s), the hosts file asks for 1" in up("[0]", cpu).stderr
    proc = run_doctor(hosts, env=cpu)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert rows(proc.stdout, "local-a")["gpus"] == (
        "✗ torch sees 0 CUDA device(s), the hosts file asks for 1\n"
        "fix: install a CUDA build of torch matching the driver")
