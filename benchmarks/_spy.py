"""Where one Python process's threads spend their time (benchmarks/logs.py --profile): py-spy's
samples of it by thread, beside each thread's CPU time.

    python benchmarks/_spy.py DIR/NAME     per group of threads (digits in their names folded):
                                           CPU seconds, and where their samples were

``Spy(pid, DIR, NAME, RATE)`` runs ``py-spy record --threads --idle --native`` on the process until
it exits (raw stacks to NAME.txt; native stacks pause the process at each sample: at 100 a second
that slowed an 8-host controller several times over, and each pause costs every thread system
time) and reads every thread's CPU time from /proc until then (NAME.cpu: ``tid user system``, the
seconds used from the start to the last reading; at RATE 1 the samples only name the threads;
without ``native`` py-spy does not pause it, and tells no wait for the GIL).
A sample "waits for the GIL" where its native frames below the last Python frame hold a pthread
condition wait: CPython 3.11 waits on one only in take_gil and drop_gil (its locks wait on
semaphores, sockets in poll: "blocked").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from collections import Counter, defaultdict
from pathlib import Path

PY_FRAME = re.compile(r"\((?:[^()]*\.py|<[a-z]+>):\d+\)$")
# Native frames of a thread waiting for a lock, a queue, a socket or a selector ("blocked").
BLOCKING = ("PyThread_acquire_lock_timed", "poll (", "epoll_wait", "select (", "sem_wait", "sem_clockwait",
            "read (libc")
TICK = os.sysconf("SC_CLK_TCK")


def file(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)  # not with_suffix: names hold dots (0.0005)


class Spy:
    """py-spy on ``pid`` and its threads' CPU time, until the process exits: start → wait."""

    def __init__(self, pid: int, folder: Path, name: str, rate: int = 100, native: bool = True) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.pid, self.path = pid, folder / name  # NAME.txt, .cpu, .err
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        argv = [spy, "record", "--pid", str(pid), "--threads", "--idle", "--rate", str(rate), "--format", "raw",
                "--output", str(file(self.path, ".txt")), "--native" if native else "--nonblocking"]
        with open(file(self.path, ".err"), "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        self.gone = threading.Event()
        self.reader = threading.Thread(target=self._read_cpu, daemon=True, name="spy-cpu")
        self.reader.start()

    def _read_cpu(self) -> None:
        first: dict[int, tuple[float, float]] = {}  # at the start: what the threads had used before
        last: dict[int, tuple[float, float]] = {}
        while True:  # a reading every 0.2 s: the last one before the exit stands
            try:
                for tid in os.listdir(f"/proc/{self.pid}/task"):
                    with open(f"/proc/{self.pid}/task/{tid}/stat") as stat:
                        fields = stat.read().rsplit(")", 1)[1].split()
                    last[int(tid)] = (int(fields[11]) / TICK, int(fields[12]) / TICK)
            except (FileNotFoundError, ProcessLookupError):
                if not os.path.exists(f"/proc/{self.pid}"):
                    break
            first = first or dict(last)
            if self.gone.wait(0.2):
                break
        used = {t: (u - first.get(t, (0, 0))[0], s - first.get(t, (0, 0))[1]) for t, (u, s) in last.items()}
        file(self.path, ".cpu").write_text("".join(f"{t} {u:.2f} {s:.2f}\n" for t, (u, s) in used.items()))

    def wait(self, timeout: float) -> int:
        """py-spy's exit status once the process has exited and py-spy wrote its samples."""
        try:
            return self.proc.wait(timeout)
        finally:
            self.gone.set()
            self.reader.join(timeout)


def kind(frames: list[str]) -> str:
    """What one sample of a thread shows it doing: "waits for the GIL", "blocked", or its last Python function."""
    last = max((k for k, f in enumerate(frames) if PY_FRAME.search(f)), default=-1)
    native = frames[last + 1:]
    if any("pthread_cond_" in f for f in native):
        return "waits for the GIL"
    if any(f.startswith(BLOCKING) for f in native):
        return "blocked"
    if last < 0:  # native frames alone, an address in libc first: unwound wrongly, nothing to tell
        return "unresolved"
    return "in " + frames[last].split(" (")[0]


def split(path: Path, top: int = 6) -> str:
    """Per group of threads: CPU seconds, samples, and their kinds (the ``top`` most common)."""
    names: dict[int, str] = {}
    kinds: dict[str, Counter[str]] = defaultdict(Counter)
    for line in file(path, ".txt").read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        found = re.match(r"thread \((\d+)\): (.*)", frames[0])
        if not found:
            continue
        group = re.sub(r"\d+", "N", found.group(2)).removesuffix(" (N)")
        names[int(found.group(1))] = group
        kinds[group][kind(frames[1:])] += int(count)
    cpu: dict[str, float] = defaultdict(float)
    for row in file(path, ".cpu").read_text().splitlines():
        tid, user, system = row.split()
        cpu[names.get(int(tid), "(not sampled)")] += float(user) + float(system)
    out = []
    for group in sorted(set(kinds) | {g for g, s in cpu.items() if s}, key=lambda g: -cpu[g]):
        threads = sum(1 for g in names.values() if g == group)
        seen = kinds[group]
        total, waiting, lost = sum(seen.values()), seen.pop("blocked", 0), seen.pop("unresolved", 0)
        awake = sum(seen.values())
        shares = ", ".join(f"{k} {n / awake:.0%}" for k, n in seen.most_common(top)) if awake else ""
        out.append(f"{group} ×{threads}: cpu {cpu[group]:.2f} s; {total} samples, {waiting / max(total, 1):.0%} "
                   f"blocked, {lost / max(total, 1):.0%} unresolved; the {awake} others: {shares}")
    return "\n".join(out)

if __name__ == "__main__":
    print(split(Path(sys.argv[1])))
