"""The agent's parts driven in this process against real local processes: an attempt's records
written as the survivor and the monitor write them, processes that carry its marker, and the
agent's answers (``serve.answer``, as a request line would get them).

The agent runs on a host as its own process (``tests/test_agent.py``, integration); these helpers
let the fast tier call its parts directly, with real ``sleep`` and ``sh`` children in the job's place.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusterrun.agent import serve
from clusterrun.agent.records import boot_id
from tests.conftest import alive, start_time, wait_for


def entry(pid: int) -> dict[str, Any]:
    """A process as state.json records it: its pid and start time."""
    return {"pid": pid, "start_time": start_time(pid)}


def ask(request: dict[str, Any]) -> dict[str, Any]:
    """The agent's answer to one request, decoded from its line as ``serve`` decodes it."""
    reply = serve.answer(json.dumps(request).encode())
    assert reply is not None, request
    return reply


@dataclass
class Attempt:
    """One node attempt's place under a state dir, and the requests that name it."""

    state_dir: Path
    job: str
    node: int = 0
    attempt: int = 1

    @property
    def folder(self) -> Path:
        return self.state_dir / "jobs" / self.job / f"node{self.node}" / f"attempt{self.attempt}"

    @property
    def marker(self) -> str:
        return f"CLUSTERRUN_JOB={self.job}.{self.node}.{self.attempt}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment the survivor gives torchrun: the marker and torchrun's log dir."""
        name, _, value = self.marker.partition("=")
        return {**os.environ, name: value, "PET_LOG_DIR": str(self.folder / "torchrun"), **extra}

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        return {"op": op, "job": self.job, "node": self.node, "attempt": self.attempt,
                "state_dir": str(self.state_dir), **fields}

    def make(self, spec: dict[str, Any] | None = None, **state: Any) -> dict[str, Any]:
        """The attempt's directory with spec.json and state.json (``state`` over a running one); the state."""
        (self.folder / "torchrun").mkdir(parents=True, exist_ok=True)
        (self.folder / "output.log").touch()
        base_spec = {"job": self.job, "node": self.node, "attempt": self.attempt, "argv": ["torchrun"], "env": {},
                     "first_rank": 0, "cgroup": None, "fallbacks": []}
        (self.folder / "spec.json").write_text(json.dumps({**base_spec, **(spec or {})}))
        full = {"state": "running", "job": self.job, "node": self.node, "attempt": self.attempt,
                "boot_id": boot_id(), "survivor": None, "supervisor": None, "torchrun": None, "exit_code": None,
                "signal": None, "error": None, "stop_requested": False, "workers": [], "sessions": [],
                "cgroup": None, "fallbacks": [], "degraded": None, **state}
        self.write_state(full)
        return full

    def write_state(self, state: dict[str, Any]) -> None:
        (self.folder / "state.json").write_text(json.dumps(state))

    def state(self) -> dict[str, Any]:
        return json.loads((self.folder / "state.json").read_text())  # type: ignore[no-any-return]


@dataclass
class Processes:
    """Children started by a test; every one still running at its end is killed and reaped."""

    started: list[subprocess.Popen[bytes]] = field(default_factory=list)
    adopted: dict[int, int | None] = field(default_factory=dict)  # pid -> start time: not our children

    def start(self, argv: Sequence[str], env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(list(argv), env=env, stdin=subprocess.DEVNULL, **popen)
        self.started.append(proc)
        return proc

    def adopt(self, pids: Sequence[int]) -> None:
        """Processes the children started (in sessions of their own): killed at the end too."""
        self.adopted.update((pid, start_time(pid)) for pid in pids)

    def close(self) -> None:
        for pid, started in self.adopted.items():
            if started is not None and alive(pid, started):
                os.kill(pid, signal.SIGKILL)
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


def pids_from(proc: subprocess.Popen[bytes], count: int) -> list[int]:
    """The ``count`` pids a child prints, one per line, once each of those processes runs."""
    assert proc.stdout is not None
    return [int(proc.stdout.readline()) for _ in range(count)]


@dataclass
class Tree:
    """A job's processes as a start leaves them: the survivor (an unmarked ``sh``, leader of its own
    session, that ends when torchrun does), torchrun (an ``sh`` carrying the marker, in a session of
    its own) and its workers (``sleep``s, in torchrun's session)."""

    survivor: subprocess.Popen[bytes]
    torchrun: int
    workers: list[int]

    def state(self) -> dict[str, Any]:
        """What state.json says of them once the monitor has seen the workers."""
        survivor = dict(entry(self.survivor.pid), sid=self.survivor.pid)
        return {"survivor": survivor, "torchrun": entry(self.torchrun), "sessions": [self.torchrun],
                "session_leaders": {str(self.torchrun): start_time(self.torchrun)},
                "workers": [{"pid": pid, "rank": rank, "local_rank": rank, "died": None}
                            for rank, pid in enumerate(self.workers)]}


def job_tree(procs: Processes, at: Attempt, workers: int = 1, ignore_term: bool = False, unmarked: int = 0) -> Tree:
    """Start ``at``'s job as the survivor starts it (``Tree``); with ``ignore_term`` torchrun ignores
    SIGTERM (its workers do not); the last ``unmarked`` workers run under ``env -i`` (no marker: only
    their session tells them apart)."""
    name, _, value = at.marker.partition("=")
    inner = ("sleep 600 & echo $!; " * workers + "env -i /bin/sleep 600 & echo $!; " * unmarked
             + ('trap "" TERM; ' if ignore_term else "") + "echo $$; wait")
    survivor = procs.start(["sh", "-c", 'setsid env "$@"; exit 0', "sh", f"{name}={value}",
                            f"PET_LOG_DIR={at.folder / 'torchrun'}", "sh", "-c", inner],
                           stdout=subprocess.PIPE, start_new_session=True)
    *sleeps, torchrun = pids_from(survivor, workers + unmarked + 1)
    # `$!` is the forked shell's pid: wait for its exec of sleep (its environment is the new one's then)
    procs.adopt([torchrun, *sleeps])
    wait_for(lambda: all(_comm(pid) == "sleep" for pid in sleeps), timeout=30, what="the workers to run")
    return Tree(survivor, torchrun, sleeps)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def forked(run: Callable[[], int]) -> int:
    """``run()`` in a child forked from this process, as the agent forks its survivor; its pid. When
    this test run measures coverage, the child measures its own lines into the run's data (its exit
    skips the interpreter's, as the survivor's does)."""
    from tests.clirun import measured

    where = measured()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        cov = None
        if where is not None:
            import coverage

            cov = coverage.Coverage(data_suffix=True, **where)
            cov.set_option("run:disable_warnings", ["module-not-measured", "no-data-collected"])
            cov.start()
        try:
            code = run()
        finally:
            if cov is not None:
                cov.stop()
                cov.save()
    finally:
        os._exit(code)


def carrying(marker: str) -> list[int]:
    """The live processes whose environment holds exactly ``marker`` (read here, not by the agent's scan)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
                state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z" and marker.encode() in env:
                found.append(int(name))
    return sorted(found)


def gone(pid: int, started: int | None) -> bool:
    """True once the process that started at ``started`` has ended (a zombie counts as ended)."""
    return started is None or not alive(pid, started)
