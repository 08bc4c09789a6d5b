"""An attempt without its records: its directory is gone (a cleanup script, a full-disk rescue)
while its processes may run on. They are found all the same, through the cgroups named after the
attempt and the marker every process of it carries (never by command line), for ``status`` to
say so and for ``stop`` to stop them as the verified stop does: torchrun first, then the rest."""

from __future__ import annotations

import os
import time

from .cgroup import cg_kill, cg_pids, cg_populated, cg_remove, cg_wait_empty, cgroup2_mount, cgroup_parent
from .procs import PidHandle, all_procs, has_marker, proc_env, proc_info, signal
from .records import attempt_dir, attempt_marker

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .wire import NodeRequest, StopRequest

PARENTS_WAIT = 20.0  # seconds for the survivor and monitor to leave once torchrun is gone


def named_cgroups(job: str, node: int, attempt: int) -> tuple[list[str], list[str]]:
    """The cgroups made for this attempt (``clusterrun-<job>-n<node>-a<attempt>``, or that name
    and the random suffix a stale one gets), and the directories looked in."""
    name = f"clusterrun-{job}-n{node}-a{attempt}"
    places = [p for p in dict.fromkeys((cgroup2_mount(), cgroup_parent()[0])) if p]
    found = []
    for place in places:
        try:
            entries = os.listdir(place)
        except OSError:
            continue
        for entry in entries:
            suffix = entry[len(name):]
            if entry == name or (suffix.startswith("-") and len(suffix) == 7 and _is_hex(suffix[1:])):
                if entry.startswith(name) and os.path.isdir(os.path.join(place, entry)):
                    found.append(os.path.join(place, entry))
    return sorted(found), places


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def marked(marker: str, log_dir: str | None = None) -> list[int]:
    """The live processes whose environment carries ``marker`` (``CLUSTERRUN_JOB=<job>.<node>.<attempt>``),
    but none that names another state dir's attempt (``PET_LOG_DIR``, which the survivor sets
    beside the marker: the same job id under two state dirs is not the same job)."""
    me = os.getpid()
    return sorted(pid for pid, info in all_procs().items()
                  if pid != me and info.state != "Z" and has_marker(pid, marker) and _ours(pid, log_dir))


def _ours(pid: int, log_dir: str | None) -> bool:
    if log_dir is None:
        return True
    seen = proc_env(pid).get("PET_LOG_DIR")
    return seen is None or seen == log_dir


def census(req: NodeRequest) -> dict[str, Any]:
    """What runs of an attempt without records: ``cgroups`` (by name), ``marked`` (pids) and
    ``looked`` (where, in words: for a report that never claims more than was checked)."""
    job, node, attempt = req.job, req.node, req.attempt
    marker = attempt_marker(job, node, attempt)
    log_dir = os.path.join(attempt_dir(req), "torchrun")
    cgroups, places = named_cgroups(job, node, attempt)
    cgroups = [cg for cg in cgroups if all(_ours(pid, log_dir) for pid in cg_pids(cg))]
    populated = [cg for cg in cgroups if cg_populated(cg)]
    pids = marked(marker, log_dir)
    where = " or ".join(places) if places else "no cgroup2 mount"
    looked = [f"cgroups named clusterrun-{job}-n{node}-a{attempt} under {where}",
              f"processes carrying {marker} (a scan of /proc)"]
    return {"cgroups": cgroups, "populated": populated, "marked": pids, "looked": looked, "marker": marker,
            "log_dir": log_dir}


def found_by(found: dict[str, Any]) -> list[str]:
    """The mechanisms that found something, in words."""
    said = [f"cgroup {cg} found by name" + ("" if cg in found["populated"] else " (empty)") for cg in found["cgroups"]]
    if found["marked"]:
        count = len(found["marked"])
        said.append(f"{count} process{'es' if count != 1 else ''} carrying {found['marker']} found by a marker scan")
    return said


def status_unrecorded(found: dict[str, Any]) -> dict[str, Any]:
    """``status`` of an attempt whose directory is gone while something of it runs."""
    error = ("the attempt's records on this host are gone (its directory was deleted) while its processes run: "
             + "; ".join(found_by(found)) + "; `clusterrun down` stops them")
    return {"ok": True, "state": {"state": "lost", "error": error, "records_gone": True},
            "alive": {"survivor": False, "supervisor": False, "torchrun": bool(found["marked"])},
            "log_size": 0, "records_gone": True, "found_by": found_by(found), "looked": found["looked"],
            "containment": "cgroup" if found["cgroups"] else "sweep", "fallbacks": []}


