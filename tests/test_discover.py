"""Jobs found again on their hosts (`--hosts HOSTS.yaml`) by a controller without their records.

The rules (which jobs fit a hosts file) are tested on made-up answers; the wiring with two
controllers (two XDG_STATE_HOME) on simulated SSH hosts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from clusterrun.config.hostsfile import load_cluster_text
from clusterrun.core.errors import ConnectError
from clusterrun.core.events import JobState, NodeState
from clusterrun.life.discover import records_from
from tests.conftest import ROOT, SUPPORT, wait_for
from tests.simhosts import SimCluster
from tests.test_lifecycle import clusterrun, ps_json, up_detached, wait_state
from tests.test_lifecycle_ssh import marked_on
from tests.test_ssh import ssh_hosts

HOSTS = "state_dir: /s\nhosts:\n  - host: a\n    nproc: 2\n  - host: b\n    nproc: 1\n"


def entry(job: str, node: int, attempt: int = 1, state: str = "running", **more: Any) -> dict[str, Any]:
    about = {"name": job.split("-")[0], "script": "train.py", "script_args": ["--x"], "master_addr": "a",
             "master_port": 29500 + attempt, "grace": 3.0, "nnodes": 2, "env_overrides": ["TOKEN"]}
    return {"job": job, "node": node, "attempt": attempt, "started": 1000.0 + attempt,
            "state": {"state": state, "torchrun": {"pid": 40 + node}, **more}, "argv": ["python", f"n{node}"],
            "env": {"TOKEN": "t", "OTHER": "o"}, "cwd": None, "first_rank": 2 * node, "about": about}


def test_a_job_is_adopted_only_when_its_nodes_are_on_the_hosts_in_the_files_order() -> None:
    spec = load_cluster_text(HOSTS, "hosts.yaml")
    ok, swapped, big, known = "ok-1", "swapped-1", "big-1", "known-1"
    answers: dict[int, Any] = {
        0: {"jobs": [entry(ok, 0), entry(ok, 0, 2, "exited", exit_code=0, ended_at=2000.0),
                     entry(swapped, 1), entry(big, 0), entry(known, 0)]},
        1: {"jobs": [entry(ok, 1), entry(ok, 1, 2, "exited", exit_code=1, ended_at=2100.0),
                     entry(swapped, 0), entry(big, 1), entry(big, 2), entry(known, 1)]},
    }
    records, notes = records_from(spec, "hosts.yaml", HOSTS, answers, known={known}, local_cwd="/w", ssh_config=None)
    assert [r.job_id for r in records] == [ok]
    record = records[0]
    assert record.adopted and record.attempt == 2 and record.state is JobState.FAILED
    assert [(n.host, n.state, n.exit_code) for n in record.nodes] == [("a", NodeState.SUCCEEDED, 0),
                                                                      ("b", NodeState.FAILED, 1)]
    assert [a.master_port for a in record.attempts] == [29501, 29502] and record.attempts[-1].ended == 2100.0
    assert record.script_args == ["--x"] and record.env_overrides == {"TOKEN": "t"}
    assert record.plan["nodes"][1]["first_rank"] == 2 and record.plan["state_dir"] == "/s"
    assert any(f"job {big}: has node 2, more nodes than hosts.yaml lists" in n for n in notes), notes
    assert any(f"job {swapped}: no node 0 on a: started with another hosts file" in n for n in notes), notes
    assert not any(known in n for n in notes)

    answers[1] = ConnectError("b", "connection refused")
    records, notes = records_from(spec, "hosts.yaml", HOSTS, answers, known=set(), local_cwd="/w", ssh_config=None)
    assert records == []
    assert notes[0].startswith("b: could not be asked for its jobs: ")
    assert f"job {ok}: node(s) 1 on unreachable hosts; not adopted" in notes


@pytest.mark.integration
def test_a_second_controller_finds_adopts_and_stops_a_job_from_its_hosts(
        sim_cluster: Callable[..., SimCluster], tmp_path: Path) -> None:
    cluster = sim_cluster(2)
    hosts = ssh_hosts(tmp_path, cluster, [1, 1], tmp_path / "state")
    job = up_detached("--name", "far", "--grace", "2", hosts, SUPPORT / "counter.py", "100000", "0.05")
    try:
        wait_state(job, "running")
        second_controller(cluster, tmp_path, hosts, job)
    finally:
        clusterrun("down", job)  # a no-op once the second controller has stopped it


def second_controller(cluster: SimCluster, tmp_path: Path, hosts: Path, job: str) -> None:
    other = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "other-controller"))

    def second(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "clusterrun", *map(str, args)], capture_output=True, text=True,
                              timeout=120, cwd=ROOT, env=other, stdin=subprocess.DEVNULL)

    assert second("ps", "-a").stdout.splitlines()[1:] == []
    unknown = second("down", job)
    assert unknown.returncode == 2 and f"no job matches {job!r}" in unknown.stderr

    found = second("ps", "--hosts", hosts)
    assert found.returncode == 0, found.stderr
    assert f"adopted job {job} (running) from the hosts of {hosts}" in found.stderr
    names = ",".join(h.name for h in cluster.hosts)
    assert [line.split()[:4] for line in found.stdout.splitlines()[1:]] == [[job, "far", names, "running"]]
    again = second("ps", "--hosts", hosts)  # adopted once: known from now on
    assert "adopted" not in again.stderr and job in again.stdout
    assert not list((tmp_path / "other-controller").glob("clusterrun/jobs/*/monitor.pid"))  # no second owner

    wait_for(lambda: "rank 1 line 3" in second("logs", "--node", "1", job).stdout, timeout=60, what="node 1's log")
    down = second("down", job)
    assert down.returncode == 0, down.stderr
    assert down.stderr.count("nothing left (verified by cgroup)") == 2, down.stderr
    assert [marked_on(h, job) for h in cluster.hosts] == [[], []]
    assert wait_state(job, "stopped")["state"] == "stopped"  # the first controller sees the stop too
    assert ps_json(job)["nodes"][0]["state"] == "stopped"

    where = tmp_path / "state" / "jobs" / job
    assert all(h.run("test", "-d", str(where / f"node{k}")).returncode == 0 for k, h in enumerate(cluster.hosts))
    removed = second("rm", "--hosts-too", "--yes", job)
    assert removed.returncode == 0 and removed.stdout == f"{job}\n", removed.stderr
    assert removed.stderr.count(f"{job}: node") == 2 and "removed " in removed.stderr, removed.stderr
    assert [h.run("test", "-e", str(where)).returncode for h in cluster.hosts] == [1, 1]  # its logs, on every host
    assert second("ps", "-a").stdout.splitlines()[1:] == []


def another_controller(home: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Runs clusterrun as a controller whose state is in ``home`` (no record of anything yet)."""
    env = dict(os.environ, XDG_STATE_HOME=str(home))

    def run(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "clusterrun", *map(str, args)], capture_output=True, text=True,
                              timeout=120, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
    return run


