"""The network interface chosen for you, on simulated machines (real sshd, real torchrun with gloo).

Debian's default /etc/hosts maps a machine's own name to 127.0.1.1: without an interface named,
gloo advertises that address and the other nodes connect to their own loopback. A host with a
second network that node 0 cannot reach, whose name resolves to its address there, makes gloo
advertise that one. In both cases clusterrun sets GLOO_SOCKET_IFNAME to the interface that routes
to the master, and the job runs. The policy itself is tested in tests/test_interfaces.py.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_up
from tests.simhosts import SimCluster, SimHost

pytestmark = pytest.mark.integration
MakeCluster = Callable[..., SimCluster]
SCRIPT = ROOT / "tests" / "_support" / "allreduce_net.py"


def hosts_file(folder: Path, cluster: SimCluster, nprocs: Sequence[int], extra: str = "") -> Path:
    lines = [f"state_dir: {folder / 'state'}", f"ssh_config: {cluster.ssh_config}", "defaults:",
             f"  python: {sys.executable}", f"  workdir: {ROOT}", "hosts:"]
    for host, n in zip(cluster.hosts, nprocs, strict=True):
        lines += [f"  - host: {host.name}", f"    nproc: {n}"]
    path = folder / "hosts.yaml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def ranks_saw(stdout: str) -> dict[int, tuple[str, str, str]]:
    """rank → (host, GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) of every rank whose all_reduce sum was right."""
    found = re.findall(r"\| NET rank=(\d+) host=(\S+) gloo_ifname=(\S+) nccl_ifname=(\S+) sum=(\S+) expected=(\S+)$",
                       stdout, re.M)
    return {int(rank): (host, gloo, nccl) for rank, host, gloo, nccl, total, expected in found if total == expected}


def debian_hosts(host: SimHost, hosts: Sequence[SimHost]) -> str:
    """Debian's default: the machine's own name on 127.0.1.1; the others by their address."""
    return ("127.0.0.1 localhost\n" + f"127.0.1.1 {host.name}\n"
            + "".join(f"{h.address} {h.name}\n" for h in hosts if h is not host))


def test_hostnames_on_127_0_1_1_the_job_runs(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = sim_cluster(2, etc_hosts=debian_hosts)
    for host in cluster.hosts:
        assert host.run("getent", "hosts", host.name).stdout.split()[0] == "127.0.1.1"
    hosts = hosts_file(tmp_path, cluster, [2, 2])
    dry = run_up("--dry-run", hosts, SCRIPT)
    assert dry.returncode == 0, dry.stderr
    for host in cluster.hosts:
        assert f"  network: eth0 {host.address} (routes to the master {cluster.hosts[0].address}; " in dry.stdout
    proc = run_up(hosts, SCRIPT)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "clusterrun: network: node0 sim1 eth0, node1 sim2 eth0" in proc.stderr
    assert ranks_saw(proc.stdout) == {0: ("sim1", "eth0", "eth0"), 1: ("sim1", "eth0", "eth0"),
                                      2: ("sim2", "eth0", "eth0"), 3: ("sim2", "eth0", "eth0")}


def test_two_networks_the_job_runs_on_the_one_that_reaches_node_0(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    """sim2 and sim3 also share a second network, which node 0 (sim1) is not on, and their names
    resolve to their addresses there: gloo alone advertises those, and sim1 (of two peers, gloo
    has the higher address connect; the second network's are lower) finds no route to them."""

    def second_first(host: SimHost, hosts: Sequence[SimHost]) -> str:
        return "127.0.0.1 localhost\n" + "".join(f"{h.address2 or h.address} {h.name}\n" for h in hosts)

    cluster = sim_cluster(3, etc_hosts=second_first, second_network=["sim2", "sim3"])
    sim1, sim2, sim3 = cluster.hosts
    assert sim2.address2 and sim2.run("getent", "hosts", "sim2").stdout.split()[0] == sim2.address2
    assert sim1.run("ip", "route", "get", sim2.address2).returncode != 0  # node 0 cannot reach that network
    assert sim3.run("ip", "route", "get", sim2.address2).returncode == 0
    dry = run_up("--dry-run", hosts_file(tmp_path, cluster, [1, 1, 1]), SCRIPT)
    for host in (sim2, sim3):
        assert f"  network: eth0 {host.address} (routes to the master {sim1.address}; " in dry.stdout, dry.stdout
    proc = run_up(hosts_file(tmp_path, cluster, [1, 1, 1]), SCRIPT)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert ranks_saw(proc.stdout) == {0: ("sim1", "eth0", "eth0"), 1: ("sim2", "eth0", "eth0"),
                                      2: ("sim3", "eth0", "eth0")}
    # what the user sets wins, in the hosts file or the command line
    proc = run_up("--env", "NCCL_SOCKET_IFNAME=ib0", hosts_file(
        tmp_path, cluster, [1, 1, 1], extra="env:\n  GLOO_SOCKET_IFNAME: eth0\n"), SCRIPT)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert set(ranks_saw(proc.stdout).values()) == {(h.name, "eth0", "ib0") for h in cluster.hosts}


def test_a_master_name_that_another_host_resolves_to_loopback_is_refused_before_anything_starts(
        sim_cluster: MakeCluster, tmp_path: Path) -> None:
    def sim1_is_local_on_sim2(host: SimHost, hosts: Sequence[SimHost]) -> str:
        if host.name == "sim2":
            return "127.0.0.1 localhost\n127.0.1.1 sim2 sim1\n"
        return "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in hosts)

    cluster = sim_cluster(2, etc_hosts=sim1_is_local_on_sim2)
    proc = run_up(hosts_file(tmp_path, cluster, [1, 1], extra="master:\n  addr: sim1\n"), SCRIPT)
    assert proc.returncode == 3, proc.stderr
    assert ("clusterrun: error: 1 host(s) cannot run the job; nothing was started\n"
            "sim2: the master sim1 resolves to 127.0.1.1 on this host, its own loopback: its ranks would not reach "
            "node 0 (sim1)\n  hint: /etc/hosts:2: 127.0.1.1 sim2 sim1 maps sim1 to 127.0.1.1; set `master: addr:` "
            "in the hosts file to node 0's address on a network every node reaches, or fix /etc/hosts on sim2"
            ) in proc.stderr
    assert "Traceback" not in proc.stderr and "NET rank" not in proc.stdout
    assert not (tmp_path / "state" / "jobs").exists()
    # a master address no host has a route to
    proc = run_up(hosts_file(tmp_path, cluster, [1, 1], extra="master:\n  addr: 10.99.0.1\n"), SCRIPT)
    assert proc.returncode == 3, proc.stderr
    for host in cluster.hosts:
        assert (f"\n{host.name}: cannot reach the master 10.99.0.1: no route to 10.99.0.1 (10.99.0.1): Network is "
                "unreachable\n  hint: set `master: addr:`") in proc.stderr, proc.stderr
    assert not (tmp_path / "state" / "jobs").exists()
