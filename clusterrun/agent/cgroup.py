"""The attempt's cgroup v2 (see the package docstring): where one may be made, making, killing,
waiting for and removing it."""

from __future__ import annotations

import os
import time

from .procs import PidHandle, proc_info, signal
from .system import lingers

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


CGROUP_OFF_VAR = "CLUSTERRUN_NO_CGROUP"  # set (non-empty) on a host: no cgroup, the sweep only


def cgroup2_mount() -> str | None:
    """Where the cgroup v2 hierarchy is mounted (its root visible), from /proc/self/mountinfo."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if sep and right.split(" ", 1)[0] == "cgroup2" and len(fields) >= 5 and fields[3] == "/":
            return fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
    return None


def own_cgroup(pid: int | str = "self") -> str | None:
    """The cgroup v2 path of a process (``/user.slice/...``), or None."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return None


def cgroup_parent() -> tuple[str | None, str]:
    """The cgroup under which this agent may make one per attempt, or None and why not.

    As root: the top of the cgroup2 mount (outside any login session, so logind's
    KillUserProcesses does not reach it). As a user: the agent's own cgroup if it was delegated
    (writable), except inside a systemd user manager that stops at the last logout (no linger):
    containment must never cost detachment."""
    if os.environ.get(CGROUP_OFF_VAR):
        return None, f"cgroups turned off on this host ({CGROUP_OFF_VAR} is set)"
    mount = cgroup2_mount()
    if mount is None:
        return None, "no cgroup2 file system is mounted"
    if os.geteuid() == 0:
        if os.access(os.path.join(mount, "cgroup.procs"), os.W_OK) and os.access(mount, os.W_OK):
            return mount, ""
        return None, f"{mount} is not writable (read-only mount?)"
    own = own_cgroup()
    if own is None:
        return None, "this process is in no cgroup v2"
    path = mount + own.rstrip("/") if own != "/" else mount
    if not (os.access(path, os.W_OK) and os.access(os.path.join(path, "cgroup.procs"), os.W_OK)):
        return None, (f"cgroup {path} is not delegated to uid {os.getuid()} (not writable); run as root or "
                      "in a delegated cgroup (systemd: Delegate=yes) for a stop verified by cgroup")
    if f"/user@{os.getuid()}.service" in own and not lingers():
        return None, (f"cgroup {path} belongs to the systemd user manager, which stops at your last logout: "
                      "`loginctl enable-linger` lets it (and a cgroup per job) outlive the session")
    return path, ""


def cg_write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def cg_pids(cgroup: str) -> list[int]:
    """Every process in ``cgroup`` and the cgroups below it (as this pid namespace sees them)."""
    pids: list[int] = []
    for folder, _dirs, _files in os.walk(cgroup):
        try:
            with open(os.path.join(folder, "cgroup.procs")) as f:
                pids += [int(p) for p in f.read().split() if p != "0"]
        except (OSError, ValueError):
            pass
    return sorted(set(pids))


def cg_populated(cgroup: str) -> bool:
    """True while a process lives in ``cgroup`` or below (``cgroup.events``: ``populated 1``)."""
    try:
        with open(os.path.join(cgroup, "cgroup.events")) as f:
            return "populated 1" in f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return bool(cg_pids(cgroup))


def cg_kill(cgroup: str, killed: dict[int, dict[str, Any]]) -> str:
    """Kill everything in ``cgroup`` and below at once (``cgroup.kill``, Linux >= 5.14), else
    freeze it and SIGKILL each process (by pidfd, once it is seen in the cgroup again, so that a
    reused pid is never signalled); returns the method used."""
    for pid in cg_pids(cgroup):
        info = proc_info(pid)
        if info is not None and info.state != "Z":
            killed.setdefault(pid, info.as_dict())["signal"] = "SIGKILL"
    if not os.path.isdir(cgroup):
        return "gone"
    try:
        cg_write(os.path.join(cgroup, "cgroup.kill"), b"1")
        return "cgroup.kill"
    except OSError:
        pass
    frozen = False
    try:
        cg_write(os.path.join(cgroup, "cgroup.freeze"), b"1")  # nothing forks between listing and killing
        frozen = True
    except OSError:
        pass
    where = cgroup_path(cgroup)
    try:
        for _ in range(500):
            pids = cg_pids(cgroup)
            if not pids:
                break
            for pid in pids:
                try:
                    handle = PidHandle(pid)
                except ProcessLookupError:
                    continue
                own = own_cgroup(pid) or ""
                if own == where or own.startswith(where + "/"):
                    handle.signal(signal.SIGKILL)
                handle.close()
            time.sleep(0.01)
    finally:
        if frozen:
            try:
                cg_write(os.path.join(cgroup, "cgroup.freeze"), b"0")  # SIGKILL ends frozen tasks all the same
            except OSError:
                pass
    return "freeze + SIGKILL"


def cgroup_path(folder: str) -> str:
    """The cgroup path (``/clusterrun-...``) of a cgroup directory, as /proc/PID/cgroup names it."""
    mount = cgroup2_mount() or ""
    return (folder[len(mount):] or "/") if folder.startswith(mount) else folder


def cg_wait_empty(cgroup: str, deadline: float) -> bool:
    """Wait until no process is left in ``cgroup`` or below; True if none is."""
    while cg_populated(cgroup):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def cg_remove(cgroup: str) -> bool:
    """Remove an empty cgroup and its (empty) children; True if it is gone."""
    for folder, _dirs, _files in sorted(os.walk(cgroup), key=lambda entry: -len(entry[0])):
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            pass
        except OSError:
            return False
    return not os.path.isdir(cgroup)


def make_cgroup(job: str, node: int, attempt: int) -> tuple[str | None, str]:
    """Make the attempt's cgroup (and its ``job`` child, for torchrun and everything it starts)."""
    parent, why = cgroup_parent()
    if parent is None:
        return None, why
    name = f"clusterrun-{job}-n{node}-a{attempt}"
    for suffix in ("", *(f"-{os.urandom(3).hex()}" for _ in range(3))):  # a stale one of the same name
        path = os.path.join(parent, name + suffix)
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        except OSError as exc:
            return None, f"cannot make a cgroup in {parent}: {os.strerror(exc.errno or 0)}"
        try:
            os.mkdir(os.path.join(path, "job"))
        except OSError as exc:
            cg_remove(path)
            return None, f"cannot make a cgroup in {path}: {os.strerror(exc.errno or 0)}"
        return path, ""
    return None, f"cannot make a cgroup in {parent}: {name} exists"


def forget_cgroup(state: dict[str, Any]) -> None:
    """Remove the cgroup of an attempt whose supervisor is gone (SIGKILLed, so it could not) once
    nothing is left in it; a populated one stays for the stop to kill."""
    cgroup = state.get("cgroup")
    if cgroup and os.path.isdir(cgroup) and not cg_populated(cgroup):
        cg_remove(cgroup)
