"""Shared fixtures: hosts files for local nodes, running `clusterrun up`, checking processes."""

from __future__ import annotations

import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from click.testing import CliRunner

from tests.leaks import Snapshot, agents_left, end, report
from tests.simhosts import sim_cluster  # noqa: F401 - the simulated machines, for every test module
from tests.slurmsim import slurm_cluster, slurm_gpu_cluster  # noqa: F401 - a real Slurm on them (test_slurm_cluster)

if TYPE_CHECKING:
    from tests.agenthost import Attempt, Processes

# The tests keep their compiled code (pytest's rewritten test modules and the package's bytecode, in
# the __pycache__ folders git ignores) even where PYTHONDONTWRITEBYTECODE is set, as on the project's
# machines: else each xdist worker parses, rewrites and compiles ~50,000 lines again on every run
# (10 s of the fast tier's collection, against 1.4 s), and every command a test starts (they read
# the bytecode the tests wrote) compiles the package again.
sys.dont_write_bytecode = False

# A suite started in the background by a non-interactive shell (`nohup pytest ... &`) inherits SIGINT
# ignored, and so would every command the tests start: Python then never raises KeyboardInterrupt,
# and the tests of Ctrl-C would wait for a host's ConnectTimeout. A handler here is reset to the
# default in the commands (exec keeps only an ignored signal ignored).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parent.parent
SUPPORT = ROOT / "tests" / "_support"


# The interpreter write_hosts and test_ssh.ssh_hosts give the hosts when the test names none: the
# fake_python fixture's in a test marked fake_torchrun (set in the environment: pytest imports this
# file as `conftest` and the tests as `tests.conftest`, two modules), else this one.
HOSTS_PYTHON = "CRTEST_HOSTS_PYTHON"


def hosts_python() -> str:
    return os.environ.get(HOSTS_PYTHON) or sys.executable


def write_hosts(folder: Path, nprocs: Sequence[int], state_dir: Path, extra: str = "",
                python: Path | str | None = None) -> Path:
    """A hosts file with one local node per entry of ``nprocs`` (their interpreter ``python``, if given)."""
    python = python or os.environ.get(HOSTS_PYTHON)
    lines = [f"state_dir: {state_dir}", "defaults:", "  transport: local",
             *([f"  python: {python}"] if python else []), "hosts:"]
    for i, n in enumerate(nprocs):
        lines += [f"  - host: local-{chr(ord('a') + i)}", f"    nproc: {n}"]
    path = folder / "hosts.yaml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def up_argv(*args: str | os.PathLike[str]) -> list[str]:
    return [sys.executable, "-m", "clusterrun", "up", "--no-tui", *map(str, args)]


def run_up(*args: str | os.PathLike[str], timeout: float = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(up_argv(*args), capture_output=True, text=True, timeout=timeout, cwd=cwd)


def job_id_of(stderr: str) -> str:
    found = re.search(r"clusterrun: job (\S+): \d+ nodes", stderr)
    assert found, f"no job id in:\n{stderr}"
    return found.group(1)


def unique_job(stem: str) -> str:
    """A job id no other test uses now: the agent names cgroups after jobs, machine-wide, so tests that
    run at once (pytest-xdist's workers, another run on this machine) must not share one. The pid tells
    concurrent processes apart; the random part, the tests of one process."""
    return f"{stem}-{os.getpid()}-{os.urandom(3).hex()}"


def start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int, started: int) -> bool:
    """True if the process that started at ``started`` still exists (zombies count as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] != "Z" and int(fields[19]) == started


def marked(job_id: str) -> list[int]:
    """Pids of live processes carrying the job's marker (CLUSTERRUN_JOB=<job>.<node>.<attempt>), any attempt."""
    found = []
    needle = f"CLUSTERRUN_JOB={job_id}.".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(item.startswith(needle) for item in env.split(b"\0")):
            found.append(int(name))
    return found


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "state"
    yield path
    # Leave nothing behind even when a test failed half-way: stop every job this test started.
    stop_all_jobs(path)


def stop_all_jobs(path: Path) -> None:
    """Stop every node attempt recorded under the state dir ``path`` with the agent's stop."""
    from clusterrun.config.hostsfile import HostSpec
    from clusterrun.transports.local import LocalTransport

    transport = LocalTransport(HostSpec(host="cleanup", transport="local"))
    for state in sorted(path.glob("jobs/*/node*/attempt*/state.json")):
        folder = state.parent
        request = {"op": "stop", "job": folder.parent.parent.name, "node": int(folder.parent.name[4:]),
                   "attempt": int(folder.name[7:]), "state_dir": str(path), "grace": 1}
        transport.call(request)


@pytest.fixture
def procs() -> Iterator[Processes]:
    """Children a test starts (``tests/agenthost.py``); those still running at its end are killed and reaped."""
    from tests.agenthost import Processes

    started = Processes()
    yield started
    started.close()


@pytest.fixture
def attempt(tmp_path: Path) -> Attempt:
    """One node attempt's place under a state dir of the test's, for the agent's parts called in this process."""
    from tests.agenthost import Attempt

    return Attempt(tmp_path / "state", unique_job("agent"))


@pytest.fixture(scope="session")
def _ssh_tools() -> None:
    """The test setup installs OpenSSH (server and client) and rsync (sync's first choice) when
    missing; a no-op when present."""
    subprocess.run(["sh", str(SUPPORT / "install_sshd.sh"), "rsync"], check=True, capture_output=True, timeout=900)


