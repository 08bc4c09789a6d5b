"""What a test leaves running: the children of the test process and the threads it started in its
call phase that are still alive once its own fixtures are torn down.

A child left so is a ``Popen`` nobody waits for: the garbage collector finds it later, in whichever
test it runs then, and pytest fails that test on the ``ResourceWarning`` (still running, its pipes
unclosed). Found here, the leak is named by the test that made it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Child:
    pid: int
    start: int  # its start time in clock ticks: a pid reused later is another process
    state: str  # /proc's one-letter state: Z is a zombie (ended, not yet waited for)
    argv: str


def children() -> dict[tuple[int, int], Child]:
    """This process's children (of every thread), keyed by pid and start time."""
    found: dict[tuple[int, int], Child] = {}
    for listing in Path("/proc/self/task").glob("*/children"):
        try:
            pids = listing.read_text().split()
        except OSError:  # the thread ended meanwhile
            continue
        for pid in map(int, pids):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError):  # reaped meanwhile
                continue
            found[pid, int(fields[19])] = Child(pid, int(fields[19]), fields[0], argv.strip()[:200])
    return found


@dataclass
class Snapshot:
    """The children and threads alive when a test's call phase began."""

    kids: set[tuple[int, int]]
    threads: set[threading.Thread]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(set(children()), set(threading.enumerate()))

    def started_since(self) -> Snapshot:
        return Snapshot(set(children()) - self.kids, set(threading.enumerate()) - self.threads)


def left_running(started: Snapshot) -> tuple[list[Child], list[str]]:
    """Of what a call phase started, the children still running (not zombies) and the threads alive."""
    now = children()
    kids = [now[key] for key in sorted(started.kids) if key in now and now[key].state != "Z"]
    threads = sorted(t.name for t in started.threads if t.is_alive())
    return kids, threads
