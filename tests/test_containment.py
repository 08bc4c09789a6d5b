"""The agent's stop against hostile jobs, with and without a cgroup, on this machine and on a
simulated SSH host (cgroup2 mounted at /sys/fs/cgroup there, or no cgroup at all).

With a cgroup nothing may be left, every time, also after the survivor (torchrun's parent and
the subreaper of what it leaves) was SIGKILLed; without one, the stop must say that it only swept
(and what it cannot see: a process that escaped the job's tree, sessions and environment after
the survivor died survives, and is not reported as "verified"). An unrelated process with the
same command line always survives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from clusterrun.config.hostsfile import HostSpec
from clusterrun.transports import transport_for
from clusterrun.transports.base import Transport
from clusterrun.transports.local import LocalTransport
from tests.conftest import SUPPORT, alive, start_time, unique_job, wait_for
from tests.simhosts import SimCluster, SimHost, namespace_problem, unavailable

pytestmark = pytest.mark.integration

KINDS = ["escape", "unshare", "sigterm", "storm"]
CHECK = ("import sys\nfor a in sys.argv[1:]:\n pid, st = a.split(':')\n try:\n"
         "  f = open('/proc/%s/stat' % pid).read().rsplit(')', 1)[1].split()\n except OSError:\n  continue\n"
         " if f[0] != 'Z' and f[19] == st:\n  print(pid)\n")


@dataclass
class Place:
    """Where the agent runs: this machine (``host`` None) or a simulated host; with a cgroup or not."""

    name: str
    transport: Transport
    cgroup: bool
    host: SimHost | None = None
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def call(self, request: dict) -> dict:
        return self.transport.call(request)

    def alive(self, pids: dict[str, tuple[int, int]]) -> list[str]:
        """The names of ``pids`` (name → pid, start time) still alive, as seen on the host."""
        if self.host is None:
            return sorted(name for name, (pid, st) in pids.items() if alive(pid, st))
        out = self.host.run(sys.executable, "-c", CHECK, *(f"{pid}:{st}" for pid, st in pids.values()))
        assert out.returncode == 0, out.stderr
        living = {int(p) for p in out.stdout.split()}
        return sorted(name for name, (pid, _) in pids.items() if pid in living)

    def kill(self, pids: list[int]) -> None:
        if not pids:
            return
        if self.host is None:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for child in self.children:
                if child.pid in pids:
                    child.wait()
        else:
            self.host.run("kill", "-9", *map(str, pids))

    def sleeper(self) -> tuple[int, int]:
        """An unrelated ``sleep 3600`` (the escapee's very command line): its pid and start time."""
        if self.host is None:
            proc = subprocess.Popen(["sleep", "3600"], start_new_session=True)
            self.children.append(proc)
            started = start_time(proc.pid)
            assert started is not None
            return proc.pid, started
        out = self.host.run("sh", "-c", "setsid sleep 3600 </dev/null >/dev/null 2>&1 & echo $!")
        pid = int(out.stdout)
        stat = self.host.run("cat", f"/proc/{pid}/stat").stdout
        return pid, int(stat.rsplit(")", 1)[1].split()[19])


def with_and_without_cgroup(n: int) -> Iterator[dict[bool, SimCluster]]:
    """Two clusters of ``n`` simulated hosts: with cgroup2 mounted (True) and without (False)."""
    if namespace_problem():
        unavailable(f"no simulated hosts here: {namespace_problem()}")
    made: dict[bool, SimCluster] = {}
    try:
        made[True] = SimCluster.start(n, isolated=True)
        made[False] = SimCluster.start(n, isolated=True, cgroup=False)
        yield made
    finally:
        for cluster in made.values():
            cluster.close()


@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[bool, SimCluster]]:
    yield from with_and_without_cgroup(1)


@pytest.fixture(params=["local-cgroup", "local-sweep", "ssh-cgroup", "ssh-sweep"])
def place(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Place]:
    where, how = request.param.split("-")
    cgroup = how == "cgroup"
    if where == "local":
        if not cgroup:
            monkeypatch.setenv("CLUSTERRUN_NO_CGROUP", "1")
        found = Place(request.param, LocalTransport(HostSpec(host="here", transport="local")), cgroup)
    else:
        cluster = request.getfixturevalue("clusters")[cgroup]
        transport = transport_for(HostSpec(host="sim1", python=sys.executable), ssh_config=str(cluster.ssh_config))
        found = Place(request.param, transport, cgroup, cluster.hosts[0])
    try:
        yield found
    finally:
        found.transport.close()  # its connection (an SSH one's reader thread) ends with the test


JOB = "hostile-1"  # each test's own (_own_job): the agent names machine-wide cgroups after it


@pytest.fixture(autouse=True)
def _own_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(globals(), "JOB", unique_job("hostile"))


def req(state_dir: Path, op: str, attempt: int = 1, **extra: object) -> dict:
    return {"op": op, "job": JOB, "node": 0, "attempt": attempt, "state_dir": str(state_dir), **extra}


def recorded(piddir: Path) -> dict[str, tuple[int, int]]:
    found = {}
    for path in piddir.glob("*.pid"):
        pid, started = map(int, path.read_text().split())
        found[path.name] = (pid, started)
    return found


