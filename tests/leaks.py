"""What a test leaves behind: the children of the test process and the threads it started in its
call phase that are still there once its own fixtures are torn down.

A local agent left so (``transports/local.py``: an ``AgentSession`` or a job never closed) is a
``Popen`` nobody waits for. Once its agent ends (another test's monitor kills the sessions below
it, which is the test process) its last reference goes, and ``Popen.__del__`` warns "still
running" in whichever test runs then, which pytest fails. ``agents_left`` fails the test that made
it instead; ``CRTEST_LEAK_REPORT=FILE`` lists every child and thread each test leaves, for a hunt.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from clusterrun.agent import BOOTSTRAP
from tests import simnet
from tests.simnet import proc_bytes

REAPED_WITHIN = 10.0  # seconds: an agent killed by a job's close is reaped by its follower's thread


@dataclass(frozen=True)
class Child:
    pid: int
    start: int  # its start time in clock ticks: a pid reused later is another process
    state: str  # /proc's one-letter state: Z is a zombie (ended, not yet waited for)
    argv: bytes

    @property
    def is_agent(self) -> bool:
        return BOOTSTRAP.encode() in self.argv

    def render(self) -> str:
        text = self.argv.replace(b"\0", b" ").decode(errors="replace").strip()
        return f"{self.pid} ({self.state}) {'local agent' if self.is_agent else text[:160]}"


def children() -> dict[tuple[int, int], Child]:
    """This process's children (running, or zombies not yet waited for), keyed by pid and start time."""
    found: dict[tuple[int, int], Child] = {}
    for pid in simnet.children().get(os.getpid(), []):
        try:
            fields = proc_bytes(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()
            argv = proc_bytes(f"/proc/{pid}/cmdline")
        except (OSError, IndexError):  # reaped meanwhile
            continue
        found[pid, int(fields[19])] = Child(pid, int(fields[19]), fields[0].decode(), argv)
    return found


def _threads() -> set[tuple[int | None, str]]:
    """The live threads by ident and name: no reference to them is kept (a thread object may hold
    a test's sockets, which must become garbage when the test ends)."""
    return {(t.ident, t.name) for t in threading.enumerate()}


@dataclass
class Snapshot:
    """The children and threads alive at a moment (``take``), or started after one (``started_since``)."""

    kids: set[tuple[int, int]]
    threads: set[tuple[int | None, str]]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(set(children()), _threads())

    def started_since(self) -> Snapshot:
        now = Snapshot.take()
        return Snapshot(now.kids - self.kids, now.threads - self.threads)


def left(started: Snapshot) -> tuple[list[Child], list[str]]:
    """Of what a call phase started, the children not reaped and the names of the threads alive."""
    now = children()
    return ([now[key] for key in sorted(started.kids) if key in now],
            sorted(name for _, name in started.threads & _threads()))


def agents_left(started: Snapshot, within: float = REAPED_WITHIN) -> list[Child]:
    """The local agents started since ``started`` was taken that nobody has reaped ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        agents = [kid for kid in left(started)[0] if kid.is_agent]
        if not agents or time.monotonic() > deadline:
            return agents
        time.sleep(0.05)


def end(agents: list[Child]) -> None:
    """Kill and reap the leaked ``agents`` through their ``Popen``s, pipes closed: the test that
    leaked them fails, not the next one as well."""
    import contextlib
    import gc
    import subprocess

    pids = {a.pid for a in agents}
    for proc in [o for o in gc.get_objects() if isinstance(o, subprocess.Popen) and o.pid in pids]:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):  # stderr: its reader thread closes it at the end
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def report(nodeid: str, started: Snapshot, path: str) -> None:
    """Append what the test left (if anything) to the file ``path``."""
    kids, threads = left(started)
    if kids or threads:
        lines = [f"{nodeid} [pid {os.getpid()}]", *(f"  child {k.render()}" for k in kids),
                 *(f"  thread {name}" for name in threads)]
        with open(path, "a") as out:
            out.write("\n".join(lines) + "\n")
