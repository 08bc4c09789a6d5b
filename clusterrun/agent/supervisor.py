"""The detached supervisor of one attempt (see the package docstring): how it is started (forked,
or through systemd-run with ``SUPERVISE``), how it starts torchrun, and ``Supervisor`` itself."""

from __future__ import annotations

import os
import sys
import time

from .cgroup import _cgroup_path, _make_cgroup, _own_cgroup, cg_kill, cg_remove, cg_wait_empty, cg_write
from .codec import json_dumps, json_loads
from .kmsg import KernelLog
from .procs import JobScope, PidHandle, all_procs, descendants, proc_env, proc_info, signal
from .ranklogs import RankLogs
from .records import _boot_id, _fs_problem, _marker, _read_json, _write_json_atomic
from .system import _close_fds_from
from .waker import IDLE_CHECK, Waker, _drain

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import NoReturn

PR_SET_CHILD_SUBREAPER = 36
# How often at most the supervisor reads new bytes of torchrun's per-rank files to merge them into
# the node's log (``follow.POLL_INTERVAL`` is its counterpart; docs/benchmarks.md); without inotify
# also its polling interval. It looks for new worker processes every SCAN_INTERVAL seconds for
# BUSY seconds after torchrun started or made new per-rank files (it is starting workers), else
# every IDLE_SCAN_INTERVAL seconds.
MERGE_INTERVAL = 0.02
SCAN_INTERVAL = 0.25
IDLE_SCAN_INTERVAL = 2.0
BUSY = 10.0


def _spawn_job(argv: list[str], env: dict[str, str], cwd: str | None, out_fd: int, cgroup: str | None = None) -> int:
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


