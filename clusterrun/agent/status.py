"""``status``, ``remove`` and ``jobs``: what the records and the processes say of attempts."""

from __future__ import annotations

import os

from .cgroup import forget_cgroup
from .monitor import ensure_monitor
from .orphans import census, status_unrecorded
from .procs import is_alive, job_alive
from .records import AgentFailure, attempt_dir, boot_id, load_state, lost, read_json, read_state, state_root
from .wire import StatusRequest

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .wire import JobsRequest, NodeRequest, RemoveRequest


def absent_answer(req: NodeRequest) -> dict[str, Any] | None:
    """The answer for a node that was never started (its controller died during ``start``)."""
    if os.path.exists(attempt_dir(req)):
        return None
    return {"ok": True, "state": {"state": "absent"}, "alive": {"supervisor": False, "torchrun": False},
            "log_size": 0, "killed": [], "left": []}


def op_status(req: StatusRequest) -> dict[str, Any]:
    absent = absent_answer(req)
    if absent is not None:  # never started, or its records were deleted while it runs
        found = census(req)
        return status_unrecorded(found) if found["populated"] or found["marked"] else absent
    folder, state = load_state(req)
    same_boot = state.get("boot_id") == boot_id()
    alive = {key: same_boot and is_alive(state.get(key)) for key in ("survivor", "supervisor", "torchrun")}
    if same_boot:  # a new monitor copies what is left; with nothing of the job alive the node is lost all the same
        ensure_monitor(folder, state)
    if state.get("state") != "exited" and not any(alive.values()):
        state = read_state(folder) or state  # it may have ended just now
        if state.get("state") != "exited":
            state = lost(state)
    if not alive["supervisor"] and not alive["survivor"]:
        forget_cgroup(state)
    try:
        size = os.path.getsize(os.path.join(folder, "output.log"))
    except OSError:
        size = 0
    return {"ok": True, "state": state, "alive": alive, "log_size": size, "degraded": state.get("degraded"),
            "fallbacks": state.get("fallbacks") or [], "containment": "cgroup" if state.get("cgroup") else "sweep"}


def op_remove(req: RemoveRequest) -> dict[str, Any]:
    """Delete one node's state and logs of a job (every attempt), and the job's directory once no
    node is left in it. Refused while a supervisor or torchrun of any attempt still runs."""
    import shutil

    folder = os.path.dirname(attempt_dir(req, attempt=1))
    if not os.path.isdir(folder):
        return {"ok": True, "removed": None, "bytes": 0}
    size = 0
    for name in sorted(os.listdir(folder)):
        state = read_json(os.path.join(folder, name, "state.json"))
        if state is not None and job_alive(state):
            raise AgentFailure(f"{os.path.join(folder, name)} still runs; stop the job first (`clusterrun down`)")
    for parent, _dirs, files in os.walk(folder):
        for file in files:
            try:
                size += os.lstat(os.path.join(parent, file)).st_size
            except OSError:
                pass
    shutil.rmtree(folder)
    try:
        os.rmdir(os.path.dirname(folder))  # the job's directory, once its last node is gone
    except OSError:
        pass
    return {"ok": True, "removed": folder, "bytes": size}


def op_jobs(req: JobsRequest) -> dict[str, Any]:
    """Every node attempt under the state root, as ``status`` sees it, with what ``start`` was
    given (argv, env, cwd, first_rank, about): for a controller that has no record of the job."""
    root = os.path.join(state_root(req.state_dir), "jobs")
    found = []
    try:
        jobs = sorted(os.listdir(root))
    except FileNotFoundError:
        jobs = []
    for job in jobs:
        try:
            nodes = sorted(os.listdir(os.path.join(root, job)))
        except OSError:
            continue
        for node_dir in nodes:
            if not node_dir.startswith("node") or not node_dir[4:].isdigit():
                continue
            for attempt_name in sorted(os.listdir(os.path.join(root, job, node_dir))):
                if not attempt_name.startswith("attempt") or not attempt_name[7:].isdigit():
                    continue
                query = StatusRequest(job=job, node=int(node_dir[4:]), attempt=int(attempt_name[7:]),
                                      state_dir=req.state_dir)
                try:
                    status = op_status(query)
                except AgentFailure:
                    status = {"state": {"state": "starting"}}  # no state.json yet (being started, or it never was)
                folder = attempt_dir(query)
                spec = read_json(os.path.join(folder, "spec.json")) or {}
                try:
                    started = os.stat(os.path.join(folder, "spec.json")).st_mtime
                except OSError:
                    started = None
                found.append(dict(job=job, node=query.node, attempt=query.attempt, state_dir=req.state_dir,
                                  state=status.get("state"), started=started, argv=spec.get("argv"),
                                  env=spec.get("env"), cwd=spec.get("cwd"), first_rank=spec.get("first_rank"),
                                  about=spec.get("about")))
    return {"ok": True, "root": root, "jobs": found}
