"""The monitor of one attempt (see the package docstring): everything but waiting for torchrun.
It merges the rank logs, records workers and sessions, and writes the final state; it may die at
any moment and is started again, by the survivor or by the next agent to look, and resumes."""

from __future__ import annotations

import os
import select
import sys
import time

from .cgroup import cg_kill, cg_pids, cg_remove, cg_wait_empty, cg_write
from .hangwatch import QuietWatch, joined_store, master_port
from .kmsg import KernelLog
from .procs import (
    ExitReader,
    JobScope,
    PidHandle,
    all_procs,
    descendants,
    is_alive,
    pin,
    proc_entry,
    proc_env,
    proc_info,
    signal,
    zombie_exit,
)
from .ranklogs import RankLogs
from .records import boot_id, fs_problem, read_json, write_json_atomic
from .system import close_fds_from, exit_with
from .waker import IDLE_CHECK, Waker, drain

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# How often at most the supervisor reads new bytes of torchrun's per-rank files to merge them into
# the node's log (``follow.POLL_INTERVAL`` is its counterpart; docs/benchmarks.md); without inotify
# also its polling interval. It looks for new worker processes every SCAN_INTERVAL seconds for
# BUSY seconds after torchrun made new per-rank files (it makes a rank's files just before its
# worker: inotify wakes the monitor), else every IDLE_SCAN_INTERVAL seconds; while torchrun starts
# (importing torch, in the rendezvous: seconds, no worker yet) the interval doubles from
# SCAN_INTERVAL up to IDLE_SCAN_INTERVAL (a scan costs 0.3 ms: 4 a second on every node while the
# others start, docs/benchmarks.md).
MERGE_INTERVAL = 0.02
SCAN_INTERVAL = 0.25
IDLE_SCAN_INTERVAL = 2.0
# How often at most the monitor asks whether torchrun joined the rendezvous: /proc/<pid>/net/tcp lists
# every TCP socket of the host (9 ms at 250 of them), and the start-up watch counts in minutes.
RDZV_CHECK = 2.0
BUSY = 10.0
POLL_INTERVAL = 0.05  # how often a monitor looks for the exit file while the survivor lives
EXIT_FILE = "exit"  # the survivor's record of torchrun's end: {"exit_code", "signal", "pid"}
RANK_JOURNAL = "ranklogs.json"  # RankLogs's offsets, for a monitor that resumes
TIMES = "output.times"  # when output.log's bytes were written (RankLogs.note_time), read by ``follow``
MONITOR_LOCK = "monitor.lock"  # flock'ed by the one monitor at work
PROGRESS_EVERY = 2.0  # seconds between two saves of a changed progress (a bar redraws itself many times a second)
# What rank 0's output must show before the progress tracker (and with it ``re``, ~5 ms) is loaded: a start
# whose ranks print no progress pays nothing for it.
PROGRESS_HINTS = (b"loss", b"Loss", b"it/s", b"s/it", b"%|", b"step", b"Step", b"iter", b"epoch", b"Epoch")
EXIT_WAIT = 10.0  # seconds a monitor waits for a living survivor to write the exit file
RESPAWNS = 5  # monitors the survivor restarts at most in a row without progress (a monitor's bug)


def read_exit(folder: str) -> dict[str, Any] | None:
    """The exit file: ``{exit_code, signal}`` of torchrun as the survivor reaped it, or None."""
    record = read_json(os.path.join(folder, EXIT_FILE))
    if record is None or not isinstance(record.get("exit_code"), int):
        return None
    return {"exit_code": record["exit_code"], "signal": record.get("signal")}


def learned_exit(workers: list[dict[str, Any]], folder: str) -> dict[str, Any] | None:
    """torchrun's exit where nobody reaped it (its survivor was killed), as far as its ranks' ends
    tell: the exits the monitor read of them, then torchrun's failure report in the log. torchrun
    exits 0 when every rank did and 1 when one failed; ``exit_learned`` says how this was learned."""
    first = first_failure(workers)
    if first is not None:
        return {"exit_code": 1, "signal": None, "exit_learned": f"{rank_end(first)}{UNREAPED}",
                "failed_rank": first.get("rank")}
    if workers and all(w.get("exit_code") == 0 for w in workers):
        return {"exit_code": 0, "signal": None, "exit_learned": f"every rank exited 0{UNREAPED}"}
    report = failure_report(os.path.join(folder, "output.log"))
    if report is None:
        return None
    return {"exit_code": 1, "signal": None, "exit_learned": f"{report}{UNREAPED}"}


