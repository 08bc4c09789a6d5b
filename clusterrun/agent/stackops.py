"""``stack``: the Python stacks of an attempt's live ranks on this host, by ``py-spy dump``.

The ranks are the workers the monitor recorded (state.json's ``workers``: pid and ``RANK``),
each checked again by the attempt's marker in its environment before it is looked at, so a
reused pid is never dumped. py-spy runs once per rank, all at once, each bounded by the
request's ``timeout``. Where py-spy is missing the answer names the command that installs it
for the job's interpreter; where the kernel refuses ptrace, why (owner, Yama, capabilities) and
the fix. The controller's side is ``clusterrun/diagnose/stacks.py``.
"""

from __future__ import annotations

import os

from .codec import json_loads
from .procs import has_marker, job_alive, proc_env, proc_info
from .records import attempt_dir, attempt_marker, load_state, read_json
from .wire import STOPPED, Frame, RankStack, StackAnswer, StackRequest, ThreadStack

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    # One look at a rank: its stacks (no threads where py-spy is missing) and ``_counters`` then.
    Look = tuple[RankStack, tuple[float, float | None, float | None]]

PY_SPY = "py-spy"
CAP_SYS_PTRACE = 19  # capability(7)'s bit


def op_stack(req: StackRequest) -> dict[str, Any]:
    if not os.path.isdir(attempt_dir(req)):  # never started on this host
        return StackAnswer(ok=True, state="absent", ranks=[]).to_json()
    folder, state = load_state(req)
    kind = str(state.get("state"))
    if kind != "exited" and not job_alive(state):
        kind = "lost"
    if kind not in ("starting", "running"):
        return StackAnswer(ok=True, state=kind, ranks=[]).to_json()
    return take_stacks(folder, state, req.ranks, native=req.native, timeout=req.timeout, looks=req.looks,
                       apart=req.apart).to_json()


def take_stacks(folder: str, state: dict[str, Any], ranks: list[int] | None = None, *, native: bool = False,
                timeout: float = 10.0, looks: int = 1, apart: float = 3.0) -> StackAnswer:
    """The stacks of the live workers of the attempt in ``folder`` (its ``state``), all at once. With
    ``looks`` 2 twice, ``apart`` seconds apart (the job's owner, when the job hangs): each rank says
    whether its stacks moved and the CPU it used meanwhile, the CPU also where py-spy is missing
    (then the answer's ``error`` says so)."""
    import time

    marker = attempt_marker(state["job"], state["node"], state["attempt"])
    workers = [w for w in state.get("workers") or [] if w.get("died") is None and isinstance(w.get("pid"), int)
               and (ranks is None or w.get("rank") in ranks)]
    spec = read_json(os.path.join(folder, "spec.json")) or {}
    python = (spec.get("argv") or [None])[0]
    kind = str(state.get("state"))
    tool = find_py_spy(python, workers, marker)
    missing = (f"py-spy is not installed on this host (looked beside {python or 'the job interpreter'}, on the "
               "job's PATH and the agent's)")
    if tool is None and looks < 2:
        return StackAnswer(ok=True, state=kind, ranks=[], error=missing, fix=install_hint(python))
    looked = _look(tool, workers, marker, native, timeout)
    if looks >= 2:
        time.sleep(apart)
        again = _look(tool, workers, marker, native, timeout)
        looked = [_compared(a, b, bool(tool)) for a, b in zip(looked, again)]  # noqa: B905 - hosts may run 3.8
    return StackAnswer(ok=True, state=kind, ranks=sorted((s for s, _ in looked), key=lambda s: s.rank), tool=tool,
                       error=None if tool else missing, fix=None if tool else install_hint(python))