class Supervisor:
    """Runs one node's torchrun: create → run() → (torchrun exits) → sweep → final state."""

    def __init__(self, folder: str, ready_fd: int = -1, env: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.env = env  # torchrun's environment (spec.json holds it with secret values masked)
        spec = _read_json(os.path.join(folder, "spec.json"))
        if spec is None:
            raise SystemExit(f"clusterrun supervisor: no spec.json in {folder}")
        self.spec = spec
        self.ready_fd = ready_fd
        self.cgroup: str | None = spec.get("cgroup")
        self.job_cgroup: str | None = os.path.join(self.cgroup, "job") if self.cgroup else None
        me = proc_info(os.getpid())
        self.state = {
            "state": "starting", "job": spec["job"], "node": spec["node"], "attempt": spec["attempt"],
            "boot_id": _boot_id(), "supervisor": {"pid": os.getpid(), "start_time": me.start_time if me else None},
            "torchrun": None, "exit_code": None, "signal": None, "error": None, "stop_requested": False,
            "workers": [], "sessions": [], "started_at": time.time(), "ended_at": None,
            "cgroup": None, "fallbacks": list(spec.get("fallbacks") or []), "degraded": None,
        }
        self.term_requested = False
        self.workers: dict[int, PidHandle] = {}

    def save(self) -> bool:
        """Write the state; on a full or read-only disk keep it in memory and go on supervising
        (stopping needs no disk), and leave a ``degraded`` marker for the agent where one fits."""
        try:
            _write_json_atomic(os.path.join(self.folder, "state.json"), self.state)
            return True
        except OSError as exc:
            self._degrade(f"cannot write state.json: {_fs_problem(exc)}")
            return False

    def _degrade(self, reason: str) -> None:
        if self.state.get("degraded"):
            return
        self.state["degraded"] = reason
        try:
            print(f"clusterrun supervisor: degraded: {reason}", flush=True)
        except OSError:
            pass  # supervisor.log is on the same disk
        try:  # an empty file needs an inode, not a block: it often fits where the state did not
            fd = os.open(os.path.join(self.folder, "degraded"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, reason.encode())
            finally:
                os.close(fd)
        except OSError:
            pass

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

    def _join_cgroup(self) -> None:
        if self.spec.get("user_scope"):  # started by systemd-run in a scope delegated to the user
            self.cgroup, why = _make_cgroup(self.spec["job"], self.spec["node"], self.spec["attempt"])
            self.job_cgroup = os.path.join(self.cgroup, "job") if self.cgroup else None
            if why:
                self.state["fallbacks"].append(f"no cgroup: {why}")
        if not self.cgroup:
            return
        try:
            cg_write(os.path.join(self.cgroup, "cgroup.procs"), str(os.getpid()).encode())
        except OSError as exc:
            self.state["fallbacks"].append(f"no cgroup: cannot join {self.cgroup}: {os.strerror(exc.errno or 0)}")
            cg_remove(self.cgroup)
            self.cgroup = self.job_cgroup = None
        self.state["cgroup"] = self.cgroup

    def _leave_cgroup(self) -> None:
        """Once nothing of the job is left: move out of the attempt's cgroup and remove it."""
        if not self.cgroup:
            return
        try:
            cg_write(os.path.join(os.path.dirname(self.cgroup), "cgroup.procs"), str(os.getpid()).encode())
        except OSError:
            return  # the stop removes it once the supervisor has exited
        self.state["cgroup_removed"] = cg_remove(self.cgroup)

    def run(self) -> int:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_term)
        self._join_cgroup()
        if not _set_subreaper():
            self.state["fallbacks"].append("no subreaper (prctl through ctypes failed): orphans of the job go to "
                                           "init and are found by marker and session only")
        env = dict(self.env) if self.env is not None else {**os.environ, **self.spec["env"]}
        key, _, value = _marker(self.spec["job"], self.spec["node"], self.spec["attempt"]).partition("=")
        env[key] = value
        # torchrun's --log-dir, inside this attempt's private directory (never the log we keep)
        env["PET_LOG_DIR"] = os.path.join(self.folder, "torchrun")
        # Woken by a child's end and by SIGTERM: their handlers write to this pipe (a handler for
        # SIGCHLD, not SIG_IGN, which would reap torchrun before its status is read).
        self.wakeup, wakeup_w = os.pipe()
        os.set_blocking(self.wakeup, False)
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w)
        signal.signal(signal.SIGCHLD, _ignore)
        self.waker = Waker()
        if self.waker.fd < 0:
            self.state["fallbacks"].append("no inotify: the supervisor polls (20 times a second)")
        try:
            log_fd = os.open(os.path.join(self.folder, "output.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.makedirs(env["PET_LOG_DIR"], mode=0o700, exist_ok=True)  # torchrun accepts it existing
            _write_json_atomic(os.path.join(self.folder, "state.json"), self.state)  # nothing runs yet
        except OSError as exc:
            self.state.update(state="exited", ended_at=time.time(), unwritable=True,
                              error=f"cannot write to the state dir {self.folder}: {_fs_problem(exc)}; nothing was "
                                    "started (free space there or set `state_dir:` for this host)")
            self._leave_cgroup()
            self._ready()
            return 1
        self.rank_logs = RankLogs(env["PET_LOG_DIR"], log_fd, int(self.spec.get("first_rank") or 0), self.waker)
        self.kernel = KernelLog()  # from here on: an OOM kill of the job is among what it reads
        try:
            pid = _spawn_job(self.spec["argv"], env, self.spec.get("cwd") or None, log_fd, self.job_cgroup)
        except OSError as exc:
            self.kernel.close()
            os.close(log_fd)
            self.state.update(state="exited", error="could not start {}: {}".format(self.spec["argv"][0], exc),
                              ended_at=time.time())
            self._leave_cgroup()
            self.save()
            self._ready()
            return 1
        info = proc_info(pid)
        torchrun = PidHandle(pid)
        if self.job_cgroup and _own_cgroup(pid) != _cgroup_path(self.job_cgroup):
            self.state["fallbacks"].append(f"torchrun is not in {self.job_cgroup}: a stop kills the attempt's "
                                           "whole cgroup instead")
            self.job_cgroup = None
        self.state.update(state="running", torchrun={"pid": pid, "start_time": info.start_time if info else None})
        self.state["sessions"] = [pid]
        self.save()
        self._ready()
        status = self._watch(torchrun)
        torchrun.close()
        if os.WIFSIGNALED(status):
            self.state["signal"] = os.WTERMSIG(status)
            self.state["exit_code"] = -os.WTERMSIG(status)
        else:
            self.state["exit_code"] = os.WEXITSTATUS(status)
        self.state["stop_requested"] = self.term_requested or os.path.exists(os.path.join(self.folder, "stop"))
        self.save()
        if self.job_cgroup:  # what torchrun left behind, all of it, at once
            cg_kill(self.job_cgroup, {})
            cg_wait_empty(self.job_cgroup, time.monotonic() + 10)
        scope = JobScope(self.state, exclude={os.getpid()})
        scope.sweep(term_wait=2.0, deadline=time.monotonic() + 20, killed={})
        self._reap_all(timeout=10)
        self.rank_logs.poll(final=True)  # nothing of the job is left to write: the rest, partial lines too
        self.rank_logs.close()
        if self.rank_logs.error:
            self._degrade(self.rank_logs.error)
        os.close(log_fd)
        if self.state["exit_code"] != 0:  # a rank or torchrun may have been OOM-killed: what the kernel said
            self.state["oom"] = self.kernel.report(self.cgroup)
        self.kernel.close()
        self._leave_cgroup()
        self.state.update(state="exited", ended_at=time.time())
        self.save()
        return 0

    def _watch(self, torchrun: PidHandle) -> int:
        """Reap children until torchrun exits; meanwhile merge the rank logs and record workers
        and sessions. Sleeps until something happens (see ``Waker``): a rank file written or
        created, a worker's pidfd, a child's end or SIGTERM (through the signal wake-up pipe)."""
        waker = self.waker
        last_scan = last_merge = 0.0
        busy_until = time.monotonic() + BUSY  # torchrun is about to start its workers
        forwarded = unsaved = False
        while True:
            now = time.monotonic()
            polling = not waker.reliable or any(h.fd < 0 for h in self.workers.values())
            scan_every = SCAN_INTERVAL if polling or now < busy_until else IDLE_SCAN_INTERVAL
            timeout = MERGE_INTERVAL if polling else min(last_scan + scan_every - now, IDLE_CHECK)
            ready = waker.wait(timeout, [h.fd for h in self.workers.values() if h.fd >= 0] + [self.wakeup])
            if self.wakeup in ready:
                _drain(self.wakeup)
            changed = False
            for pid, handle in list(self.workers.items()):
                if handle.fd in ready or (handle.fd < 0 and not handle.alive()):
                    for w in self.state["workers"]:
                        if w["pid"] == pid and w["died"] is None:
                            w["died"] = time.time()
                            changed = True
                    handle.close()
                    del self.workers[pid]
            status = None
            while True:
                try:
                    pid, st = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if pid == torchrun.pid:
                    status = st
            if self.term_requested and not forwarded:
                forwarded = True
                torchrun.signal(signal.SIGTERM)
            now = time.monotonic()
            if status is None and now - last_scan >= scan_every:
                last_scan = now
                changed |= self._scan(torchrun.pid)
                self.kernel.keep = {torchrun.pid, *(w["pid"] for w in self.state["workers"])}
                self.kernel.drain()  # often enough that the kernel's ring buffer does not overwrite a kill
            if status is None and last_merge + MERGE_INTERVAL > now:  # woken again at once (a flood): batches
                time.sleep(last_merge + MERGE_INTERVAL - now)
            last_merge = time.monotonic()
            if self.rank_logs.poll():
                busy_until = last_merge + BUSY
            if self.rank_logs.error:
                self._degrade(self.rank_logs.error)
            if changed or (unsaved and now - last_scan < 0.1):  # after a failed write: at each scan
                unsaved = not self.save()
            if status is not None:
                for w in self.state["workers"]:
                    if w["died"] is None:
                        w["died"] = time.time()
                return status

    def _scan(self, torchrun_pid: int) -> bool:
        procs = all_procs()
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
                self.state["workers"].append({"pid": pid, "rank": int(env.get("RANK", -1)),
                                              "local_rank": int(env.get("LOCAL_RANK", -1)), "died": None})
                changed = True
        sessions = set(self.state["sessions"])
        leaders = self.state.setdefault("session_leaders", {})
        for pid in descendants(os.getpid(), procs):
            sid = procs[pid].sid
            if sid not in sessions:
                sessions.add(sid)
                leader = procs.get(sid)
                leaders[str(sid)] = leader.start_time if leader is not None else None
        if sessions != set(self.state["sessions"]):
            self.state["sessions"] = sorted(sessions)
            changed = True
        return changed

    def _reap_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                time.sleep(0.05)


def _ignore(signum: int, frame: object) -> None:
    """A signal handler that does nothing: the signal only wakes the wait (``set_wakeup_fd``)."""


def _set_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants; False where that failed."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (ImportError, OSError, AttributeError):  # ImportError: a Python built without ctypes
        return False  # the marker and the recorded sessions still find the job's processes


# What systemd-run runs in the user's scope (argv: the attempt's folder, then where this package is
# imported from and its name, ``_importable()``): the job's environment arrives on stdin as JSON
# (it holds secrets: never on disk).
SUPERVISE = (
    "import os,sys;e=sys.stdin.buffer.read();n=os.open(os.devnull,os.O_RDONLY);os.dup2(n,0);os.close(n);"
    'sys.path.insert(0,sys.argv[2]);__import__(sys.argv[3]+".supervisor",fromlist=["_"]).supervise_in_scope(sys.argv[1],e)'
)


def _spawn_supervisor(folder: str, scope: list[str] | None = None,
                      env: dict[str, str] | None = None) -> tuple[int, int]:
    """Fork the detached supervisor of ``folder`` (see the module docstring) and return at once
    with the read end of a pipe on which it writes its first state as one JSON line, and the pid
    of a child to reap once that is read (0 if none). With ``scope`` (``user_scope``), the
    supervisor is a new interpreter that systemd-run starts in a scope of the user's manager.
    ``env``: torchrun's whole environment (secrets included), handed over in memory or on the pipe."""
    sys.stdout.flush()
    sys.stderr.flush()
    ready_r, ready_w = os.pipe()
    source_r, source_w = os.pipe() if scope else (-1, -1)
    child = os.fork()
    if child:
        os.close(ready_w)
        if not scope:
            os.waitpid(child, 0)  # the middle process exits at once: the supervisor is nobody's child
            return ready_r, 0
        os.close(source_r)
        try:
            view = memoryview(json_dumps(env).encode())
            while view:
                view = view[os.write(source_w, view):]
        except OSError:
            pass  # systemd-run failed: its message is in supervisor.log, and the ready pipe says so
        finally:
            os.close(source_w)
        return ready_r, child

    def supervise() -> int:
        os.setsid()
        if not scope and os.fork():
            os._exit(0)
        os.chdir(folder)
        log_fd = os.open(os.path.join(folder, "supervisor.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(source_r if scope else os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.dup2(ready_w, 3)
        os.set_inheritable(3, bool(scope))
        _close_fds_from(4)  # the SSH channel's pipes among them: the connection may close
        if scope:
            os.execvp(scope[0], [*scope, sys.executable, "-S", "-c", SUPERVISE, folder, *_importable()])
        return Supervisor(folder, ready_fd=3, env=env).run()

    _exit_with(supervise)


def _exit_with(run: Callable[[], int]) -> NoReturn:
    """End this (forked) process with what ``run`` returns, 1 if it raised: its traceback, the
    supervisor's last word, goes to its log (stderr)."""
    code = 1
    try:
        code = run()
    except BaseException:  # noqa: BLE001 - the supervisor's last word, in its log
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def supervise_in_scope(folder: str, env: bytes) -> None:
    """The supervisor started by systemd-run (``SUPERVISE``), with torchrun's environment as JSON:
    forked once more, so that it is nobody's child, and in the scope all the same."""
    if os.fork():
        os._exit(0)
    os.set_inheritable(3, False)
    _exit_with(lambda: Supervisor(folder, ready_fd=3, env=json_loads(env or b"null")).run())


def _importable() -> tuple[str, str]:
    """Where this package is imported from (a ``sys.path`` entry: on a host, its cached zip) and
    its name there (``clusterrun_agent`` from the zip, ``clusterrun.agent`` in tests)."""
    package = __package__ or "clusterrun_agent"
    root = os.path.dirname(os.path.abspath(__file__))
    for _ in package.split("."):
        root = os.path.dirname(root)
    return root, package
