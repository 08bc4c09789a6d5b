"""The node agent driven through the local transport, with plain processes instead of torchrun.

The supervisor runs whatever argv it is given, so these tests exercise detaching, logging,
following and the verified stop quickly, without torch.
"""

from __future__ import annotations

import importlib.util
import os
import random
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterrun.config.hostsfile import HostSpec
from clusterrun.core.errors import AgentError
from clusterrun.transports.local import LocalTransport
from tests.conftest import alive, start_time, unique_job, wait_for

pytestmark = pytest.mark.integration

TRANSPORT = LocalTransport(HostSpec(host="here", transport="local"))
JOB = "job-1"  # each test's own (_own_job): the agent names machine-wide cgroups after it


@pytest.fixture(autouse=True)
def _own_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(globals(), "JOB", unique_job("job"))


def req(state_dir: Path, op: str, job: str | None = None, node: int = 0, **extra: object) -> dict:
    job = JOB if job is None else job
    return {"op": op, "job": job, "node": node, "attempt": 1, "state_dir": str(state_dir), **extra}


def start(state_dir: Path, code: str, job: str | None = None, node: int = 0, env: dict | None = None) -> dict:
    return TRANSPORT.call(req(state_dir, "start", job, node, argv=[sys.executable, "-c", code],
                              env=env or {}, cwd=str(state_dir.parent)))


def follow(state_dir: Path, offset: int = 0, job: str | None = None) -> list[dict]:
    return list(TRANSPORT.stream(req(state_dir, "follow", job, offset=offset)))


# Writes its output in three parts, each once the test has seen the one before it streamed.
WRITER = r"""
import os, sys, time
out = sys.stdout.buffer
def after(flag):
    while not os.path.exists(flag): time.sleep(0.01)
out.write(b"first line\npart"); out.flush(); after("go1")
out.write(b"ial\n\xff\xfe not utf-8\n"); out.flush(); after("go2")
out.write(b"unterminated tail"); out.flush()
"""


