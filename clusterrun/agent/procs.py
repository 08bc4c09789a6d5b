"""Processes as /proc shows them: their stat and environment, handles pinned by pidfd, and
``JobScope``, the sweep of what belongs to one attempt (tree ∪ marker ∪ sessions)."""

from __future__ import annotations

import os
import select
import time

from .records import attempt_marker, boot_id

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as signal  # the other parts import it from here
    from typing import Any
else:
    try:  # signal imports enum and re: its C part is what the agent uses (docs/benchmarks.md)
        import _signal as signal
    except ImportError:  # not CPython
        import signal


SIGNAL_NAMES: dict[int, str] = {signal.SIGTERM: "SIGTERM", signal.SIGKILL: "SIGKILL"}


class ProcInfo:
    """What /proc/<pid>/stat says of one process."""

    __slots__ = ("pid", "comm", "state", "ppid", "sid", "start_time", "cpu_ticks")

    def __init__(self, pid: int, comm: str, state: str, ppid: int, sid: int, start_time: int,
                 cpu_ticks: int = 0) -> None:
        self.pid, self.comm, self.state = pid, comm, state
        self.ppid, self.sid, self.start_time = ppid, sid, start_time
        self.cpu_ticks = cpu_ticks  # utime + stime + cutime + cstime (fields 14-17), in clock ticks

    def as_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "name": self.comm, "state": self.state}


def proc_info(pid: int) -> ProcInfo | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    lpar, rpar = data.find(b"("), data.rfind(b")")
    rest = data[rpar + 2 :].split()
    try:
        return ProcInfo(pid, data[lpar + 1 : rpar].decode(errors="replace"), rest[0].decode(),
                        int(rest[1]), int(rest[3]), int(rest[19]), sum(int(v) for v in rest[11:15]))
    except (IndexError, ValueError):
        return None


