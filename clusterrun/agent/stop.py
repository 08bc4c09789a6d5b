"""``stop``: the verified stop of one attempt (see the package docstring)."""

from __future__ import annotations

import os
import time

from .cgroup import cg_kill, cg_pids, cg_populated, cg_remove, cg_wait_empty, forget_cgroup
from .monitor import EXIT_WAIT, FAILED_STOP, ensure_monitor, read_stop
from .orphans import census, stop_unrecorded
from .procs import JobScope, all_procs, pin, proc_info, signal
from .records import attempt_dir, boot_id, fs_problem, read_json, read_state, write_json_atomic
from .status import absent_answer

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .wire import StopRequest


UNSEEN = "processes that left the job's tree, session and environment could not be seen"


def write_mark(log: str, by: str, now: float | None = None) -> None:
    """Append ``---- stopped by <by> at 11:37:58Z ----`` to the node's log, before torchrun is
    signalled: every reader of the log sees who ended it before torchrun's shutdown output (a
    ``SignalException`` traceback, which alone reads like a crash)."""
    when = time.strftime("%H:%M:%SZ", time.gmtime(time.time() if now is None else now))
    fd = os.open(log, os.O_RDWR | os.O_APPEND)  # never made here: an attempt without a log has nothing to mark
    try:
        size = os.fstat(fd).st_size  # torchrun writes to the same file: a line it left unended is ended first
        head = b"" if size == 0 or os.pread(fd, 1, size - 1) == b"\n" else b"\n"
        os.write(fd, head + f"---- stopped by {by} at {when} ----\n".encode())
    finally:
        os.close(fd)


