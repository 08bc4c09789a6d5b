"""Job lifecycle over SSH on simulated machines: dropped connections, down, two jobs, a reboot."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from clusterrun.run.follower import Reconnect
from clusterrun.transports.base import FOLLOW_TIMEOUT
from tests import simhosts
from tests.conftest import ROOT, SUPPORT, up_argv, wait_for
from tests.simhosts import SimCluster, SimHost
from tests.test_lifecycle import (
    attempt_dir,
    clusterrun,
    counter_lines,
    kill_monitors,
    ps_json,
    up_detached,
    wait_state,
)
from tests.test_ssh import ssh_hosts

pytestmark = pytest.mark.integration
MakeCluster = Callable[..., SimCluster]
# ssh_config's ConnectTimeout for the tests that cut a host's cable: each connection attempt to it
# costs this (clusterrun's default is OpenSSH's 10 s); long enough for a handshake on a loaded machine.
CUT_CONNECT_TIMEOUT = 5


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


@pytest.mark.fake_torchrun
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
    gate = tmp_path / "gate"  # b waits at its half: it must still run after `down a` (under load that took 7 s)
    a = up_detached("--name", "a", "--grace", "2", hosts, SUPPORT / "counter.py", "10000", "0.05")
    b = up_detached("--name", "b", hosts, SUPPORT / "counter.py", "150", "0.05", gate)
    wait_state(a, "running")
    wait_for(lambda: all(marked_on(h, a) and marked_on(h, b) for h in cluster.hosts), timeout=60,
             what="both jobs on both hosts")
    down = clusterrun("down", a)
    assert down.returncode == 0, down.stderr
    assert down.stderr.count("nothing left (verified by cgroup)") == 2
    assert [marked_on(h, a) for h in cluster.hosts] == [[], []]  # checked inside each host's PID namespace
    assert all(marked_on(h, b) for h in cluster.hosts)  # b runs on, untouched
    gate.touch()
    record = wait_state(b, "succeeded")
    assert [n["exit_code"] for n in record["nodes"]] == [0, 0]
    logs = clusterrun("logs", "--node", "1", b).stdout
    assert [line for line in logs.splitlines() if line.startswith("[rank2]:")] == counter_lines(2, 150)
    assert ps_json(a)["state"] == "stopped"
    assert [marked_on(h, b) for h in cluster.hosts] == [[], []]


@pytest.mark.fake_torchrun
def test_a_rebooted_host_shows_its_node_lost(sim_cluster: MakeCluster, tmp_path: Path,
                                              controller_state: Path) -> None:
    cluster = sim_cluster(2)
    hosts = ssh_hosts(tmp_path, cluster, [1, 1], tmp_path / "state")
    job = up_detached("--grace", "2", hosts, SUPPORT / "counter.py", "10000", "0.05")
    wait_state(job, "running")
    kill_monitors(controller_state)  # nobody watches: only the next `ps` can tell
    cluster.reboot(cluster.hosts[1])  # returns once its new sshd accepts connections
    record = ps_json(job)
    assert [n["state"] for n in record["nodes"]] == ["running", "lost"], record
    shown = clusterrun("ps", job).stdout
    assert re.search(r"^1 +sim2 +lost ", shown, re.M), shown
    # ps found the job without an owner and started a monitor: fail-fast stops node 0.
    record = wait_state(job, "lost", "failed", timeout=120)
    assert [n["state"] for n in record["nodes"]] == ["stopped", "lost"], record
    assert marked_on(cluster.hosts[0], job) == []


def test_ps_shows_a_host_whose_cable_is_out_unreachable_since_then_never_running(sim_cluster: MakeCluster,
                                                                                  tmp_path: Path,
                                                                                  controller_state: Path) -> None:
    """sim2's network cable is pulled while the job runs (its monitor still follows it): `ps JOB`
    cannot reach it and shows its node `unreachable since <time>`, kept from that first failure;
    `ps --json` says unreachable with the time; once the cable is back, running again."""
    cluster = sim_cluster(2, connect_timeout=CUT_CONNECT_TIMEOUT)
    hosts = ssh_hosts(tmp_path, cluster, [1, 1], tmp_path / "state")
    job = up_detached("--grace", "2", hosts, SUPPORT / "counter.py", "10000", "0.05")
    wait_state(job, "running")
    cluster.set_link(cluster.hosts[1], up=False)
    try:
        shown = clusterrun("ps", job)
        assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
        found = re.search(r"^1 +sim2 +(unreachable since \d\d:\d\d:\d\dZ) ", shown.stdout, re.M)
        assert found and re.search(r"^0 +sim1 +running ", shown.stdout, re.M), shown.stdout
        assert "\n  hint:" not in shown.stdout, shown.stdout  # the error's hint stays in its row
        node = ps_json(job)["nodes"][1]
        assert node["state"] == "unreachable" and node["last_state"] == "running"
        assert node["unreachable_since"].endswith(found.group(1).split()[-1])  # the first failure's time, kept
    finally:
        cluster.set_link(cluster.hosts[1], up=True)
    wait_for(lambda: [n["state"] for n in ps_json(job)["nodes"]] == ["running", "running"], timeout=120,
             interval=1, what="sim2 to be reached again")
    assert clusterrun("down", job).returncode == 0
    # the monitor's stream to sim2, opened before the cable came back, times out first (20 s)
    wait_for(lambda: not monitors_of(controller_state), timeout=90, interval=1, what="the monitor to see the stop")
    # the hosts' agents removed the attempts' cgroups (on this machine's hierarchy, which they mount)
    assert not [c for c in simhosts._attempt_cgroups() if f"clusterrun-{job}-" in c]


@pytest.mark.fake_torchrun
def test_dashboard_shows_a_dropped_connection_and_resumes_from_its_offset(sim_cluster: MakeCluster, tmp_path: Path,
                                                                          controller_state: Path) -> None:
    """The dashboard (Pilot) over SSH: its connection and the monitor's are killed twice mid-run
    (sshd's per-connection processes); the node shows as unreachable, reconnects, and its log
    view holds every line exactly once."""
    from tests.test_tui import dashboard_on, drive, log_lines, table_states, until

    cluster = sim_cluster(1)
    hosts = ssh_hosts(tmp_path, cluster, [1], tmp_path / "state")
    gate = tmp_path / "gate"  # the ranks wait at line 150 for it: the job runs on at each drop, however late it is seen
    job = up_detached(hosts, SUPPORT / "counter.py", "300", "0.025", gate)
    app = dashboard_on(job)
    drops: list[int] = []
    shown: list[str] = []

    async def script(app: Any, pilot: Any) -> None:
        for at in (60, 120):
            await until(pilot, lambda a=at: app.board.nodes and app.board.nodes[0].log.count >= a, 60,
                        f"{at} lines")
            drops.append(cluster.hosts[0].drop_connections())
            await until(pilot, lambda: any("unreachable" in n for n in app.board.notes), 30, "unreachable")
            shown.append(" ".join(app.board.notes))
            # the reconnection may be noted in the same poll as the loss: looked for after it, not after a clear
            await until(pilot, lambda: any("reconnected" in n for n in after_loss(list(app.board.notes))), 60,
                        "reconnected")
            app.board.notes.clear()
        gate.touch()
        await until(pilot, lambda: app.board.finished, 120, "the job's end")
        assert table_states(app) == ["succeeded"]
        assert [line for line in log_lines(app) if line.startswith("[rank")] == counter_lines(0, 300)
        await pilot.press("q")

    drive(app, script)
    assert len(drops) == 2 and all(d >= 1 for d in drops)
    assert all("node0 sim1: unreachable" in text for text in shown), shown


def after_loss(notes: list[str]) -> list[str]:
    """The notes after the first that tells of a lost connection."""
    lost = next((i for i, note in enumerate(notes) if "unreachable" in note), len(notes))
    return notes[lost + 1:]


# Longer than any silence the controller allows a connection (its follow timeout; 30 s before it):
# resumed, it finds every stream silent for longer than that, and its connections dropped by sshd.
PAUSE = FOLLOW_TIMEOUT + 5


@pytest.mark.fake_torchrun
def test_a_paused_controller_never_stops_a_healthy_job(sim_cluster: MakeCluster, tmp_path: Path,
                                                       controller_state: Path, request: pytest.FixtureRequest) -> None:
    """A laptop closed for a while: `up` (foreground) and the monitor of an `up -d` job are stopped
    (SIGSTOP) while the hosts' sshd drop their silent connections and the jobs end; resumed, both
    follow on from where they were: the jobs succeed, nothing was stopped, every line exactly once.
    Both jobs print their second half only once the controller is paused (counter.py's gate)."""
    cluster = sim_cluster(2, sshd_options={"ClientAliveInterval": "2", "ClientAliveCountMax": "2"})
    state, gate = tmp_path / "state", tmp_path / "gate"
    hosts = ssh_hosts(tmp_path, cluster, [1, 1], state)
    background = up_detached("--name", "background", hosts, SUPPORT / "counter.py", "300", "0.02", gate)
    monitor = wait_for(lambda: monitors_of(controller_state), timeout=30, what="the monitor")[0]
    up = subprocess.Popen(up_argv("--name", "foreground", hosts, SUPPORT / "counter.py", "300", "0.02", gate),
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    request.addfinalizer(lambda: finish(up))
    lines, errors, readers = read_both(up)
    wait_for(lambda: any("line 20" in line for line in lines), timeout=60, what="the foreground job's output")
    paused = time.monotonic()
    for pid in (up.pid, monitor):
        os.kill(pid, signal.SIGSTOP)
    gate.touch()
    try:
        foreground = job_id_of_dir(state, exclude=background)
        wait_for(lambda: all(host_ended(state, job, node) for job in (background, foreground) for node in (0, 1)),
                 timeout=120, what="both jobs to end on their hosts")
        wait_for(lambda: not any(host.served() for host in cluster.hosts), timeout=60,
                 what="the hosts' sshd to drop the paused controller's connections")
        wait_for(lambda: time.monotonic() - paused >= PAUSE, timeout=PAUSE + 5, interval=1, what="the pause")
    finally:
        for pid in (up.pid, monitor):
            os.kill(pid, signal.SIGCONT)
    assert up.wait(timeout=120) == 0, "".join(errors)
    for reader in readers:
        reader.join(timeout=10)
    for node in (0, 1):
        printed = [f"[rank{m.group(2)}]:{m.group(3)}" for line in lines
                   if (m := re.match(r"^node(\d) sim\d +rank(\d) +\| (.*)$", line)) and m.group(1) == str(node)]
        assert printed == counter_lines(node, 300)
    assert wait_state(background, "succeeded", "failed", "stopped", "lost")["state"] == "succeeded"
    for job in (background, foreground):
        for node in (0, 1):
            assert not (attempt_dir(state, job, node) / "stop").exists()  # nobody asked for a stop


# Longer than every timeout on the way (the follow's silence, then connection attempts of
# CUT_CONNECT_TIMEOUT each after Reconnect's delays: at least three of them fail); nothing in
# clusterrun counts failures or time towards giving up unless --unreachable-timeout is given.
OUTAGE = FOLLOW_TIMEOUT + 3 * (CUT_CONNECT_TIMEOUT + Reconnect().most) + 4


@pytest.mark.fake_torchrun
def test_a_host_unreachable_longer_than_every_timeout_is_waited_for_not_stopped(sim_cluster: MakeCluster,
                                                                               tmp_path: Path, controller_state: Path,
                                                                               request: pytest.FixtureRequest) -> None:
    """sim2's network cable is out (OUTAGE) while the job runs: its node shows unreachable,
    nothing is stopped anywhere, and when it is back the job goes on and succeeds, every line once,
    with one notice that the node reconnected (the requests made on the dead connection meanwhile
    left no channel for sshd to open when the link came back) and no word from paramiko."""
    cluster = sim_cluster(2, connect_timeout=CUT_CONNECT_TIMEOUT)
    state = tmp_path / "state"
    hosts = ssh_hosts(tmp_path, cluster, [1, 1], state)
    count = int((OUTAGE + 30) / 0.1)  # the job runs on for a while after the cable is back
    up = subprocess.Popen(up_argv(hosts, SUPPORT / "counter.py", str(count), "0.1"), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    request.addfinalizer(lambda: finish(up))
    lines, errors, readers = read_both(up)
    wait_for(lambda: any("rank 1 line 10" in line for line in lines), timeout=60, what="output from node 1")
    cut = time.monotonic()
    cluster.set_link(cluster.hosts[1], up=False)
    try:
        wait_for(lambda: any("node1 sim2: unreachable" in e for e in errors), timeout=60,
                 what="node 1 to be shown unreachable")
        wait_for(lambda: time.monotonic() - cut >= OUTAGE, timeout=OUTAGE + 5, interval=1, what="the outage")
    finally:
        cluster.set_link(cluster.hosts[1], up=True)
    assert up.wait(timeout=count * 0.1 + 120) == 0, "".join(errors)
    for reader in readers:
        reader.join(timeout=10)
    for node in (0, 1):
        printed = [f"[rank{m.group(2)}]:{m.group(3)}" for line in lines
                   if (m := re.match(r"^node(\d) sim\d +rank(\d) +\| (.*)$", line)) and m.group(1) == str(node)]
        assert printed == counter_lines(node, count)
    assert sum("node1 sim2: reconnected" in e for e in errors) == 1, "".join(errors)
    assert not [e for e in errors if not e.startswith(("clusterrun: ", "  "))], "".join(errors)  # nothing of paramiko's
    job = job_id_of_dir(state)
    assert not any((attempt_dir(state, job, node) / "stop").exists() for node in (0, 1))


def read_both(proc: subprocess.Popen[str]) -> tuple[list[str], list[str], list[threading.Thread]]:
    """The lines of ``proc``'s stdout and stderr as they come, each read by a thread of its own
    (through the pipes' own buffers: nothing read is lost, as communicate() would lose it)."""
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda: out.extend(proc.stdout or ()), daemon=True),
               threading.Thread(target=lambda: err.extend(proc.stderr or ()), daemon=True)]
    for reader in readers:
        reader.start()
    return out, err, readers


def finish(proc: subprocess.Popen[str]) -> None:
    """Leave nothing of a controller a test started: its process and its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def monitors_of(home: Path) -> list[int]:
    from tests.conftest import monitors

    return monitors(home)


def job_id_of_dir(state: Path, exclude: str | None = None) -> str:
    """The one job with state under ``state`` (the hosts' state dir), other than ``exclude``."""
    jobs = [p.name for p in (state / "jobs").iterdir() if p.name != exclude]
    assert len(jobs) == 1, jobs
    return jobs[0]


def host_ended(state: Path, job: str, node: int) -> bool:
    try:
        return json.loads((attempt_dir(state, job, node) / "state.json").read_text()).get("state") == "exited"
    except (OSError, ValueError):
        return False
