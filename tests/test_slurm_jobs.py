"""A job of ``up --from-slurm`` as a recorded job, against a real Slurm (``tests/slurmsim.py``): its
record (``ps``, ``ps JOB``, ``ps --json``), what ``ps`` says once its ``up`` is gone, and ``down``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import SUPPORT, wait_for
from tests.slurmsim import SlurmCluster
from tests.test_joblist import documented_schema, violations
from tests.test_slurm_cluster import (
    _census,
    _clusterrun_under,
    _descendants,
    _end,
    _env,
    _files,
    _read_lines,
    _run_up,
    _up,
)
from tests.test_tui import screen

pytestmark = [pytest.mark.integration, pytest.mark.fake_torchrun]


def _cli(slurm: SlurmCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterrun", *args], capture_output=True, text=True,
                          env=_env(slurm), timeout=60)


def _job_id(text: str) -> str:
    found = re.search(r"clusterrun: job (\S+): 2 nodes of Slurm job", text)
    assert found, text
    return found.group(1)


def _sleeping(slurm: SlurmCluster, tmp_path: Path, fake_python: Path) -> tuple[subprocess.Popen[str], Path, str]:
    """`up --from-slurm` of ranks that sleep, once all four wrote: the process (salloc), the script, the job."""
    script, hosts = _files(tmp_path, fake_python)
    proc = subprocess.Popen(_up(hosts, str(script), "sleep"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(slurm), cwd=tmp_path, start_new_session=True)
    try:
        seen = _read_lines(proc, lambda lines: sum(" | rank " in line for line in lines) == 4, timeout=60)
    except BaseException:
        _end(proc)
        raise
    return proc, script, _job_id("".join(seen))


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
    assert [(n["host"], n["state"], n["exit_code"]) for n in job["nodes"]][1] == ("sim2", "failed", 1), job["nodes"]
    assert job["nodes"][0]["state"] in ("succeeded", "failed", "stopped")  # done, or ended with the step (timing)
    assert job["attempts"][0]["root_cause"].startswith("rank 3 on node 1 (sim2, local rank 1): exit code 7")
    for command in (["logs", "-f"], ["attach", "--no-tui"]):  # an ended job: its lines, then its end as `up` says it
        ended = _cli(slurm_cluster, *command, job_id)
        assert ended.returncode == 1, ended.stderr
        assert "root cause: rank 3 on node 1 (sim2, local rank 1): exit code 7" in ended.stderr, ended.stderr
        assert "last lines of rank 3:\n    rank 3 of 4 on sim2 node 1 args ['fail', '3']" in ended.stderr, ended.stderr


def test_a_job_whose_up_was_killed_is_lost_once_slurm_no_longer_runs_its_step(
        slurm_cluster: SlurmCluster, tmp_path: Path, fake_python: Path) -> None:
    proc, script, job_id = _sleeping(slurm_cluster, tmp_path, fake_python)
    try:
        running = json.loads(_cli(slurm_cluster, "ps", job_id, "--json").stdout)["jobs"][0]
        assert (running["state"], running["slurm"]["unwatched"]) == ("running", None)
        os.kill(wait_for(lambda: _clusterrun_under(proc.pid), 10, what="clusterrun under salloc"), signal.SIGKILL)
        proc.communicate(timeout=60)  # srun got its parent-death signal and ended the step; salloc then ends
    finally:
        _end(proc)
    down = _cli(slurm_cluster, "down", job_id)  # the first to look: it finds the step gone
    assert down.returncode == 0 and f"job {job_id} already finished (lost); nothing to stop" in down.stderr, down
    shown = _cli(slurm_cluster, "ps", job_id)
    assert f"job {job_id} (ranks): lost, attempt 1" in shown.stdout, shown.stdout + shown.stderr
    assert re.search(r"its `up --from-slurm` \(pid \d+ on \S+\) is gone and Slurm no longer runs its step: how it "
                     r"ended is not known here \(`sacct -j \d+` says\)", shown.stdout), shown.stdout
    for host in slurm_cluster.sim.hosts:
        assert _census(host, str(script)) == [], host.name


def test_down_stops_a_recorded_slurm_job_and_its_record_says_stopped(
        slurm_cluster: SlurmCluster, tmp_path: Path, fake_python: Path) -> None:
    proc, script, job_id = _sleeping(slurm_cluster, tmp_path, fake_python)
    try:
        down = _cli(slurm_cluster, "down", "ranks")
        proc.communicate(timeout=60)
    finally:
        _end(proc)
    assert down.returncode == 0, down.stderr
    assert f"job {job_id} stopped; Slurm ended every process of its step" in down.stderr
    job = json.loads(_cli(slurm_cluster, "ps", job_id, "--json").stdout)["jobs"][0]
    assert job["state"] == "stopped" and {n["state"] for n in job["nodes"]} == {"stopped"}, job
    for host in slurm_cluster.sim.hosts:
        assert _census(host, str(script)) == [], host.name
    again = _cli(slurm_cluster, "down", job_id)
    assert again.returncode == 0 and f"job {job_id} already finished (stopped); nothing to stop" in again.stderr


def test_logs_reads_the_files_up_kept_by_node_rank_and_attempt(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                                fake_python: Path) -> None:
    script, hosts = _files(tmp_path, fake_python)
    done = _run_up(slurm_cluster, tmp_path, hosts, str(script), "--", "a b")
    assert done.returncode == 0, done.stderr
    job_id = _job_id(done.stderr)
    logs = _cli(slurm_cluster, "logs", job_id)
    assert logs.returncode == 0, logs.stderr
    for rank in range(4):
        node = rank // 2
        line = f"node{node} sim{node + 1} rank{rank} | rank {rank} of 4 on sim{node + 1} node {node} args ['a b']"
        assert line in logs.stdout.splitlines(), logs.stdout
    ranked = _cli(slurm_cluster, "logs", job_id, "--rank", "3")
    assert [line for line in ranked.stdout.splitlines() if "of 4 on" in line] == [
        "[rank3]:rank 3 of 4 on sim2 node 1 args ['a b']"], ranked.stdout  # one node shown: no prefix
    raw = _cli(slurm_cluster, "logs", job_id, "--node", "0", "--attempt", "1")
    assert "[rank0]:rank 0 of 4 on sim1 node 0 args ['a b']\n" in raw.stdout, raw.stdout  # the file as written
    assert _cli(slurm_cluster, "logs", job_id, "--tail", "1", "--node", "1").stdout.count("\n") == 1


@pytest.mark.parametrize("command", [["logs", "-f"], ["attach", "--no-tui"]])
def test_logs_f_and_attach_follow_a_running_slurm_job_and_end_with_it(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                                       fake_python: Path, command: list[str]) -> None:
    proc, _script, job_id = _sleeping(slurm_cluster, tmp_path, fake_python)
    follow = None
    try:
        follow = subprocess.Popen([sys.executable, "-m", "clusterrun", *command, job_id], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env=_env(slurm_cluster))
        followed = _read_lines(follow, lambda lines: sum(" | rank " in line for line in lines) == 4, timeout=60)
        assert "node1 sim2 rank3 | rank 3 of 4 on sim2 node 1 args ['sleep']\n" in followed
        assert follow.poll() is None  # the job runs: logs -f waits for more
        assert _cli(slurm_cluster, "down", job_id).returncode == 0
        rest, _ = follow.communicate(timeout=60)
        proc.communicate(timeout=60)
    finally:
        _end(proc)
        if follow is not None and follow.poll() is None:
            follow.kill()
            follow.wait()
    assert follow.returncode == 1, rest
    assert f"job {job_id} stopped (clusterrun down)" in rest and "node0 sim1: stopped" in rest, rest


@contextlib.contextmanager
def _terminal(slurm: SlurmCluster, tmp_path: Path, command: str) -> Iterator[Callable[..., str]]:
    """``command`` in a real terminal (tmux) in ``tmp_path``, with ``echo EXIT=$?`` after it; yields
    ``keys(*keys)``, which sends keys (none: only looks) and returns the screen. Whatever the shell
    started is killed at the end, should the test have failed before it ended."""
    subprocess.run(["sh", str(SUPPORT / "install_sshd.sh"), "tmux"], check=True, capture_output=True)
    assert shutil.which("tmux"), "tmux could not be installed"
    session, tmux = f"crslurm{os.getpid()}", ["tmux", "-S", str(tmp_path / "tmux.sock")]
    subprocess.run([*tmux, "new-session", "-d", "-s", session, "-x", "160", "-y", "45",
                    f"cd {shlex.quote(str(tmp_path))} && {command}; echo EXIT=$?; sleep 60"], check=True,
                   env={**_env(slurm), "TERM": "xterm-256color"})

    def keys(*sent: str) -> str:
        for key in sent:
            subprocess.run([*tmux, "send-keys", "-t", session, key], check=True)
        return screen(tmux, session)

    try:
        yield keys
    finally:
        pane = subprocess.run([*tmux, "display", "-p", "-t", session, "#{pane_pid}"], capture_output=True, text=True)
        left = _descendants(int(pane.stdout)) if pane.stdout.strip().isdigit() else []
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _kill_from_the_dashboard(keys: Callable[..., str]) -> None:
    """K, y in the dashboard, then q once the job is shown stopped; it must exit 130."""
    keys("K")
    wait_for(lambda: "Kill job" in keys(), timeout=10, what="the confirm dialog")
    # y again while the question shows: a key typed while the dialog is still being mounted may be lost (seen
    # once under load); a second y after it closed means nothing to the dashboard
    wait_for(lambda: "Kill job" not in keys("y"), timeout=20, what=f"the dialog to take y:\n{keys()}")
    wait_for(lambda: "STOPPED" in keys(), timeout=60, what=f"the job stopped:\n{keys()}")
    keys("q")
    wait_for(lambda: "EXIT=" in keys(), timeout=30, what=f"clusterrun to exit:\n{keys()}")
    assert "EXIT=130" in keys(), keys()


def _both_running(keys: Callable[..., str]) -> None:
    wait_for(lambda: "sim2" in keys() and keys().count("running") >= 2 and "rank 0 of 4 on sim1" in keys(),
             timeout=90, what=f"the dashboard with both nodes running:\n{keys()}")


def test_the_dashboard_shows_a_slurm_job_and_k_cancels_its_step(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                                 fake_python: Path) -> None:
    """`up --from-slurm` in a real terminal (tmux): the dashboard with both Slurm nodes; K, y: the step is
    stopped on every node, the job recorded stopped, exit 130."""
    script, hosts = _files(tmp_path, fake_python)
    with _terminal(slurm_cluster, tmp_path, shlex.join(_up(hosts, "--grace=1", str(script), "sleep"))) as keys:
        _both_running(keys)
        job_id = next(p.name for p in (Path(os.environ["XDG_STATE_HOME"]) / "clusterrun" / "jobs").iterdir())
        # the task's shell, torchrun and its 2 workers on each node
        assert [len(_census(h, str(script))) for h in slurm_cluster.sim.hosts] == [4, 4]
        _kill_from_the_dashboard(keys)
    for host in slurm_cluster.sim.hosts:
        assert _census(host, str(script)) == [], host.name
    job = json.loads(_cli(slurm_cluster, "ps", job_id, "--json").stdout)["jobs"][0]
    assert job["state"] == "stopped" and {n["state"] for n in job["nodes"]} == {"stopped"}, job
    assert "rank 3 of 4 on sim2" in _cli(slurm_cluster, "logs", job_id).stdout  # kept while the dashboard showed it


def test_attach_follows_the_kept_logs_in_the_dashboard_and_k_stops_the_step(
        slurm_cluster: SlurmCluster, tmp_path: Path, fake_python: Path) -> None:
    """`attach` to a Slurm job its `up --no-tui` runs: the dashboard from the files and the record; K, y stops
    the step (as `down`), the `up` records the job stopped, the view shows it and exits 130."""
    proc, script, job_id = _sleeping(slurm_cluster, tmp_path, fake_python)
    try:
        command = shlex.join([sys.executable, "-m", "clusterrun", "attach", job_id])
        with _terminal(slurm_cluster, tmp_path, command) as keys:
            _both_running(keys)
            _kill_from_the_dashboard(keys)
        out, _ = proc.communicate(timeout=60)
    finally:
        _end(proc)
    assert proc.returncode == 1 and f"job {job_id} stopped (clusterrun down)" in out, out
    for host in slurm_cluster.sim.hosts:
        assert _census(host, str(script)) == [], host.name
    assert json.loads(_cli(slurm_cluster, "ps", job_id, "--json").stdout)["jobs"][0]["state"] == "stopped"


FLAKY = """\
import os, pathlib, sys
sys.stdout.write(f"rank {os.environ['RANK']} here\\n")
sys.stdout.flush()
if os.environ["RANK"] == "3" and not pathlib.Path(sys.argv[1]).exists():
    sys.exit(7)
