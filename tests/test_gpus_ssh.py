"""The GPU view on simulated SSH hosts: each host's own fake ``nvidia-smi`` first on its PATH (a
good one, one that exits 9, none), read by the dashboard's poller over SSH, and by ``ps JOB``."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from clusterrun.config.hostsfile import load_cluster
from clusterrun.core.events import NodeGpus
from clusterrun.transports import transport_for
from clusterrun.views.gpus import BROKEN, MISSING, GpuPoller, cell
from tests.conftest import ROOT, SUPPORT, write_hosts
from tests.simhosts import SimCluster, namespace_problem, unavailable
from tests.test_joblist import documented_schema, violations
from tests.test_lifecycle import up_detached, wait_state
from tests.test_ssh import ssh_hosts

pytestmark = pytest.mark.integration
NVIDIA = Path(__file__).parent / "_support" / "nvidia"
PATH_DIR = "/usr/local/sbin"  # first on root's PATH on the hosts, and empty here


def with_nvidia_smis(sim_cluster: Callable[..., SimCluster]) -> SimCluster:
    """Three hosts: sim1's nvidia-smi reads two GPUs, sim2's exits 9, sim3 has none."""
    if (reason := namespace_problem()) is not None:
        unavailable(reason)
    cluster = sim_cluster(3)
    assert cluster.isolated
    for host, kind in zip(cluster.hosts, ("good", "broken"), strict=False):
        done = host.run("mount", "--bind", str(NVIDIA / kind), PATH_DIR)  # in the host's mount namespace only
        assert done.returncode == 0, done.stderr
    return cluster


def test_the_poller_reads_each_hosts_own_nvidia_smi_over_ssh(sim_cluster: Callable[..., SimCluster],
                                                            tmp_path: Path) -> None:
    cluster = with_nvidia_smis(sim_cluster)
    spec = load_cluster(str(ssh_hosts(tmp_path, cluster, [1, 1, 1], tmp_path / "state")))
    transports = [transport_for(host, ssh_config=spec.ssh_config) for host in spec.hosts]
    got: queue.SimpleQueue[NodeGpus] = queue.SimpleQueue()
    poller = GpuPoller(lambda: transports, got.put, interval=0.2)
    poller.start()
    try:
        seen: dict[int, list[NodeGpus]] = {0: [], 1: [], 2: []}
        while len(seen[0]) < 2 or len(seen[1]) < 2 or not seen[2]:  # sim1 and sim2 read again, sim3 once
            event = got.get(timeout=60)
            seen[event.node].append(event)
    finally:
        poller.stop()
        for transport in transports:
            transport.close()
    assert [cell(seen[rank][-1]) for rank in range(3)] == ["2× 86% 59/160G", BROKEN, MISSING]
    assert seen[1][-1].problem.startswith("nvidia-smi exited with status 9: NVIDIA-SMI has failed")
    assert len(seen[2]) == 1  # no nvidia-smi: asked once


@pytest.mark.fake_torchrun
def test_ps_shows_each_nodes_gpus(tmp_path: Path, state_dir: Path) -> None:
    """`ps JOB` asks each host's agent for its GPUs after the status: a column, and each GPU below."""
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached(hosts, SUPPORT / "counter.py", "3", "0.01")
    wait_state(job, "succeeded")
    env = dict(os.environ, PATH=f"{NVIDIA / 'good'}:{os.environ['PATH']}")  # the local hosts' agents see it
    shown = subprocess.run([sys.executable, "-m", "clusterrun", "ps", job], capture_output=True, text=True,
                           timeout=60, cwd=ROOT, env=env)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[1].split()[-1] == "GPUS" and lines[2].endswith("2× 86% 59/160G"), shown.stdout
    assert "node1 local-b: GPUs: gpu0 87% 29/80G · gpu1 85% 29/80G" in lines, shown.stdout
    document = subprocess.run([sys.executable, "-m", "clusterrun", "ps", "--json", job], capture_output=True,
                              text=True, timeout=60, cwd=ROOT, env=env)
    assert violations(json.loads(document.stdout), documented_schema("ps")) == []
    assert json.loads(document.stdout)["jobs"][0]["nodes"][0]["gpus"] == {
        "found": True, "problem": "", "gpus": [{"index": 0, "util": 87, "mem_used": 30123, "mem_total": 81920},
                                             {"index": 1, "util": 85, "mem_used": 29876, "mem_total": 81920}]}
    plain = subprocess.run([sys.executable, "-m", "clusterrun", "ps", job], capture_output=True, text=True,
                           timeout=60, cwd=ROOT, env=dict(os.environ, PATH="/usr/bin:/bin"))
    assert "GPUS" not in plain.stdout and "GPUs:" not in plain.stdout, plain.stdout  # no nvidia-smi: no column