@pytest.mark.parametrize("supervisor_killed", [False, True], ids=["", "survivor-killed"])
@pytest.mark.parametrize("kind", KINDS)
def test_hostile_jobs_are_stopped_or_reported(place: Place, kind: str, supervisor_killed: bool,
                                              tmp_path: Path) -> None:
    probe = place.call({"op": "probe", "state_dir": str(tmp_path / "state")})
    assert probe["containment"] == ("cgroup" if place.cgroup else "sweep"), probe
    assert place.cgroup or any(f.startswith("no cgroup: ") for f in probe["fallbacks"]), probe
    piddir = tmp_path / "pids"
    piddir.mkdir()
    state_dir = tmp_path / "state"
    argv = [sys.executable, str(SUPPORT / "hostile_child.py"), kind, str(piddir)]
    argv += ["wait"] if supervisor_killed else []
    answer = place.call(req(state_dir, "start", argv=argv, env={}, cwd=str(tmp_path)))
    assert bool(answer["state"]["cgroup"]) is place.cgroup, answer
    pids: dict[str, tuple[int, int]] = {}
    bystander = place.sleeper()
    try:
        if supervisor_killed:
            sup = answer["state"]["survivor"]
            place.kill([sup["pid"]])
            wait_for(lambda: not place.alive({"supervisor": (sup["pid"], sup["start_time"])}), 10,
                     what="the survivor to die")
            (piddir / "go").touch()
        wait_for(lambda: (piddir / "ready").exists(), 60, what=f"the hostile processes: {os.listdir(piddir)}")
        pids = recorded(piddir)
        assert len(place.alive(pids)) == len(pids) >= 2, pids
        report = place.call(req(state_dir, "stop", grace=1))
        survivors = place.alive(pids)
        if place.cgroup:
            assert (report["containment"], report["verified"], report["left"], survivors) == ("cgroup", True, [], [])
            assert "is empty and removed" in report["detail"]
        else:
            assert (report["containment"], report["verified"]) == ("sweep", False), report
            assert "could not be seen" in report["detail"]
            # what the sweep cannot see: out of the tree (no survivor to reap it), sessions and environment
            expected = [n for n in pids if n.startswith("escape-")] if kind == "escape" and supervisor_killed else []
            assert survivors == expected, report
        assert place.alive({"bystander": bystander}) == ["bystander"]
    finally:
        place.kill([pid for pid, _ in pids.values()] + [bystander[0]])


@pytest.mark.parametrize("kind", KINDS)
def test_what_torchrun_leaves_behind_is_killed_when_it_exits(place: Place, kind: str, tmp_path: Path) -> None:
    """torchrun ends on its own (success, or the failure that makes fail-fast stop the others):
    the supervisor kills everything the job left before it records the end."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    state_dir = tmp_path / "state"
    argv = [sys.executable, str(SUPPORT / "hostile_child.py"), kind, str(piddir), "exit"]
    answer = place.call(req(state_dir, "start", argv=argv, env={}, cwd=str(tmp_path)))
    pids: dict[str, tuple[int, int]] = {}
    try:
        end = list(place.transport.stream(req(state_dir, "follow")))[-1]
        assert end["t"] == "end" and end["state"]["exit_code"] == 0, end
        pids = recorded(piddir)
        assert len(pids) >= 2
        assert place.alive(pids) == []
        if place.cgroup:
            assert end["state"]["cgroup_removed"] is True
            assert place.call(req(state_dir, "stop", grace=1))["verified"] is True
        assert bool(answer["state"]["cgroup"]) is place.cgroup
    finally:
        place.kill([pid for pid, _ in pids.values()])


def test_a_stale_stop_of_attempt_1_leaves_attempt_2_untouched(place: Place, tmp_path: Path) -> None:
    """A stop of attempt 1 working from a stale record (down racing restart) while attempt 2 of
    the same job runs on the same node: attempt 2's processes live on and it ends normally."""
    state_dir = tmp_path / "state"
    place.call(req(state_dir, "start", argv=[sys.executable, "-c", "print('one')"], env={}, cwd=str(tmp_path)))
    wait_for(lambda: place.call(req(state_dir, "status"))["state"]["state"] == "exited", 30, what="attempt 1's end")
    flag, piddir = tmp_path / "finish", tmp_path / "pids"
    piddir.mkdir()
    code = ("import os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, sys.argv[1], 'sigterm', sys.argv[2]])\n"
            "while not os.path.exists(sys.argv[3]): time.sleep(0.02)\n"
            "child.kill(); print('attempt 2 done', flush=True)\n")
    second = place.call(req(state_dir, "start", attempt=2, argv=[sys.executable, "-c", code,
                        str(SUPPORT / "hostile_child.py"), str(piddir), str(flag)], env={}, cwd=str(tmp_path)))
    wait_for(lambda: (piddir / "ready").exists(), 30, what="attempt 2's processes")
    tr = second["state"]["torchrun"]
    pids = {"torchrun": (tr["pid"], tr["start_time"]), **recorded(piddir)}
    try:
        report = place.call(req(state_dir, "stop", grace=1))  # attempt 1, again
        assert report["killed"] == [] and report["left"] == []
        assert place.alive(pids) == sorted(pids)
        flag.touch()
        messages = list(place.transport.stream(req(state_dir, "follow", attempt=2)))
        end = messages[-1]
        assert end["t"] == "end" and end["state"]["exit_code"] == 0 and not end["state"]["stop_requested"], end
        assert b"attempt 2 done" in b"".join(m.get("data", b"") for m in messages)
    finally:
        place.kill([pid for pid, _ in pids.values()])
        place.call(req(state_dir, "stop", attempt=2, grace=1))


