"""The survivor of one attempt (see the package docstring): the small process that starts
torchrun, waits for it and reaps it, writes its exit status to the exit file, and restarts the
monitor when it dies. It does nothing else, so that nothing else can take it down."""

from __future__ import annotations

import os
import select
import time

from .cgroup import cg_remove, cg_write, cgroup_path, make_cgroup, own_cgroup
from .codec import json_dumps
from .kmsg import KernelLog
from .monitor import EXIT_FILE, RESPAWNS, Monitor, leave_cgroup, save_state
from .procs import proc_entry, signal
from .records import (
    attempt_marker,
    boot_id,
    fs_problem,
    not_started,
    read_json,
    write_atomic,
    write_json_atomic,
)
from .system import exit_with
from .waker import IDLE_CHECK, Waker, drain

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

PR_SET_CHILD_SUBREAPER = 36


def exit_record(status: int, pid: int) -> dict[str, Any]:
    """The exit file's content for a wait status."""
    if os.WIFSIGNALED(status):
        return {"exit_code": -os.WTERMSIG(status), "signal": os.WTERMSIG(status), "pid": pid}
    return {"exit_code": os.WEXITSTATUS(status), "signal": None, "pid": pid}


class Survivor:
    """The part of a node's attempt that must outlive everything (conmon's role): it starts
    torchrun, reaps it and its orphans, writes the exit file, and restarts the monitor when it dies.

    create → run(): join the cgroup (a child writes it while this one prepares), start torchrun,
    fork the monitor, tell ``start`` → wait and
    reap → (torchrun exits) exit file → (the monitor finished) leave and remove the cgroup.
    It writes state.json only before the monitor runs; from then on the monitor owns it."""

    def __init__(self, folder: str, ready_fd: int = -1, env: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.env = env  # torchrun's environment (spec.json holds it with secret values masked)
        spec = read_json(os.path.join(folder, "spec.json"))
        if spec is None:
            raise SystemExit(f"clusterrun supervisor: no spec.json in {folder}")
        self.spec = spec
        self.ready_fd = ready_fd
        self.cgroup: str | None = spec.get("cgroup")
        self.job_cgroup: str | None = os.path.join(self.cgroup, "job") if self.cgroup else None
        self.state = {
            "state": "starting", "job": spec["job"], "node": spec["node"], "attempt": spec["attempt"],
            "boot_id": boot_id(), "survivor": dict(proc_entry(os.getpid()), sid=os.getsid(0)), "supervisor": None,
            "torchrun": None, "exit_code": None, "signal": None, "error": None, "stop_requested": False,
            "workers": [], "sessions": [], "started_at": time.time(), "ended_at": None,
            "cgroup": None, "fallbacks": list(spec.get("fallbacks") or []), "degraded": None,
        }
        self.term_requested = False

    def save(self) -> bool:
        return save_state(self.folder, self.state)

    def _ready(self) -> None:
        """Tell the agent that started us how the start went (once), whether or not it is on disk."""
        if self.ready_fd >= 0:
            try:
                os.write(self.ready_fd, json_dumps(self.state).encode() + b"\n")
            except OSError:
                pass  # the agent is gone: the state file says it
            os.close(self.ready_fd)
            self.ready_fd = -1

    def _on_term(self, signum: int, frame: object) -> None:
        self.term_requested = True

    def _start_joining(self) -> int:
        """Begin this process's move into the attempt's cgroup, written by a child: a first move
        waits about 10 ms for the kernel (an RCU grace period of cgroup_threadgroup_rwsem), during
        which this one gets on with the start (its ctypes import, 4-5 ms). The child's pid, or 0."""
        if self.spec.get("user_scope"):  # started by systemd-run in a scope delegated to the user
            self.cgroup, why = make_cgroup(self.spec["job"], self.spec["node"], self.spec["attempt"])
            self.job_cgroup = os.path.join(self.cgroup, "job") if self.cgroup else None
            if why:
                self.state["fallbacks"].append(f"no cgroup: {why}")
        if not self.cgroup:
            return 0
        procs, me = os.path.join(self.cgroup, "cgroup.procs"), os.getpid()
        child = os.fork()
        if child == 0:
            code = 0
            try:
                cg_write(procs, str(me).encode())
            except OSError as exc:
                code = exc.errno or 255
            os._exit(code)  # no clean-up: a forked copy of this process
        return child

    def _joined(self, child: int) -> None:
        """Wait for ``_start_joining``'s child; where it could not move us, no cgroup (said why)."""
        if child:
            _, status = os.waitpid(child, 0)
            if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
                why = os.strerror(os.WEXITSTATUS(status)) if os.WIFEXITED(status) else f"status {status}"
                self.state["fallbacks"].append(f"no cgroup: cannot join {self.cgroup}: {why}")
                if self.cgroup:
                    cg_remove(self.cgroup)
                self.cgroup = self.job_cgroup = None
        self.state["cgroup"] = self.cgroup

    def _leave_cgroup(self) -> None:
        """Once nothing of the job is left: out of the attempt's cgroup, which is removed (the
        monitor did it already unless it could not)."""
        if self.cgroup and os.path.isdir(self.cgroup):
            leave_cgroup(self.cgroup, [os.getpid()])

    def run(self) -> int:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_term)
        joining = self._start_joining()
        if not set_subreaper():
            self.state["fallbacks"].append("no subreaper (prctl through ctypes failed): orphans of the job go to "
                                           "init and are found by marker and session only")
        env = dict(self.env) if self.env is not None else {**os.environ, **self.spec["env"]}
        key, _, value = attempt_marker(self.spec["job"], self.spec["node"], self.spec["attempt"]).partition("=")
        env[key] = value
        # torchrun's --log-dir, inside this attempt's private directory (never the log we keep)
        env["PET_LOG_DIR"] = os.path.join(self.folder, "torchrun")
        # Woken by a child's end and by SIGTERM: their handlers write to this pipe (a handler for
        # SIGCHLD, not SIG_IGN, which would reap torchrun before its status is read).
        self.wakeup, self.wakeup_w = os.pipe()
        os.set_blocking(self.wakeup, False)
        os.set_blocking(self.wakeup_w, False)
        signal.set_wakeup_fd(self.wakeup_w)
        signal.signal(signal.SIGCHLD, _ignore)
        waker = Waker()
        if waker.fd < 0:
            self.state["fallbacks"].append("no inotify: the supervisor polls (20 times a second)")
        waker.close()
        self._joined(joining)  # before anything is recorded or started: the job is born in the cgroup
        try:
            log_fd = os.open(os.path.join(self.folder, "output.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.makedirs(env["PET_LOG_DIR"], mode=0o700, exist_ok=True)  # torchrun accepts it existing
            write_json_atomic(os.path.join(self.folder, "state.json"), self.state)  # nothing runs yet
        except OSError as exc:
            self.state.update(state="exited", ended_at=time.time(), unwritable=True,
                              error=not_started("cannot write to the state dir", self.folder, exc))
            self._leave_cgroup()
            self._ready()
            return 1
        kernel = KernelLog()  # from here on: an OOM kill of the job is among what it reads
        try:
            pid = spawn_job(self.spec["argv"], env, self.spec.get("cwd") or None, log_fd, self.job_cgroup)
        except OSError as exc:
            kernel.close()
            os.close(log_fd)
            self.state.update(state="exited", error="could not start {}: {}".format(self.spec["argv"][0], exc),
                              ended_at=time.time())
            self._leave_cgroup()
            self.save()
            self._ready()
            return 1
        os.close(log_fd)  # torchrun holds it; the monitor opens its own
        if self.job_cgroup and own_cgroup(pid) != cgroup_path(self.job_cgroup):
            self.state["fallbacks"].append(f"torchrun is not in {self.job_cgroup}: a stop kills the attempt's "
                                           "whole cgroup instead")
            self.state["job_cgroup_missed"] = True
        self.state.update(state="running", torchrun=proc_entry(pid), sessions=[pid])
        go_r, go_w = os.pipe()
        monitor = self._fork_monitor(kernel, go_r, go_w)
        os.close(go_r)
        self.state["supervisor"] = proc_entry(monitor)
        self.save()
        os.close(go_w)  # the monitor starts from the state just written
        self._ready()
        return self._wait(pid, monitor, kernel)

    def _fork_monitor(self, kernel: KernelLog, go_fd: int = -1, go_w: int = -1) -> int:
        state = dict(self.state)
        child = os.fork()
        if child:
            return child
        signal.set_wakeup_fd(-1)
        os.close(self.wakeup)
        os.close(self.wakeup_w)
        if self.ready_fd >= 0:
            os.close(self.ready_fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        if go_fd >= 0:
            os.close(go_w)
            os.read(go_fd, 1)  # EOF once the survivor wrote the state
            os.close(go_fd)
        exit_with(lambda: Monitor(self.folder, state if go_fd >= 0 else None, kernel).run())

    def _wait(self, torchrun: int, monitor: int, kernel: KernelLog) -> int:
        """Reap until torchrun has exited (its exit file written) and a monitor has finished."""
        exited = finished = forwarded = False
        respawns = 0
        while not (exited and finished):
            select.select([self.wakeup], [], [], IDLE_CHECK)
            drain(self.wakeup)
            if self.term_requested and not forwarded and not exited:
                forwarded = True
                os.kill(torchrun, signal.SIGTERM)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if pid == torchrun:
                    exited = True
                    try:
                        write_atomic(os.path.join(self.folder, EXIT_FILE),
                                     json_dumps(exit_record(status, pid)).encode())
                    except OSError as exc:  # the monitor then reports the exit status as unknown
                        print(f"clusterrun survivor: cannot write the exit file: {fs_problem(exc)}", flush=True)
                elif pid == monitor:
                    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                        finished = True  # it wrote the final state
                    elif respawns < RESPAWNS:
                        respawns += 1
                        print(f"clusterrun survivor: monitor {pid} died (status {status}); restarting it", flush=True)
                        monitor = self._fork_monitor(kernel)
                    else:
                        finished = True  # the next contact of an agent starts one
        self._leave_cgroup()
        return 0


def spawn_job(argv: list[str], env: dict[str, str], cwd: str | None, out_fd: int, cgroup: str | None = None) -> int:
    """Start ``argv`` (found on ``env``'s PATH) in a session of its own, stdin from /dev/null and
    stdout and stderr to ``out_fd``; its pid, or the ``OSError`` that kept it from running.

    What ``subprocess.Popen(..., start_new_session=True)`` does, without importing subprocess
    (paid on the way to every node's start). Every other descriptor of the supervisor
    is close-on-exec (Python opens them so), so the job inherits none of them.
    With ``cgroup``, the child moves itself there before anything else runs in it.
    """
    errors_r, errors_w = os.pipe()  # close-on-exec: the parent reads EOF once exec succeeded
    pid = os.fork()
    if pid == 0:
        failure = b"OSError"
        try:
            os.close(errors_r)
            if cgroup:
                try:
                    cg_write(os.path.join(cgroup, "cgroup.procs"), b"0")
                except OSError:
                    pass  # it stays in the supervisor's cgroup, which the supervisor notices
            os.setsid()
            for sig in ("SIGPIPE", "SIGXFSZ"):  # Python ignores them; as subprocess does, not the job
                if hasattr(signal, sig):
                    signal.signal(getattr(signal, sig), signal.SIG_DFL)
            if cwd:
                failure = b"chdir"
                os.chdir(cwd)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out_fd, 1)
            os.dup2(out_fd, 2)
            failure = b"exec"
            os.execvpe(argv[0], argv, env)
        except OSError as exc:
            os.write(errors_w, b"%d %s" % (exc.errno or 0, failure))
        finally:
            os._exit(127)
    os.close(errors_w)
    try:
        report = os.read(errors_r, 256)
    finally:
        os.close(errors_r)
    if report:
        os.waitpid(pid, 0)
        number, _, step = report.partition(b" ")
        where = cwd if step == b"chdir" else argv[0]
        raise OSError(int(number), os.strerror(int(number)), where)
    return pid


def _ignore(signum: int, frame: object) -> None:
    """A signal handler that does nothing: the signal only wakes the wait (``set_wakeup_fd``)."""


def set_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants; False where that failed."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (ImportError, OSError, AttributeError):  # ImportError: a Python built without ctypes
        return False  # the marker and the recorded sessions still find the job's processes
