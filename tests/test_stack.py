"""``clusterrun stack`` end to end: real torchrun ranks blocked in a gloo barrier, locally and over
SSH on simulated hosts; py-spy missing on a host; ptrace refused by the kernel (the agent as
``nobody``, the rank root's)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterrun.agent.records import boot_id
from clusterrun.agent.wire import StackAnswer, StackRequest
from clusterrun.tui import Dashboard
from clusterrun.tui.screens import Stacks
from tests.conftest import ROOT, SUPPORT, start_time, wait_for, write_hosts
from tests.simhosts import SimCluster, in_ci
from tests.test_lifecycle import attempt_dir, clusterrun, up_detached
from tests.test_ssh import ssh_hosts
from tests.test_tui import dashboard_on, drive, until

pytestmark = pytest.mark.integration
# Beside this interpreter (a venv's bin, as CI's, need not be on PATH), else on PATH.
PY_SPY = next((str(p) for p in [Path(sys.executable).with_name("py-spy")] if p.exists()), shutil.which("py-spy"))
# Skipped without py-spy here, but not under CI, which must test what it claims (the test extra has it).
needs_py_spy = pytest.mark.skipif(PY_SPY is None and not in_ci(),
                                  reason="py-spy is not installed (pip install -e '.[test]')")
USER_PYTHON = "/usr/bin/python3"  # an interpreter every user may run (this one may live in /root)


def stack(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clusterrun", "stack", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


def blocked(job: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``stack`` once ranks 0-2 wait in the barrier and rank 3 lingers before it (they get there
    in their own time: asked again until they are)."""
    def ready() -> subprocess.CompletedProcess[str] | None:
        proc = stack(job, *args)
        summary = proc.stdout.split("\n", 1)[0]  # every rank's place: none still in init_process_group
        places = {part.split(": ", 1)[-1].split(" at ")[0] for part in summary.split(" · ")}
        return proc if places == {"barrier in wait_for_peers", "linger"} else None

    return wait_for(ready, timeout=120, interval=0.5, what="the ranks in the barrier")  # type: ignore[no-any-return]


def check_barrier(proc: subprocess.CompletedProcess[str], hosts: tuple[str, str]) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == ("ranks 0-2: barrier in wait_for_peers at barrier_rank.py:16 · "
                        "rank 3: linger at barrier_rank.py:12")
    assert "ranks 0-2 (nodes 0-1):" in lines and f"rank 3 (node 1 {hosts[1]}):" in lines
    group = lines[lines.index("ranks 0-2 (nodes 0-1):") + 1:lines.index(f"rank 3 (node 1 {hosts[1]}):")]
    assert group[0] == "  Thread MainThread" and group[1].startswith("    barrier (torch/distributed/")
    assert "    wait_for_peers (barrier_rank.py:16)" in group


def dashboard_stacks(job: str) -> str:
    """What the dashboard's ``s`` shows of the job (its Stacks screen, once taken)."""
    app = dashboard_on(job, tail=0)
    seen: list[str] = []

    async def script(app: Dashboard, pilot: Any) -> None:
        await until(pilot, lambda: app.check_action("stack", ()), 30, "the job's state")
        await pilot.press("s")
        await until(pilot, lambda: isinstance(app.screen, Stacks) and "ranks 0-2" in (seen.append(
            str(app.screen.query_one("#stacks-text").render())) or seen[-1]), 60, "the stacks")
        await pilot.press("escape", "d")

    drive(app, script)
    return seen[-1]


@needs_py_spy
def test_stack_groups_the_ranks_blocked_in_a_barrier(tmp_path: Path, state_dir: Path) -> None:
    hosts = write_hosts(tmp_path, [2, 2], state_dir)
    job = up_detached(hosts, SUPPORT / "barrier_rank.py", "600")
    try:
        check_barrier(blocked(job), ("local-a", "local-b"))
        only = stack(job, "--rank", "3")
        assert only.returncode == 0, only.stderr
        assert only.stdout.splitlines()[0] == "rank 3: linger at barrier_rank.py:12"
        assert "ranks 0-2" not in only.stdout
        node0 = stack(job, "--node", "0")
        assert node0.returncode == 0, node0.stderr
        assert node0.stdout.startswith("ranks 0-1: barrier in wait_for_peers at "), node0.stdout
        as_json = stack(job, "--json")
        assert as_json.returncode == 0, as_json.stderr
        data = json.loads(as_json.stdout)
        assert [(g["ranks"], g["nodes"]) for g in data["groups"]] == [([0, 1, 2], [0, 1]), ([3], [1])]
        assert data["groups"][1]["where"] == "linger at barrier_rank.py:12" and not data["problems"]
        assert dashboard_stacks(job).startswith(data["summary"])  # the dashboard's `s` shows the same
        state = json.loads((attempt_dir(state_dir, job, 1) / "state.json").read_text())
        pid = next(w["pid"] for w in state["workers"] if w["rank"] == 3)
        os.kill(pid, signal.SIGSTOP)  # Ctrl-Z on rank 3: py-spy cannot pause it to read it
        try:
            wait_for(lambda: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T",
                     timeout=30, what="rank 3 to stop")
            held = stack(job, "--rank", "3")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert held.returncode == 0, held.stdout + held.stderr
        assert held.stdout.splitlines()[:3] == [
            "rank 3: linger at barrier_rank.py:12 (stopped)", "", "rank 3 (node 1 local-b):"]
        assert (f"  stopped (a SIGSTOP, Ctrl-Z or a debugger holds it): the ranks that wait for it wait until "
                f"`kill -CONT {pid}` on local-b") in held.stdout.splitlines()
        bad = stack(job, "--rank", "two")
        assert bad.returncode == 2 and "'two' is not a rank or a range of ranks" in bad.stderr
    finally:
        clusterrun("down", job)
    ended = stack(job)
    assert ended.returncode == 1 and "it runs no rank to look at" in ended.stderr