"""


def test_restart_runs_a_new_step_in_the_allocation_and_is_refused_once_it_ended(
        slurm_cluster: SlurmCluster, tmp_path: Path, fake_python: Path) -> None:
    _script, hosts = _files(tmp_path, fake_python)
    flaky, ok = tmp_path / "flaky.py", tmp_path / "ok"
    flaky.write_text(FLAKY)
    clusterrun = shlex.join([sys.executable, "-m", "clusterrun"])
    up = shlex.join(_up(hosts, "--name", "flaky", str(flaky), str(ok))[5:])  # from "up" on
    inside = f"{clusterrun} {up}; echo UP=$?; touch {shlex.quote(str(ok))}; exec {clusterrun} restart flaky"
    done = subprocess.run(["salloc", "-N2", "sh", "-c", inside], capture_output=True, text=True,
                          env=_env(slurm_cluster), cwd=tmp_path, timeout=300)
    assert done.returncode == 0 and "UP=1" in done.stdout, done.stdout + done.stderr
    assert re.search(r"job flaky-\S+: attempt 2, a new step in Slurm job (\d+), on 2 nodes", done.stderr), done.stderr
    job = json.loads(_cli(slurm_cluster, "ps", "flaky", "--json").stdout)["jobs"][0]
    assert (job["state"], job["attempt"], [a["state"] for a in job["attempts"]]) == (
        "succeeded", 2, ["failed", "succeeded"]), job
    assert job["slurm"]["step"].endswith(".1")  # the allocation's second step
    for attempt in ("1", "2"):
        assert "node1 sim2 rank3 | rank 3 here" in _cli(slurm_cluster, "logs", "flaky", "--attempt", attempt).stdout

    refused = _cli(slurm_cluster, "restart", "flaky")
    assert refused.returncode == 1, refused.stderr
    assert re.search(r"job flaky-\S+ cannot be restarted: its allocation, Slurm job \d+, has ended; nothing was "
                     r"started", refused.stderr), refused.stderr
    assert "run `up --from-slurm" in refused.stderr
    assert json.loads(_cli(slurm_cluster, "ps", "flaky", "--json").stdout)["jobs"][0]["attempt"] == 2


SLEEPY = """\
import os, pathlib, sys, time
sys.stdout.write(f"rank {os.environ['RANK']} here\\n")
sys.stdout.flush()
if not pathlib.Path(sys.argv[1]).exists():
    time.sleep(600)