def test_without_cgroup_kill_the_cgroup_is_frozen_and_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels before 5.14 have no cgroup.kill: freeze, SIGKILL every process listed, thaw."""
    from clusterrun.agent import cgroup as cg

    parent, why = cg.cgroup_parent()
    if parent is None:
        unavailable(f"no cgroup here: {why}")
    cgroup = os.path.join(parent, f"clusterrun-test-{os.getpid()}")
    os.mkdir(cgroup)
    real_write = cg.cg_write
    tried: list[str] = []

    def no_kill(path: str, data: bytes) -> None:
        tried.append(os.path.basename(path))
        if path.endswith("cgroup.kill"):
            raise FileNotFoundError(path)
        real_write(path, data)

    piddir = tmp_path / "pids"
    piddir.mkdir()
    join = f"open({os.path.join(cgroup, 'cgroup.procs')!r}, 'w').write('0'); import runpy, sys; "
    code = join + f"sys.argv = ['x', 'storm', {str(piddir)!r}]; runpy.run_path({str(SUPPORT / 'hostile_child.py')!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        wait_for(lambda: (piddir / "ready").exists(), 30, what="the fork storm")
        pids = recorded(piddir)
        monkeypatch.setattr(cg, "cg_write", no_kill)
        killed: dict[int, dict] = {}
        assert cg.cg_kill(cgroup, killed) == "freeze + SIGKILL"
        assert "cgroup.freeze" in tried
        assert cg.cg_wait_empty(cgroup, time.monotonic() + 10)
        assert [name for name, (pid, st) in pids.items() if alive(pid, st)] == []
        assert set(pid for pid, _ in pids.values()) <= set(killed)
    finally:
        proc.kill()
        proc.wait()
        real_write(os.path.join(cgroup, "cgroup.kill"), b"1")
        cg.cg_wait_empty(cgroup, time.monotonic() + 10)
        os.rmdir(cgroup)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs: the state dir on a disk that a test can fill."""
    folder = tmp_path / "small"
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "crtest-small", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        unavailable(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(disk: Path) -> Path:
    """Fill ``disk`` to the last block; returns the file that does it (delete it to make room)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def test_a_full_state_dir_refuses_the_start_cleanly(small_disk: Path, tmp_path: Path) -> None:
    from clusterrun.core.errors import AgentError

    transport = LocalTransport(HostSpec(host="here", transport="local"))
    state_dir = small_disk / "state"
    state_dir.mkdir()
    filler = fill(small_disk)
    request = req(state_dir, "start", argv=[sys.executable, "-c", "import time; time.sleep(600)"], env={},
                  cwd=str(tmp_path))
    with pytest.raises(AgentError, match=r"cannot write to the state dir .*No space left on device.*nothing was "
                                         r"started \(free space there, or set `state_dir:` in the hosts file\)"):
        transport.call(request)
    assert transport.call(req(state_dir, "status"))["state"] == {"state": "absent"}
    filler.unlink()  # once there is room, the same attempt starts
    answer = transport.call(request)
    assert answer["ok"]
    report = transport.call(req(state_dir, "stop", grace=1))
    assert report["left"] == [] and report["notes"] == []


def test_a_disk_that_fills_up_degrades_the_supervisor_but_the_stop_works(small_disk: Path, tmp_path: Path) -> None:
    """The supervisor cannot write its state any more: it keeps supervising, says so (degraded),
    and the stop still kills and verifies everything, saying what it could not record."""
    from clusterrun.agent import cgroup as cg

    transport = LocalTransport(HostSpec(host="here", transport="local"))
    state_dir = small_disk / "state"
    piddir, flag = tmp_path / "pids", tmp_path / "go"
    piddir.mkdir()
    code = ("import os, subprocess, sys, time\n"
            "while not os.path.exists(sys.argv[3]): time.sleep(0.02)\n"  # a new session once the disk is full
            "subprocess.Popen([sys.executable, sys.argv[1], 'escape', sys.argv[2]], start_new_session=True)\n"
            "time.sleep(3600)\n")
    answer = transport.call(req(state_dir, "start", argv=[sys.executable, "-c", code,
                                str(SUPPORT / "hostile_child.py"), str(piddir), str(flag)], env={}, cwd=str(tmp_path)))
    folder = Path(answer["dir"])
    sup = answer["state"]["survivor"]
    filler = fill(small_disk)
    flag.touch()
    wait_for(lambda: (piddir / "ready").exists(), 30, what="the job's new processes")
    status = wait_for(lambda: (s := transport.call(req(state_dir, "status")))["degraded"] and s, 30,
                      what="the supervisor to find it cannot write")
    assert "could not write its state" in status["degraded"] or "No space left" in status["degraded"], status
    assert alive(sup["pid"], sup["start_time"]), "the supervisor must keep supervising"
    pids = {**recorded(piddir), "supervisor": (sup["pid"], sup["start_time"])}
    try:
        report = transport.call(req(state_dir, "stop", grace=1))
        assert [n for n, (pid, st) in pids.items() if alive(pid, st)] == []
        assert report["left"] == [] and report["degraded"], report
        if cg.cgroup_parent()[0] is not None:
            assert report["verified"] and report["containment"] == "cgroup"
        assert any("could not record the end of the job in state.json: No space left on device" in n
                   for n in report["notes"]), report["notes"]
        assert "Traceback" not in (folder / "supervisor.log").read_text(errors="replace")
        # Followed now, the node ends at once, lost, saying why (the monitor started for it cannot record it either)
        ended: list[dict[str, Any]] = []
        reader = threading.Thread(target=lambda: ended.extend(transport.stream(req(state_dir, "follow", logs=False))),
                                  daemon=True)
        reader.start()
        reader.join(timeout=30)
        assert not reader.is_alive(), "the follow of a node whose end cannot be recorded never ended"
        assert ended[-1]["t"] == "end" and ended[-1]["state"]["state"] == "lost", ended[-1]
        assert "their end could not be recorded: " in ended[-1]["state"]["error"], ended[-1]
    finally:
        for pid, _ in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        filler.unlink()


@pytest.fixture
def login_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path, str]]:
    """A fake logind layout: a cgroup named like an SSH login's session scope, an interpreter that
    puts itself there before it runs the agent, and a `loginctl` whose answer the test writes."""
    from clusterrun.agent import cgroup as cg

    parent, why = cg.cgroup_parent()
    if parent is None or os.geteuid() != 0:
        unavailable(f"needs root and cgroup2 to make the session's cgroup: {why}")
    top = os.path.join(parent, f"crtest-{os.getpid()}")
    scope = os.path.join(top, "user.slice", "user-0.slice", "session-7.scope")
    os.makedirs(scope)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(f"#!/bin/sh\necho $$ > {scope}/cgroup.procs && exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    answer = tmp_path / "loginctl.out"
    loginctl = bin_dir / "loginctl"
    loginctl.write_text(f"#!/bin/sh\ncat {answer}\n")
    loginctl.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # no systemd user manager to start the job in
    try:
        yield str(python), answer, scope
    finally:
        with open(os.path.join(scope, "cgroup.kill"), "w") as f:  # "logout": what logind does to the scope
            f.write("1")
        cg.cg_wait_empty(top, time.monotonic() + 10)
        for folder in sorted((f for f, _, _ in os.walk(top)), key=len, reverse=True):
            os.rmdir(folder)


@pytest.mark.parametrize("kill_user_processes", ["yes", "no"])
def test_logind_that_kills_at_logout_refuses_the_start_without_a_cgroup(
        login_session: tuple[str, Path, str], kill_user_processes: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    python, answer, _ = login_session
    answer.write_text(f"KillUserProcesses={kill_user_processes}\nKillOnlyUsers=\nKillExcludeUsers=\n")
    monkeypatch.setenv("CLUSTERRUN_NO_CGROUP", "1")  # as a user whose cgroup is not delegated
    transport = LocalTransport(HostSpec(host="here", transport="local", python=python))
    state_dir = tmp_path / "state"
    request = req(state_dir, "start", argv=[sys.executable, "-c", "import time; time.sleep(600)"], env={},
                  cwd=str(tmp_path))
    probe = transport.call({"op": "probe", "state_dir": str(state_dir)})
    if kill_user_processes == "no":
        assert not [f for f in probe["fallbacks"] if "logind" in f]
        transport.call(request)
        transport.call(req(state_dir, "stop", grace=1))
        return
    assert [f for f in probe["fallbacks"] if "KillUserProcesses=yes" in f], probe
    from clusterrun.core.errors import AgentError

    with pytest.raises(AgentError, match=r"logind kills every process of this login session "
                                         r"\(/crtest-\d+/user.slice/user-0.slice/session-7.scope\).*nothing was "
                                         r"started. Fix: `loginctl enable-linger root`.*KillExcludeUsers=root"):
        transport.call(request)
    assert transport.call(req(state_dir, "status"))["state"] == {"state": "absent"}


def test_one_agent_asks_logind_once(login_session: tuple[str, Path, str], tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe, the preflight's inspect and the start each need logind's settings; `loginctl` (a
    process on every real host) runs once per agent."""
    python, answer, _ = login_session
    answer.write_text("KillUserProcesses=no\nKillOnlyUsers=\nKillExcludeUsers=\n")
    calls = tmp_path / "loginctl.calls"
    loginctl = Path(python).parent / "loginctl"
    loginctl.write_text(f"#!/bin/sh\necho called >> {calls}\ncat {answer}\n")
    monkeypatch.setenv("CLUSTERRUN_NO_CGROUP", "1")  # as a user whose cgroup is not delegated
    transport = LocalTransport(HostSpec(host="here", transport="local", python=python))
    state_dir = tmp_path / "state"
    session = transport.session()
    try:
        session.call({"op": "probe", "state_dir": str(state_dir)})
        session.call({"op": "inspect", "cwd": str(tmp_path), "paths": ["."], "state_dir": str(state_dir)})
        session.call(req(state_dir, "start", argv=[sys.executable, "-c", "import time; time.sleep(600)"], env={},
                         cwd=str(tmp_path)))
    finally:
        session.close()
        transport.call(req(state_dir, "stop", grace=1))
    assert calls.read_text() == "called\n"


def test_as_root_the_job_leaves_the_login_session_and_outlives_it(login_session: tuple[str, Path, str],
                                                                   tmp_path: Path) -> None:
    """With KillUserProcesses=yes and root: the attempt's cgroup is outside the session's scope,
    so killing the scope (a logout) leaves the job running."""
    python, answer, scope = login_session
    answer.write_text("KillUserProcesses=yes\nKillOnlyUsers=\nKillExcludeUsers=\n")
    transport = LocalTransport(HostSpec(host="here", transport="local", python=python))
    state_dir = tmp_path / "state"
    started = transport.call(req(state_dir, "start", argv=[sys.executable, "-c", "import time; time.sleep(600)"],
                                 env={}, cwd=str(tmp_path)))
    sup, tr = started["state"]["survivor"], started["state"]["torchrun"]
    try:
        with open(os.path.join(scope, "cgroup.kill"), "w") as f:
            f.write("1")
        from clusterrun.agent import cgroup as cg

        assert cg.cg_wait_empty(scope, time.monotonic() + 10)
        assert alive(sup["pid"], sup["start_time"]) and alive(tr["pid"], tr["start_time"])
    finally:
        report = transport.call(req(state_dir, "stop", grace=1))
    assert report["verified"]


USER_PYTHON = "/usr/bin/python3"  # an interpreter every user may run (this one may live in /root)


@pytest.fixture
def delegated(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str, Path]]:
    """A cgroup delegated to the unprivileged user ``nobody`` (chowned as systemd's Delegate=yes
    does: the directory, cgroup.procs, cgroup.subtree_control, cgroup.threads), an interpreter
    wrapper that enters it and drops to that user, and a folder that user may write."""
    import shutil
    import tempfile

    from clusterrun.agent import cgroup as cg

    parent, why = cg.cgroup_parent()
    if parent is None or os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(USER_PYTHON):
        unavailable(f"needs root, setpriv, {USER_PYTHON} and cgroup2: {why}")
    uid, gid = 65534, 65534
    top = os.path.join(parent, f"crtest-{os.getpid()}")
    cgroup = os.path.join(top, "user.slice", "user-65534.slice", "app.slice", "delegated.scope")
    os.makedirs(cgroup)
    for name in ("", "cgroup.procs", "cgroup.subtree_control", "cgroup.threads"):
        os.chown(os.path.join(cgroup, name), uid, gid)
    folder = Path(tempfile.mkdtemp(prefix="crtest-user-"))
    folder.chmod(0o755)
    os.chown(folder, uid, gid)
    wrapper = folder / "python"
    wrapper.write_text(f"#!/bin/sh\necho $$ > {cgroup}/cgroup.procs && exec setpriv --reuid={uid} --regid={gid} "
                       f"--clear-groups {USER_PYTHON} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("HOME", str(folder))
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder / "cache"))  # the agent's, which the user must own
    try:
        yield str(wrapper), cgroup, folder
    finally:
        remove_cgroup_tree(top)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("kind", ["escape", "storm"])
