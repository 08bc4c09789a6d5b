"""The mark a stop leaves in each node's log, with real torchrun and gloo ranks on local hosts.

Written by the agent when the stop reaches it, before torchrun is signalled, so that torchrun's
shutdown output (``Received 15 death signal``, a ``SignalException`` traceback, which alone reads
like a crash) follows a line that says who stopped the attempt, for every reader of the log (fail-fast
kills a failing attempt's cgroup at once: no shutdown output follows). The agent's part is tested in
this process in ``tests/test_agent_stop.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import SUPPORT, job_id_of, run_up, wait_for, write_hosts
from tests.test_lifecycle import clusterrun, up_detached, wait_state

pytestmark = pytest.mark.integration

MARK = r"---- stopped by {by} at \d\d:\d\d:\d\dZ ----"


def log_of(job: str, node: int, attempt: int | None = None) -> str:
    shown = clusterrun("logs", job, "--node", str(node), *(("--attempt", str(attempt)) if attempt else ()))
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def marked_before_the_shutdown(log: str, by: str) -> None:
    """The log holds the mark once, before the first line of torchrun's shutdown."""
    marks = [m.start() for m in re.finditer(MARK.format(by=re.escape(by)), log)]
    assert len(marks) == 1, log
    shutdown = log.find("Received 15 death signal")
    assert shutdown > marks[0] and log.find("SignalException") > marks[0], log


def test_fail_fast_marks_the_log_of_the_node_it_stopped(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    proc = run_up(hosts, SUPPORT / "fail_alone.py", timeout=180)
    assert proc.returncode == 1, proc.stderr
    job = job_id_of(proc.stderr)
    # The attempt failed and has a cgroup: torchrun is killed at once with it, no SIGTERM shutdown
    log = log_of(job, 0)
    assert len(re.findall(MARK.format(by="fail-fast after node 1 failed"), log)) == 1, log
    assert "Received 15 death signal" not in log and "SignalException" not in log, log
    assert re.search(r"^clusterrun: node0 local-a: stopped torchrun \(pid \d+\).* at once \(SIGKILL, the attempt had "
                     r"failed\); nothing left \(verified by cgroup\)$", proc.stderr, re.M), proc.stderr
    # the failed node's torchrun is not waited for either: its mark says why its teardown was cut short
    assert len(re.findall(MARK.format(by="fail-fast after its rank failed"), log_of(job, 1))) == 1, log_of(job, 1)
    assert re.search(r"^node0 local-a +\| " + MARK.format(by="fail-fast after node 1 failed") + "$", proc.stdout,
                     re.M), proc.stdout  # the stream shows it as a line of the node


def test_restart_and_down_mark_the_logs_of_the_attempts_they_stopped(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached(hosts, SUPPORT / "barrier_rank.py", "600")
    wait_state(job, "running")
    wait_for(lambda: "rank 1 lingers" in log_of(job, 1), timeout=90, interval=0.5, what="the ranks to run")
    restarted = clusterrun("restart", job, timeout=180)
    assert restarted.returncode == 0, restarted.stderr
    wait_for(lambda: "rank 1 lingers" in log_of(job, 1, 2), timeout=90, interval=0.5, what="attempt 2's ranks")
    down = clusterrun("down", job, timeout=120)
    assert down.returncode == 0, down.stderr
    for node in (0, 1):
        marked_before_the_shutdown(log_of(job, node, 1), "restart")
        marked_before_the_shutdown(log_of(job, node, 2), "down")