def _look(tool: str | None, workers: list[dict[str, Any]], marker: str, native: bool, timeout: float) -> list[Look]:
    """Every worker's stacks (py-spy, one thread each, all at once) and time counters, in their order."""
    import threading  # here, not at the agent's start

    looks: list[Look | None] = [None] * len(workers)

    def one(i: int, worker: dict[str, Any]) -> None:
        counters = _counters(int(worker["pid"]))
        stack = (dump_rank(tool, worker, marker, native, timeout) if tool else
                 RankStack(rank=int(worker.get("rank", -1)), pid=int(worker["pid"]), threads=[],
                           local_rank=worker.get("local_rank") if isinstance(worker.get("local_rank"), int) else None))
        looks[i] = (stack, counters)

    threads = [threading.Thread(target=one, args=(i, w), daemon=True) for i, w in enumerate(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [look for look in looks if look is not None]


def _counters(pid: int) -> tuple[float, float | None, float | None]:
    """Now (monotonic), the CPU seconds the process has used (every thread), and the seconds its
    main thread has run or waited for a core (``/proc/PID/schedstat``: on a busy host a spinning
    rank waits for a core as much as it runs; a rank blocked in a collective does neither)."""
    import time

    info = proc_info(pid)
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            ran, waited = f.read().split()[:2]
        wants: float | None = (int(ran) + int(waited)) / 1e9
    except (OSError, ValueError):
        wants = None
    return time.monotonic(), (info.cpu_ticks / os.sysconf("SC_CLK_TCK") if info is not None else None), wants


def _compared(first: Look, last: Look, stacks: bool) -> Look:
    """The last look at a rank, with whether its main thread's stack moved since the first (``stacks``: py-spy
    took them), its share of a core and of the time running or runnable meanwhile, its process state."""
    stack, counters = last
    (at0, cpu0, wants0), (at1, cpu1, wants1) = first[1], counters
    moved = (None if not stacks or first[0].error or stack.error
             else _frames(first[0].threads) != _frames(stack.threads))
    cpu = None if cpu0 is None or cpu1 is None or at1 <= at0 else round((cpu1 - cpu0) / (at1 - at0), 3)
    runnable = None if wants0 is None or wants1 is None or at1 <= at0 else round((wants1 - wants0) / (at1 - at0), 3)
    info = proc_info(stack.pid)
    fields = {name: getattr(stack, name) for name in stack.FIELDS}
    return RankStack(**dict(fields, moved=moved, cpu=cpu, runnable=runnable,
                            state=info.state if info is not None else None)), counters


def _frames(threads: list[ThreadStack]) -> list[str]:
    """What must differ for a rank's stacks to have moved: its main thread's frames or lines (a data
    loader's or a logger's thread moves in a rank that waits for ever)."""
    main = [t for t in threads if t.name == "MainThread"] or threads[:1]
    return [repr([(f.name, f.file, f.line) for f in t.frames]) for t in main]


def find_py_spy(python: str | None, workers: list[dict[str, Any]], marker: str) -> str | None:
    """py-spy beside the job's interpreter (a venv's bin), on a rank's PATH (what its setup left,
    a conda env), on the agent's PATH, or in ~/.local/bin (``pip install --user``)."""
    folders = [os.path.dirname(python)] if python and os.sep in python else []
    for worker in workers[:1]:
        if has_marker(worker["pid"], marker):
            folders += (proc_env(worker["pid"]).get("PATH") or "").split(os.pathsep)
    folders += (os.environ.get("PATH") or "/usr/bin:/bin").split(os.pathsep)
    folders.append(os.path.expanduser("~/.local/bin"))
    for folder in folders:
        path = os.path.join(folder, PY_SPY)
        if folder and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def install_hint(python: str | None, upgrade: bool = False) -> str:
    if upgrade:
        return "pip install -U 'py-spy>=0.4' with the pip of the interpreter that installed it"
    return (f"{python or 'python3'} -m pip install py-spy   (on this host, into the job's interpreter; "
            "or put py-spy on the PATH of the job's setup)")


def dump_rank(tool: str, worker: dict[str, Any], marker: str, native: bool, timeout: float) -> RankStack:
    """One rank's stacks by ``py-spy dump --json``, or why not."""
    import subprocess

    pid, rank = int(worker["pid"]), int(worker.get("rank", -1))
    local = worker.get("local_rank")

    info = proc_info(pid)
    # Stopped (SIGSTOP, Ctrl-Z, a debugger): py-spy cannot pause it, and need not, its memory holds still
    stopped = info is not None and info.state in STOPPED

    def made(threads: list[ThreadStack] | None = None, error: str | None = None, fix: str | None = None) -> RankStack:
        return RankStack(rank=rank, pid=pid, local_rank=local if isinstance(local, int) else None,
                         threads=threads or [], error=error, fix=fix,
                         state=info.state if stopped and info is not None else None)

    if info is None or info.state == "Z":
        return made(error="its process has ended")
    if not has_marker(pid, marker) and _environ_readable(pid):
        return made(error="its process has ended (the pid is another process's now)")
    argv = ([tool, "dump", "--json", "--pid", str(pid)] + (["--nonblocking"] if stopped else [])
            + (["--native"] if native else []))
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return made(error=f"py-spy did not answer within {timeout:g} s (the process is in state {_state_of(pid)}; "
                    "D: waiting in the kernel, e.g. on a device or a network file system)",
                    fix="try again, or give py-spy longer: clusterrun stack --timeout 60")
    except OSError as exc:
        return made(error=f"cannot run {tool}: {exc.strerror or exc}")
    if done.returncode == 0:
        try:
            return made(threads=parse_dump(json_loads(done.stdout)))
        except (ValueError, KeyError, TypeError) as exc:
            return made(error=f"py-spy answered something unexpected: {exc}")
    said = done.stderr.decode("utf-8", "replace").strip()
    first = next((line for line in said.splitlines() if line.strip()), f"exit status {done.returncode}")
    if "Permission Denied" in said or "Operation not permitted" in said or "EPERM" in said:
        error, fix = ptrace_refused(pid, tool)
        return made(error=error, fix=fix)
    if "--json" in said:  # an older py-spy without ``dump --json``
        return made(error=f"{tool} is too old to answer in JSON ({first})", fix=install_hint(None, upgrade=True))
    if proc_info(pid) is None:
        return made(error="its process has ended")
    if "Failed to find python version" in said:  # an interpreter that has not finished starting
        return made(error=f"py-spy: {first} (is the rank still starting?)", fix="try again in a moment")
    return made(error=f"py-spy: {first}")


def parse_dump(data: Any) -> list[ThreadStack]:
    """py-spy's JSON (0.4: a list of threads, each with its frames innermost first)."""
    threads = []
    for thread in data:
        frames = [Frame(name=str(f.get("name")), file=str(f.get("short_filename") or f.get("filename")),
                        line=f.get("line") if isinstance(f.get("line"), int) else None,
                        lib=_is_library(str(f.get("filename"))))
                  for f in thread.get("frames") or []]
        threads.append(ThreadStack(name=thread.get("thread_name"), frames=frames, active=bool(thread.get("active"))))
    return threads


def _is_library(path: str) -> bool:
    """Whether a frame's file is the standard library's or an installed package's (not the job's code)."""
    return any(part in path for part in ("/lib/python3", "/site-packages/", "/dist-packages/")) or \
        path.startswith("<frozen")


def _environ_readable(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb"):
            return True
    except OSError:
        return False


def _state_of(pid: int) -> str:
    info = proc_info(pid)
    return info.state if info is not None else "gone"


def _status_field(pid: str | int, key: str) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _has_cap(mask: str | None, bit: int) -> bool:
    return mask is not None and bool(int(mask, 16) >> bit & 1)


def ptrace_refused(pid: int, tool: str = PY_SPY) -> tuple[str, str]:
    """Why the kernel refused py-spy's ptrace of ``pid``, in words, and the fix on this host."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope: int | None = int(f.read().strip())
    except (OSError, ValueError):
        scope = None
    owner = (_status_field(pid, "Uid") or "").split()[:1]
    me = os.getuid()
    privileged = _has_cap(_status_field("self", "CapEff"), CAP_SYS_PTRACE)
    bounded = _has_cap(_status_field("self", "CapBnd"), CAP_SYS_PTRACE)
    container = os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")
    what = f"ptrace of pid {pid} refused by the kernel"
    if owner and int(owner[0]) != me and not privileged:
        import pwd

        def name(uid: int) -> str:
            try:
                return pwd.getpwuid(uid).pw_name
            except KeyError:
                return str(uid)

        return (f"{what}: the process belongs to {name(int(owner[0]))}, the agent runs as {name(me)}",
                "run clusterrun as the job's user (the hosts file's `user:`), or as root")
    if not bounded:
        return (f"{what}: this host lacks CAP_SYS_PTRACE (a container started without SYS_PTRACE)",
                "start the container with --cap-add SYS_PTRACE (docker, podman), or add SYS_PTRACE to the pod's "
                "securityContext.capabilities (Kubernetes)")
    if scope == 3:
        return (f"{what}: kernel.yama.ptrace_scope is 3 (no ptrace at all until a reboot)",
                "set kernel.yama.ptrace_scope = 1 in /etc/sysctl.d/ and reboot")
    if scope in (1, 2) and not privileged:
        return (f"{what}: kernel.yama.ptrace_scope is {scope} (only {'parents' if scope == 1 else 'root'} "
                "may trace)", "sudo sysctl -w kernel.yama.ptrace_scope=0 (until the next reboot), or let py-spy "
                f"trace: sudo setcap cap_sys_ptrace+ep {tool}")
    if container:
        return (f"{what}: inside a container (its seccomp profile may block ptrace)",
                "start the container with --cap-add SYS_PTRACE, or --security-opt seccomp=unconfined")
    return (f"{what}: the process is not dumpable (it changed user, or called prctl(PR_SET_DUMPABLE, 0))",
            "run clusterrun as root on this host to look at it")
