"""Restarts by policy end to end: `up --max-restarts` on local hosts with real torchrun.

The policy's branches are tested on the fake transport (``tests/test_restarts.py``); this proves
the wiring: the foreground `up` restarts the whole job, waits for each attempt, and exits 0.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, SUPPORT, job_id_of, run_up, write_hosts
from tests.test_lifecycle import clusterrun, up_detached, wait_state

pytestmark = pytest.mark.integration


def _notified(path: Path, count: int) -> list[str]:
    """The notify command's lines (event id, the job's state when it was sent), once there are ``count``
    (its sender runs in the background). Sent by the attempt's owner as it follows it, the job is not ended:
    a command that finds the job ended and its events unsent would send them too."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lines = [line.split() for line in (path.read_text().splitlines() if path.exists() else [])]
        if len(lines) >= count:
            assert all(state in ("starting", "running") for _, state in lines), lines
            return [event for event, _ in lines]
        time.sleep(0.05)  # poll the command's output file
    raise AssertionError(f"{path}: fewer than {count} notifications")


def _notify(path: Path) -> str:
    return f"notify: {{command: 'echo $CLUSTERRUN_EVENT_ID $CLUSTERRUN_STATE >> {path}', on: [restarted]}}\n"


def test_a_job_failing_twice_is_restarted_and_succeeds(tmp_path: Path, state_dir: Path) -> None:
    sent = tmp_path / "sent"
    hosts = write_hosts(tmp_path, [1, 1], state_dir, extra="restart: {backoff: 0s}\n" + _notify(sent))
    counter = tmp_path / "runs"
    proc = run_up("--max-restarts", "2", hosts, SUPPORT / "fail_until.py", counter, "3", timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert counter.read_text() == "run\n" * 3
    assert "attempt 1 failed: " in proc.stderr and "(in 0 s) as attempt 2 (restart 1 of 2" in proc.stderr
    assert "(in 0 s) as attempt 3 (restart 2 of 2" in proc.stderr
    job = job_id_of(proc.stderr)
    assert f"job {job} FAILED" not in proc.stderr  # the attempts failed, the job did not
    shown = subprocess.run([sys.executable, "-m", "clusterrun", "ps", "--json", job], capture_output=True, text=True,
                           cwd=ROOT, timeout=60)
    record = json.loads(shown.stdout)["jobs"][0]
    assert record["state"] == "succeeded" and record["attempt"] == 3
    assert [(a["state"], a["restarted"]) for a in record["attempts"]] == [
        ("failed", "policy"), ("failed", "policy"), ("succeeded", None)]
    assert _notified(sent, 2) == [f"{job}:2:restarted", f"{job}:3:restarted"]  # by the owner, `up`
    history = subprocess.run([sys.executable, "-m", "clusterrun", "ps", job], capture_output=True, text=True,
                             cwd=ROOT, timeout=60)
    assert "ATTEMPT" in history.stdout and "RESTARTED" in history.stdout, history.stdout
    for attempt in (1, 3):  # each attempt keeps its own logs
        logs = subprocess.run([sys.executable, "-m", "clusterrun", "logs", "--attempt", str(attempt), job],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert f"run {attempt}" in logs.stdout and logs.stdout.count("run ") == 1, logs.stdout


def test_a_countdown_says_the_failure_once_with_the_time_of_the_restart(tmp_path: Path, state_dir: Path) -> None:
    """A backoff of 16-21 s (its jitter), which the owner counts down in steps of 10 s: the stream says once that
    attempt 1 failed, when attempt 2 starts, and each node's end once."""
    hosts = write_hosts(tmp_path, [1, 1], state_dir, extra="restart: {backoff: 21s}\n")
    counter = tmp_path / "runs"
    proc = run_up("--max-restarts", "1", hosts, SUPPORT / "fail_until.py", counter, "2", timeout=240)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    first = lines[:next(i for i, line in enumerate(lines) if "started attempt 2" in line)]
    failed = [line for line in first if line.startswith("clusterrun: attempt 1 failed: ")]
    at = r"· restarting at \d\d:\d\d:\d\dZ \(in \d+ s\) as attempt 2 "
    assert len(failed) == 1 and re.search(at, failed[0]), lines
    # "failed (exit code 1)", or with the reason when its torchrun was stopped at once after the rank
    ends = [line for line in first if line.startswith("clusterrun: node0 local-a: failed (exit code 1")]
    assert len(ends) == 1, lines


def test_a_users_restart_during_the_backoff_is_the_users_and_the_failed_attempt_stays_failed(
        tmp_path: Path, state_dir: Path, controller_state: Path) -> None:
    """`up -d --max-restarts 1` with a backoff of an hour: attempt 1 fails, its monitor counts down;
    `clusterrun restart` takes over. Attempt 1 is `failed`, restarted by the user, not the policy."""
    sent = tmp_path / "sent"
    hosts = write_hosts(tmp_path, [1, 1], state_dir, extra="restart: {backoff: 1h}\n" + _notify(sent))
    counter = tmp_path / "runs"
    job = up_detached("--max-restarts", "1", hosts, SUPPORT / "fail_until.py", counter, "2")
    wait_state(job, "restarting", timeout=120)
    restarted = clusterrun("restart", job, timeout=180)
    assert restarted.returncode == 0, restarted.stderr
    record = wait_state(job, "succeeded", timeout=120)
    assert counter.read_text() == "run\n" * 2
    assert [(a["state"], a["restarted"]) for a in record["attempts"]] == [("failed", "user"), ("succeeded", None)]
    assert record["attempts"][0]["root_cause"].startswith("rank 0 on node 0 (local-a"), record
    assert _notified(sent, 1) == [f"{job}:2:restarted"]  # by the new attempt's monitor