def stop_unrecorded(req: StopRequest, found: dict[str, Any]) -> dict[str, Any]:
    """Stop what ``census`` found: SIGTERM to the roots of the marked tree (torchrun; its
    workers are below it) and ``grace`` seconds, then the cgroups (``job`` first) and SIGKILL to
    whatever still carries the marker, each through a pidfd after it was identified again."""
    grace = float(req.grace)
    deadline = time.monotonic() + grace + 15
    marker = found["marker"]
    killed: dict[int, dict[str, Any]] = {}
    procs = all_procs()
    tree = set(found["marked"])
    roots = [pid for pid in found["marked"] if pid in procs and procs[pid].ppid not in tree]
    parents = {procs[pid].ppid for pid in roots if procs[pid].ppid > 1} - tree  # the survivor, if it runs
    handles = [h for h in (_pinned(pid, marker) for pid in roots) if h is not None]
    for handle in handles:
        if handle.signal(signal.SIGTERM):
            killed[handle.pid] = dict(_described(handle.pid), signal="SIGTERM")
    end = time.monotonic() + grace
    for handle in handles:
        if not handle.wait(max(0.0, end - time.monotonic())) and handle.signal(signal.SIGKILL):
            killed[handle.pid] = dict(_described(handle.pid), signal="SIGKILL")
        handle.close()
    method = ""
    for cgroup in found["cgroups"]:
        for part in (os.path.join(cgroup, "job"), cgroup):
            if os.path.isdir(part):
                method = cg_kill(part, killed) if cg_populated(part) else method
                cg_wait_empty(part, deadline)
    while True:  # what carries the marker outside any cgroup of the attempt
        left_pids = marked(marker, found["log_dir"])
        if not left_pids or time.monotonic() >= deadline:
            break
        for pid in left_pids:
            pinned = _pinned(pid, marker)
            if pinned is not None:
                if pinned.signal(signal.SIGKILL):
                    killed.setdefault(pid, _described(pid))["signal"] = "SIGKILL"
                pinned.close()
        time.sleep(0.05)
    _wait_parents(parents, time.monotonic() + PARENTS_WAIT)
    removed = [cg for cg in found["cgroups"] if not cg_populated(cg) and cg_remove(cg)]
    left = [info.as_dict() for pid in marked(marker, found["log_dir"]) if (info := proc_info(pid))]
    seen = {entry["pid"] for entry in left}
    for cgroup in found["cgroups"]:
        left += [info.as_dict() for pid in cg_pids(cgroup) if pid not in seen and (info := proc_info(pid))]
    verified = bool(found["cgroups"]) and len(removed) == len(found["cgroups"]) and not left
    if found["cgroups"]:
        detail = (f"cgroup {', '.join(found['cgroups'])} empty and removed" if verified
                  else f"cgroup {', '.join(found['cgroups'])} NOT empty")
        if method and method != "gone":
            detail += f" ({method})"
    else:
        detail = (f"no cgroup of the attempt: the marker scan finds no process carrying {marker} any more; "
                  "a process that dropped its environment (env -i) cannot be seen")
    state = {"state": "exited", "job": req.job, "node": req.node, "attempt": req.attempt,
             "stop_requested": True, "records_gone": True,
             "error": "the attempt's records on this host were gone (its directory was deleted)"}
    return {"ok": True, "killed": sorted(killed.values(), key=lambda e: e["pid"]), "left": left, "state": state,
            "containment": "cgroup" if found["cgroups"] else "sweep", "verified": verified, "detail": detail,
            "fallbacks": [], "degraded": None, "notes": [], "grace": grace, "records_gone": True,
            "found_by": found_by(found), "looked": found["looked"]}


def _pinned(pid: int, marker: str) -> PidHandle | None:
    """A pidfd of ``pid`` if, once it is held, the process still carries ``marker``."""
    try:
        handle = PidHandle(pid)
    except ProcessLookupError:
        return None
    if not has_marker(pid, marker) or not handle.alive():
        handle.close()
        return None
    return handle


def _described(pid: int) -> dict[str, Any]:
    info = proc_info(pid)
    return info.as_dict() if info else {"pid": pid}


def _wait_parents(pids: set[int], deadline: float) -> None:
    """Wait for the processes that were torchrun's parents (its survivor and the survivor's monitor
    end once torchrun has; they cannot be identified without the records, so they are not killed)."""
    for pid in pids:
        try:
            handle = PidHandle(pid)
        except ProcessLookupError:
            continue
        handle.wait(max(0.0, deadline - time.monotonic()))
        handle.close()
