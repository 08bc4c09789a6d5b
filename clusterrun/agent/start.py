"""``start``: the attempt's directory, spec and cgroup, then the detached supervisor."""

from __future__ import annotations

import os
import time

from .cgroup import cg_populated, cg_remove, make_cgroup
from .codec import json_loads
from .logind import logind_problem, user_scope
from .records import AgentFailure, attempt_dir, not_started, write_json_atomic
from .setup import PREPARED, run_setup, setup_key
from .supervisor import spawn_supervisor
from .system import read_until, static_fallbacks

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .wire import StartRequest


def op_start(req: StartRequest) -> dict[str, Any]:
    if req.unlisten is not None:  # the preflight's listener on the master port, which torchrun binds
        from .doctorops import op_unlisten
        from .wire import UnlistenRequest

        op_unlisten(UnlistenRequest(port=req.unlisten))
    folder = attempt_dir(req)
    argv, env, cwd, setup = req.argv, req.env or {}, req.cwd, req.setup or []
    if not argv:
        raise AgentFailure("argv must be a non-empty list of strings")
    output = b""
    if setup:  # run by the ``setup`` request of this agent already, or here (before anything exists)
        prepared = PREPARED.pop(setup_key(req), None)
        run_env, output = (prepared.env, prepared.output) if prepared else run_setup(setup, env, cwd,
                                                                                     req.setup_timeout)
    else:
        run_env = {**os.environ, **env}
    try:
        os.makedirs(folder, mode=0o700)
    except FileExistsError:
        raise AgentFailure(f"{folder} already exists: this attempt was started before") from None
    except OSError as exc:
        raise AgentFailure(not_started("cannot create the state dir", folder, exc)) from None
    scope = None
    session_problem = logind_problem()
    if session_problem:
        scope = user_scope(req.job, req.node, req.attempt)
        if scope is None:
            os.rmdir(folder)
            raise AgentFailure(session_problem)
        cgroup, why = None, ""  # the supervisor makes it in its scope (delegated to the user)
    else:
        cgroup, why = make_cgroup(req.job, req.node, req.attempt)
    secret = set(req.secret_env or ())  # their values reach torchrun in memory only, never this disk
    shown = {name: "****" if name in secret else value for name, value in env.items()}
    spec = {"job": req.job, "node": req.node, "attempt": req.attempt, "argv": argv, "env": shown,
            "setup": setup, "first_rank": req.first_rank, "about": req.about,
            "cwd": os.path.expanduser(cwd) if cwd else None, "cgroup": cgroup, "user_scope": scope is not None,
            "hang_after": req.hang_after, "progress": req.progress,
            "fallbacks": ([f"no cgroup: {why}"] if why else []) + static_fallbacks()}
    middle = 0
    logged = b""
    try:
        write_json_atomic(os.path.join(folder, "spec.json"), spec)
        if setup:
            logged = _log_setup(folder, output, {env[name] for name in secret if env.get(name)})
        ready, middle = spawn_supervisor(folder, scope, run_env)
    except OSError as exc:
        if cgroup:
            cg_remove(cgroup)
        _discard(folder)
        raise AgentFailure(not_started("cannot write to the state dir", folder, exc)) from None
    deadline = time.monotonic() + 30
    try:
        data = read_until(ready, deadline, line=True)
    finally:
        os.close(ready)
        if middle:
            os.waitpid(middle, 0)  # systemd-run's interpreter, which forked the supervisor and exited
    state = None
    if data.endswith(b"\n"):
        try:
            state = json_loads(data)
        except ValueError:
            state = None
    if state is None:
        if cgroup and not cg_populated(cgroup):
            cg_remove(cgroup)
        why = "did not start within 30 s" if not data and time.monotonic() >= deadline else "ended at once"
        raise AgentFailure(f"the supervisor {why}; see {folder}/supervisor.log")
    if state.get("error"):
        if state.get("unwritable"):
            _discard(folder)  # nothing ran: the same attempt may be started again once there is room
        return {"ok": False, "error": state["error"], "dir": folder, "state": state}
    answer = {"ok": True, "dir": folder, "state": state}
    if logged and len(logged) <= SETUP_IN_ANSWER:  # shown before the start, as it ran (a longer one: followed)
        answer["setup_log"] = logged.decode("utf-8", "surrogateescape")
    return answer


SETUP_TAG = b"[setup]:"  # setup's lines in output.log, as a rank's are tagged [rankN]:
SETUP_IN_ANSWER = 1 << 20  # setup's log up to this size comes back in start's answer (a follow's chunk)


def _log_setup(folder: str, output: bytes, secrets: set[str]) -> bytes:
    """Setup's output at the head of the node's log (output.log), each line tagged ``[setup]:``,
    secret values as ``****`` (this disk never holds one), timed now in output.times; what was written."""
    for value in sorted(secrets, key=len, reverse=True):
        output = output.replace(os.fsencode(value), b"****")
    lines = output.splitlines() or [b"(setup printed nothing)"]
    logged = b"".join(SETUP_TAG + b" " + line + b"\n" for line in lines)
    with open(os.path.join(folder, "output.log"), "ab") as f:  # under the agent's umask 077: 0600
        f.write(logged)
    with open(os.path.join(folder, "output.times"), "ab") as f:
        f.write(b"0 %d\n" % time.time_ns())
    return logged


def _discard(folder: str) -> None:
    """Remove an attempt directory whose start failed before anything ran."""
    for folder_, _dirs, files in sorted(os.walk(folder), key=lambda entry: -len(entry[0])):
        for name in files:
            try:
                os.unlink(os.path.join(folder_, name))
            except OSError:
                pass
        try:
            os.rmdir(folder_)
        except OSError:
            pass