def test_follow_holds_back_partial_lines_and_resumes_exactly(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    start(state_dir, WRITER)
    messages = []
    parts = [b"first line\n", b"partial\n\xff\xfe not utf-8\n", b"unterminated tail"]
    for message in TRANSPORT.stream(req(state_dir, "follow", offset=0)):
        messages.append(message)
        if message["t"] == "log":  # a partial line stays back until the job completes it
            seen = sum(m["t"] == "log" for m in messages)
            assert message["data"] == parts[seen - 1]
            (tmp_path / f"go{seen}").touch()
    logs = [m for m in messages if m["t"] == "log"]
    assert messages[-1]["t"] == "end" and messages[-1]["state"]["exit_code"] == 0
    # every chunk but the last ends at a line boundary; the final read brings the partial line
    assert all(m["data"].endswith(b"\n") for m in logs[:-1])
    assert logs[-1]["data"].endswith(b"unterminated tail")
    data = b"".join(m["data"] for m in logs)
    log_file = next(state_dir.glob(f"jobs/{JOB}/node0/attempt1/output.log"))
    assert data == log_file.read_bytes() == b"first line\npartial\n\xff\xfe not utf-8\nunterminated tail"
    # resuming from any offset the agent handed out gives exactly the rest: nothing lost or repeated
    for m in logs:
        rest = follow(state_dir, offset=m["next"])
        tail = b"".join(x["data"] for x in rest if x["t"] == "log")
        assert tail == data[m["next"]:]


def test_state_is_private_whatever_the_umask(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    old = os.umask(0o022)
    try:
        answer = start(state_dir, "print('hi')")
    finally:
        os.umask(old)
    follow(state_dir)
    folder = Path(answer["dir"])
    assert {f.name for f in folder.iterdir()} >= {"spec.json", "state.json", "output.log", "supervisor.log"}
    everything = [state_dir, *state_dir.rglob("*")]
    assert folder in everything and state_dir / "jobs" / JOB in everything
    for p in everything:
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p


STUBBORN = r"""
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import os,time; os.setsid(); time.sleep(600)"])
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env={})
if os.fork() == 0:
    if os.fork() == 0:
        time.sleep(600)
    os._exit(0)
print("ready", flush=True)
time.sleep(600)
"""


def _job_tree(root_pid: int) -> set[int]:
    """Live pids whose ancestry reaches ``root_pid`` (the survivor): computed independently."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(name)] = int(fields[1])
    found = set()
    for pid in parents:
        p = pid
        while p in parents and p > 1:
            p = parents[p]
            if p == root_pid:
                found.add(pid)
                break
    return found


def test_stop_kills_the_whole_job_and_verifies(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    answer = start(state_dir, STUBBORN)
    sup = answer["state"]["survivor"]["pid"]  # torchrun's parent and the subreaper of what it leaves
    log = Path(answer["dir"]) / "output.log"
    wait_for(lambda: b"ready" in log.read_bytes(), timeout=20, what="ready")
    monitor = answer["state"]["supervisor"]["pid"]  # not the job's: it is the survivor's child, in its session
    members = wait_for(lambda: t if len(t := _job_tree(sup) - {monitor}) == 4 else None, timeout=10, what="children")
    pinned = {pid: start_time(pid) for pid in members}
    report = TRANSPORT.call(req(state_dir, "stop", grace=1, by="down"))
    assert report["left"] == []
    killed = {k["pid"] for k in report["killed"]}
    assert set(pinned) <= killed
    assert [pid for pid, st in pinned.items() if st is not None and alive(pid, st)] == []
    assert report["state"]["state"] == "exited" and report["state"]["stop_requested"] is True
    assert report["state"]["stopped_by"] == "down"  # what a viewer, which did not stop it, says
    stop_at = report["state"]["stop_at"]  # when the stop reached the host: what it killed ended after
    assert stop_at == (Path(answer["dir"]) / "stop").stat().st_mtime
    assert all(w["died"] >= stop_at for w in report["state"]["workers"]), (stop_at, report["state"]["workers"])
    # idempotent: a second stop finds nothing to do
    again = TRANSPORT.call(req(state_dir, "stop", grace=1))
    assert again["killed"] == [] and again["left"] == []


def test_follow_sends_the_degraded_reason_written_after_the_marker_was_seen_empty(tmp_path: Path) -> None:
    """A ``degraded`` marker is created, then its reason written; a follow that looked between the
    two sent a reason that says less, and the real one never (it compared the marker's existence)."""
    state_dir = tmp_path / "state"
    answer = start(state_dir, "import time; time.sleep(600)")
    marker = Path(answer["dir"]) / "degraded"
    reason = "cannot write state.json: No space left on device (a test)"
    sent: list[str | None] = []
    stream = TRANSPORT.stream(req(state_dir, "follow", logs=False))
    try:
        for message in stream:
            if message["t"] == "state":
                sent.append(message["state"].get("degraded"))
                if len(sent) == 1:
                    marker.touch()  # created, its reason not written yet: as between open() and write()
                elif sent[-1] == reason:
                    break
                elif sent[-1] is not None:  # the empty marker seen: now its reason
                    marker.write_text(reason)
            elif message["t"] == "beat" and marker.exists() and marker.read_text():  # idle 5 s with the reason written
                break
    finally:
        stream.close()
        TRANSPORT.call(req(state_dir, "stop", grace=1))
    assert sent[0] is None and "could not write its state" in str(sent[1]) and sent[-1] == reason, sent


def test_supervisor_is_detached_and_holds_nothing_of_the_agent(tmp_path: Path) -> None:
    """Forked from the agent, the supervisor must keep none of its pipes (over SSH: the channel,
    which would then never close) and be nobody's child (no zombie under a long-lived agent)."""
    state_dir = tmp_path / "state"
    answer = start(state_dir, "import time; time.sleep(30)")
    sup = answer["state"]["supervisor"]["pid"]
    def settled() -> dict[int, str] | None:
        """Its descriptors once it has read the survivor's go-ahead (EOF on a pipe it then closes)."""
        fds = {int(fd): os.readlink(f"/proc/{sup}/fd/{fd}") for fd in os.listdir(f"/proc/{sup}/fd")}
        pipes = [t for t in fds.values() if t.startswith("pipe:")]
        return fds if all(pipes.count(p) == 2 for p in pipes) else None  # only its own wake-up pipe, both ends

    try:
        fds = wait_for(settled, timeout=10, what="the monitor's descriptors: only its own wake-up pipe")
        assert fds[0] == "/dev/null", fds
        assert fds[1] == fds[2] == str(Path(answer["dir"]) / "supervisor.log"), fds
        assert not [t for t in fds.values() if t.startswith("socket:")], fds
        stat_fields = Path(f"/proc/{sup}/stat").read_text().rsplit(")", 1)[1].split()
        parent, session, tty = int(stat_fields[1]), int(stat_fields[3]), int(stat_fields[4])
        assert session != os.getsid(0) and tty == 0  # a session of its own (not leading it), no terminal
        assert parent != os.getpid()  # not the agent's parent's child either
    finally:
        TRANSPORT.call(req(state_dir, "stop", grace=1))


def test_stop_touches_only_its_own_job(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    first = start(state_dir, "import time; print('a', flush=True); time.sleep(600)", job=f"{JOB}-a")
    second = start(state_dir, "import time; print('b', flush=True); time.sleep(600)", job=f"{JOB}-b")
    other = second["state"]["torchrun"]
    TRANSPORT.call(req(state_dir, "stop", job=f"{JOB}-a", grace=1))
    assert not alive(first["state"]["torchrun"]["pid"], first["state"]["torchrun"]["start_time"])
    assert alive(other["pid"], other["start_time"])
    TRANSPORT.call(req(state_dir, "stop", job=f"{JOB}-b", grace=1))
    assert not alive(other["pid"], other["start_time"])


def test_stop_never_signals_a_reused_pid(tmp_path: Path) -> None:
    """A state file naming a pid that now belongs to an unrelated process: it must survive."""
    state_dir = tmp_path / "state"
    answer = start(state_dir, "print('done')")
    follow(state_dir)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        state_path = Path(answer["dir"]) / "state.json"
        import json

        state = json.loads(state_path.read_text())
        true_start = start_time(bystander.pid)
        assert true_start is not None
        # same pid, different start time: what a reused pid looks like
        state.update(state="running", torchrun={"pid": bystander.pid, "start_time": true_start - 1},
                     supervisor={"pid": bystander.pid, "start_time": true_start - 1})
        state_path.write_text(json.dumps(state))
        report = TRANSPORT.call(req(state_dir, "stop", grace=1))
        assert report["killed"] == []
        assert bystander.poll() is None and alive(bystander.pid, true_start)
    finally:
        bystander.kill()
        bystander.wait()


def test_start_failure_is_reported(tmp_path: Path) -> None:
    with pytest.raises(AgentError, match="could not start /nonexistent/python"):
        TRANSPORT.call(req(tmp_path / "state", "start", argv=["/nonexistent/python"], env={}, cwd=None))


def test_same_attempt_cannot_start_twice(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    start(state_dir, "print(1)")
    with pytest.raises(AgentError, match="already exists"):
        start(state_dir, "print(2)")


@pytest.mark.parametrize("job", ["../escape", "", "a/b", ".hidden"])
def test_job_ids_cannot_escape_the_state_dir(tmp_path: Path, job: str) -> None:
    with pytest.raises(AgentError, match="invalid job id"):
        TRANSPORT.call(req(tmp_path / "state", "start", job=job, argv=["true"], env={}, cwd=None))
    assert not (tmp_path / "escape").exists()


def test_probe_reports_torch_and_a_free_port(tmp_path: Path) -> None:
    import socket

    answer = TRANSPORT.call({"op": "probe", "free_port": True, "state_dir": str(tmp_path)})
    assert answer["torch"] and answer["torch"].startswith("2.")
    assert "--signals-to-handle" in answer["torchrun_flags"]
    with socket.socket() as s:
        s.bind(("", answer["port"]))  # it really is free
    assert answer["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _fake_torch(site_dir: Path, version: str) -> None:
    (site_dir / "torch" / "distributed").mkdir(parents=True)
    (site_dir / "torch" / "__init__.py").write_text("raise ImportError('the probe must not import torch')\n")
    (site_dir / "torch" / "version.py").write_text(f"__version__ = {version!r}\n")
    (site_dir / "torch" / "distributed" / "run.py").write_text("# --signals-to-handle\n")


def _probe_with(python: Path, tmp_path: Path) -> dict:
    from clusterrun.agent.codec import json_loads
    from clusterrun.transports.base import agent_bundle, agent_command, request_line

    probe = {"op": "probe", "free_port": False, "state_dir": str(tmp_path / "state")}
    proc = subprocess.run(agent_command(str(python)), input=agent_bundle().stdin(request_line(probe)),
                          capture_output=True, timeout=60, env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc
    return json_loads(proc.stdout)


@pytest.mark.parametrize("system_site", [False, True])
def test_probe_in_a_virtualenv_reports_the_environments_torch_without_running_site(
        tmp_path: Path, system_site: bool) -> None:
    """Under ``-S`` a venv's ``sys.prefix`` is the base interpreter's: the probe must look in the
    venv's site-packages (where `pip install torch` put it), not report the base's torch, and
    must not run its ``.pth`` files (an editable install's finder imports re and enum)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", *(["--system-site-packages"] * system_site),
                    str(venv)], check=True, timeout=120)
    site_dir = next(venv.glob("lib/python3*/site-packages"))
    _fake_torch(site_dir, "9.9.9+venv")
    marker = tmp_path / "pth-ran"
    (site_dir / "zz_marker.pth").write_text(f"import os; open({str(marker)!r}, 'w').close()\n")
    answer = _probe_with(venv / "bin" / "python", tmp_path)
    assert answer["torch"] == "9.9.9+venv" and answer["torchrun_flags"] == ["--signals-to-handle"]
    assert not marker.exists()


def test_probe_finds_a_torch_that_only_a_pth_file_knows(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    elsewhere = tmp_path / "elsewhere"
    _fake_torch(elsewhere, "8.8.8")
    (next(venv.glob("lib/python3*/site-packages")) / "extra.pth").write_text(f"{elsewhere}\n")
    assert _probe_with(venv / "bin" / "python", tmp_path)["torch"] == "8.8.8"


def test_rank_logs_pass_on_whole_lines_only(tmp_path: Path) -> None:
    from clusterrun.agent.ranklogs import RankLogs

    folder = tmp_path / "torchrun" / "run_x" / "attempt_0"
    (folder / "0").mkdir(parents=True)
    (folder / "1").mkdir()
    out = tmp_path / "output.log"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    logs = RankLogs(str(tmp_path / "torchrun"), fd, first_rank=4)
    try:
        (folder / "0" / "stdout.log").write_bytes(b"one\ntw")  # a print caught half-way
        (folder / "1" / "stderr.log").write_bytes(b"Traceback\n")
        logs.poll()
        assert sorted(out.read_bytes().splitlines()) == [b"[rank4]:one", b"[rank5]:Traceback"]
        with open(folder / "0" / "stdout.log", "ab") as f:
            f.write(b"o\nthree")
        logs.poll()
        assert out.read_bytes().splitlines()[-1] == b"[rank4]:two"
        logs.poll(final=True)  # the job is over: the unterminated rest is passed on too
        assert out.read_bytes().splitlines()[-1] == b"[rank4]:three"
    finally:
        logs.close()
        os.close(fd)


def test_atomic_writes_from_hosts_with_the_same_pids_do_not_collide(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Hosts sharing a filesystem (an NFS home, or the simulated hosts) run agents with equal pids:
    their temporary files must not share a name, or one host's rename fails."""
    import threading

    from clusterrun.agent import records

    monkeypatch.setattr(records.os, "getpid", lambda: 18)  # every writer looks like pid 18 on its own host
    target = tmp_path / "agent.py"
    errors: list[BaseException] = []

    def write(n: int) -> None:
        try:
            for _ in range(300):
                records.write_atomic(str(target), f"writer {n}\n".encode() * 1000)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    assert errors == []
    assert target.read_bytes() in {f"writer {n}\n".encode() * 1000 for n in range(4)}
    assert [p.name for p in tmp_path.iterdir()] == ["agent.py"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def _random_json(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.randint(-2**70, 2**70)
    if kind == 2:
        return rng.choice([0.0, -1.5, 1e300, 3.141592653589793, float("inf"), float("-inf")])
    if kind in (3, 4, 5):  # text as the agent sends it: log lines, undecodable bytes kept as surrogates
        alphabet = 'aZ 09"\\/\n\r\t\x00\x1f\x7fé€😀\udcff'
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
    if kind in (6, 7):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {_random_json(rng, 3) if rng.random() < 0.8 else str(rng.random()): _random_json(rng, depth + 1)
            for _ in range(rng.randrange(5))}


def test_agent_json_matches_the_json_module() -> None:
    """The agent speaks JSON through json's C parts (see codec._codec): byte for byte what json
    would write, and reads whatever json reads; the fallback is the json module itself."""
    import json

    from clusterrun.agent import codec

    rng = random.Random(5)
    for _ in range(3000):
        obj = {str(k): _random_json(rng) for k in range(rng.randrange(4))} if rng.random() < 0.5 else _random_json(rng)
        text = json.dumps(obj)
        assert codec.json_dumps(obj) == text
        try:
            assert codec.json_dumps_sorted(obj) == json.dumps(obj, sort_keys=True)
        except TypeError:  # keys of mixed types cannot be sorted: json refuses them alike
            with pytest.raises(TypeError):
                json.dumps(obj, sort_keys=True)
        assert codec.json_dumps(codec.json_loads(text)) == text
        assert codec.json_dumps(codec.json_loads(f" \n{text}\t".encode())) == text
    assert codec.json_loads('{"a": NaN}')["a"] != codec.json_loads('{"a": NaN}')["a"]
    for bad in ["", "{", '{"a": 1} x', "[1,]", "{'a': 1}", '"\x01"', "nul"]:
        with pytest.raises(ValueError):
            codec.json_loads(bad)
    with pytest.raises(TypeError, match="set is not JSON serializable"):
        codec.json_dumps({"a": {1}})


def test_agent_json_falls_back_to_the_json_module(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from clusterrun.agent import codec

    monkeypatch.setitem(sys.modules, "_json", None)  # a Python without json's C parts
    dumps, dumps_sorted, loads = codec._codec()
    assert dumps is json.dumps and loads is json.loads
    assert dumps_sorted({"b": 1, "a": 2}) == '{"a": 2, "b": 1}'


def _own_imports(importtime: str) -> set[str]:
    """The modules in ``-X importtime`` output that the agent imported itself. The agent is
    stdlib-only, so a top-level import of anything else came from ``site`` (run when torch is
    not in the site directories: a ``.pth`` file, sitecustomize); it and what it imported (listed
    before it, indented) are not the agent's."""
    import sysconfig

    stdlib = (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])
    own: set[str] = set()
    subtree: set[str] = set()
    for line in importtime.splitlines():
        if not line.startswith("import time:") or line.endswith("imported package"):
            continue
        column = line.split("|")[-1]
        name = column.strip()
        subtree.add(name)
        if len(column) - len(column.lstrip()) > 1:  # nested: decided with its top-level import
            continue
        spec = None if name.split(".")[0] == "clusterrun_agent" else importlib.util.find_spec(name)  # its parts
        origin = getattr(spec, "origin", None) or ""
        in_stdlib = origin.startswith(stdlib) and not {"site-packages", "dist-packages"} & set(Path(origin).parts)
        if spec is None or origin in ("built-in", "frozen") or in_stdlib:
            own |= subtree
        subtree = set()
    return own


def test_own_imports_leave_out_what_a_pth_file_imported() -> None:
    importtime = ("import time: self [us] | cumulative | imported package\n"
                  "import time:       100 |        100 |     re._parser\n"
                  "import time:       100 |        200 |   re\n"
                  "import time:       100 |        300 | pytest\n"
                  "import time:       100 |        100 |   _json\n"
                  "import time:       100 |        200 | json.scanner\n"
                  "import time:       100 |        100 | _signal\n")
    assert _own_imports(importtime) == {"_json", "json.scanner", "_signal"}


def test_the_agent_and_its_supervisor_import_little(tmp_path: Path) -> None:
    """Every module the agent imports is paid for on every host at every command (the figures are
    in docs/benchmarks.md)."""
    from clusterrun.transports.base import agent_bundle, agent_command, request_line

    heavy = {"re", "enum", "json", "subprocess", "socket", "typing", "glob", "random", "threading", "importlib.util",
             "contextlib", "collections"}
    argv = agent_command(sys.executable)
    argv[1:1] = ["-X", "importtime"]  # also in the forked supervisor, which logs to supervisor.log
    request = req(tmp_path / "state", "start", argv=[sys.executable, "-c", "print('ran')"], env={},
                  cwd=str(tmp_path))
    probe = {"op": "probe", "free_port": True, "state_dir": str(tmp_path / "state")}
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    first = subprocess.run(argv, input=agent_bundle().stdin(request_line(probe)), capture_output=True, timeout=60,
                           env=env)  # installs and compiles this version: once per version and interpreter
    assert b'"ok": true' in first.stdout and "zipfile" in _own_imports(first.stderr.decode()), first
    # a probe imports the parts a probe needs (serve imports a handler's module at its first request)
    alone = subprocess.run(argv, input=agent_bundle().stdin(request_line(probe)), capture_output=True, timeout=60,
                           env=env)
    parts = {name.split(".")[-1] for name in _own_imports(alone.stderr.decode()) if "clusterrun_agent." in name}
    assert "probe" in parts and not {"start", "survivor", "monitor", "follow", "syncops", "doctorops"} & parts, parts
    # what `up` asks every host: the probe, the route to the master and the preflight's TCP test, the start
    route = {"op": "route", "route_to": {"addr": "127.0.0.1", "port": 9, "peers": ["127.0.0.1"], "always_peers": True}}
    reach = {"op": "reach", "addr": "127.0.0.1", "port": 9, "token": "t", "timeout": 5}
    proc = subprocess.run(argv, input=agent_bundle().stdin(*map(request_line, (probe, route, reach, request))),
                          capture_output=True, timeout=60, env=env)
    answers = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(answers) == 4 and all(b'"ok": true' in a for a in answers), proc
    agent_modules = _own_imports(proc.stderr.decode())
    assert "_json" in agent_modules and not heavy & agent_modules, sorted(heavy & agent_modules)
    folder = tmp_path / "state" / "jobs" / JOB / "node0" / "attempt1"
    wait_for(lambda: b"ran" in (folder / "output.log").read_bytes(), 30, what="the job's output")
    wait_for(lambda: '"exited"' in (folder / "state.json").read_text(), 30, what="the end of the job")
    supervisor_modules = _own_imports((folder / "supervisor.log").read_text())
    assert supervisor_modules and not heavy & supervisor_modules, sorted(heavy & supervisor_modules)


def test_start_in_a_missing_directory_is_reported_with_the_directory(tmp_path: Path) -> None:
    with pytest.raises(AgentError, match=f"could not start {sys.executable}: .*No such file.*{tmp_path}/gone"):
        TRANSPORT.call(req(tmp_path / "state", "start", argv=[sys.executable, "-c", "pass"], env={},
                           cwd=str(tmp_path / "gone")))


def test_job_finds_its_program_on_its_own_path_and_keeps_no_descriptor(tmp_path: Path) -> None:
    """The job is run as subprocess would: argv[0] looked up on the job's PATH, a session of its
    own, stdin /dev/null, SIGPIPE back to default, and no descriptor of the supervisor."""
    state_dir = tmp_path / "state"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "mytool"
    tool.write_text("#!/bin/sh\nls -l /proc/self/fd/ | sed 1d | wc -l; readlink /proc/self/fd/0; "
                    "ps -o sid= -p $$ | tr -d ' '; echo $$; grep SigIgn /proc/self/status\n")
    tool.chmod(0o755)
    answer = TRANSPORT.call(req(state_dir, "start", argv=["mytool"], env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
                                cwd=str(tmp_path)))
    messages = follow(state_dir)
    assert messages[-1]["state"]["exit_code"] == 0
    fds, stdin, sid, pid, _, ignored = b"".join(m["data"] for m in messages if m["t"] == "log").decode().split()[:6]
    assert int(fds) == 4  # 0, 1, 2 and the one ls itself lists /proc/self/fd with
    assert stdin == "/dev/null" and sid == pid == str(answer["state"]["torchrun"]["pid"])
    assert int(ignored, 16) & (1 << (13 - 1)) == 0  # SIGPIPE (13) not ignored


def _wakeups(pid: int) -> int:
    """How often ``pid``'s threads have gone to sleep (voluntary context switches): a process
    that polls wakes on a timer, one that waits for events only when they come. Unlike its CPU
    time this does not grow when a loaded machine makes each wake-up slower."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        status = Path(f"/proc/{pid}/task/{task}/status").read_text()
        total += int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
    return total


def test_a_quiet_job_costs_its_supervisor_and_follower_no_cpu(tmp_path: Path) -> None:
    """Both sleep until inotify, a pidfd or a signal says that something happened: at most a
    few wake-ups a second (their liveness checks, every IDLE_CHECK) where polling takes 20."""
    import threading

    from clusterrun.agent import BOOTSTRAP
    from clusterrun.agent.supervisor import BUSY

    state_dir = tmp_path / "state"
    flag = tmp_path / "go"
    began = time.monotonic()
    answer = start(state_dir, "import os, time\nprint('hello', flush=True)\n"
                              f"while not os.path.exists({str(flag)!r}): time.sleep(0.05)\nprint('late', flush=True)")
    supervisor = answer["state"]["supervisor"]["pid"]
    messages: list[dict] = []
    def read() -> None:
        for message in TRANSPORT.stream(req(state_dir, "follow")):
            messages.append(message)

    follower = threading.Thread(target=read, daemon=True)
    try:
        follower.start()
        wait_for(lambda: any(b"hello" in m.get("data", b"") for m in messages), 10, what="the first line")
        agents = [int(p) for p in os.listdir("/proc") if p.isdigit() and Path(f"/proc/{p}/stat").exists()
                  and BOOTSTRAP.encode() in Path(f"/proc/{p}/cmdline").read_bytes()
                  and int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid()]
        assert len(agents) == 1, agents
        before = _wakeups(agents[0])
        time.sleep(4)  # a window measured, not a wait for something
        assert _wakeups(agents[0]) - before <= 12  # 4 here; polling every 50 ms: 80
        time.sleep(max(0.0, began + BUSY + 1 - time.monotonic()))  # torchrun would have started its workers
        before = _wakeups(supervisor)
        time.sleep(3)
        assert _wakeups(supervisor) - before <= 9  # 3 here; polling every 50 ms: 60
        flag.touch()
        follower.join(10)
        assert not follower.is_alive() and messages[-1]["t"] == "end"
        assert b"".join(m["data"] for m in messages if m["t"] == "log") == b"hello\nlate\n"
    finally:
        TRANSPORT.call(req(state_dir, "stop", grace=1))


def woken(waker: object) -> bool:
    """True if the Waker's next wait would return at once: inotify has an event for it."""
    import select

    return bool(select.select([waker.fd], [], [], 0)[0])  # type: ignore[attr-defined]


def test_rank_logs_are_watched_as_torchrun_makes_them(tmp_path: Path) -> None:
    """The supervisor's wait wakes when a per-rank file is made or written, however deep, and
    sleeps through its timeout when nothing happens."""
    from clusterrun.agent.ranklogs import RankLogs
    from clusterrun.agent.waker import Waker

    root = tmp_path / "torchrun"
    root.mkdir()
    fd = os.open(tmp_path / "output.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    waker = Waker()
    logs = RankLogs(str(root), fd, first_rank=0, waker=waker)
    try:
        assert waker.reliable
        assert logs.poll() is False
        assert not woken(waker)  # nothing happened: nothing to wake it
        (root / "run_x" / "attempt_0" / "0").mkdir(parents=True)
        wait_for(lambda: woken(waker), 10, what="inotify to report the new directory")
        waker.wait(0)
        assert not woken(waker)  # the wait drained what woke it
        (root / "run_x" / "attempt_0" / "0" / "stdout.log").write_bytes(b"one\n")  # before it is watched
        assert logs.poll() is True  # found, read, and its directories watched
        assert (tmp_path / "output.log").read_bytes() == b"[rank0]:one\n"
        waker.wait(0)  # what the write above queued
        with open(root / "run_x" / "attempt_0" / "0" / "stdout.log", "ab") as f:
            f.write(b"two\n")
        wait_for(lambda: woken(waker), 10, what="inotify to report the write")
        waker.wait(0)
        assert logs.poll() is False
        assert (tmp_path / "output.log").read_bytes() == b"[rank0]:one\n[rank0]:two\n"
    finally:
        logs.close()
        waker.close()
        os.close(fd)


def test_without_inotify_the_waits_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Python without ctypes: the supervisor is no subreaper (the marker and the recorded
    sessions still find the job's processes) and its waits poll."""
    from clusterrun.agent.survivor import set_subreaper
    from clusterrun.agent.waker import Waker

    monkeypatch.setitem(sys.modules, "ctypes", None)
    set_subreaper()  # no ImportError
    waker = Waker()
    assert not waker.reliable
    began = time.monotonic()
    assert waker.wait(0.2) == []
    assert time.monotonic() - began >= 0.2  # it slept the interval (time.sleep never returns early)


@pytest.mark.parametrize(("source", "version"), [
    ("from typing import Optional\n__version__ = '2.13.0+cpu'\ndebug = False\n", "2.13.0+cpu"),
    ('__version__: str = "2.5.1+cu121"\n', "2.5.1+cu121"),
    ("x__version__ = '1'\n__version__ = get()\n", "unknown"),
    ("__version__ = '\n", "unknown"),
])
def test_torch_version_is_read_from_its_version_file(source: str, version: str) -> None:
    from clusterrun.agent.probe import version_of

    assert version_of(source) == version


def test_a_lost_node_says_whether_its_host_restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    from clusterrun.agent import records

    monkeypatch.setattr(records, "boot_id", lambda: "boot-2")
    assert records.lost({"state": "running", "boot_id": "boot-1"}) == {
        "state": "lost", "boot_id": "boot-1",
        "error": "the host restarted since the job started (its boot id changed): the job's processes ended with it",
        "rebooted": True}
    same_boot = records.lost({"state": "running", "boot_id": "boot-2"})
    assert same_boot["error"].startswith("the job's processes on the host are gone (killed?)")
    assert same_boot["rebooted"] is False
    assert records.lost({"state": "running", "error": "could not start"})["error"] == "could not start"
