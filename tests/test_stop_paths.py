"""Every way a job is stopped, against every hostile kind of process at once, on local and SSH hosts,
with a cgroup and without one.

The agent's stop itself is tested kind by kind in test_containment.py; here each path of the
controller that stops a job — `down`, Ctrl-C, fail-fast, the dashboard's K, `restart` — must
reach it for the right attempt and say which guarantee held: with a cgroup, nothing is left and
the output says "verified"; without (forced off), nothing the sweep can see is left, and the
output says what it could not see, never "verified" or "nothing of it is left"; and that torchrun
outlived the grace (the ranks ignore SIGTERM) and was SIGKILLed, or, fail-fast's stop of an attempt
with a cgroup, was SIGKILLed at once with it. Each also after
node 0's supervisor was SIGKILLed (then a sweep may miss the escapee, and says so). An unrelated
process with the escapee's command line survives every time.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import ROOT, SUPPORT, alive, job_id_of, start_time, up_argv, wait_for, write_hosts
from tests.simhosts import SimCluster, SimHost
from tests.test_containment import CHECK, with_and_without_cgroup
from tests.test_lifecycle import clusterrun, host_state, up_detached
from tests.test_ssh import ssh_hosts
from tests.test_tui import dashboard_on, drive, until

pytestmark = [pytest.mark.integration, pytest.mark.fake_torchrun]

PATHS = ["down", "ctrl-c", "fail-fast", "dashboard-K", "restart"]
VERIFIED = "nothing left (verified by cgroup)"
UNSEEN = "processes that left the job's tree, session and environment could not be seen"


@dataclass
class Where:
    """Two nodes (one rank each) on this machine or on two simulated hosts; with a cgroup or not."""

    cgroup: bool
    cluster: SimCluster | None  # None: local hosts
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def hosts(self) -> list[SimHost] | None:
        return None if self.cluster is None else self.cluster.hosts

    def alive(self, pids: dict[str, tuple[int, int]]) -> list[str]:
        """Which of ``pids`` (name → pid, start time; names start with ``a<attempt>-rank<r>``) still live."""
        if self.hosts is None:
            return sorted(name for name, (pid, st) in pids.items() if alive(pid, st))
        living = []
        for rank, host in enumerate(self.hosts):
            mine = {name: p for name, p in pids.items() if f"-rank{rank}-" in name}
            out = host.run(sys.executable, "-c", CHECK, *(f"{pid}:{st}" for pid, st in mine.values()))
            assert out.returncode == 0, out.stderr
            found = {int(p) for p in out.stdout.split()}
            living += [name for name, (pid, _) in mine.items() if pid in found]
        return sorted(living)

    def bystanders(self) -> dict[str, tuple[int, int]]:
        """An unrelated `sleep 3600` (the escapee's command line) on every host of the job."""
        if self.hosts is None:
            proc = subprocess.Popen(["sleep", "3600"], start_new_session=True)
            self.children.append(proc)
            started = start_time(proc.pid)
            assert started is not None
            return {"a0-rank0-bystander": (proc.pid, started)}
        made = {}
        for rank, host in enumerate(self.hosts):
            pid = int(host.run("sh", "-c", "setsid sleep 3600 </dev/null >/dev/null 2>&1 & echo $!").stdout)
            stat = host.run("cat", f"/proc/{pid}/stat").stdout
            made[f"a0-rank{rank}-bystander"] = (pid, int(stat.rsplit(")", 1)[1].split()[19]))
        return made

    def kill(self, pids: dict[str, tuple[int, int]]) -> None:
        for name in self.alive(pids):
            pid = pids[name][0]
            if self.hosts is None:
                os.kill(pid, signal.SIGKILL)
            else:
                self.hosts[int(name.split("-rank")[1].split("-")[0])].run("kill", "-9", str(pid))
        for child in self.children:
            if child.pid in {pid for pid, _ in pids.values()}:
                child.wait()


@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[bool, SimCluster]]:
    yield from with_and_without_cgroup(2)


