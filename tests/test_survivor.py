"""The faults an attempt must survive, end to end on local hosts with torchrun (the fake where the
order of the nodes' ends matters: the real one's exit barrier ends them together): the monitor
(the process in state.json's ``supervisor``) SIGKILLed, the survivor itself SIGKILLed, and the
hosts' state directory of a running job deleted before `down`."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from tests.conftest import SUPPORT, alive, marked, start_time, wait_for, write_hosts
from tests.test_lifecycle import (
    attempt_dir,
    clusterrun,
    counter_lines,
    host_state,
    kill_monitors,
    ps_json,
    rank_lines,
    up_detached,
)

pytestmark = pytest.mark.integration

LINES = 120


def line_seen(state_dir: Path, job: str, node: int, line: int) -> bool:
    log = attempt_dir(state_dir, job, node) / "output.log"
    return log.exists() and f"[rank{node}]:rank {node} line {line}\n".encode() in log.read_bytes()


def kill_entry(state_dir: Path, job: str, key: str) -> dict:
    """SIGKILL the process node 0's state.json names under ``key``; its entry."""
    entry = host_state(state_dir, job, 0)[key]
    assert alive(entry["pid"], entry["start_time"]), entry
    os.kill(entry["pid"], signal.SIGKILL)
    wait_for(lambda: not alive(entry["pid"], entry["start_time"]), timeout=10, what=f"{key} to die")
    return entry


def every_line_once(state_dir: Path, job: str) -> None:
    for node in (0, 1):
        on_host = (attempt_dir(state_dir, job, node) / "output.log").read_text()
        assert rank_lines(on_host, node) == counter_lines(node, LINES), node
    logs = clusterrun("logs", job)
    assert logs.returncode == 0, logs.stderr
    for node in (0, 1):
        shown = [line for line in logs.stdout.splitlines()
                 if f"rank {node} line " in line or f"rank {node} done" in line]
        assert len(shown) == LINES + 1, (node, len(shown))