@pytest.fixture(autouse=True)
def _ssh_tools_for_integration(request: pytest.FixtureRequest) -> None:
    """Only integration tests need OpenSSH: the unit tests (``-m "not integration"``) run no apt."""
    if request.node.get_closest_marker("integration"):
        request.getfixturevalue("_ssh_tools")


@pytest.fixture
def young_heap() -> Iterator[None]:
    """For a test that starts the dashboard: what the test process made before is left out of the
    garbage collections, as a dashboard's own process has only the app's objects. The app collects
    all of it once when its first frame is drawn (then ``gc.freeze``: ``Dashboard._freeze_heap``),
    which in a test process is the whole suite's heap: 0.2-0.3 s a test."""
    gc.freeze()
    yield
    gc.unfreeze()  # the app's unmount has done it already, unless it never started


@pytest.fixture(autouse=True)
def _leaks_found_where_made(request: pytest.FixtureRequest) -> Iterator[None]:
    """An integration test's garbage is collected as it ends: a pipe or process it left behind fails
    it, not whichever test the collector happens to run in later (a monitor's test named none)."""
    yield
    if request.node.get_closest_marker("integration"):
        gc.collect()


_CALL_STARTED = pytest.StashKey[Snapshot]()
LEAK_REPORT = "CRTEST_LEAK_REPORT"  # a file: each test's leftover children and threads appended to it


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    before = Snapshot.take()
    try:
        return (yield)
    finally:
        item.stash[_CALL_STARTED] = before.started_since()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """After the test's own fixtures are torn down: a local agent its call phase started and left
    running fails it here, not a later test of this worker once the agent ends (``tests/leaks.py``).
    Module fixtures start theirs in setup, which is not looked at."""
    result = yield
    started = item.stash.get(_CALL_STARTED, None)
    if started is not None:
        del item.stash[_CALL_STARTED]
        if os.environ.get(LEAK_REPORT):
            report(item.nodeid, started, os.environ[LEAK_REPORT])
        agents = agents_left(started)
        if agents:
            end(agents)
            raise AssertionError(f"{item.nodeid} left {len(agents)} local agent(s) it started running: "
                                 f"{', '.join(a.render() for a in agents)}; close the sessions, jobs and "
                                 f"runners it made (as `up` closes its job), or their Popens warn in a later test")
    return result


@pytest.fixture(autouse=True)
def controller_state(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test gets its own controller state dir (job records), never the user's; local agents
    cache their compiled code in the session's temp dir, not in the user's ~/.cache."""
    home = tmp_path_factory.mktemp("xdg-state")
    monkeypatch.setenv("XDG_STATE_HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))  # the agent's code
    yield home
    # A monitor ends with its job (the state_dir fixture has stopped them all); one that does not
    # within a few seconds is killed here, by its recorded pid and start time.
    for pidfile in home.glob("clusterrun/jobs/*/monitor.pid"):
        pid, started = map(int, pidfile.read_text().split())
        try:
            wait_for(lambda p=pid, s=started: not alive(p, s), timeout=15, what=f"monitor {pid} to exit")
        except AssertionError:
            if alive(pid, started):
                os.kill(pid, signal.SIGKILL)
            raise


@pytest.fixture(scope="session")
def fake_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An interpreter for a host's ``python:`` that runs torchrun as ``tests/_support/fake_torchrun.py``
    (the same process tree and files, without importing torch) and is this one for everything else."""
    path = tmp_path_factory.mktemp("fake-python") / "python"
    path.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = torch.distributed.run ]; then\n    shift 2\n'
                    f'    exec {sys.executable} {SUPPORT / "fake_torchrun.py"} "$@"\nfi\nexec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return path


@pytest.fixture(autouse=True)
def _fake_torchrun_if_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """``@pytest.mark.fake_torchrun``: the hosts of ``write_hosts`` run torchrun as the stdlib fake
    (``fake_python``), for tests whose scripts need its process tree but not torch."""
    if request.node.get_closest_marker("fake_torchrun"):
        monkeypatch.setenv(HOSTS_PYTHON, str(request.getfixturevalue("fake_python")))


@pytest.fixture(scope="session")
def readable_code() -> Iterator[Path]:
    """A world-readable copy of ``clusterrun/`` and ``tests/_support/`` (same layout), for what the tests run
    as an unprivileged user (``nobody``, the simulated hosts' ``crtest``): the checkout may sit in a 0700
    directory (root's home, CI's temp dir) that such a user cannot enter."""
    folder = Path(tempfile.mkdtemp(prefix="crtest-code-"))
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "clusterrun", folder / "clusterrun", ignore=ignore)
    shutil.copytree(SUPPORT, folder / "tests" / "_support", ignore=ignore)
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def monitors(home: Path) -> list[int]:
    """Pids of the live monitors of the jobs recorded under the controller state dir ``home``."""
    found = []
    for pidfile in home.glob("clusterrun/jobs/*/monitor.pid"):
        pid, started = map(int, pidfile.read_text().split())
        if alive(pid, started):
            found.append(pid)
    return found


def cli_runner() -> CliRunner:
    """A click test runner whose result keeps stdout and stderr apart: click < 8.2 (the floor, 8.0)
    mixes them unless told (``mix_stderr``, a parameter 8.2 removed)."""
    if "mix_stderr" in CliRunner.__init__.__code__.co_varnames:
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    return CliRunner()