def test_an_unprivileged_user_with_a_delegated_cgroup_gets_a_verified_stop(
        delegated: tuple[str, str, Path], kind: str, readable_code: Path) -> None:
    python, cgroup, folder = delegated
    transport = LocalTransport(HostSpec(host="here", transport="local", python=python))
    state_dir, piddir = folder / "state", folder / "pids"
    probe = transport.call({"op": "probe", "state_dir": str(state_dir)})
    assert probe["containment"] == "cgroup", probe
    os.mkdir(piddir)
    os.chown(piddir, 65534, 65534)
    argv = [USER_PYTHON, str(readable_code / "tests" / "_support" / "hostile_child.py"), kind, str(piddir), "wait"]
    answer = transport.call(req(state_dir, "start", argv=argv, env={}, cwd=str(folder)))
    attempt = answer["state"]["cgroup"]
    assert os.path.dirname(attempt) == cgroup, answer  # below the user's own cgroup
    sup = answer["state"]["survivor"]
    os.kill(sup["pid"], signal.SIGKILL)
    wait_for(lambda: not alive(sup["pid"], sup["start_time"]), 10, what="the supervisor to die")
    (piddir / "go").touch()
    wait_for(lambda: (piddir / "ready").exists(), 60, what="the hostile processes")
    pids = recorded(piddir)
    assert all(Path(f"/proc/{pid}").stat().st_uid == 65534 for pid, _ in pids.values())
    report = transport.call(req(state_dir, "stop", grace=1))
    assert (report["containment"], report["verified"], report["left"]) == ("cgroup", True, []), report
    assert [n for n, (pid, st) in pids.items() if alive(pid, st)] == []
    assert not os.path.exists(attempt)