"""


@pytest.mark.parametrize("command", [["logs", "-f"], ["attach", "--no-tui"]])
def test_a_viewer_follows_a_restart_run_from_another_shell_into_the_next_attempt(
        slurm_cluster: SlurmCluster, tmp_path: Path, fake_python: Path, command: list[str]) -> None:
    """`logs -f` or `attach` of a Slurm job whose step `restart` stops from another shell: the viewer
    waits while the restart records the next attempt, follows it from its start, and ends with its outcome."""
    _script, hosts = _files(tmp_path, fake_python)
    sleepy, ok = tmp_path / "sleepy.py", tmp_path / "ok"
    sleepy.write_text(SLEEPY)
    up = shlex.join([sys.executable, "-m", "clusterrun", *_up(hosts, "--name", "sleepy", str(sleepy), str(ok))[5:]])
    proc = subprocess.Popen(["salloc", "-N2", "sh", "-c", f"{up}; echo UP=$?; sleep 120"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(slurm_cluster), cwd=tmp_path,
                            start_new_session=True)
    follow = None
    try:
        seen = _read_lines(proc, lambda lines: sum(" | rank " in line for line in lines) == 4, timeout=60)
        job_id = _job_id("".join(seen))
        follow = subprocess.Popen([sys.executable, "-m", "clusterrun", *command, job_id], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env=_env(slurm_cluster))
        _read_lines(follow, lambda lines: sum(" | rank " in line for line in lines) == 4, timeout=60)
        ok.touch()
        restarted = subprocess.run([sys.executable, "-m", "clusterrun", "restart", job_id], capture_output=True,
                                   text=True, env=_env(slurm_cluster), cwd=tmp_path, timeout=180)
        assert restarted.returncode == 0, restarted.stdout + restarted.stderr
        rest, _ = follow.communicate(timeout=60)
    finally:
        _end(proc)
        if follow is not None and follow.poll() is None:
            follow.kill()
            follow.wait()
    assert f"following attempt 2 of job {job_id}" in rest, rest
    assert rest.count(" | rank ") == 4 and f"job {job_id} succeeded" in rest, rest
    assert follow.returncode == 0, rest

