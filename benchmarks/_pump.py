"""The benchmarks' reader of many processes at once (benchmarks/logs.py): each one's stdout as it
arrived, with the time each chunk arrived, all read in one thread so that no reader lags behind;
and what they share about processes: a process's exit and CPU, the hosts kept off the controller's
cores (``hosts_apart``)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import selectors
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READY, DONE = b"ready\n", b"done lines="
PIPE_SIZE = 1 << 20



@dataclass
class Source:
    """One process whose stdout is read by the pump: the data as it arrived, with arrival times."""

    name: str
    proc: subprocess.Popen[bytes]
    node: int | None = None  # the node whose log this is (None: lines carry their node)
    started: float = 0.0
    chunks: list[tuple[float, bytes]] = field(default_factory=list)
    first: float | None = None  # when the first complete line arrived
    end: float | None = None  # when stdout closed
    cpu: float | None = None  # its user + system CPU seconds, once ended (``Pump.finish``)
    marks: dict[bytes, int] = field(default_factory=lambda: {READY: 0, DONE: 0})
    _edge: bytes = b""

    def feed(self, when: float, data: bytes) -> None:
        self.chunks.append((when, data))
        if self.first is None and b"\n" in data:
            self.first = when
        for mark in self.marks:  # occurrences ending in `data`, none counted twice
            self.marks[mark] += (self._edge[len(self._edge) - len(mark) + 1:] + data).count(mark)
        self._edge = (self._edge + data)[-16:]

    def lines(self) -> Iterable[tuple[float, bytes]]:
        """Every complete line, with the time the chunk holding its newline arrived."""
        partial = b""
        for when, data in self.chunks:
            parts = (partial + data).split(b"\n")
            partial = parts.pop()
            for line in parts:
                yield when, line

    @property
    def nbytes(self) -> int:
        return sum(len(data) for _, data in self.chunks)


def exited(pid: int, timeout: float) -> bool:
    """Whether ``pid`` (a child, left unreaped, or any other process) exits within ``timeout`` s."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def cpu_seconds(pid: int) -> float:
    """``pid``'s own user + system CPU seconds (``/proc/PID/stat``); OSError if it is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def hosts_apart(split: bool) -> Iterator[str]:
    """With ``split``, what starts inside (the simulated hosts: sshd, and all it starts inherits
    its cores) runs on the first half of this machine's cores, and this process and what it starts
    afterwards (the controller's side) on the rest: as if the hosts were other machines. Yields
    the split, said in words ("" without)."""
    if not split:
        yield ""
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--split-cpus needs at least 2 cores")
    hosts, readers = cores[:len(cores) // 2], cores[len(cores) // 2:]
    os.sched_setaffinity(0, hosts)
    try:
        yield f"hosts on cores {hosts}, the controller's side on cores {readers}"
    finally:
        os.sched_setaffinity(0, readers)


class Pump:
    """Starts processes and reads all their stdouts in this one thread (no reader lags behind)."""

    def __init__(self, logdir: Path, env: dict[str, str]) -> None:
        self.selector = selectors.DefaultSelector()
        self.logdir = logdir
        self.env = env
        self.sources: list[Source] = []

    def start(self, name: str, argv: list[str], node: int | None = None, stdin: bool = False) -> Source:
        err = open(self.logdir / f"{name}.err", "wb")  # noqa: SIM115 - the child keeps it
        try:
            began = time.time()
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=err, cwd=ROOT, env=self.env)
        finally:
            err.close()
        assert proc.stdout is not None
        with contextlib.suppress(OSError):  # a reader of every node writes as much as the tails together
            fcntl.fcntl(proc.stdout.fileno(), fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        source = Source(name, proc, node, started=began)
        self.sources.append(source)
        self.selector.register(proc.stdout.fileno(), selectors.EVENT_READ, source)
        return source

    def stderr(self, source: Source) -> str:
        return (self.logdir / f"{source.name}.err").read_text(errors="replace")

    def run(self, until: Callable[[], bool], timeout: float, what: str,
            alive: Iterable[Source] = ()) -> None:
        """Read until ``until()``; fail after ``timeout`` s or if a source of ``alive`` ends first."""
        alive = list(alive)
        deadline = time.monotonic() + timeout
        while not until():
            for source in alive:
                if source.end is not None:
                    source.proc.wait()
                    raise RuntimeError(f"{source.name} ended (exit {source.proc.returncode}) while waiting for "
                                       f"{what}:\n{self.stderr(source)[-3000:]}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
            for key, _ in self.selector.select(min(left, 0.2)):
                data = os.read(key.fd, PIPE_SIZE)
                when = time.time()
                source = key.data
                if data:
                    source.feed(when, data)
                else:
                    source.end = when
                    self.selector.unregister(key.fd)
                    assert source.proc.stdout is not None
                    source.proc.stdout.close()

    def finish(self, source: Source, timeout: float = 30) -> int:
        """Wait for a source's process to exit (its stdout already closed); its exit code. Its CPU
        time is read (``source.cpu``) while it is a zombie: exited, not yet reaped."""
        try:
            if source.proc.returncode is None and exited(source.proc.pid, timeout):
                with contextlib.suppress(OSError):
                    source.cpu = cpu_seconds(source.proc.pid)
            return source.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            source.proc.kill()
            return source.proc.wait()

    def close(self) -> None:
        """Stop what is still running among the processes started here (by their own pid)."""
        for source in self.sources:
            proc = source.proc
            if proc.stdin is not None and not proc.stdin.closed:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            if proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(3)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None and not proc.stdout.closed:
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(proc.stdout.fileno())
                proc.stdout.close()
        self.sources.clear()
