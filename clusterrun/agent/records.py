"""The attempt's directory and records on the host: paths, ids, atomic writes, ``state.json``
read back (with ``degraded``), and ``AgentFailure``, the error every operation reports."""

from __future__ import annotations

import os

from .codec import json_dumps_sorted, json_loads

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .wire import NodeRequest


MARKER_VAR = "CLUSTERRUN_JOB"


_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")


_ID_CHARS = _ALNUM | frozenset("._-")


class AgentFailure(Exception):
    """A request that cannot be carried out; reported as ``{ok: false, error}``."""


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def lost(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` of a node none of whose processes is left (survivor, monitor, torchrun) and that wrote no end:
    ``lost``, with why as far as the host can tell (a restart of the host shows in its boot id)."""
    rebooted = bool(state.get("boot_id")) and state.get("boot_id") != boot_id()
    why = ("the host restarted since the job started (its boot id changed): the job's processes ended with it"
           if rebooted else f"the job's processes on the host are gone and their end could not be recorded: "
                            f"{state['degraded']}" if state.get("degraded")
           else "the job's processes on the host are gone (killed?) and none recorded an end")
    return dict(state, state="lost", error=state.get("error") or why, rebooted=rebooted)


def unlink_quietly(path: str) -> None:
    """Remove a temporary file a failed write leaves (gone already is fine)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def write_atomic(path: str, data: bytes) -> None:
    """Write a temporary file (0600, a random name: hosts sharing a filesystem have the same pids), fsync, rename."""
    tmp = f"{path}.{os.urandom(6).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise


def write_json_atomic(path: str, obj: object) -> None:
    write_atomic(path, json_dumps_sorted(obj).encode())


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            value = json_loads(f.read())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def state_root(state_dir: str | None) -> str:
    if state_dir:
        return os.path.abspath(os.path.expanduser(state_dir))
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "clusterrun")


def attempt_dir(req: NodeRequest, attempt: int | None = None) -> str:
    """The directory of the request's attempt (or of ``attempt`` of the same node)."""
    job, node, attempt = req.job, req.node, req.attempt if attempt is None else attempt
    if not isinstance(job, str) or not (0 < len(job) <= 128 and job[0] in _ALNUM and _ID_CHARS.issuperset(job)):
        raise AgentFailure(f"invalid job id {job!r}")
    if not isinstance(node, int) or not isinstance(attempt, int) or node < 0 or attempt < 1:
        raise AgentFailure(f"invalid node {node!r} or attempt {attempt!r}")
    root = state_root(req.state_dir)
    return os.path.join(root, "jobs", job, f"node{node}", f"attempt{attempt}")


def attempt_marker(job: str, node: int, attempt: int) -> str:
    """The variable every process of one attempt of one node carries: never another attempt's."""
    return f"{MARKER_VAR}={job}.{node}.{attempt}"


def fs_problem(exc: OSError) -> str:
    """A short reason for a failed write to the state dir (a full or read-only disk, a quota)."""
    return f"{os.strerror(exc.errno) if exc.errno else exc}" + (f": {exc.filename}" if exc.filename else "")


def not_started(what: str, folder: str, exc: OSError) -> str:
    """Why a start wrote nothing to the state dir (``what``: "cannot create the state dir"), and the fix."""
    import errno

    remedy = {errno.ENOSPC: "free space there", errno.EDQUOT: "free space there (a quota)",
              errno.EROFS: "make that file system writable", errno.EACCES: "let this user write there",
              errno.EPERM: "let this user write there"}.get(exc.errno or 0, "free space there or make it writable")
    return f"{what} {folder}: {fs_problem(exc)}; nothing was started ({remedy}, or set `state_dir:` in the hosts file)"


def load_state(req: NodeRequest) -> tuple[str, dict[str, Any]]:
    folder = attempt_dir(req)
    state = read_state(folder)
    if state is None:
        raise AgentFailure(f"no job {req.job} node {req.node} attempt {req.attempt} in {folder}")
    return folder, state


def read_state(folder: str) -> dict[str, Any] | None:
    """state.json, with ``degraded`` set if the supervisor could not write everything since."""
    state = read_json(os.path.join(folder, "state.json"))
    if state is not None and not state.get("degraded"):
        reason = _degraded(folder)
        if reason:
            state = dict(state, degraded=reason)
    return state


def _degraded(folder: str) -> str | None:
    """Why the supervisor could not write to its attempt directory (its ``degraded`` marker)."""
    try:
        with open(os.path.join(folder, "degraded"), "rb") as f:
            reason = f.read().decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        reason = f"({exc.strerror})"
    if reason and not reason.startswith("("):
        return reason
    try:
        fs = os.statvfs(folder)
        if fs.f_flag & os.ST_RDONLY:
            reason = f"(the file system of {folder} is read-only)"
        elif fs.f_bavail == 0:
            reason = f"(no space left on the file system of {folder})"
    except OSError:
        pass
    return f"the supervisor could not write its state {reason or '(a full disk or a quota?)'}"