@pytest.mark.fake_torchrun
def test_a_host_without_py_spy_is_told_how_to_install_it(tmp_path: Path, state_dir: Path,
                                                          fake_python: Path) -> None:
    env = dict(os.environ, PATH="/usr/bin:/bin", HOME=str(tmp_path))  # no py-spy on the job's PATH, nor ~/.local/bin
    hosts = write_hosts(tmp_path, [1, 1], state_dir)
    proc = subprocess.run([sys.executable, "-m", "clusterrun", "up", "-d", str(hosts), str(SUPPORT / "counter.py"),
                           "2000", "0.1"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip()
    try:
        out = stack(job, env=env)
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"nodes 0-1: py-spy is not installed on this host (looked beside {fake_python}" in out.stdout
        assert f"  fix: {fake_python} -m pip install py-spy" in out.stdout
    finally:
        clusterrun("down", job)


@pytest.fixture
def readable_tmp() -> Iterator[Path]:
    """A temp dir ``nobody`` may enter (pytest's own are 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="crtest-stack-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@needs_py_spy
def test_a_refused_ptrace_is_reported_with_its_cause_and_fix(readable_tmp: Path, readable_code: Path) -> None:
    """The agent as ``nobody``, a rank of root's: the kernel refuses py-spy's ptrace."""
    assert PY_SPY is not None
    bin_dir = readable_tmp / "venv" / "bin"  # the job's interpreter's bin dir, where py-spy is found
    bin_dir.mkdir(parents=True)
    shutil.copy(PY_SPY, bin_dir / "py-spy")
    (bin_dir / "py-spy").chmod(0o755)
    rank = subprocess.Popen([USER_PYTHON, "-c", "import time; time.sleep(300)"],
                            env=dict(os.environ, CLUSTERRUN_JOB="stk.0.1", RANK="0"))
    try:
        wait_for(lambda: start_time(rank.pid), timeout=10, what="the rank")
        attempt = readable_tmp / "state" / "jobs" / "stk" / "node0" / "attempt1"
        attempt.mkdir(parents=True)
        (attempt / "spec.json").write_text(json.dumps({"argv": [str(bin_dir / "python")]}))
        (attempt / "state.json").write_text(json.dumps({
            "job": "stk", "node": 0, "attempt": 1, "state": "running", "boot_id": boot_id(),
            "torchrun": {"pid": rank.pid, "start_time": start_time(rank.pid)},
            "workers": [{"rank": 0, "local_rank": 0, "pid": rank.pid, "died": None}]}))
        for path in [readable_tmp / "state", *(readable_tmp / "state").rglob("*")]:
            os.chown(path, 65534, 65534)
        request = StackRequest(job="stk", node=0, attempt=1, state_dir=str(readable_tmp / "state"))
        agent = ("import json, sys; sys.path.insert(0, sys.argv[1]); from clusterrun.agent.serve import answer; "
                 "print(json.dumps(answer(sys.stdin.buffer.readline())))")
        proc = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", USER_PYTHON, "-S",
                               "-c", agent, str(readable_code)], input=json.dumps(request.to_json()) + "\n",
                              capture_output=True, text=True, timeout=60, cwd="/")
        assert proc.returncode == 0, proc.stderr
        answer = StackAnswer.from_json(json.loads(proc.stdout))
        assert answer.state == "running" and answer.tool == str(bin_dir / "py-spy")
        [refused] = answer.ranks
        assert refused.rank == 0 and not refused.threads
        assert refused.error == f"ptrace of pid {rank.pid} refused by the kernel: the process belongs to root, " \
                                "the agent runs as nobody"
        assert refused.fix == "run clusterrun as the job's user (the hosts file's `user:`), or as root"
    finally:
        rank.kill()
        rank.wait()


@needs_py_spy
def test_stack_over_ssh_on_simulated_hosts(sim_cluster: Callable[..., SimCluster], tmp_path: Path) -> None:
    cluster = sim_cluster(2)
    hosts = ssh_hosts(tmp_path, cluster, [2, 2], tmp_path / "state")
    job = up_detached(hosts, SUPPORT / "barrier_rank.py", "600")
    try:
        check_barrier(blocked(job), (cluster.hosts[0].name, cluster.hosts[1].name))
    finally:
        clusterrun("down", job)


@pytest.mark.fake_torchrun
def test_over_ssh_a_host_without_py_spy_is_told_how_to_install_it(sim_cluster: Callable[..., SimCluster],
                                                                   tmp_path: Path, fake_python: Path) -> None:
    """The simulated hosts' login PATH has no py-spy, nor has the fake interpreter's directory."""
    cluster = sim_cluster(2)
    hosts = ssh_hosts(tmp_path, cluster, [2, 1], tmp_path / "state")
    job = up_detached(hosts, SUPPORT / "counter.py", "2000", "0.1")
    try:
        out = stack(job, "--rank", "1-2")
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"nodes 0-1: py-spy is not installed on this host (looked beside {fake_python}" in out.stdout
        assert f"  fix: {fake_python} -m pip install py-spy" in out.stdout
    finally:
        clusterrun("down", job)
