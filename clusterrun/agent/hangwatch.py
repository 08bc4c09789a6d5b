"""``HangWatch``: a node whose ranks wrote no output and used no CPU for ``hang_after`` seconds is
hung (``hung_since`` in state.json); ``hang_report`` saves what the host shows of their stacks."""

from __future__ import annotations

import os
import time

from .procs import proc_env, proc_info

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

HANG_REPORT = "hang.txt"  # beside output.log: the ranks' stacks when the node became hung
PY_SPY_TIMEOUT = 20.0  # seconds one ``py-spy dump`` may take


def cpu_ticks(pid: int) -> int | None:
    """utime + stime (+ those of its reaped children) of ``pid`` from /proc/<pid>/stat, in clock ticks."""
    info = proc_info(pid)
    return info.cpu_ticks if info is not None else None


def joined_store(pid: int, port: int) -> bool:
    """Whether process ``pid`` (torchrun) holds an established TCP connection to ``port`` (the
    master's store, which torchrun's rendezvous goes through; node 0's torchrun connects to its
    own store too): its node has joined the rendezvous."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return False
    if not inodes:  # no socket at all: no need to read the host's tables
        return False
    for table in ("tcp", "tcp6"):  # of the process's own network namespace
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()  # sl local_address rem_address st ... inode (the 10th)
            if len(cols) > 9 and cols[3] == "01" and cols[9] in inodes and int(cols[2].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def master_port(argv: list[str]) -> int | None:
    """``--master-port=N`` of torchrun's command line (``plan.torchrun_argv`` writes it so)."""
    for arg in argv:
        if arg.startswith("--master-port=") and arg[14:].isdigit():
            return int(arg[14:])
    return None


class HangWatch:
    """Activity of a node's ranks, sampled at the monitor's scans: the CPU ticks of the living
    workers and the size of output.log. Unchanged for ``hang_after`` seconds (monotonic) makes the
    node hung since the last change; any change ends it.

    create (with the ``hung_since`` a monitor before this one recorded) → ``sample(pids, out_size)``
    at each scan, True when ``hung_since`` changed."""

    def __init__(self, hang_after: float | None, hung_since: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hang_after = hang_after
        self.clock = clock
        self.last: tuple[int, int] | None = None
        self.active_at = 0.0  # monotonic time of the last change
        self.hung_since = hung_since  # wall clock

    def sample(self, pids: Iterable[int], out_size: int) -> bool:
        if not self.hang_after:
            return False
        now = self.clock()
        ticks = [t for t in (cpu_ticks(p) for p in pids) if t is not None]
        activity = (sum(ticks), out_size)
        if self.last is None and self.hung_since is not None and ticks:  # resumed: hung as recorded
            self.last, self.active_at = activity, now - max(0.0, time.time() - self.hung_since)
            return False
        if activity != self.last or not ticks:  # no rank alive: not a hang (starting, or ending)
            self.last, self.active_at = activity, now
            if self.hung_since is not None:
                self.hung_since = None
                return True
            return False
        if self.hung_since is None and now - self.active_at >= self.hang_after:
            self.hung_since = time.time() - (now - self.active_at)
            return True
        return False


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read().strip()
    except OSError as exc:
        return f"({exc.strerror or exc})"


def _py_spy(pid: int) -> str:
    """``py-spy dump --pid`` of one rank, where py-spy is on the rank's PATH (its environment's)."""
    import shutil
    import subprocess

    path = proc_env(pid).get("PATH") or os.environ.get("PATH")
    exe = shutil.which("py-spy", path=path)
    if exe is None:
        return "py-spy: not found on the rank's PATH (pip install py-spy in the job's environment)"
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=PY_SPY_TIMEOUT, errors="replace")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy: {exc}"
    return (done.stdout + done.stderr).strip()


def hang_report(folder: str, workers: Iterable[tuple[int, int]], since: float) -> str:
    """Write ``hang.txt`` in ``folder``: per living rank its process state, kernel wait channel,
    kernel stack (root only) and Python stack (py-spy, where the host has it); its path."""
    parts = [f"ranks hung since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(since))} "
             "(no output, no CPU)\n"]
    for rank, pid in sorted(workers):
        stat = _read(f"/proc/{pid}/stat")
        state = stat[stat.rfind(")") + 2:].split(" ", 1)[0] if ")" in stat else "?"
        parts.append(f"== rank {rank} (pid {pid}) state {state} wchan {_read(f'/proc/{pid}/wchan') or '-'}\n"
                     f"-- kernel stack:\n{_read(f'/proc/{pid}/stack')}\n-- python stack:\n{_py_spy(pid)}\n")
    path = os.path.join(folder, HANG_REPORT)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, "\n".join(parts).encode())
    finally:
        os.close(fd)
    return path
