"""Recovery after a failure end to end: `up --max-restarts 1` on local hosts, real torchrun and gloo.

The failed node's torchrun is not waited for (its teardown is cut short by its cgroup's kill, as the
other nodes' stop), yet its end stays its rank's failure: the record names the rank, its exit code
and its root cause, and the next attempt runs. The policy's branches: ``tests/test_recovery.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SUPPORT, job_id_of, run_up, wait_for, write_hosts
from tests.test_lifecycle import attempt_dir

pytestmark = pytest.mark.integration


def test_the_failed_nodes_torchrun_is_cut_short_and_its_rank_stays_the_root_cause(
        tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 2], state_dir, extra="restart: {backoff: 0s}\n")
    flag = tmp_path / "failed"
    proc = run_up("--max-restarts", "1", hosts, SUPPORT / "fail_once_recorded.py", flag, "2", "custom failure 7",
                  timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "node1 local-b: failed (exit code 1: rank 2 exited 1; torchrun was stopped at once after it)" \
        in proc.stderr, proc.stderr
    job = job_id_of(proc.stderr)
    shown = subprocess.run([sys.executable, "-m", "clusterrun", "ps", "--json", job], capture_output=True, text=True,
                           cwd=ROOT, timeout=60)
    record = json.loads(shown.stdout)["jobs"][0]
    assert [a["state"] for a in record["attempts"]] == ["failed", "succeeded"]
    assert record["attempts"][0]["root_cause"].startswith(
        "rank 2 on node 1 (local-b, local rank 1): exit code 1: RuntimeError: custom failure 7")
    failed = attempt_dir(state_dir, job, 1)
    state = json.loads((failed / "state.json").read_text())
    # torchrun waited for its SIGTERM-ignoring rank: only the stop at once can have ended it
    assert (state["exit_code"], state["signal"], state["stop_requested"]) == (1, None, False)
    assert state["exit_learned"] == "rank 2 exited 1; torchrun was stopped at once after it"
    log = (failed / "output.log").read_text()
    assert "---- stopped by fail-fast after its rank failed at " in log
    assert any(line.startswith("[rank2]:") and line.endswith("RuntimeError: custom failure 7")
               for line in log.splitlines())  # the rank's own traceback: its tail
    errors = [json.loads(p.read_text()) for p in (failed / "torchrun").rglob("error.json")]
    assert [e["message"]["message"] for e in errors] == ["RuntimeError: custom failure 7"]  # torch elastic's file
    stopped = json.loads((attempt_dir(state_dir, job, 0) / "state.json").read_text())
    assert stopped["stop_requested"] is True  # node 0 was stopped, not failed


def test_logs_f_and_attach_follow_the_job_through_its_restart_to_its_end(tmp_path: Path, state_dir: Path) -> None:
    """Until the job ends, not its first attempt: each says how attempt 1 ended, then follows attempt 2."""
    hosts = write_hosts(tmp_path, [1, 1], state_dir, extra="restart: {backoff: 1s}\n")
    counter, gate = tmp_path / "runs", tmp_path / "fail"
    started = subprocess.run([sys.executable, "-m", "clusterrun", "up", "-d", "--max-restarts", "1", hosts,
                              SUPPORT / "fail_once_gated.py", counter, gate], capture_output=True, text=True,
                             cwd=ROOT, timeout=120)
    assert started.returncode == 0, started.stderr
    job = started.stdout.strip()
    readers = {}
    for name, argv in (("logs", ["logs", "-f", job]), ("attach", ["attach", "--no-tui", job])):
        with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
            readers[name] = (subprocess.Popen([sys.executable, "-m", "clusterrun", *argv], cwd=ROOT, stdout=out,
                                              stderr=err, stdin=subprocess.DEVNULL), tmp_path / f"{name}.out")
    try:
        for _proc, out_path in readers.values():
            wait_for(lambda o=out_path: "run 1 rank 1 line" in o.read_text(), timeout=120, what="attempt 1's lines")
        gate.touch()  # rank 1 fails: the policy starts attempt 2 after its backoff
        for name, (proc, out_path) in readers.items():  # followed on, not ended with attempt 1
            wait_for(lambda p=proc, o=out_path: "run 2 rank 1 line" in o.read_text() or p.poll() is not None,
                     timeout=120, what="attempt 2's lines")
            assert proc.poll() is None, (tmp_path / f"{name}.err").read_text()
        down = subprocess.run([sys.executable, "-m", "clusterrun", "down", job], capture_output=True, text=True,
                              cwd=ROOT, timeout=120)
        assert down.returncode == 0, down.stderr
        codes = {name: proc.wait(timeout=60) for name, (proc, _) in readers.items()}
    finally:
        for proc, _ in readers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, (_proc, out_path) in readers.items():
        out, err = out_path.read_text(), (tmp_path / f"{name}.err").read_text()
        assert codes[name] == 1, err  # the job was stopped: its end, not the first attempt's
        assert "run 1 rank 1 fails" in out and "run 2 rank 0 line" in out, out
        assert f"job {job} FAILED" not in err, err  # attempt 1 ended, not the job
        assert "root cause: rank 1 on node 1 (local-b, local rank 0): exit code 1" in err, err
        assert f"following attempt 2 of job {job}" in err and f"job {job} stopped" in err, err