def op_stop(req: StopRequest) -> dict[str, Any]:
    absent = absent_answer(req)
    if absent is not None:  # never started, or its records were deleted: look for its processes all the same
        found = census(req)
        if found["populated"] or found["marked"]:
            return stop_unrecorded(req, found)
        removed = [f"removed its empty cgroup {cg}" for cg in found["cgroups"] if cg_remove(cg)]
        return dict(absent, records_gone=True, found_by=[], looked=found["looked"], notes=removed)
    folder = attempt_dir(req)
    spec = read_json(os.path.join(folder, "spec.json")) or {}
    state = read_state(folder)
    if state is not None:
        state = ensure_monitor(folder, state)  # it copies the last lines and writes the final state
    notes: list[str] = []
    if state is None:  # the supervisor never wrote it (it died, or the disk was full): find what we can
        state = {"job": req.job, "node": req.node, "attempt": req.attempt, "state": "starting",
                 "fallbacks": spec.get("fallbacks") or []}
        notes.append("no state.json: the supervisor never recorded the job's pids")
    grace = float(req.grace)
    deadline = time.monotonic() + grace + 15
    killed: dict[int, dict[str, Any]] = {}
    base = {"ok": True, "fallbacks": state.get("fallbacks") or [], "degraded": state.get("degraded"), "notes": notes}
    if state.get("boot_id") and state.get("boot_id") != boot_id():
        forget_cgroup(state)
        return dict(base, killed=[], left=[], state=state, containment="reboot", verified=True,
                    detail="the host rebooted since the job started: nothing of it can be running")
    # The cgroup counts once the supervisor joined it (it says so in its first state); else the sweep.
    cgroup = state.get("cgroup") or None
    if cgroup is None and spec.get("cgroup") and state.get("state") == "starting" and os.path.isdir(spec["cgroup"]):
        cgroup = spec["cgroup"]  # the supervisor could not record it (a full disk): the cgroup is there
    if req.failed and not cgroup:  # its kill could not be verified: torchrun ends on its own, as it does
        return dict(base, killed=[], left=[], state=state, containment="sweep", verified=False, grace=grace,
                    detail="its rank failed: torchrun ends on its own (no cgroup to kill it with at once)")
    if state.get("state") != "exited":
        mark_path = os.path.join(folder, "stop")  # read by ``monitor.read_stop``
        try:
            if not os.path.isfile(mark_path):  # the first stop's is kept: its time is when a stop first reached us
                with open(mark_path, "w") as mark:
                    # FAILED_STOP: the monitor records the rank's failure; then who stops it, for its end
                    mark.write(f"{FAILED_STOP if req.failed else ''}\n{req.by or 'clusterrun'}\n")
        except OSError as exc:
            notes.append(f"could not record the stop request: {fs_problem(exc)}")
        try:
            write_mark(os.path.join(folder, "output.log"), req.by or "clusterrun")
        except FileNotFoundError:
            pass  # torchrun never had a log: nothing to mark
        except OSError as exc:
            notes.append(f"could not mark the stop in output.log: {fs_problem(exc)}")
    scope = JobScope(state, exclude={os.getpid()})
    tr = state.get("torchrun") or {}
    torchrun = pin(tr["pid"], tr.get("start_time")) if tr.get("pid") else None
    # A failing attempt with a cgroup: torchrun's own shutdown is not waited for (it only ends the
    # ranks, which the cgroup's kill does at once); torchrun is still the first to be signalled,
    # and its end (a process with torch imported: tenths of a second) is waited for with its ranks'.
    fast = bool(req.failing) and bool(cgroup)
    if torchrun is not None:
        info = proc_info(torchrun.pid)
        entry = dict(info.as_dict() if info else {"pid": torchrun.pid})
        if not fast and torchrun.signal(signal.SIGTERM):
            killed[torchrun.pid] = dict(entry, signal="SIGTERM")
            scope.continue_stopped()
        if (fast or not torchrun.wait(grace)) and torchrun.signal(signal.SIGKILL):
            killed[torchrun.pid] = dict(entry, signal="SIGKILL")
            if not fast:
                torchrun.wait(5)
    method = ""
    if cgroup:
        job = os.path.join(cgroup, "job")
        if os.path.isdir(job):
            method = cg_kill(job, killed)
            cg_wait_empty(job, deadline)
    if torchrun is not None:
        if fast:
            torchrun.wait(5)
        torchrun.close()
    scope.sweep(term_wait=0.5 if cgroup else 2.0, deadline=deadline, killed=killed)
    current = read_state(folder) or state  # a monitor started since names itself there
    for key in ("supervisor", "survivor"):  # the monitor writes the final state, then the survivor leaves
        entry = current.get(key) or state.get(key) or {}
        handle = pin(entry["pid"], entry.get("start_time")) if entry.get("pid") else None
        if handle is not None:
            if not handle.wait(EXIT_WAIT + 10):
                handle.signal(signal.SIGKILL)
                handle.wait(5)
            handle.close()
    cgroup_empty = False
    if cgroup:
        if os.path.isdir(cgroup):  # the supervisor was killed before it could remove it
            used = cg_kill(cgroup, killed)
            method = method or used
            cg_wait_empty(cgroup, deadline)
        cgroup_empty = not cg_populated(cgroup)
        if cgroup_empty and not cg_remove(cgroup):
            notes.append(f"could not remove the empty cgroup {cgroup}")
    final = read_state(folder) or state
    if final.get("state") != "exited":
        stop = read_stop(folder)
        final = dict(final, state="exited", stop_requested=True, stopped_by=req.by or "clusterrun",
                     stop_at=stop[2] if stop else None,
                     error=final.get("error") or "the supervisor ended without recording an exit")
        try:
            write_json_atomic(os.path.join(folder, "state.json"), final)
        except OSError as exc:
            notes.append(f"could not record the end of the job in state.json: {fs_problem(exc)}")
    procs = all_procs()
    left = [procs[pid].as_dict() for pid in sorted(scope.members(procs))]  # verify: nothing may be left
    if cgroup:
        seen = {e["pid"] for e in left}
        left += [info.as_dict() for pid in cg_pids(cgroup) if pid not in seen and (info := proc_info(pid))]
    # torchrun is named in the report already; the sweep's count is of the processes it left
    count = len([pid for pid in killed if torchrun is None or pid != torchrun.pid])
    if cgroup:
        detail = (f"cgroup {cgroup} is empty and removed" if cgroup_empty and not left
                  else f"cgroup {cgroup} is NOT empty")
        if method and method != "gone":
            detail += f" ({method})"
    else:
        besides = " besides torchrun" if torchrun is not None else ""
        detail = f"swept {count} process{'es' if count != 1 else ''}{besides}; {UNSEEN}"
    return dict(base, killed=sorted(killed.values(), key=lambda e: e["pid"]), left=left, state=final,
                containment="cgroup" if cgroup else "sweep", verified=bool(cgroup) and cgroup_empty and not left,
                detail=detail, degraded=final.get("degraded") or state.get("degraded"), grace=grace,
                at_once=fast)