@pytest.fixture(params=["local-cgroup", "local-sweep", "ssh-cgroup", "ssh-sweep"])
def where(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Where:
    place, how = request.param.split("-")
    cgroup = how == "cgroup"
    if place == "local":
        if not cgroup:
            monkeypatch.setenv("CLUSTERRUN_NO_CGROUP", "1")  # the local agents inherit it
        return Where(cgroup, None)
    return Where(cgroup, request.getfixturevalue("clusters")[cgroup])


def hosts_file(where: Where, tmp_path: Path, state_dir: Path) -> Path:
    if where.cluster is None:
        return write_hosts(tmp_path, [1, 1], state_dir)
    return ssh_hosts(tmp_path, where.cluster, [1, 1], state_dir)


def ready_attempt(piddir: Path, after: int) -> int | None:
    """The first attempt after ``after`` whose two ranks are both ready, if any."""
    attempts = sorted({int(p.name[1:].split("-")[0]) for p in piddir.glob("a*-rank*.ready")})
    return next((a for a in attempts if a > after
                 and all((piddir / f"a{a}-rank{r}.ready").exists() for r in (0, 1))), None)


def recorded(piddir: Path, job: str, after: int = 0) -> tuple[int, dict[str, tuple[int, int]]]:
    """The first attempt of ``job`` after ``after`` whose ranks are both ready, and every process it made:
    name → (pid, start time). An attempt whose start failed and was retried at once (its master port
    taken meanwhile by another test's job: "Address already in use") is passed over. If none is
    ready: what the folder holds then, and what `ps JOB` says."""
    try:
        attempt: int = wait_for(lambda: ready_attempt(piddir, after), 120, what=f"the hostile processes of {job}")
    except AssertionError as exc:
        ps = clusterrun("ps", job)
        raise AssertionError(f"{exc}; {piddir} holds {sorted(p.name for p in piddir.iterdir())}; "
                             f"`clusterrun ps {job}` said:\n{ps.stdout}{ps.stderr}") from None
    found = {}
    for path in piddir.glob(f"a{attempt}-rank*-*/*.pid"):
        pid, started = map(int, path.read_text().split())
        found[f"{path.parent.name}-{path.stem}"] = (pid, started)
    assert len(found) == 2 * 23, sorted(found)  # per rank: itself, 4 kinds' mains, 3 children, 15 of the storm
    return attempt, found


def kill_node0_supervisor(where: Where, state_dir: Path, job: str, attempt: int) -> None:
    sup = host_state(state_dir, job, 0, attempt)["survivor"]  # torchrun's parent, the subreaper: the harder fault
    supervisor = {f"a{attempt}-rank0-supervisor": (sup["pid"], sup["start_time"])}
    where.kill(supervisor)
    wait_for(lambda: not where.alive(supervisor), 10, what="node 0's supervisor to die")


def stop_by(path: str, hosts: Path, piddir: Path, where: Where, state_dir: Path,
            kill_supervisor: bool = False) -> tuple[str, dict[str, tuple[int, int]]]:
    """Start the hostile job, stop it by ``path`` (after SIGKILLing node 0's supervisor, with
    ``kill_supervisor``); what the controller said of it, and the processes of the attempt it stopped."""
    args = ["--grace", "1", hosts, SUPPORT / "hostile_all.py", piddir]
    if path in ("ctrl-c", "fail-fast"):
        extra = ["fail", "1"] if path == "fail-fast" else []
        proc = subprocess.Popen(up_argv(*args, *extra), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        try:
            job = job_id_of(proc.stderr.readline())
            attempt, pids = recorded(piddir, job)
            if kill_supervisor:
                kill_node0_supervisor(where, state_dir, job, attempt)
            if path == "ctrl-c":
                proc.send_signal(signal.SIGINT)
            else:
                (piddir / "fail").touch()
            try:
                code = proc.wait(timeout=120)  # its stderr is a few lines: the pipe does not fill
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err = proc.stderr.read()
        proc.stderr.close()
        assert code == (130 if path == "ctrl-c" else 1), err
        if attempt > 1:  # what the failed start said is not this stop's
            err = err[err.index(f"started attempt {attempt}"):]
        return err, pids
    job = up_detached(*args)
    attempt, pids = recorded(piddir, job)
    if kill_supervisor:
        kill_node0_supervisor(where, state_dir, job, attempt)
    if path == "down":
        down = clusterrun("down", job)
        assert down.returncode == 0, down.stderr
        return down.stderr, pids
    if path == "restart":
        again = clusterrun("restart", job)
        assert again.returncode == 0, again.stderr
        _, second = recorded(piddir, job, after=attempt)
        assert len(second) == len(pids)  # attempt 2 runs, whole
        return again.stderr, pids
    app = dashboard_on(job, tail=0)
    shown: list[str] = []

    async def script(app: object, pilot: object) -> None:
        await pilot.press("K", "y")  # type: ignore[attr-defined]
        await until(pilot, lambda: app.board.finished, 120, "the job to end")  # type: ignore[attr-defined]
        shown.append(str(app.query_one("#report").render()))  # type: ignore[attr-defined]
        await pilot.press("q")  # type: ignore[attr-defined]

    drive(app, script)  # type: ignore[arg-type]
    return shown[0], pids


@pytest.mark.parametrize("path", [*PATHS, *(f"{p}-supervisor-killed" for p in PATHS)])
def test_every_stop_path_stops_every_hostile_process_and_says_which_guarantee_held(
        where: Where, path: str, tmp_path: Path, state_dir: Path) -> None:
    piddir = tmp_path / "pids"
    piddir.mkdir()
    hosts = hosts_file(where, tmp_path, state_dir)
    bystanders = where.bystanders()
    pids: dict[str, tuple[int, int]] = {}
    try:
        path, killed = path.removesuffix("-supervisor-killed"), path.endswith("-supervisor-killed")
        said, pids = stop_by(path, hosts, piddir, where, state_dir, kill_supervisor=killed)
        # What a sweep may not see: the escapee, once no supervisor (a subreaper) holds it in the tree —
        # unless the supervisor had recorded its session before it was killed.
        unseen = {n for n in pids if "-rank0-escape-escape-" in n} if killed and not where.cgroup else set()
        assert set(where.alive(pids)) <= unseen, said
        # the node whose rank failed is killed at once with the others where it has a cgroup; else its
        # torchrun ends by itself (its supervisor contained what torchrun left)
        stopped = 1 if path == "fail-fast" and not where.cgroup else 2
        # the ranks ignore SIGTERM, so each torchrun waits for its rank until the grace is over; but a
        # failing attempt's cgroup is killed at once, torchrun first, without its SIGTERM shutdown
        at_once = path == "fail-fast" and where.cgroup
        grace = ("at once (SIGKILL, the attempt had failed)" if at_once
                 else "torchrun outlived the 1 s grace after SIGTERM")
        if at_once:  # the failed node too, unless its torchrun had ended by itself before the kill came (a race)
            stopped = said.count(grace)
            assert stopped in (1, 2) and len(re.findall(r"node0 \S+: stopped torchrun .* at once", said)) == 1, said
        assert said.count(grace) == stopped, said
        if where.cgroup:
            assert said.count(VERIFIED) == stopped, said
        else:
            assert "verified" not in said and "nothing of it is left" not in said, said
            assert UNSEEN in said, said
        assert where.alive(bystanders) == sorted(bystanders)
    finally:
        if path == "restart":
            clusterrun("down", job_of(state_dir))
        where.kill({**pids, **bystanders})


def job_of(state_dir: Path) -> str:
    return next((state_dir / "jobs").iterdir()).name
