"""A job of ``up --from-slurm`` as a recorded job, against a real Slurm (``tests/slurmsim.py``): its
record (``ps``, ``ps JOB``, ``ps --json``), what ``ps`` says once its ``up`` is gone, and ``down``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.slurmsim import SlurmCluster
from tests.test_joblist import documented_schema, violations
from tests.test_slurm_cluster import _census, _clusterrun_under, _end, _env, _files, _read_lines, _run_up, _up

pytestmark = [pytest.mark.integration, pytest.mark.fake_torchrun]


def _cli(slurm: SlurmCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterrun", *args], capture_output=True, text=True,
                          env=_env(slurm), timeout=60)


def _job_id(text: str) -> str:
    found = re.search(r"clusterrun: job (\S+): 2 nodes of Slurm job", text)
    assert found, text
    return found.group(1)


def test_a_failed_slurm_job_is_recorded_and_ps_shows_it_like_a_job_over_ssh(
        slurm_cluster: SlurmCluster, tmp_path: Path, fake_python: Path) -> None:
    script, hosts = _files(tmp_path, fake_python)
    done = _run_up(slurm_cluster, tmp_path, hosts, str(script), "fail", "3")
    assert done.returncode == 1, done.stderr
    job_id = _job_id(done.stderr)

    listed = _cli(slurm_cluster, "ps")
    assert re.search(rf"^{job_id}\s+ranks\s+sim1,sim2\s+failed\s+1\s+\S+$", listed.stdout, re.M), listed.stdout

    shown = _cli(slurm_cluster, "ps", job_id[:-2])
    assert shown.returncode == 0, shown.stderr
    assert f"job {job_id} (ranks): failed, attempt 1, {script} fail 3" in shown.stdout
    assert re.search(rf"^engine: Slurm \(job (\d+), step \1\.\d+, named {job_id}\); its logs are kept on \S+",
                     shown.stdout, re.M), shown.stdout
    assert re.search(r"^1\s+sim2\s+failed\s+-\s+1\s*$", shown.stdout, re.M), shown.stdout
    assert "root cause: rank 3 on node 1 (sim2, local rank 1): exit code 7" in shown.stdout

    data = json.loads(_cli(slurm_cluster, "ps", job_id, "--json").stdout)
    assert violations(data, documented_schema("ps")) == []
    job = data["jobs"][0]
    assert (job["engine"], job["state"], job["attempt"]) == ("slurm", "failed", 1)
    assert re.fullmatch(r"(\d+)\.\d+", job["slurm"]["step"]) and job["slurm"]["step"].startswith(job["slurm"]["job"])
    assert [(n["host"], n["state"], n["exit_code"]) for n in job["nodes"]] == [("sim1", "succeeded", 0),
                                                                                ("sim2", "failed", 1)], job["nodes"]
    assert job["attempts"][0]["root_cause"].startswith("rank 3 on node 1 (sim2, local rank 1): exit code 7")


def test_a_job_whose_up_was_killed_is_lost_once_slurm_no_longer_runs_its_step(
        slurm_cluster: SlurmCluster, tmp_path: Path, fake_python: Path) -> None:
    script, hosts = _files(tmp_path, fake_python)
    proc = subprocess.Popen(_up(hosts, str(script), "sleep"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(slurm_cluster), cwd=tmp_path, start_new_session=True)
    try:
        seen = _read_lines(proc, lambda lines: sum(" | rank " in line for line in lines) == 4, timeout=60)
        job_id = _job_id("".join(seen))
        running = json.loads(_cli(slurm_cluster, "ps", job_id, "--json").stdout)["jobs"][0]
        assert (running["state"], running["slurm"]["unwatched"]) == ("running", None)
        os.kill(wait_for(lambda: _clusterrun_under(proc.pid), 10, what="clusterrun under salloc"), signal.SIGKILL)
        proc.communicate(timeout=60)  # srun got its parent-death signal and ended the step; salloc then ends
    finally:
        _end(proc)
    shown = _cli(slurm_cluster, "ps", job_id)
    assert f"job {job_id} (ranks): lost, attempt 1" in shown.stdout, shown.stdout + shown.stderr
    assert re.search(r"its `up --from-slurm` \(pid \d+ on \S+\) is gone and Slurm no longer runs its step: how it "
                     r"ended is not known here \(`sacct -j \d+` says\)", shown.stdout), shown.stdout
    for host in slurm_cluster.sim.hosts:
        assert _census(host, str(script)) == [], host.name


def test_down_stops_a_recorded_slurm_job_and_its_record_says_stopped(
        slurm_cluster: SlurmCluster, tmp_path: Path, fake_python: Path) -> None:
    script, hosts = _files(tmp_path, fake_python)
    proc = subprocess.Popen(_up(hosts, str(script), "sleep"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(slurm_cluster), cwd=tmp_path, start_new_session=True)
    try:
        seen = _read_lines(proc, lambda lines: sum(" | rank " in line for line in lines) == 4, timeout=60)
        job_id = _job_id("".join(seen))
        down = _cli(slurm_cluster, "down", "ranks")
        proc.communicate(timeout=60)
    finally:
        _end(proc)
    assert down.returncode == 0, down.stderr
    assert f"job {job_id} stopped; Slurm ended every process of its step" in down.stderr
    job = json.loads(_cli(slurm_cluster, "ps", job_id, "--json").stdout)["jobs"][0]
    assert job["state"] == "stopped" and {n["state"] for n in job["nodes"]} == {"stopped"}, job
    again = _cli(slurm_cluster, "down", job_id)
    assert again.returncode == 0 and f"job {job_id} already finished (stopped); nothing to stop" in again.stderr
