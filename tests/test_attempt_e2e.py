"""The attempt owner's guarantee with real processes: a refused ``restart`` stops nothing.

Local hosts and real torchrun (``tests/_support/counter.py``); the policies themselves are tested
on the fake in ``tests/test_attempt.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SUPPORT, alive, marked, start_time, wait_for, write_hosts
from tests.test_lifecycle import clusterrun, host_state, ps_json, up_detached

pytestmark = pytest.mark.integration

SECRET = "CRTEST_TOKEN"


def restart(job: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterrun", "restart", job], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


def running(job: str) -> dict[int, int | None]:
    """Every process of the job by pid, with its start time (to tell a pid reused from the same one)."""
    return {pid: start_time(pid) for pid in marked(job)}


def assert_untouched(job: str, before: dict[int, int | None], state_dir: Path) -> None:
    assert running(job) == before and all(alive(pid, t or -1) for pid, t in before.items())
    record = ps_json(job)
    assert record["state"] == "running" and record["attempt"] == 1, record
    for node in (0, 1):
        assert not host_state(state_dir, job, node).get("stop_requested")


def test_a_restart_without_the_secret_stops_nothing(tmp_path: Path, state_dir: Path) -> None:
    """A job started with a secret --env value, restarted from a shell without it: exit 2 before
    anything stops; the job still runs. With the secret back, the restart goes through."""
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached("--env", f"{SECRET}=s3cret", hosts, SUPPORT / "counter.py", "10000", "0.05")
    wait_for(lambda: "line 3" in clusterrun("logs", "--node", "1", job).stdout, timeout=60, what="output")
    before = running(job)
    env = {k: v for k, v in os.environ.items() if k != SECRET}
    proc = restart(job, env)
    assert proc.returncode == 2, proc.stderr
    assert SECRET in proc.stderr and "was not restarted" in proc.stderr and "Traceback" not in proc.stderr
    assert "s3cret" not in proc.stderr
    assert_untouched(job, before, state_dir)
    proc = restart(job, {**env, SECRET: "s3cret"})
    assert proc.returncode == 0, proc.stderr
    assert ps_json(job)["attempt"] == 2
    assert clusterrun("down", job).returncode == 0


def test_a_restart_whose_script_is_gone_stops_nothing(tmp_path: Path, state_dir: Path) -> None:
    """restart checks what up checks: the script removed since the start refuses it, job untouched."""
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    script = tmp_path / "counter.py"
    shutil.copy(SUPPORT / "counter.py", script)
    job = up_detached(hosts, script, "10000", "0.05")
    wait_for(lambda: "line 3" in clusterrun("logs", "--node", "1", job).stdout, timeout=60, what="output")
    before = running(job)
    script.unlink()
    proc = clusterrun("restart", job)
    assert proc.returncode == 2, proc.stderr
    assert f"{script} does not exist" in proc.stderr and "Traceback" not in proc.stderr
    assert_untouched(job, before, state_dir)
    assert clusterrun("down", job).returncode == 0
    assert marked(job) == []


def test_down_after_node0s_supervisor_died_says_stopped_everywhere(tmp_path: Path, state_dir: Path) -> None:
    """Node 0's supervisor is SIGKILLed, then `down`: `ps` and `wait` say stopped too, without a
    root cause (the monitor that sees node 0 lost afterwards does not overwrite the stop)."""
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached(hosts, SUPPORT / "counter.py", "10000", "0.05")
    wait_for(lambda: "line 3" in clusterrun("logs", "--node", "1", job).stdout, timeout=60, what="output")
    supervisor = host_state(state_dir, job, 0)["supervisor"]
    os.kill(supervisor["pid"], signal.SIGKILL)
    wait_for(lambda: not alive(supervisor["pid"], supervisor["start_time"]), timeout=10, what="the supervisor's death")
    down = clusterrun("down", job)
    assert down.returncode == 0, down.stderr
    assert marked(job) == []
    waited = clusterrun("wait", "--timeout", "60", job)
    assert waited.returncode == 1 and f"job {job} stopped" in waited.stderr, waited.stderr
    record = ps_json(job)
    assert record["state"] == "stopped" and record["attempts"][0]["state"] == "stopped", record
    assert record["attempts"][0]["root_cause"] is None, record
    shown = clusterrun("ps", job).stdout
    assert "root cause" not in shown and "stopped" in shown, shown


def test_a_restart_whose_setup_fails_stops_nothing_and_setup_is_in_the_log(tmp_path: Path, state_dir: Path) -> None:
    """Issue 25: `restart` runs the hosts' setup before it stops anything, once per attempt (the
    start reuses what the checks' setup made), and setup's output opens the node's log, tagged."""
    runs, flag = tmp_path / "setup-runs", tmp_path / "broken"
    hosts = write_hosts(tmp_path, [1, 1], state_dir, extra=(
        "    setup:\n"
        f"      - 'echo run >> {runs}; echo preparing node-b'\n"
        f"      - 'if test -e {flag}; then echo \"{flag} is there\"; exit 1; fi'\n"))
    job = up_detached(hosts, SUPPORT / "counter.py", "10000", "0.05")
    wait_for(lambda: "line 3" in clusterrun("logs", "--node", "1", job).stdout, timeout=60, what="output")
    log = clusterrun("logs", "--node", "1", job).stdout
    assert "[setup]: preparing node-b" in log and log.index("[setup]: preparing node-b") < log.index("line 1"), log
    assert runs.read_text() == "run\n"  # the preflight saw setup's environment; the start did not run it again
    before = running(job)
    flag.touch()
    proc = clusterrun("restart", job)
    assert proc.returncode == 3, proc.stderr
    assert "local-b: node 1: setup failed with status 1" in proc.stderr, proc.stderr
    assert f"{flag} is there" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert_untouched(job, before, state_dir)
    flag.unlink()
    proc = clusterrun("restart", job)
    assert proc.returncode == 0, proc.stderr
    assert ps_json(job)["attempt"] == 2 and runs.read_text() == "run\n" * 3  # once for each start, checks included
    assert clusterrun("down", job).returncode == 0
    assert marked(job) == []
