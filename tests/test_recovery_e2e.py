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

from tests.conftest import ROOT, SUPPORT, job_id_of, run_up, write_hosts
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