def test_an_unprivileged_user_without_delegation_or_linger_is_swept(delegated: tuple[str, str, Path]) -> None:
    """Not delegated (owned by root), or inside a user manager without linger (it stops at the
    last logout, and the job with it): no cgroup, and the probe says why."""
    python, cgroup, folder = delegated
    transport = LocalTransport(HostSpec(host="here", transport="local", python=python))
    manager = os.path.join(os.path.dirname(os.path.dirname(cgroup)), "user@65534.service")
    os.mkdir(manager)
    os.chown(manager, 65534, 65534)
    os.chown(os.path.join(manager, "cgroup.procs"), 65534, 65534)
    os.chown(os.path.join(cgroup, "cgroup.procs"), 0, 0)
    probe = transport.call({"op": "probe", "state_dir": str(folder / "state")})
    assert probe["containment"] == "sweep"
    assert any(f"cgroup {cgroup} is not delegated to uid 65534" in f for f in probe["fallbacks"]), probe
    wrapper = Path(python)
    wrapper.write_text(wrapper.read_text().replace(cgroup, manager))
    probe = transport.call({"op": "probe", "state_dir": str(folder / "state")})
    assert probe["containment"] == "sweep"
    assert any("user manager, which stops at your last logout" in f and "loginctl enable-linger" in f
               for f in probe["fallbacks"]), probe