@pytest.mark.integration
@pytest.mark.fake_torchrun
def test_wait_restart_and_rm_adopt_a_job_from_its_hosts_too(
        sim_cluster: Callable[..., SimCluster], tmp_path: Path) -> None:
    """``--hosts`` on ``wait``, ``restart`` and ``rm``, each run by a controller of its own that
    has no record of the job: it adopts the job, then does what it does to a job of its own."""
    cluster = sim_cluster(2)
    hosts = ssh_hosts(tmp_path, cluster, [1, 1], tmp_path / "state")
    job = up_detached("--name", "far", "--grace", "2", hosts, SUPPORT / "counter.py", "100000", "0.05")
    second = another_controller(tmp_path / "second")
    try:
        wait_state(job, "running")
        waited = another_controller(tmp_path / "waiter")("wait", "--hosts", hosts, "--timeout", "0", job)
        assert waited.returncode == 124, waited.stderr
        assert f"adopted job {job} (running) from the hosts of {hosts}" in waited.stderr
        assert f"job {job} is still running after 0 s" in waited.stderr

        restarted = second("restart", "--hosts", hosts, job)
        assert restarted.returncode == 0, restarted.stderr
        assert f"adopted job {job} (running)" in restarted.stderr
        assert restarted.stderr.count("nothing left (verified by cgroup)") == 2, restarted.stderr
        assert f"job {job} restarted as attempt 2" in restarted.stderr
        shown = json.loads(second("ps", "--json", job).stdout)["jobs"][0]
        assert shown["attempt"] == 2 and shown["state"] in ("starting", "running"), shown
        assert list((tmp_path / "second").glob(f"clusterrun/jobs/{job}/monitor.pid"))  # it owns attempt 2
        assert wait_state(job, "stopped")["attempt"] == 1  # the first controller saw its attempt stopped
        wait_for(lambda: "rank 1 line 3" in second("logs", "--node", "1", job).stdout, timeout=60,
                 what="attempt 2's log on node 1")
        assert second("down", job).returncode == 0

        ended = another_controller(tmp_path / "waiter-2")("wait", "--hosts", hosts, job)
        assert ended.returncode == 1, ended.stderr
        assert f"adopted job {job} (stopped)" in ended.stderr and f"job {job} stopped (attempt 2)" in ended.stderr

        where = tmp_path / "state" / "jobs" / job
        removed = another_controller(tmp_path / "remover")("rm", "--hosts", hosts, "--hosts-too", "--yes", job)
        assert removed.returncode == 0 and removed.stdout == f"{job}\n", removed.stderr
        assert f"adopted job {job} (stopped)" in removed.stderr and removed.stderr.count("removed ") == 2
        assert [h.run("test", "-e", str(where)).returncode for h in cluster.hosts] == [1, 1]  # every attempt's logs
    finally:
        second("down", job)  # attempt 2, if the second controller started it
        clusterrun("down", job)
