"""logind, which may kill a login session's processes at logout: whether it would kill a job
started from here, and the systemd user scope that a job then starts in instead."""

from __future__ import annotations

import os

from .cgroup import cgroup_parent, own_cgroup
from .system import capture, lingers, user_name, which


def user_scope(job: str, node: int, attempt: int) -> list[str] | None:
    """The systemd-run argv that starts a command in a scope of the user's systemd manager, out of
    the login session (Delegate=yes: the supervisor makes its cgroup there), or None when no
    manager runs, it does not linger (it would stop at the last logout, the job with it) or
    systemd-run is missing."""
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    if not os.path.exists(os.path.join(runtime, "systemd", "private")) or not which("systemd-run"):
        return None
    if not lingers():
        return None
    return ["systemd-run", "--user", "--scope", "--quiet", "--collect", "-p", "Delegate=yes",
            f"--unit=clusterrun-{job}-n{node}-a{attempt}-{os.urandom(3).hex()}", "--"]


_SETTINGS: dict[str, str] = {}  # asked once per agent: the probe, the preflight's inspect and the start all ask


def _logind_settings() -> dict[str, str]:
    """logind's KillUserProcesses, KillOnlyUsers and KillExcludeUsers: asked of logind through
    ``loginctl`` (a process: 5-10 ms of the host's CPU), else read from logind.conf and its
    drop-ins (later files win)."""
    if not _SETTINGS:
        _SETTINGS.update(_ask_logind())
    return dict(_SETTINGS)


def _ask_logind() -> dict[str, str]:
    out = capture(["loginctl", "show-session", "-p", "KillUserProcesses", "-p", "KillOnlyUsers",
                   "-p", "KillExcludeUsers"])
    text = out if out and "KillUserProcesses=" in out else ""
    if not text:
        files = ["/etc/systemd/logind.conf"]
        for folder in ("/usr/lib/systemd/logind.conf.d", "/run/systemd/logind.conf.d", "/etc/systemd/logind.conf.d"):
            try:
                files += sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".conf"))
            except OSError:
                pass
        for path in files:
            try:
                with open(path) as f:
                    text += f.read() + "\n"
            except OSError:
                pass
    settings = {"KillExcludeUsers": "root"}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key in ("KillUserProcesses", "KillOnlyUsers", "KillExcludeUsers"):
            settings[key] = value.strip()
    return settings


def logind_problem() -> str:
    """Why a supervisor started from here would die when the SSH session ends, or "".

    logind with ``KillUserProcesses=yes`` kills every process of a login session's scope
    (``session-N.scope``) at logout, a detached one too. As root with a cgroup the supervisor
    leaves the session (its own cgroup at the top); otherwise the start is refused."""
    own = own_cgroup() or ""
    if not any(part.startswith("session-") and part.endswith(".scope") for part in own.split("/")):
        return ""
    if cgroup_parent()[0] is not None and os.geteuid() == 0:
        return ""
    settings = _logind_settings()
    if settings.get("KillUserProcesses", "no").lower() not in ("yes", "true", "1", "on"):
        return ""
    user = user_name()
    only, exclude = settings.get("KillOnlyUsers", "").split(), settings.get("KillExcludeUsers", "").split()
    if user in exclude or (only and user not in only):
        return ""
    return (f"logind kills every process of this login session ({own}) at logout (KillUserProcesses=yes), "
            "a detached one too, and there is no systemd user manager with linger to start the job in "
            f"instead: nothing was started. Fix: `loginctl enable-linger {user}` (keeps your systemd user "
            "manager running after you log out; clusterrun then starts each job in a scope of it, outside "
            f"the session), or KillExcludeUsers={user} in /etc/systemd/logind.conf, or run the job as root")