@pytest.fixture
def user_session(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A fake logind and systemd for the user ``nobody``: an SSH login's session scope (root's),
    a user manager's scope delegated to them, a `loginctl` that answers KillUserProcesses=yes and
    Linger as the test says, a `systemd-run` that enters that scope, and XDG_RUNTIME_DIR with the
    manager's socket. The interpreter wrapper enters the session and drops to ``nobody``."""
    import shutil
    import tempfile

    from clusterrun.agent import cgroup as cg

    parent, why = cg.cgroup_parent()
    if parent is None or os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(USER_PYTHON):
        unavailable(f"needs root, setpriv, {USER_PYTHON} and cgroup2: {why}")
    top = os.path.join(parent, f"crtest-{os.getpid()}")
    user = os.path.join(top, "user.slice", "user-65534.slice")
    session = os.path.join(user, "session-7.scope")
    scope = os.path.join(user, "user@65534.service", "app.slice", "run-r1.scope")
    os.makedirs(session)
    os.makedirs(scope)
    # Delegate=yes hands the scope to the user; the fake systemd-run needs the slice too, to move in
    for path in (scope, os.path.join(scope, "cgroup.procs"), os.path.join(scope, "cgroup.subtree_control"),
                 os.path.join(user, "cgroup.procs")):
        os.chown(path, 65534, 65534)
    folder = Path(tempfile.mkdtemp(prefix="crtest-user-"))
    folder.chmod(0o755)
    os.chown(folder, 65534, 65534)
    (folder / "run" / "systemd").mkdir(parents=True)
    (folder / "run" / "systemd" / "private").touch()
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    scripts = {
        "python": f"echo $$ > {session}/cgroup.procs && exec setpriv --reuid=65534 --regid=65534 --clear-groups "
                  f"{USER_PYTHON} \"$@\"",
        "loginctl": f"case \"$1\" in show-user) cat {folder}/linger;; "
                    "*) printf 'KillUserProcesses=yes\\nKillExcludeUsers=root\\n';; esac",
        "systemd-run": f"echo \"$@\" > {folder}/systemd-run.args\n"
                       "while [ \"$1\" != -- ]; do shift; done; shift\n"
                       f"echo $$ > {scope}/cgroup.procs && exec \"$@\"",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{text}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder / "run"))
    monkeypatch.setenv("HOME", str(folder))
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder / "cache"))  # the agent's, which the user must own
    try:
        yield {"python": str(bin_dir / "python"), "session": session, "scope": scope, "folder": folder}
    finally:
        remove_cgroup_tree(top)
        shutil.rmtree(folder, ignore_errors=True)


def test_logind_with_linger_starts_the_job_in_a_user_scope_that_outlives_the_session(
        user_session: dict[str, Any], readable_code: Path) -> None:
    folder: Path = user_session["folder"]
    (folder / "linger").write_text("Linger=yes\n")
    transport = LocalTransport(HostSpec(host="here", transport="local", python=user_session["python"]))
    state_dir, piddir = folder / "state", folder / "pids"
    probe = transport.call({"op": "probe", "state_dir": str(state_dir)})
    assert any("jobs start in a scope of your systemd user manager" in f for f in probe["fallbacks"]), probe
    os.mkdir(piddir)
    os.chown(piddir, 65534, 65534)
    argv = [USER_PYTHON, str(readable_code / "tests" / "_support" / "hostile_child.py"), "escape", str(piddir)]
    answer = transport.call(req(state_dir, "start", argv=argv, env={}, cwd=str(folder)))
    args = (folder / "systemd-run.args").read_text()
    assert args.startswith(f"--user --scope --quiet --collect -p Delegate=yes --unit=clusterrun-{JOB}-n0-a1-")
    cgroup = answer["state"]["cgroup"]
    assert os.path.dirname(cgroup) == user_session["scope"], answer  # its own cgroup, in the user's scope
    sup, tr = answer["state"]["survivor"], answer["state"]["torchrun"]
    wait_for(lambda: (piddir / "ready").exists(), 60, what="the hostile processes")
    pids = {**recorded(piddir), "supervisor": (sup["pid"], sup["start_time"]),
            "torchrun": (tr["pid"], tr["start_time"])}
    with open(os.path.join(user_session["session"], "cgroup.kill"), "w") as f:  # the logout
        f.write("1")
    from clusterrun.agent import cgroup as cg

    assert cg.cg_wait_empty(user_session["session"], time.monotonic() + 10)
    assert [n for n, (pid, st) in pids.items() if not alive(pid, st)] == []  # all outlived the session
    report = transport.call(req(state_dir, "stop", grace=1))
    assert (report["containment"], report["verified"], report["left"]) == ("cgroup", True, []), report
    assert [n for n, (pid, st) in pids.items() if alive(pid, st)] == []


def test_logind_without_linger_refuses_the_start_and_names_enable_linger(user_session: dict[str, Any]) -> None:
    from clusterrun.core.errors import AgentError

    folder: Path = user_session["folder"]
    (folder / "linger").write_text("Linger=no\n")
    transport = LocalTransport(HostSpec(host="here", transport="local", python=user_session["python"]))
    with pytest.raises(AgentError, match=r"KillUserProcesses=yes.*no systemd user manager with linger.*nothing "
                                         r"was started. Fix: `loginctl enable-linger nobody` \(keeps your systemd"):
        transport.call(req(folder / "state", "start", argv=["true"], env={}, cwd=str(folder)))
    assert not (folder / "systemd-run.args").exists()


def test_the_cgroup_of_a_survivor_killed_is_removed_once_empty(tmp_path: Path) -> None:
    """The monitor removes the cgroup at the end, also when the survivor was killed (torchrun's
    exit status is then unknown); the next status or stop would, once nothing is left in it."""
    transport = LocalTransport(HostSpec(host="here", transport="local"))
    state_dir, flag = tmp_path / "state", tmp_path / "go"
    code = f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.02)\n"
    answer = transport.call(req(state_dir, "start", argv=[sys.executable, "-c", code], env={}, cwd=str(tmp_path)))
    cgroup, sup, tr = answer["state"]["cgroup"], answer["state"]["survivor"], answer["state"]["torchrun"]
    if cgroup is None:
        unavailable("no cgroup here")
    os.kill(sup["pid"], signal.SIGKILL)
    wait_for(lambda: not alive(sup["pid"], sup["start_time"]), 10, what="the survivor to die")
    assert transport.call(req(state_dir, "status"))["state"]["state"] == "running"
    assert os.path.isdir(cgroup)  # torchrun still runs in it
    flag.touch()
    wait_for(lambda: not alive(tr["pid"], tr["start_time"]), 10, what="the job to end")
    final = wait_for(lambda: (s := transport.call(req(state_dir, "status")))["state"]["state"] == "exited" and s,
                     30, what="the monitor's final state")
    assert (final["state"]["exit_status"], final["state"]["exit_code"]) == ("unknown", None)
    assert not os.path.exists(cgroup)


