"""What the agent asks of its host without subprocess (``agent/system.py``), logind's settings
(``agent/logind.py``), the cache of agent versions (``agent/loader.py``, ``agent/cache.py``) and how the
survivor starts the job (``survivor.spawn_job``): called in this process with real commands."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from clusterrun.agent import cache, loader, logind, system
from clusterrun.agent.supervisor import _importable
from clusterrun.agent.survivor import Survivor, spawn_job


def test_which_finds_a_program_on_path_only_if_it_can_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tool").write_text("#!/bin/sh\n")
    (tmp_path / "plain").write_text("")
    (tmp_path / "tool").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert system.which("tool") == str(tmp_path / "tool") and system.which("plain") is None
    assert system.which("sh") in ("/usr/bin/sh", "/bin/sh") and system.which("no-such-program") is None


def test_capture_is_a_commands_stdout_or_none_when_it_fails_cannot_run_or_overruns(tmp_path: Path) -> None:
    assert system.capture(["sh", "-c", "echo out; echo err >&2"]) == "out\n"
    assert system.capture(["sh", "-c", "echo out; exit 3"]) is None
    assert system.capture(["/nonexistent/program"]) is None
    assert system.capture(["sh", "-c", 'echo "$X $(pwd)"'], env={"X": "given", "PATH": "/usr/bin:/bin"},
                           cwd=str(tmp_path)) == f"given {tmp_path}\n"
    started = time.monotonic()
    assert system.capture(["sleep", "30"], timeout=0.2) is None  # killed at its deadline
    assert time.monotonic() - started < 20


def test_launched_commands_run_side_by_side_and_are_collected_in_turn() -> None:
    launched = [system.launch(["sh", "-c", f"echo {i}"]) for i in range(3)]
    assert [system.collect(one) for one in launched] == ["0\n", "1\n", "2\n"]
    assert system.collect(None) is None


def test_read_until_stops_at_a_line_the_end_or_the_deadline() -> None:
    r, w = os.pipe()
    try:
        os.write(w, b"first\n")
        assert system.read_until(r, time.monotonic() + 5, line=True) == b"first\n"
        assert system.read_until(r, time.monotonic() + 0.05) == b""  # nothing more before the deadline
        os.write(w, b"the ")
        os.write(w, b"rest")
        os.close(w)
        w = -1
        assert system.read_until(r, time.monotonic() + 5) == b"the rest"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_this_python_lacks_nothing_the_supervisor_uses_and_the_user_is_named() -> None:
    if hasattr(os, "pidfd_open"):
        assert system.static_fallbacks() == []
    else:
        assert system.static_fallbacks()[0].startswith("no pidfd (Python ")
    assert system.user_name() == pwd.getpwuid(os.getuid()).pw_name


def test_linger_is_asked_of_logind_else_read_from_its_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(system, "capture", lambda argv, *a, **k: "Linger=yes\n")
    assert system.lingers()
    monkeypatch.setattr(system, "capture", lambda argv, *a, **k: "Linger=no\n")
    assert not system.lingers()
    monkeypatch.setattr(system, "capture", lambda argv, *a, **k: None)  # no loginctl
    monkeypatch.setattr(system, "user_name", lambda: "no-such-user-here")
    assert not system.lingers()


SESSION = "/user.slice/user-1000.slice/session-4.scope"


def test_logind_kills_a_login_sessions_job_only_as_its_settings_say(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logind, "own_cgroup", lambda: SESSION)
    monkeypatch.setattr(logind, "cgroup_parent", lambda: (None, "not delegated"))
    monkeypatch.setattr(logind, "user_name", lambda: "alice")
    settings = {"KillUserProcesses": "yes", "KillExcludeUsers": "root"}
    monkeypatch.setattr(logind, "_logind_settings", lambda: settings)
    problem = logind.logind_problem()
    assert problem.startswith(f"logind kills every process of this login session ({SESSION}) at logout")
    assert "`loginctl enable-linger alice`" in problem and "KillExcludeUsers=alice" in problem
    for change in ({"KillUserProcesses": "no"}, {"KillExcludeUsers": "root alice"}, {"KillOnlyUsers": "bob"}):
        settings.update(change)
        assert logind.logind_problem() == ""
        settings.update({"KillUserProcesses": "yes", "KillExcludeUsers": "root", "KillOnlyUsers": ""})
    monkeypatch.setattr(logind, "own_cgroup", lambda: "/system.slice/sshd.service")  # no login session
    assert logind.logind_problem() == ""


def test_logind_settings_come_from_loginctl_else_from_its_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logind, "capture", lambda argv, *a, **k: "KillUserProcesses=yes\nKillOnlyUsers=\n"
                                                                  "KillExcludeUsers=root admin\n")
    assert logind._ask_logind() == {"KillUserProcesses": "yes", "KillOnlyUsers": "", "KillExcludeUsers": "root admin"}
    monkeypatch.setattr(logind, "capture", lambda argv, *a, **k: None)
    read = logind._ask_logind()  # logind.conf and its drop-ins, where this machine has them
    assert read["KillExcludeUsers"] and set(read) <= {"KillUserProcesses", "KillOnlyUsers", "KillExcludeUsers"}
    monkeypatch.setattr(logind, "_SETTINGS", {})
    monkeypatch.setattr(logind, "_ask_logind", lambda: {"KillUserProcesses": "no"})
    assert logind._logind_settings() == {"KillUserProcesses": "no"}
    monkeypatch.setattr(logind, "_ask_logind", lambda: {"KillUserProcesses": "yes"})
    assert logind._logind_settings() == {"KillUserProcesses": "no"}  # asked once per agent


def test_a_user_scope_needs_a_running_user_manager_that_lingers_and_systemd_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert logind.user_scope("job", 0, 1) is None  # no user manager
    (tmp_path / "systemd").mkdir()
    (tmp_path / "systemd" / "private").touch()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "systemd-run").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "systemd-run").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setattr(logind, "lingers", lambda: False)
    assert logind.user_scope("job", 0, 1) is None
    monkeypatch.setattr(logind, "lingers", lambda: True)
    scope = logind.user_scope("job", 2, 3)
    assert scope is not None and scope[:3] == ["systemd-run", "--user", "--scope"] and scope[-1] == "--"
    assert "-p" in scope and "Delegate=yes" in scope
    assert any(arg.startswith("--unit=clusterrun-job-n2-a3-") for arg in scope)


def test_the_agents_cache_is_the_users_and_refused_when_others_could_write_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = loader.cache_dir()
    assert folder == str(tmp_path / "cache" / "clusterrun") and loader.cache_problem(folder) == ""
    os.chmod(folder, 0o777)
    assert loader.cache_problem(folder) == (f"the agent's cache {folder} is writable by others (mode 777): code "
                                            f"there would run as you. Fix: chmod 700 {folder}")
    (tmp_path / "file").write_text("")
    assert loader.cache_problem(str(tmp_path / "file" / "sub")).startswith(
        f"cannot use the agent's cache {tmp_path / 'file' / 'sub'}: ")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # cannot be made: the user's temporary one
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    assert loader.cache_dir() == str(tmp_path / "tmp" / f"clusterrun-{os.getuid()}")
    if os.geteuid() == 0:
        other = tmp_path / "other"
        other.mkdir(mode=0o700)
        os.chown(other, 65534, 65534)
        assert "belongs to uid 65534, not to you" in loader.cache_problem(str(other))


def test_a_version_is_found_intact_compiled_once_and_a_damaged_one_removed(tmp_path: Path) -> None:
    source = tmp_path / "src.zip"
    with zipfile.ZipFile(source, "w") as archive:
        archive.writestr("crtestpkg/__init__.py", "ANSWER = 42\n")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    assert loader.intact(str(source), digest) and not loader.intact(str(source), "0" * 64)
    assert not loader.intact(str(tmp_path / "missing"), digest)
    assert loader.compiled(str(tmp_path), digest) is None

    path = cache.compile_zip(str(tmp_path), digest, str(source))
    assert Path(path).name.startswith(f"agent-{digest}-{sys.implementation.cache_tag}-")
    assert loader.compiled(str(tmp_path), digest) == path
    with zipfile.ZipFile(path) as archive:
        assert archive.namelist() == ["crtestpkg/__init__.py", "crtestpkg/__init__.pyc"]
    imported = subprocess.run([sys.executable, "-S", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                               "import crtestpkg; print(crtestpkg.ANSWER, crtestpkg.__file__)", path],
                              capture_output=True, text=True, timeout=30, check=True)
    assert imported.stdout == f"42 {path}/crtestpkg/__init__.pyc\n"  # its bytecode, from the zip

    with open(path, "r+b") as f:  # damaged on disk: found by its CRC-32 and removed
        f.seek(10)
        f.write(b"\xff")
    assert loader.compiled(str(tmp_path), digest) is None and not os.path.exists(path)


def test_the_job_starts_in_a_session_of_its_own_with_its_output_in_the_log(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        pid = spawn_job(["sh", "-c", 'echo "$X"; echo "$(ps -o sid= -p $$) $$" >&2; pwd'], {"X": "given",
                         "PATH": os.environ["PATH"]}, str(tmp_path), fd)
    finally:
        os.close(fd)
    assert os.waitpid(pid, 0)[1] == 0
    given, session, where = log.read_text().splitlines()
    assert given == "given" and where == str(tmp_path)
    sid, me = session.split()
    assert sid == me == str(pid)  # a session leader: the stop finds the job's processes by their session

    for argv, cwd, missing in ((["/nonexistent/torchrun"], None, "/nonexistent/torchrun"),
                               (["true"], str(tmp_path / "gone"), str(tmp_path / "gone"))):
        with pytest.raises(FileNotFoundError) as caught:
            spawn_job(argv, dict(os.environ), cwd, 2)
        assert caught.value.filename == missing


def test_the_survivor_tells_its_agent_how_the_start_went_once_and_leaves_its_cgroup(tmp_path: Path) -> None:
    folder = tmp_path / "attempt1"
    folder.mkdir()
    with pytest.raises(SystemExit, match="no spec.json in"):
        Survivor(str(folder))
    (folder / "spec.json").write_text(json.dumps({"job": "j", "node": 0, "attempt": 1, "argv": ["true"],
                                                  "env": {}, "cgroup": None, "fallbacks": ["no cgroup: x"]}))
    ready_r, ready_w = os.pipe()
    survivor = Survivor(str(folder), ready_fd=ready_w)
    assert survivor.state["state"] == "starting" and survivor.state["survivor"]["pid"] == os.getpid()
    survivor._ready()
    survivor._ready()  # once only: the pipe is closed after the first
    try:
        said = os.read(ready_r, 1 << 16)
        assert json.loads(said) == survivor.state and os.read(ready_r, 10) == b""
    finally:
        os.close(ready_r)
    survivor._leave_cgroup()  # none: nothing to do
    assert survivor.save() and json.loads((folder / "state.json").read_text())["fallbacks"] == ["no cgroup: x"]


def test_the_supervisor_in_a_user_scope_imports_the_agent_from_where_it_runs() -> None:
    root, package = _importable()
    assert package == "clusterrun.agent" and Path(root, "clusterrun", "agent", "supervisor.py").exists()