# Seconds from a rank's end to torchrun's SIGTERM of the others: its poll (0.1 s) on a loaded machine.
REAP_SLACK = 3.0


def first_failure(workers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The worker whose failure came first: the first to end non-zero. torchrun SIGTERMs its other
    ranks when one fails and reaps it within its poll (0.1 s), sometimes before this monitor read its
    exit: where the first failure is a SIGTERM, the last rank to end shortly before it with its exit
    unread is the one torchrun stopped them for."""
    failed = [w for w in workers if w.get("exit_code") not in (None, 0)]
    if not failed:
        return None
    first = min(failed, key=lambda w: w.get("died") or 0)
    if first["exit_code"] == -signal.SIGTERM:
        stopped = first.get("died") or 0
        unread = [w for w in workers if w.get("exit_code") is None and w.get("died") is not None
                  and stopped - REAP_SLACK <= w["died"] <= stopped]
        if unread:
            return max(unread, key=lambda w: w["died"])
    return first


def rank_end(worker: dict[str, Any]) -> str:
    """How a failed worker ended, in words (``first_failure``'s pick)."""
    code = worker.get("exit_code")
    return f"rank {worker.get('rank')} " + (f"exited {code}" if code is not None
                                            else "ended first, its exit code unread (torchrun reaped it first)")


UNREAPED = " (torchrun's own exit was not recorded: its survivor was killed)"
# The stop file's word when this node failed first (a fail-fast's ``failed`` stop): the stop only
# cut torchrun's teardown short, its end is its rank's failure, not a stop.
FAILED_STOP = "failed"


def read_stop(folder: str) -> tuple[str, str, float] | None:
    """The stop file (written by the first ``stop``): its word (``FAILED_STOP`` or empty), who stopped
    the node (``StopRequest.by``, in words) and when (its mtime); None without one."""
    try:
        with open(os.path.join(folder, "stop")) as mark:
            word, _, by = mark.read().partition("\n")
            at = os.fstat(mark.fileno()).st_mtime
    except OSError:
        return None
    return word.strip(), by.strip() or "clusterrun", at


def failed_first(workers: list[dict[str, Any]], folder: str) -> dict[str, Any] | None:
    """This node's end when a stop cut torchrun's teardown short after one of its ranks had failed
    (the stop file says ``FAILED_STOP``): exit code 1, as torchrun's for a failed rank, learned from
    the first failed rank (``first_failure``); None for any other stop, or when no rank had failed."""
    stop = read_stop(folder)
    first = first_failure(workers)
    if stop is None or stop[0] != FAILED_STOP or first is None:
        return None
    return {"exit_code": 1, "signal": None, "failed_rank": first.get("rank"),
            "exit_learned": f"{rank_end(first)}; torchrun was stopped at once after it"}


REPORT_TAIL = 1 << 16  # bytes of the log's end read for torchrun's failure report


def failure_report(log: str) -> str | None:
    """The first failed rank torchrun's failure report names at the end of ``log`` (``rank : N``
    then ``exitcode : X``, untagged), in words; None without one."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - REPORT_TAIL))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    rank = None
    for line in lines:
        key, _, value = line.strip().partition(":")
        if key.strip() == "rank" and value.strip().split(" ")[0].isdigit():
            rank = value.strip().split(" ")[0]
        elif key.strip() == "exitcode" and rank is not None:
            return f"torchrun's failure report: rank {rank} exited {value.strip().split(' ')[0]}"
    return None


def ensure_monitor(folder: str, state: dict[str, Any]) -> dict[str, Any]:
    """Start a monitor for an unfinished attempt that has none (it was killed, and its survivor
    too, or the survivor gave up restarting it): it resumes the log copy from its journal and
    writes the final state. Returns ``state`` with the new monitor as ``supervisor``."""
    if (state.get("state") == "exited" or state.get("boot_id") != boot_id()
            or is_alive(state.get("supervisor")) or is_alive(state.get("survivor"))):
        return state
    import fcntl

    try:
        fd = os.open(os.path.join(folder, MONITOR_LOCK), os.O_WRONLY | os.O_CREAT, 0o600)
    except OSError:
        return state  # the attempt's directory is gone or unwritable: nothing to resume into
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        return state  # a monitor is at work (started by another agent just now)
    finally:
        os.close(fd)
    pid = _spawn_monitor(folder, state.get("cgroup"))
    return dict(state, supervisor=proc_entry(pid)) if pid else state


def _spawn_monitor(folder: str, cgroup: str | None) -> int:
    """Fork a detached monitor of ``folder`` (in its own session, in the attempt's cgroup if it is
    still there, nobody's child); its pid, 0 if it could not be started."""
    sys.stdout.flush()
    sys.stderr.flush()
    found_r, found_w = os.pipe()
    child = os.fork()
    if child:
        os.close(found_w)
        os.waitpid(child, 0)
        data = os.read(found_r, 64)
        os.close(found_r)
        return int(data) if data.strip().isdigit() else 0

    def monitor() -> int:
        os.setsid()
        if os.fork():
            return 0
        os.write(found_w, str(os.getpid()).encode())
        os.chdir(folder)
        log_fd = os.open(os.path.join(folder, "supervisor.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        close_fds_from(3)  # the SSH channel's pipes among them: the connection may close
        if cgroup and os.path.isdir(cgroup):
            try:
                cg_write(os.path.join(cgroup, "cgroup.procs"), str(os.getpid()).encode())
            except OSError:
                pass  # outside it, the monitor still works: the stop sweeps what the cgroup would show
        print(f"clusterrun monitor {os.getpid()}: started by an agent (no monitor or survivor was running)", flush=True)
        return Monitor(folder).run()

    exit_with(monitor)


def leave_cgroup(cgroup: str, pids: list[int]) -> bool:
    """Move ``pids`` (the survivor, a monitor) to the parent of the attempt's cgroup, now that
    nothing of the job is left in it, and remove it; True if it is gone."""
    for pid in pids:
        try:
            cg_write(os.path.join(os.path.dirname(cgroup), "cgroup.procs"), str(pid).encode())
        except OSError:
            pass  # gone already; or not allowed: the next status or stop removes it once empty
    return cg_remove(cgroup)


def save_state(folder: str, state: dict[str, Any]) -> bool:
    """Write state.json; on a full or read-only disk keep it in memory and go on supervising
    (stopping needs no disk), and leave a ``degraded`` marker for the agent where one fits."""
    try:
        write_json_atomic(os.path.join(folder, "state.json"), state)
        return True
    except OSError as exc:
        _degrade(folder, state, f"cannot write state.json: {fs_problem(exc)}")
        return False


def _degrade(folder: str, state: dict[str, Any], reason: str) -> None:
    """Record why the state or log could not be written: in ``state`` and, where it fits, in a
    ``degraded`` marker file for the agent."""
    if state.get("degraded"):
        return
    state["degraded"] = reason
    try:
        print(f"clusterrun supervisor: degraded: {reason}", flush=True)
    except OSError:
        pass  # supervisor.log is on the same disk
    try:  # an empty file needs an inode, not a block: it often fits where the state did not
        fd = os.open(os.path.join(folder, "degraded"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, reason.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


class Monitor:
    """Everything of a node's attempt but waiting for torchrun: merges the rank logs, records
    workers, sessions and the kernel's OOM kills, and at the end sweeps and writes the final state.

    create → run(): take the lock → resume (state.json, RankLogs's journal) → watch until torchrun
    ended → its exit from the exit file (unknown if the survivor died first) → sweep → final
    state. It may be killed at any moment: the survivor, or the next agent to look, starts another."""

    def __init__(self, folder: str, state: dict[str, Any] | None = None, kernel: KernelLog | None = None) -> None:
        self.folder = folder
        self.given = state  # the survivor's state, when it forked us at the start
        self.kernel = kernel
        self.term_requested = False
        self.workers: dict[int, PidHandle] = {}
        self.exits = ExitReader()  # the workers' exits, read as they end
        self.state: dict[str, Any] = {}

    def save(self) -> bool:
        return save_state(self.folder, self.state)

    def _on_term(self, signum: int, frame: object) -> None:
        self.term_requested = True

    def run(self) -> int:
        import fcntl

        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        lock = os.open(os.path.join(self.folder, MONITOR_LOCK), os.O_WRONLY | os.O_CREAT, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)  # another monitor at work: take over when it ends
        state = self.given or read_json(os.path.join(self.folder, "state.json"))
        if state is None or state.get("state") == "exited":
            return 0
        self.state = state
        # A monitor that resumes watches the workers still running first: one that ends before it is
        # watched leaves no exit code. The state names this monitor once it watches them.
        self.exits.start()
        for w in state.get("workers") or []:
            if w.get("died") is None and w.get("pid") and w["pid"] not in self.workers:
                try:
                    self.workers[w["pid"]] = PidHandle(w["pid"])
                except ProcessLookupError:
                    continue
                self.exits.watch(w["pid"])
        self.state["supervisor"] = proc_entry(os.getpid())
        self.save()
        signal.signal(signal.SIGTERM, self._on_term)
        self.wakeup, wakeup_w = os.pipe()
        os.set_blocking(self.wakeup, False)
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w)
        self.waker = Waker()
        if self.kernel is None:
            self.kernel = KernelLog()  # a monitor started by an agent: kills before now are not seen
        self.cgroup = state.get("cgroup")
        self.job_cgroup = (os.path.join(self.cgroup, "job") if self.cgroup and not state.get("job_cgroup_missed")
                           else None)
        log_fd = os.open(os.path.join(self.folder, "output.log"), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self.log_fd = log_fd
        spec = read_json(os.path.join(self.folder, "spec.json")) or {}
        first_rank = int(state.get("first_rank") or spec.get("first_rank") or 0)
        # The training's progress is read from rank 0's output, on its node (the controller checked the pattern).
        self.progress: Any = None  # progress.Tracker, once rank 0 wrote what may be progress (PROGRESS_HINTS)
        self.progress_spec = (spec.get("progress"), state.get("progress")) if first_rank == 0 else None
        if self.progress_spec is not None and (spec.get("progress") or state.get("progress")):
            self._track()
        self.progress_due: float | None = None  # when a changed progress is saved next (None: nothing new)
        self.heard = 0  # bytes of the ranks' output read so far (``_rank_output``)
        self.rank_logs = RankLogs(os.path.join(self.folder, "torchrun"), log_fd, first_rank, self.waker,
                                  journal=os.path.join(self.folder, RANK_JOURNAL),
                                  times=os.path.join(self.folder, TIMES), tap=self._rank_output)
        self.silence = QuietWatch(spec.get("hang_after"), state.get("quiet_since"))
        self.master_port = master_port(spec.get("argv") or [])
        self.rdzv_next = time.monotonic() + RDZV_CHECK  # torchrun cannot have joined in its first moments
        tr = state.get("torchrun") or {}
        torchrun = pin(tr["pid"], tr.get("start_time")) if tr.get("pid") else None
        if torchrun is not None:
            self._watch(torchrun)
            torchrun.close()
        self._finish(log_fd)
        os.close(lock)
        return 0

    def _track(self) -> None:
        from .progress import Tracker

        pattern, start = self.progress_spec or (None, None)
        self.progress = Tracker(pattern, start)

    def _rank_output(self, rank: int, data: bytes) -> None:
        """A rank's new output read: a sign of life, partial lines included (a progress bar redraws
        its line without ending it); rank 0's progress, saved at most every ``PROGRESS_EVERY`` seconds."""
        self.heard += len(data)
        if rank != 0 or self.progress_spec is None:
            return
        if self.progress is None:
            if not any(hint in data for hint in PROGRESS_HINTS):
                return
            self._track()
        if self.progress.feed(data, time.time()):
            if self.progress_due is None:
                self.progress_due = time.monotonic() + (PROGRESS_EVERY if self.state.get("progress") else 0.0)

    def _progress_changed(self, final: bool = False) -> bool:
        """Whether a changed progress is due to be saved (True: it is in ``state`` now)."""
        if self.progress is None or self.progress_due is None or (time.monotonic() < self.progress_due and not final):
            return False
        self.state["progress"] = self.progress.to_json()
        self.progress_due = None
        return True

    def _exit_status(self) -> dict[str, Any] | None:
        """torchrun's exit as the survivor wrote it; waits while a living survivor may still."""
        sv = self.state.get("survivor") or {}
        survivor = pin(sv["pid"], sv.get("start_time")) if sv.get("pid") else None
        deadline = time.monotonic() + EXIT_WAIT
        try:
            while True:
                found = read_exit(self.folder)
                if found is not None or survivor is None or not survivor.alive() or time.monotonic() > deadline:
                    return found
                select.select([survivor.fd] if survivor.fd >= 0 else [], [], [], POLL_INTERVAL)
        finally:
            if survivor is not None:
                survivor.close()

    def _finish(self, log_fd: int) -> None:
        """torchrun has ended: its exit status, what it left killed, the last lines, the final state."""
        self.exits.close()
        now = time.time()
        for w in self.state["workers"]:
            if w["died"] is None:
                w["died"] = self.exits.ended.get(w["pid"], now)
            if w.get("exit_code") is None and w["pid"] in self.exits.codes:
                w["exit_code"] = self.exits.codes[w["pid"]]
        self.state["quiet_since"] = None  # no rank runs: the job's owner must not read an ended node as quiet
        found = self._exit_status() or learned_exit(self.state["workers"], self.folder)
        cut_short = failed_first(self.state["workers"], self.folder)
        if cut_short is not None and (found is None or found.get("signal") is not None):
            found = cut_short  # torchrun killed by the stop: it would have exited 1 for its rank
        if found is None:
            self.state.update(exit_code=None, signal=None, exit_status="unknown",
                              error="torchrun's exit status is unknown: the survivor that waited for it ended "
                                    "first (killed?)")
        else:
            self.state.update(found)
        stop = read_stop(self.folder)
        self.state["stop_requested"] = cut_short is None and (
            self.term_requested or bool(self.state.get("stop_requested")) or stop is not None)
        if stop is not None:
            self.state["stop_at"] = stop[2]  # a rank that ended before it failed by itself (``rootcause``)
        if self.state["stop_requested"] and stop is not None:
            self.state["stopped_by"] = stop[1]
        self.save()
        if self.job_cgroup and os.path.isdir(self.job_cgroup):  # what torchrun left behind, all of it, at once
            cg_kill(self.job_cgroup, {})
            cg_wait_empty(self.job_cgroup, time.monotonic() + 10)
        sv = self.state.get("survivor") or {}
        scope = JobScope(self.state, exclude={os.getpid(), *([sv["pid"]] if sv.get("pid") else [])})
        scope.sweep(term_wait=2.0, deadline=time.monotonic() + 20, killed={})
        self.rank_logs.poll(final=True)  # nothing of the job is left to write: the rest, partial lines too
        self.rank_logs.close()
        self._progress_changed(final=True)
        if self.rank_logs.error:
            _degrade(self.folder, self.state, self.rank_logs.error)
        os.close(log_fd)
        if self.state["exit_code"] != 0 and self.kernel is not None:  # an OOM kill? what the kernel said
            self.state["oom"] = self.kernel.report(self.cgroup)
        if self.kernel is not None:
            self.kernel.close()
        if self.cgroup and os.path.isdir(self.cgroup):  # nothing of the job is left in it: the survivor and us
            self.state["cgroup_removed"] = leave_cgroup(self.cgroup, [sv["pid"], os.getpid()] if sv.get("pid")
                                                        else [os.getpid()])
        self.state.update(state="exited", ended_at=time.time())
        self.save()

    def _watch(self, torchrun: PidHandle) -> None:
        """Until torchrun exits: merge the rank logs and record workers and sessions. Sleeps until
        something happens (see ``Waker``): a rank file written or created, a worker's or
        torchrun's pidfd, or SIGTERM (through the signal wake-up pipe)."""
        waker = self.waker
        kernel = self.kernel
        last_scan = last_merge = 0.0
        busy_until = 0.0  # until torchrun makes per-rank files
        quiet = SCAN_INTERVAL  # between scans when not busy: doubles up to IDLE_SCAN_INTERVAL
        forwarded = unsaved = False
        while True:
            now = time.monotonic()
            polling = (not waker.reliable or torchrun.fd < 0 or any(h.fd < 0 for h in self.workers.values()))
            scan_at = last_scan + (SCAN_INTERVAL if polling or now < busy_until else quiet)
            if self._awaits_rendezvous():
                scan_at = min(scan_at, self.rdzv_next)  # the start-up watch wants it at every RDZV_CHECK
            timeout = MERGE_INTERVAL if polling else min(scan_at - now, IDLE_CHECK)
            fds = [h.fd for h in self.workers.values() if h.fd >= 0] + [self.wakeup]
            ready = waker.wait(timeout, fds + ([torchrun.fd] if torchrun.fd >= 0 else []))
            if self.wakeup in ready:
                drain(self.wakeup)
            changed = False
            seen_at = time.time()
            for pid, handle in list(self.workers.items()):
                if handle.fd in ready or (handle.fd < 0 and not handle.alive()):
                    code = self.exits.codes.get(pid, zombie_exit(pid))
                    for w in self.state["workers"]:
                        if w["pid"] == pid and w["died"] is None:
                            w["died"] = self.exits.ended.get(pid, seen_at)
                            if code is not None:
                                w["exit_code"] = code
                            changed = True
                    handle.close()
                    del self.workers[pid]
                    changed |= self._quiet_watch()  # the last rank gone: not quiet from now on, said at once
            ended = not torchrun.alive()
            if self.term_requested and not forwarded:
                forwarded = True
                torchrun.signal(signal.SIGTERM)
            now = time.monotonic()
            if not ended and now >= scan_at:
                last_scan, quiet = now, min(quiet * 2, IDLE_SCAN_INTERVAL)
                changed |= self._scan(torchrun.pid) | self._quiet_watch() | self._rendezvous(torchrun.pid)
                if kernel is not None:
                    kernel.keep = {torchrun.pid, *(w["pid"] for w in self.state["workers"])}
                    kernel.drain()  # often enough that the kernel's ring buffer does not overwrite a kill
            if not ended and last_merge + MERGE_INTERVAL > now:  # woken again at once (a flood): batches
                time.sleep(last_merge + MERGE_INTERVAL - now)
            last_merge = time.monotonic()
            if self.rank_logs.poll():
                busy_until = last_merge + BUSY
            if self.rank_logs.error:
                _degrade(self.folder, self.state, self.rank_logs.error)
            changed |= self._progress_changed()
            if changed or (unsaved and now - last_scan < 0.1):  # after a failed write: at each scan
                unsaved = not self.save()
            if ended:
                return

    def _awaits_rendezvous(self) -> bool:
        """Whether torchrun may still be waiting in the rendezvous (no worker yet, not seen joined)."""
        return not (self.state["workers"] or self.master_port is None or self.state.get("rdzv_joined"))

    def _rendezvous(self, torchrun_pid: int) -> bool:
        """Until torchrun has workers: whether it joined the rendezvous (``rdzv_joined``), for the
        controller's start-up watch to name the nodes that did not; True if that changed."""
        now = time.monotonic()
        if not self._awaits_rendezvous() or self.master_port is None or now < self.rdzv_next:
            return False
        self.rdzv_next = now + RDZV_CHECK
        joined = joined_store(torchrun_pid, self.master_port)
        if joined == self.state.get("rdzv_joined"):
            return False
        self.state["rdzv_joined"] = joined
        return True

    def _quiet_watch(self) -> bool:
        """Whether the ranks went quiet, or spoke again (``QuietWatch``): by the bytes read of their
        output and the log's size (torchrun's own lines); True if ``quiet_since`` changed. The job's
        owner decides from every node's whether the job hangs."""
        try:
            size = os.fstat(self.log_fd).st_size
        except OSError:
            return False
        if not self.silence.sample(any(w["died"] is None for w in self.state["workers"]), size + self.heard):
            return False
        self.state["quiet_since"] = self.silence.quiet_since
        return True

    def _scan(self, torchrun_pid: int) -> bool:
        # the attempt's cgroup holds the survivor, torchrun and everything they started
        procs = ({pid: info for pid in cg_pids(self.cgroup) if (info := proc_info(pid)) is not None}
                 if self.cgroup else None) or all_procs()
        changed = False
        known = {w["pid"] for w in self.state["workers"]}
        for pid, info in procs.items():
            if info.ppid == torchrun_pid and pid not in known and info.state != "Z":
                env = proc_env(pid)
                if "RANK" not in env:
                    continue
                try:
                    handle = PidHandle(pid)
                except ProcessLookupError:
                    continue
                self.workers[pid] = handle
                self.exits.watch(pid)
                self.state["workers"].append({"pid": pid, "rank": int(env.get("RANK", -1)),
                                              "local_rank": int(env.get("LOCAL_RANK", -1)), "died": None})
                changed = True
        sessions = set(self.state["sessions"])
        leaders = self.state.setdefault("session_leaders", {})
        sv = self.state.get("survivor") or {}
        for pid in descendants(sv.get("pid") or os.getpid(), procs):
            sid = procs[pid].sid
            if sid not in sessions and sid != sv.get("sid"):  # the survivor's own session holds its monitors
                sessions.add(sid)
                leader = procs.get(sid)
                leaders[str(sid)] = leader.start_time if leader is not None else None
        if sessions != set(self.state["sessions"]):
            self.state["sessions"] = sorted(sessions)
            changed = True
        return changed