def test_a_sigkilled_monitor_loses_no_line_and_the_job_succeeds(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached(hosts, SUPPORT / "counter.py", str(LINES), "0.03")
    wait_for(lambda: line_seen(state_dir, job, 0, 10), timeout=60, what="rank 0's tenth line")
    first = kill_entry(state_dir, job, "supervisor")
    # the survivor starts another monitor; kill that one too, mid-run
    wait_for(lambda: host_state(state_dir, job, 0)["supervisor"]["pid"] != first["pid"], timeout=10,
             what="a new monitor")
    kill_entry(state_dir, job, "supervisor")
    waited = clusterrun("wait", job, timeout=180)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    record = ps_json(job)
    assert record["state"] == "succeeded", record
    assert [(n["state"], n["exit_code"]) for n in record["nodes"]] == [("succeeded", 0), ("succeeded", 0)]
    every_line_once(state_dir, job)


def recorded_state(controller_state: Path, job: str, node: int) -> str:
    """Node ``node``'s state in the job's record, as its owner (the controller's monitor) wrote it."""
    record = json.loads((controller_state / "clusterrun" / "jobs" / job / "job.json").read_text())
    return record["nodes"][node]["state"]  # type: ignore[no-any-return]


@pytest.mark.fake_torchrun  # torchrun's exit barrier would hold node 1 until node 0 ends
def test_a_sigkilled_survivor_loses_no_line_and_its_exit_is_learned_from_its_ranks(tmp_path: Path, state_dir: Path,
                                                                                   controller_state: Path) -> None:
    """Nobody reaps node 0's torchrun: its monitor read each rank's exit (0), so node 0 succeeded,
    with how that was learned; never a failure of torchrun."""
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    gate = tmp_path / "gate-{rank}"
    job = up_detached(hosts, SUPPORT / "counter.py", str(LINES), "0.03", gate)
    wait_for(lambda: line_seen(state_dir, job, 0, 10), timeout=60, what="rank 0's tenth line")
    kill_entry(state_dir, job, "survivor")
    # Node 1 ends first: were node 0's end unknown (lost), fail-fast would stop the nodes still
    # running. With the real torchrun both end at once (its exit barrier).
    Path(str(gate).format(rank=1)).touch()
    wait_for(lambda: recorded_state(controller_state, job, 1) == "succeeded", timeout=60, what="node 1 to succeed")
    Path(str(gate).format(rank=0)).touch()
    waited = clusterrun("wait", job, timeout=180)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    record = ps_json(job)
    assert record["state"] == "succeeded", record
    assert [n["state"] for n in record["nodes"]] == ["succeeded", "succeeded"]
    assert record["nodes"][0]["error"] == ("exit code 0: every rank exited 0 (torchrun's own exit was not "
                                           "recorded: its survivor was killed)")
    shown = clusterrun("ps", job)
    assert "every rank exited 0" in shown.stdout, shown.stdout
    assert "root cause" not in shown.stdout and "torchrun on node 0" not in shown.stdout, shown.stdout
    assert "exit_status" not in json.loads((attempt_dir(state_dir, job, 0) / "state.json").read_text())
    every_line_once(state_dir, job)


def test_with_its_survivor_and_monitor_killed_a_node_whose_ranks_exited_0_succeeded(tmp_path: Path,
                                                                                    state_dir: Path) -> None:
    """A real gloo job: node 0's survivor and monitor are SIGKILLed while its ranks wait at a gate;
    the agent that follows it starts another monitor, which watches the ranks end. Nobody reaped
    torchrun, yet every rank exited 0: node 0 `succeeded`, `exit code 0` with how that was learned."""
    # A rank's exit is read while it is a zombie, until torchrun reaps it at its monitor's next look:
    # every 2 s here, not 0.1, so that the new monitor's reader is in time on a loaded machine
    hosts = write_hosts(tmp_path, [2, 1], state_dir, extra="env:\n  PET_MONITOR_INTERVAL: '2'\n")
    gate = tmp_path / "gate"
    job = up_detached(hosts, SUPPORT / "progress_train.py", "examples", "20", gate)
    log = attempt_dir(state_dir, job, 0) / "output.log"
    wait_for(lambda: log.exists() and b"Train Epoch: 1 [640/1280" in log.read_bytes(), timeout=120,
             what="every rank at the gate")
    first = kill_entry(state_dir, job, "survivor")
    monitor = kill_entry(state_dir, job, "supervisor")
    wait_for(lambda: (s := host_state(state_dir, job, 0)["supervisor"])["pid"] not in (first["pid"], monitor["pid"])
             and alive(s["pid"], s["start_time"]), timeout=30, what="a monitor started by the agent that follows")
    gate.touch()
    waited = clusterrun("wait", job, timeout=180)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    record = ps_json(job)
    assert record["state"] == "succeeded", record
    nodes = record["nodes"]
    assert [(n["state"], n["exit_code"]) for n in nodes] == [("succeeded", 0), ("succeeded", 0)], nodes
    assert nodes[0]["error"] == ("exit code 0: every rank exited 0 (torchrun's own exit was not recorded: its "
                                 "survivor was killed)"), nodes[0]
    state = host_state(state_dir, job, 0)
    assert [w["exit_code"] for w in state["workers"]] == [0, 0] and "exit_status" not in state, state


def delete(folder: Path) -> None:
    """``rm -rf`` while the monitor still writes there: again until it is gone."""
    wait_for(lambda: shutil.rmtree(folder, ignore_errors=True) or not folder.exists(), timeout=10,
             what=f"{folder} to be deleted")


def cgroups_of(job: str) -> list[Path]:
    root = Path("/sys/fs/cgroup/unified") if Path("/sys/fs/cgroup/unified").is_dir() else Path("/sys/fs/cgroup")
    return sorted(root.glob(f"clusterrun-{job}-n*"))


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "no-cgroup"])
def test_down_without_the_hosts_records_stops_every_process(tmp_path: Path, state_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch, cgroup: bool) -> None:
    if not cgroup:
        monkeypatch.setenv("CLUSTERRUN_NO_CGROUP", "1")  # the local agents inherit it
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached(hosts, SUPPORT / "counter.py", "100000", "0.05")
    wait_for(lambda: line_seen(state_dir, job, 0, 3) and line_seen(state_dir, job, 1, 3), timeout=60,
             what="both nodes running")
    pids = {pid: start_time(pid) for pid in marked(job)}
    assert len(pids) >= 4  # torchrun and its worker on both nodes
    survivors = [host_state(state_dir, job, n)["survivor"] for n in (0, 1)]
    assert bool(cgroups_of(job)) == cgroup
    delete(state_dir / "jobs" / job)  # a cleanup script, a full-disk rescue
    status = clusterrun("ps", job)
    assert "records on this host are gone" in status.stdout, status.stdout
    down = clusterrun("down", job)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "nothing was running" not in down.stdout + down.stderr
    assert [pid for pid, st in pids.items() if st is not None and alive(pid, st)] == []
    assert not marked(job)
    wait_for(lambda: not any(alive(s["pid"], s["start_time"]) for s in survivors), timeout=30,
             what="the survivors to leave")
    assert not cgroups_of(job)
    out = down.stdout + down.stderr
    assert out.count("records on the host were gone") == 2, out
    if cgroup:
        assert out.count("found by name") == 2 and "verified" in out, out
    else:
        assert out.count("found by a marker scan") == 2 and "verified" not in out, out


def test_down_says_where_it_looked_when_nothing_of_a_job_without_records_runs(
        tmp_path: Path, state_dir: Path, controller_state: Path) -> None:
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    job = up_detached(hosts, SUPPORT / "counter.py", "100000", "0.05")
    wait_for(lambda: line_seen(state_dir, job, 0, 3), timeout=60, what="node 0 running")
    kill_monitors(controller_state)  # nobody sees the job end: its record says running
    for node in (0, 1):  # its survivors and monitors first, so that none records the end
        for key in ("survivor", "supervisor"):
            entry = host_state(state_dir, job, node)[key]
            os.kill(entry["pid"], signal.SIGKILL)
    for pid in marked(job):
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not marked(job), timeout=20, what="the job's processes to die")
    delete(state_dir / "jobs" / job)
    down = clusterrun("down", job)
    out = down.stdout + down.stderr
    assert down.returncode == 0, out
    assert "nothing was running" not in out and not cgroups_of(job)  # the empty ones are removed
    assert out.count("looked for cgroups named") == 2 and "a scan of /proc" in out, out