def zombie_exit(pid: int) -> int | None:
    """The exit of ``pid`` while it is a zombie (field 52 of /proc/PID/stat, Linux 3.5+: its wait
    status), as torch reports a worker's: the exit code, or minus the signal; None once reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
        if rest[0] != b"Z":
            return None
        status = int(rest[49])
    except (OSError, IndexError, ValueError):
        return None
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


class ExitReader:
    """Each watched worker's exit, read while it is a zombie (``zombie_exit``), in a thread of its
    own: torchrun reaps its workers within 0.1 s, less than a monitor's write of its state may take.
    The thread sleeps in ``select`` on the workers' pidfds and a wake-up pipe (a new worker, the
    close): a quiet job costs it nothing.

    create → ``start()`` → ``watch(pid)`` as workers are found → ``codes`` (pid → exit) and ``ended``
    (pid → wall-clock time its end was seen, read or not) → ``close()``."""

    def __init__(self) -> None:
        self.codes: dict[int, int] = {}
        self.ended: dict[int, float] = {}
        self._pids: set[int] = set()
        self._done = False
        self._running: Any = None  # a lock the thread holds while it runs
        self._wake: tuple[int, int] | None = None  # the pipe that wakes the thread up

    def watch(self, pid: int) -> None:
        self._pids.add(pid)
        self._poke()

    def start(self) -> None:
        import _thread  # threading's C part: threading itself costs the agent imports (test_agent)

        if hasattr(os, "pidfd_open"):
            self._wake = os.pipe()
            os.set_blocking(self._wake[1], False)  # a poke never waits for the thread
            self._running = _thread.allocate_lock()
            self._running.acquire()
            _thread.start_new_thread(self._run, ())

    def _poke(self) -> None:
        if self._wake is not None:
            try:
                os.write(self._wake[1], b"\0")
            except OSError:
                pass  # closed, or full: the thread has wake-ups enough pending

    def _run(self) -> None:
        assert self._wake is not None
        wake = self._wake[0]
        fds: dict[int, int] = {}  # fd → pid
        seen: set[int] = set()
        try:
            while not self._done:
                for pid in self._pids - seen:
                    seen.add(pid)
                    try:
                        fds[os.pidfd_open(pid)] = pid
                    except OSError:
                        pass  # reaped already: its exit is not known
                ready = select.select([wake, *fds], [], [])[0]
                now = time.time()  # one time for the ends seen together: their order is not known
                for fd in ready:
                    if fd == wake:
                        os.read(wake, 4096)
                        continue
                    pid = fds.pop(fd)
                    self.ended[pid] = now
                    code = zombie_exit(pid)
                    if code is not None:
                        self.codes[pid] = code
                    os.close(fd)
        finally:
            for fd in fds:
                os.close(fd)
            self._running.release()

    def close(self) -> None:
        self._done = True
        self._poke()
        if self._running is not None and self._running.acquire(timeout=1.0):
            self._running.release()
        if self._wake is not None and not self._running.locked():
            for fd in self._wake:
                os.close(fd)
            self._wake = None


def all_procs() -> dict[int, ProcInfo]:
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = proc_info(int(name))
            if info is not None:
                procs[info.pid] = info
    return procs


def has_marker(pid: int, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return (b"\0" + marker.encode() + b"\0") in (b"\0" + env + b"\0")


def proc_env(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return {}
    env = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def descendants(root: int, procs: dict[int, ProcInfo]) -> set[int]:
    children: dict[int, list[int]] = {}
    for info in procs.values():
        children.setdefault(info.ppid, []).append(info.pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


class PidHandle:
    """A process pinned by a pidfd (where the kernel and Python have them), so that a signal
    can never reach another process that later got the same pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = -1
        if hasattr(os, "pidfd_open"):
            try:
                self.fd = os.pidfd_open(pid)
            except ProcessLookupError:
                raise
            except OSError:
                self.fd = -1

    def signal(self, sig: int) -> bool:
        try:
            if self.fd >= 0:
                signal.pidfd_send_signal(self.fd, sig)
            else:
                os.kill(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def alive(self) -> bool:
        info = proc_info(self.pid)
        if self.fd >= 0:
            return bool(select.select([self.fd], [], [], 0)[0] == []) and (info is None or info.state != "Z")
        return info is not None and info.state != "Z"

    def wait(self, timeout: float) -> bool:
        """Wait until the process has ended (or is a zombie); True if it did."""
        deadline = time.monotonic() + timeout
        while self.alive():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.fd >= 0:
                select.select([self.fd], [], [], min(left, 0.2))
            else:
                time.sleep(min(left, 0.05))
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def pin(pid: int, start_time: int | None) -> PidHandle | None:
    """A handle on ``pid`` if it still is the process that started at ``start_time``."""
    try:
        handle = PidHandle(pid)
    except ProcessLookupError:
        return None
    info = proc_info(pid)
    if info is None or (start_time is not None and info.start_time != start_time) or not handle.alive():
        handle.close()
        return None
    return handle


class JobScope:
    """Which processes belong to one node's job: the survivor's tree ∪ marker ∪ sessions. The
    survivor and its monitors are not the job's: they are in the survivor's session (torchrun and
    what it starts are in sessions of their own, and no process can join another's session)."""

    def __init__(self, state: dict[str, Any], exclude: set[int]) -> None:
        sup = state.get("survivor") or state.get("supervisor") or {}  # an older agent's supervisor
        self.sup_pid = sup.get("pid")
        self.sup_start = sup.get("start_time")
        monitor = (state.get("supervisor") or {}).get("pid")
        self.own_sid = sup.get("sid")  # the survivor's session: itself and its monitors
        self.marker = attempt_marker(state["job"], state["node"], state["attempt"])
        self.sessions = set(state.get("sessions") or [])
        # When each session was first seen: the start time of its leader (None: already gone).
        self.leaders = {int(sid): start for sid, start in (state.get("session_leaders") or {}).items()}
        tr = state.get("torchrun") or {}
        if tr.get("pid"):
            self.sessions.add(tr["pid"])  # torchrun leads its own session
            self.leaders[tr["pid"]] = tr.get("start_time")
        self.min_start = self.sup_start or 0
        self.exclude = set(exclude) | {pid for pid in (self.sup_pid, monitor) if pid}

    def _supervisor_alive(self, procs: dict[int, ProcInfo]) -> bool:
        info = procs.get(self.sup_pid) if self.sup_pid else None
        return info is not None and info.start_time == self.sup_start

    def _in_session(self, info: ProcInfo, procs: dict[int, ProcInfo]) -> bool:
        """In one of the job's sessions, and that session is still the one recorded.

        Linux does not hand out a pid while it names a live session, so a session whose leader is
        gone is still ours; a living leader must be the process recorded (else the pid was reused
        by a process that then started a session of its own)."""
        if info.sid not in self.sessions or info.start_time < self.min_start:
            return False
        leader = procs[info.sid] if info.sid in procs else proc_info(info.sid)
        if leader is None:
            return True
        recorded = self.leaders.get(info.sid)
        return recorded is not None and leader.start_time == recorded

    def members(self, procs: dict[int, ProcInfo]) -> set[int]:
        tree = descendants(self.sup_pid, procs) if self.sup_pid and self._supervisor_alive(procs) else set()
        found = set()
        for pid, info in procs.items():
            if pid in self.exclude or info.state == "Z" or info.sid == self.own_sid:
                continue
            if pid in tree or self._in_session(info, procs) or has_marker(pid, self.marker):
                found.add(pid)
        return found

    def belongs(self, pid: int) -> bool:
        """Check one process again (after it was pinned): is it still part of the job?"""
        info = proc_info(pid)
        if info is None or info.state == "Z" or info.sid == self.own_sid:
            return False
        if self._in_session(info, {}):
            return True
        if has_marker(pid, self.marker):
            return True
        seen = set()
        while info is not None and info.ppid > 1 and info.pid not in seen:
            seen.add(info.pid)
            if info.ppid == self.sup_pid:
                sup = proc_info(self.sup_pid)
                return sup is not None and sup.start_time == self.sup_start
            info = proc_info(info.ppid)
        return False

    def signal_all(self, sig: int, killed: dict[int, dict[str, Any]]) -> int:
        """Send ``sig`` to every live member; returns how many were signalled."""
        count = 0
        for pid in sorted(self.members(all_procs())):
            try:
                handle = PidHandle(pid)
            except ProcessLookupError:
                continue
            try:
                if not self.belongs(pid) or not handle.alive():
                    continue
                info = proc_info(pid)
                if handle.signal(sig):
                    count += 1
                    entry = killed.setdefault(pid, info.as_dict() if info else {"pid": pid})
                    entry["signal"] = SIGNAL_NAMES.get(sig, str(sig))
                    if sig == signal.SIGTERM and info is not None and info.state == "T":
                        handle.signal(signal.SIGCONT)  # a stopped process acts on its SIGTERM once continued
            finally:
                handle.close()
        return count

    def continue_stopped(self) -> None:
        """SIGCONT the members stopped by a signal (SIGSTOP, Ctrl-Z), as systemd does after its SIGTERM:
        torchrun's SIGTERM to a stopped rank waits until it goes on, and torchrun with it."""
        for pid in sorted(self.members(all_procs())):
            info = proc_info(pid)
            if info is None or info.state != "T":
                continue
            try:
                handle = PidHandle(pid)
            except ProcessLookupError:
                continue
            try:
                if self.belongs(pid):
                    handle.signal(signal.SIGCONT)
            finally:
                handle.close()

    def sweep(self, term_wait: float, deadline: float, killed: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
        """SIGTERM what is left, wait up to ``term_wait``, then SIGKILL and re-scan until nothing
        is left or ``deadline`` (monotonic) passes. Returns the processes still there."""
        if self.signal_all(signal.SIGTERM, killed):
            end = min(deadline, time.monotonic() + term_wait)
            while time.monotonic() < end and self.members(all_procs()):
                time.sleep(0.05)
        while True:
            procs = all_procs()
            left = self.members(procs)
            if not left:
                return []
            if time.monotonic() >= deadline:
                return [procs[p].as_dict() for p in sorted(left) if p in procs]
            self.signal_all(signal.SIGKILL, killed)
            time.sleep(0.05)


def proc_entry(pid: int) -> dict[str, Any]:
    info = proc_info(pid)
    return {"pid": pid, "start_time": info.start_time if info else None}


def is_alive(entry: dict[str, Any] | None) -> bool:
    if not entry or not entry.get("pid"):
        return False
    info = proc_info(entry["pid"])
    return info is not None and info.start_time == entry.get("start_time") and info.state != "Z"


def job_alive(state: dict[str, Any]) -> bool:
    """Whether the survivor, the monitor or torchrun recorded in ``state`` still runs (a reboot ends all)."""
    if state.get("boot_id") != boot_id():
        return False
    return any(is_alive(state.get(key)) for key in ("survivor", "supervisor", "torchrun"))
