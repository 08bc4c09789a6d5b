"""A host of a real 3-node gloo job rebooted (simulated: its PID namespace killed, then started
again with a new boot id): the job fails, the rebooted node is the root cause, never a node that
clusterrun's own fail-fast stop ended."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from clusterrun.core.events import iso
from tests.conftest import ROOT, SUPPORT, up_argv, wait_for
from tests.simhosts import SimCluster
from tests.test_lifecycle import ps_json
from tests.test_ssh import job_processes, ssh_hosts

pytestmark = pytest.mark.integration
REBOOTED = "its boot id changed (it restarted)"
KILLED = ("when it came back none of the job's processes was left (torchrun's exit status is unknown: the survivor "
          "that waited for it ended first (killed?))")


@pytest.mark.parametrize("new_boot_id", [True, False], ids=["rebooted", "processes-killed"])
def test_a_rebooted_host_is_the_root_cause_never_a_node_the_fail_fast_stop_ended(
        sim_cluster: Callable[..., SimCluster], tmp_path: Path, controller_state: Path, new_boot_id: bool) -> None:
    """Without a new boot id (every process of the host killed at once) the monitor an agent starts
    finds torchrun's exit status unknown: that node is the root cause all the same."""
    cluster = sim_cluster(3)
    hosts = ssh_hosts(tmp_path, cluster, [1, 1, 1], tmp_path / "state")
    gate = tmp_path / "gate"  # never made: the ranks wait there, halfway, until the host goes away
    proc = subprocess.Popen(up_argv("--grace", "3", hosts, SUPPORT / "progress_train.py", "examples", "40", gate),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout or ()), daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("Train Epoch: 1 [1280/2560" in line for line in out), timeout=120,
                 what="every rank at the gate")
        before = time.time()
        cluster.reboot(cluster.hosts[2], new_boot_id=new_boot_id)
        err = proc.stderr.read()
        assert proc.wait(timeout=180) == 1, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    proc.stdout.close()
    proc.stderr.close()
    cause = re.search(r"^clusterrun: root cause: (.*)$", err, re.M)
    assert cause, err
    away = re.fullmatch(r"node 2 \(sim3\): the host went away at (\d\d:\d\d:\d\d)Z; (.*)", cause.group(1))
    assert away, err
    assert away.group(2) == (KILLED, REBOOTED)[new_boot_id], err
    assert iso(before - 1)[11:19] <= away.group(1) <= iso(time.time())[11:19]
    assert "stopped by clusterrun after node 2 failed" in err
    record = ps_json(re.search(r"clusterrun: job (\S+): 3 nodes", err).group(1))  # type: ignore[union-attr]
    assert [n["state"] for n in record["nodes"]] == ["stopped", "stopped", "lost"], record
    assert record["attempts"][-1]["root_cause"] == cause.group(1), record
    for host in cluster.hosts:
        assert job_processes(host) == []
