"""Job lifecycle over SSH on simulated machines: dropped connections, down, two jobs, a reboot."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, SUPPORT, wait_for
from tests.simhosts import SimCluster, SimHost
from tests.test_lifecycle import clusterrun, counter_lines, kill_monitors, ps_json, up_detached, wait_state
from tests.test_ssh import ssh_hosts

pytestmark = pytest.mark.integration
MakeCluster = Callable[..., SimCluster]


def marked_on(host: SimHost, job: str) -> list[int]:
    """Pids, inside the host's own PID namespace, of live processes carrying the job's marker."""
    script = ("import os,sys\nn=sys.argv[1].encode()\n"
              "for p in os.listdir('/proc'):\n"
              " try:\n  e=open('/proc/%s/environ'%p,'rb').read().split(b'\\0')\n"
              "  s=open('/proc/%s/stat'%p).read().rsplit(')',1)[1].split()[0]\n"
              " except (OSError,ValueError):\n  continue\n"
              " if s!='Z' and any(x.startswith(n) for x in e):\n  print(p)\n")
    out = host.run(sys.executable, "-c", script, f"CLUSTERRUN_JOB={job}.")
    assert out.returncode == 0, out.stderr
    return [int(p) for p in out.stdout.split()]


def test_attach_loses_and_repeats_nothing_when_connections_drop(sim_cluster: MakeCluster, tmp_path: Path,
                                                                controller_state: Path) -> None:
    cluster = sim_cluster(2)
    hosts = ssh_hosts(tmp_path, cluster, [1, 1], tmp_path / "state")
    job = up_detached(hosts, SUPPORT / "counter.py", "400", "0.025")
    attach = subprocess.Popen([sys.executable, "-m", "clusterrun", "attach", "--no-tui", job], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert attach.stdout is not None and attach.stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(attach.stdout or ()), daemon=True)
    reader.start()
    drops = 0
    for at in (50, 200):
        wait_for(lambda a=at: any(f"line {a}" in line for line in lines), timeout=60, what=f"line {at}")
        drops += sum(host.drop_connections() for host in cluster.hosts)
    assert drops >= 4  # attach's and the monitor's connections, to both hosts, each time
    assert attach.wait(timeout=120) == 0
    reader.join(timeout=10)
    err = attach.stderr.read()
    attach.stdout.close()
    attach.stderr.close()
    assert "reconnected" in err, err
    for node in (0, 1):
        printed = [f"[rank{m.group(2)}]:{m.group(3)}" for line in lines
                   if (m := re.match(r"^node(\d) sim\d +rank(\d) +\| (.*)$", line)) and m.group(1) == str(node)]
        assert printed == counter_lines(node, 400)
    assert wait_state(job, "succeeded")["state"] == "succeeded"
    assert all(host.alive for host in cluster.hosts)


def test_down_of_one_of_two_jobs_leaves_nothing_of_it_on_any_host(sim_cluster: MakeCluster,
                                                                 tmp_path: Path) -> None:
    cluster = sim_cluster(2)
    hosts = ssh_hosts(tmp_path, cluster, [2, 1], tmp_path / "state")
    a = up_detached("--name", "a", "--grace", "2", hosts, SUPPORT / "counter.py", "10000", "0.05")
    b = up_detached("--name", "b", hosts, SUPPORT / "counter.py", "150", "0.05")
    wait_state(a, "running")
    wait_for(lambda: all(marked_on(h, a) and marked_on(h, b) for h in cluster.hosts), timeout=60,
             what="both jobs on both hosts")
    down = clusterrun("down", a)
    assert down.returncode == 0, down.stderr
    assert down.stderr.count("verified: nothing of the job is left") == 2
    assert [marked_on(h, a) for h in cluster.hosts] == [[], []]  # checked inside each host's PID namespace
    assert all(marked_on(h, b) for h in cluster.hosts)  # b runs on, untouched
    record = wait_state(b, "succeeded")
    assert [n["exit_code"] for n in record["nodes"]] == [0, 0]
    logs = clusterrun("logs", "--node", "1", b).stdout
    assert [line for line in logs.splitlines() if line.startswith("[rank2]:")] == counter_lines(2, 150)
    assert ps_json(a)["state"] == "stopped"
    assert [marked_on(h, b) for h in cluster.hosts] == [[], []]


def test_a_rebooted_host_shows_its_node_lost(sim_cluster: MakeCluster, tmp_path: Path,
                                              controller_state: Path) -> None:
    cluster = sim_cluster(2)
    hosts = ssh_hosts(tmp_path, cluster, [1, 1], tmp_path / "state")
    job = up_detached("--grace", "2", hosts, SUPPORT / "counter.py", "10000", "0.05")
    wait_state(job, "running")
    kill_monitors(controller_state)  # nobody watches: only the next `ps` can tell
    cluster.reboot(cluster.hosts[1])
    time.sleep(0.5)
    record = ps_json(job)
    assert [n["state"] for n in record["nodes"]] == ["running", "lost"], record
    shown = clusterrun("ps", job).stdout
    assert re.search(r"^1 +sim2 +lost ", shown, re.M), shown
    # ps found the job without an owner and started a monitor: fail-fast stops node 0.
    record = wait_state(job, "lost", "failed", timeout=120)
    assert [n["state"] for n in record["nodes"]] == ["stopped", "lost"], record
    assert marked_on(cluster.hosts[0], job) == []


def test_dashboard_shows_a_dropped_connection_and_resumes_from_its_offset(sim_cluster: MakeCluster, tmp_path: Path,
                                                                          controller_state: Path) -> None:
    """The dashboard (Pilot) over SSH: its connection and the monitor's are killed twice mid-run
    (sshd's per-connection processes); the node shows as unreachable, reconnects, and its log
    view holds every line exactly once."""
    from tests.test_tui import dashboard_on, drive, log_lines, table_states, until

    cluster = sim_cluster(1)
    hosts = ssh_hosts(tmp_path, cluster, [1], tmp_path / "state")
    job = up_detached(hosts, SUPPORT / "counter.py", "300", "0.025")
    app = dashboard_on(job)
    drops: list[int] = []
    shown: list[str] = []

    async def script(app: Any, pilot: Any) -> None:
        for at in (60, 180):
            await until(pilot, lambda a=at: app.board.nodes and app.board.nodes[0].log.count >= a, 60,
                        f"{at} lines")
            drops.append(cluster.hosts[0].drop_connections())
            await until(pilot, lambda: any("unreachable" in n for n in app.board.notes), 30, "unreachable")
            shown.append(" ".join(app.board.notes))
            app.board.notes.clear()
            await until(pilot, lambda: any("reconnected" in n for n in app.board.notes), 60, "reconnected")
        await until(pilot, lambda: app.board.finished, 120, "the job's end")
        assert table_states(app) == ["succeeded"]
        assert [line for line in log_lines(app) if line.startswith("[rank")] == counter_lines(0, 300)
        await pilot.press("q")

    drive(app, script)
    assert len(drops) == 2 and all(d >= 1 for d in drops)
    assert all("node0 sim1: unreachable" in text for text in shown), shown