def remove_cgroup_tree(top: str) -> None:
    """Kill what runs in the cgroup tree at ``top`` and remove it, deepest first."""
    from clusterrun.agent import cgroup as cg

    with open(os.path.join(top, "cgroup.kill"), "w") as f:
        f.write("1")
    cg.cg_wait_empty(top, time.monotonic() + 10)
    for sub in sorted((f for f, _, _ in os.walk(top)), key=len, reverse=True):
        os.rmdir(sub)


# ------------------------------------------------------------------ an unprivileged user over SSH


@dataclass
class UserHost:
    """A simulated host where every login (sshd itself) starts in ``login``, a cgroup the test made
    below the cgroup2 root, and the user ``simhosts.USER`` logs in by SSH (a transport as them)."""

    host: SimHost
    transport: Transport
    home: Path
    top: str  # the test's cgroups, as the host sees them (its cgroup2 is at /sys/fs/cgroup)
    login: str  # the login cgroup, as the host sees it
    mount: str  # this machine's cgroup2 mount, where the same cgroups are seen from here

    def here(self, cgroup: str) -> str:
        """A host's cgroup path as this machine sees it."""
        return self.mount + cgroup.removeprefix("/sys/fs/cgroup")

    def alive(self, pids: dict[str, tuple[int, int]]) -> list[str]:
        out = self.host.run(sys.executable, "-c", CHECK, *(f"{pid}:{st}" for pid, st in pids.values()))
        living = {int(p) for p in out.stdout.split()}
        return sorted(name for name, (pid, _) in pids.items() if pid in living)

    def owners(self, pids: dict[str, tuple[int, int]]) -> set[str]:
        return set(self.host.run("stat", "-c", "%u", *(f"/proc/{pid}" for pid, _ in pids.values())).stdout.split())


def user_host(layout: list[str], delegate: list[str], files: tuple[str, ...] = ()) -> Iterator[UserHost]:
    """Make the cgroups ``layout`` (paths below a top of the test's own), hand ``delegate`` to the user
    (chowned as systemd's Delegate=yes does) and the cgroup files ``files`` too, start a simulated
    host whose logins start in ``layout[0]``, and yield it; remove everything after."""
    import shutil

    from clusterrun.agent import cgroup as cg
    from tests.simhosts import USER, USER_ID

    mount = cg.cgroup2_mount()
    if namespace_problem() or mount is None or not shutil.which("setpriv") or not os.path.exists(USER_PYTHON):
        unavailable(f"needs simulated hosts, cgroup2 and {USER_PYTHON}: {namespace_problem()}")
    top = os.path.join(mount, f"crtest-ssh-{os.getpid()}")
    for path in layout:
        os.makedirs(os.path.join(top, path))
    for path in delegate:
        for name in ("", "cgroup.procs", "cgroup.subtree_control", "cgroup.threads"):
            os.chown(os.path.join(top, path, name), USER_ID, USER_ID)
    for path in files:
        os.chown(os.path.join(top, path), USER_ID, USER_ID)
    rel = os.path.relpath(os.path.join(top, layout[0]), mount)
    cluster = None
    try:
        cluster = SimCluster.start(1, isolated=True, user=True, login_cgroup=rel)
        host = cluster.hosts[0]
        home = cluster.dir / host.name / USER
        spec = HostSpec(host=host.name, user=USER, python=str(home / "bin" / "python"))
        (home / "bin").mkdir()
        (home / "run" / "systemd").mkdir(parents=True)
        write_script(home / "bin" / "python", f'PATH="$HOME/bin:$PATH" XDG_RUNTIME_DIR="$HOME/run" '
                                              f'exec {USER_PYTHON} "$@"')
        yield UserHost(host, transport_for(spec, ssh_config=str(cluster.ssh_config)), home,
                       f"/sys/fs/cgroup/{os.path.relpath(top, mount)}", f"/sys/fs/cgroup/{rel}", mount)
    finally:
        if cluster is not None:
            cluster.close()
        remove_cgroup_tree(top)


def write_script(path: Path, text: str) -> None:
    path.write_text(f"#!/bin/sh\n{text}\n")
    path.chmod(0o755)


@pytest.fixture
def ssh_delegated() -> Iterator[UserHost]:
    scope = "user.slice/user-64123.slice/app.slice/delegated.scope"
    yield from user_host([scope], [scope])


@pytest.fixture
def ssh_undelegated() -> Iterator[UserHost]:
    yield from user_host(["user.slice/user-64123.slice/session-3.scope"], [])  # a login session's: root's


@pytest.mark.parametrize("kind", ["escape", "storm"])
def test_an_unprivileged_user_over_ssh_with_a_delegated_cgroup_gets_a_verified_stop(
        ssh_delegated: UserHost, kind: str, readable_code: Path) -> None:
    where = ssh_delegated
    state_dir, piddir = where.home / "state", where.home / "pids"
    probe = where.transport.call({"op": "probe", "state_dir": str(state_dir)})
    assert probe["containment"] == "cgroup", probe
    piddir.mkdir()
    os.chown(piddir, 64123, 64123)
    argv = [USER_PYTHON, str(readable_code / "tests" / "_support" / "hostile_child.py"), kind, str(piddir), "wait"]
    answer = where.transport.call(req(state_dir, "start", argv=argv, env={}, cwd=str(where.home)))
    attempt = answer["state"]["cgroup"]
    assert os.path.dirname(attempt) == where.login, answer  # below the user's own (delegated) cgroup
    sup = answer["state"]["survivor"]
    where.host.run("kill", "-9", str(sup["pid"]))
    wait_for(lambda: not where.alive({"supervisor": (sup["pid"], sup["start_time"])}), 10, what="the supervisor to die")
    (piddir / "go").touch()
    wait_for(lambda: (piddir / "ready").exists(), 60, what="the hostile processes")
    pids = recorded(piddir)
    assert where.owners(pids) == {"64123"}
    report = where.transport.call(req(state_dir, "stop", grace=1))
    assert (report["containment"], report["verified"], report["left"]) == ("cgroup", True, []), report
    assert where.alive(pids) == []
    assert not os.path.exists(where.here(attempt))


