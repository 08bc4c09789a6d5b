"""Spare hosts end to end: simulated machines (real sshd, network + PID namespaces), a real gloo job.

A host of a running job dies (its namespace killed, every process there gone); the owner's next
attempt runs on the spare in its node rank and the job succeeds; without a spare the restarts end
after that attempt, naming the host. Which spare is picked, and when, is tested on the fast tier
(tests/test_spares.py).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import ROOT, SUPPORT, job_id_of, marked, up_argv, wait_for, write_hosts
from tests.simhosts import SimCluster
from tests.test_lifecycle import clusterrun, ps_json

pytestmark = pytest.mark.integration
MakeCluster = Callable[..., SimCluster]
SCRIPT = SUPPORT / "steps_gloo.py"


def hosts_file(folder: Path, cluster: SimCluster, spares: int) -> Path:
    names = [h.name for h in cluster.hosts]
    lines = [f"state_dir: {folder / 'state'}", f"ssh_config: {cluster.ssh_config}", "defaults:",
             f"  python: {sys.executable}", f"  workdir: {ROOT}", "restart: {max: 2, backoff: 0s}",
             f"hosts: [{', '.join(names[:2])}]"]
    if spares:
        lines.append(f"spares: [{', '.join(names[2:2 + spares])}]")
    path = folder / "hosts.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_and_kill(cluster: SimCluster, hosts: Path, log: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """``up --no-tui`` of 30 one-second steps; the second host is killed once its rank has done step 2."""
    with log.open("w") as out:
        proc = subprocess.Popen(up_argv(*options, hosts, SCRIPT, "30", "1"), stdout=out,
                                stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        try:
            wait_for(lambda: f"step 2 rank=1 host={cluster.hosts[1].name}" in log.read_text(), 120,
                     what="rank 1's step 2")
            cluster.hosts[1].kill()
            proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    return subprocess.CompletedProcess(proc.args, proc.returncode, text, text)


def test_a_dead_host_is_replaced_by_the_spare_and_the_job_succeeds(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = sim_cluster(3)
    h0, h1, h2 = (h.name for h in cluster.hosts)
    done = run_and_kill(cluster, hosts_file(tmp_path, cluster, spares=1), tmp_path / "up.log",
                        "--unreachable-timeout", "15")
    assert done.returncode == 0, done.stdout
    assert f"node 1: the spare {h2} takes the place of {h1} from attempt 2" in done.stdout
    assert "done rank=0" in done.stdout and f"step 30 rank=1 host={h2} sum=2" in done.stdout
    job_id = job_id_of(done.stdout)
    job = ps_json(job_id)
    assert job["state"] == "succeeded" and [n["host"] for n in job["nodes"]] == [h0, h2]
    assert [a["replaced"] for a in job["attempts"]] == [None, {h1: h2}]
    assert job["attempts"][0]["state"] in ("failed", "lost")
    assert marked(job_id) == []  # nothing of the job is left anywhere (every host's processes are seen from here)


def test_without_a_spare_a_dead_host_ends_the_restarts_naming_it(sim_cluster: MakeCluster, tmp_path: Path) -> None:
    cluster = sim_cluster(2)
    h1 = cluster.hosts[1].name
    done = run_and_kill(cluster, hosts_file(tmp_path, cluster, spares=0), tmp_path / "up.log")
    assert done.returncode == 1, done.stdout
    # Its stop cannot reach the host: said at once, then the wait (60 s without --unreachable-timeout) ends.
    assert f"node 1 ({h1}) cannot be reached to stop it (" in done.stdout
    assert "waiting up to 60 s for it, then it counts as lost" in done.stdout
    assert f"not restarting: the attempt lost {h1} (the host went away)" in done.stdout
    assert f"root cause: node 1 ({h1}): the host went away at " in done.stdout  # not its peer's gloo error
    job = ps_json(job_id_of(done.stdout))
    assert job["state"] in ("failed", "lost") and len(job["attempts"]) == 1


def test_restart_x_puts_the_first_spare_in_the_hosts_place(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir, extra="spares:\n  - host: local-s\n    transport: local\n")
    started = clusterrun("up", "-d", str(hosts), str(SCRIPT), "600", "1")
    assert started.returncode == 0, started.stderr
    job = job_id_of(started.stderr)
    wait_for(lambda: "step 1 rank=1" in clusterrun("logs", job).stdout, 120, what="the first step")
    bad = clusterrun("restart", job, "--replace", "local-b=local-x")
    assert bad.returncode == 2 and "local-x is not a free spare of job" in bad.stderr, bad.stderr
    done = clusterrun("restart", job, "-x", "local-b", "--", "2", "0")
    assert done.returncode == 0, done.stderr
    assert "node 1: the spare local-s takes the place of local-b from attempt 2" in done.stderr
    assert clusterrun("wait", job).returncode == 0
    shown = ps_json(job)
    assert shown["state"] == "succeeded" and [n["host"] for n in shown["nodes"]] == ["local-a", "local-s"]
    assert [a["replaced"] for a in shown["attempts"]] == [None, {"local-b": "local-s"}]
    assert "done rank=1" in clusterrun("logs", job).stdout
    assert "step 1 rank=1" in clusterrun("logs", "--attempt", "1", job).stdout  # read from the host that ran it