def test_an_unprivileged_user_over_ssh_without_delegation_is_swept_and_told_why(ssh_undelegated: UserHost) -> None:
    where = ssh_undelegated
    probe = where.transport.call({"op": "probe", "state_dir": str(where.home / "state")})
    assert probe["containment"] == "sweep", probe
    assert any(f"cgroup {where.login} is not delegated to uid 64123" in f for f in probe["fallbacks"]), probe


@pytest.fixture
def ssh_logind() -> Iterator[tuple[UserHost, str]]:
    """An SSH login of the user in a session scope of a fake logind that kills the session at logout
    (KillUserProcesses=yes), with a systemd user manager whose scope is delegated to them, and a
    fake `loginctl` (linger as the test writes it) and `systemd-run` (enters that scope)."""
    user = "user.slice/user-64123.slice"
    session, scope = f"{user}/session-7.scope", f"{user}/user@64123.service/app.slice/run-r1.scope"
    for where in user_host([session, scope], [scope], files=(f"{user}/cgroup.procs",)):
        bin_dir = where.home / "bin"
        write_script(bin_dir / "loginctl", f"case \"$1\" in show-user) cat {where.home}/linger;; "
                                           "*) printf 'KillUserProcesses=yes\\nKillExcludeUsers=root\\n';; esac")
        write_script(bin_dir / "systemd-run", f"echo \"$@\" > {where.home}/systemd-run.args\n"
                                              "while [ \"$1\" != -- ]; do shift; done; shift\n"
                                              f"echo $$ > {where.top}/{scope}/cgroup.procs && exec \"$@\"")
        (where.home / "run" / "systemd" / "private").touch()
        yield where, f"{where.top}/{scope}"


def logout(where: UserHost) -> None:
    """What logind does at the session's end with KillUserProcesses=yes: SIGKILL everything in the
    session's scope — except the simulated host's sshd listener (its PID 1), which stands in for
    sshd.service, outside the session on a real host."""
    for pid in Path(where.here(where.login), "cgroup.procs").read_text().split():
        try:  # sshd's processes of the closed connection may end on their own meanwhile
            status = Path(f"/proc/{pid}/status").read_text()
            nspid = next(line.split()[-1] for line in status.splitlines() if line.startswith("NSpid:"))
            if nspid != "1":
                os.kill(int(pid), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            continue
    wait_for(lambda: len(Path(where.here(where.login), "cgroup.procs").read_text().split()) <= 1, 10,
             what="the session to end")


def test_logind_over_ssh_with_linger_starts_the_job_in_a_user_scope_that_outlives_the_logout(
        ssh_logind: tuple[UserHost, str], readable_code: Path) -> None:
    where, scope = ssh_logind
    (where.home / "linger").write_text("Linger=yes\n")
    state_dir, piddir = where.home / "state", where.home / "pids"
    probe = where.transport.call({"op": "probe", "state_dir": str(state_dir)})
    assert any("jobs start in a scope of your systemd user manager" in f for f in probe["fallbacks"]), probe
    piddir.mkdir()
    os.chown(piddir, 64123, 64123)
    argv = [USER_PYTHON, str(readable_code / "tests" / "_support" / "hostile_child.py"), "escape", str(piddir)]
    answer = where.transport.call(req(state_dir, "start", argv=argv, env={}, cwd=str(where.home)))
    args = (where.home / "systemd-run.args").read_text()
    assert args.startswith(f"--user --scope --quiet --collect -p Delegate=yes --unit=clusterrun-{JOB}-n0-a1-")
    cgroup = answer["state"]["cgroup"]
    assert os.path.dirname(cgroup) == scope, answer  # its own cgroup, in the user manager's scope
    sup, tr = answer["state"]["survivor"], answer["state"]["torchrun"]
    wait_for(lambda: (piddir / "ready").exists(), 60, what="the hostile processes")
    pids = {**recorded(piddir), "supervisor": (sup["pid"], sup["start_time"]),
            "torchrun": (tr["pid"], tr["start_time"])}
    where.transport.close()  # the SSH connection ends, then logind ends the session
    logout(where)
    assert where.alive(pids) == sorted(pids)  # all outlived the session
    report = where.transport.call(req(state_dir, "stop", grace=1))  # a new login
    assert (report["containment"], report["verified"], report["left"]) == ("cgroup", True, []), report
    assert where.alive(pids) == []


def test_logind_over_ssh_without_linger_refuses_the_start_and_names_enable_linger(
        ssh_logind: tuple[UserHost, str]) -> None:
    from clusterrun.core.errors import AgentError

    where, _ = ssh_logind
    (where.home / "linger").write_text("Linger=no\n")
    with pytest.raises(AgentError, match=r"KillUserProcesses=yes.*no systemd user manager with linger.*nothing "
                                         r"was started. Fix: `loginctl enable-linger crtest`"):
        where.transport.call(req(where.home / "state", "start", argv=["true"], env={}, cwd=str(where.home)))
    assert not (where.home / "systemd-run.args").exists()
