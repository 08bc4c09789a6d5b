"""``setup``: the node's setup commands in bash, and the environment they leave for ``start``."""

from __future__ import annotations

import os
import sys

from .procs import signal
from .records import AgentFailure

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .wire import SetupRequest, StartRequest


SETUP_TIMEOUT = 600.0


# The environment a ``setup`` request made, by (job, node, attempt), for the ``start`` that follows
# it in this agent: setup runs once, and only in memory (it may hold secrets).
_prepared: dict[tuple[str, int, int], dict[str, str]] = {}


def _setup_key(req: SetupRequest | StartRequest) -> tuple[str, int, int]:
    return req.job, req.node, req.attempt


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def setup_script(commands: list[str], python: str) -> str:
    """The bash script that runs ``commands`` in turn (each must succeed: the first that does not
    ends the script with its status and says which it was), with their output on stderr, then
    writes the resulting environment to stdout (``NAME=VALUE\\0`` each, by ``python``, which
    ``-E`` keeps from what the commands did to PYTHON* variables)."""
    lines = ["exec 3>&1 1>&2", "{"]
    for i, command in enumerate(commands):
        lines.append(command.rstrip("\n"))
        lines.append(f'__clusterrun_rc=$?; if [ "$__clusterrun_rc" -ne 0 ]; then echo "clusterrun: setup[{i}] '
                     f'exited with status $__clusterrun_rc" >&2; exit "$__clusterrun_rc"; fi')
    lines.append("} 3>&-")
    dump = "import os,sys;sys.stdout.buffer.write(b''.join(k+b'='+v+b'\\0' for k,v in os.environb.items()))"
    lines.append(f"exec {_sh_quote(python)} -S -E -c {_sh_quote(dump)} >&3 3>&-")
    return "\n".join(lines) + "\n"


def _last_lines(data: bytes, count: int = 20) -> str:
    lines = data.decode("utf-8", "replace").rstrip("\n").split("\n")
    return "\n".join(("  | " + line) for line in lines[-count:]) if data.strip() else "  (it printed nothing)"


def _run_setup(commands: list[str], env: dict[str, str], cwd: str | None,
               timeout: float | None = None) -> dict[str, str]:
    """Run the ``setup`` commands in bash, in ``cwd``, with the job's environment on top of this
    agent's; the environment they leave (what they exported, changed or unset). ``AgentFailure``
    with the last lines of their output if one fails: nothing was started then."""
    import subprocess

    limit = timeout or SETUP_TIMEOUT
    base = {**os.environ, **env}
    bash = next((os.path.join(d, "bash") for d in (base.get("PATH") or "/usr/bin:/bin").split(os.pathsep)
                 if d and os.access(os.path.join(d, "bash"), os.X_OK)), None)
    if bash is None:
        raise AgentFailure("setup needs bash, which is not on this host's PATH; nothing was started")
    folder = os.path.expanduser(cwd) if cwd else None
    try:
        proc = subprocess.Popen([bash, "-c", setup_script(commands, sys.executable or "python3"), "clusterrun-setup"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=base,
                                cwd=folder, start_new_session=True)
    except OSError as exc:
        where = folder if folder and not os.path.isdir(folder) else bash
        raise AgentFailure(f"setup could not run: {where}: {exc.strerror or exc}; nothing was started") from None
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, err = proc.communicate()
        raise AgentFailure(f"setup did not finish within {limit:g} s (killed); nothing was started; its last "
                           f"lines:\n{_last_lines(err)}") from None
    if proc.returncode != 0:
        raise AgentFailure(f"setup failed with status {proc.returncode}; nothing was started; its last "
                           f"lines:\n{_last_lines(err)}")
    if not out:
        raise AgentFailure("setup ended before its last command (does one call `exit`?); nothing was started; "
                           f"its last lines:\n{_last_lines(err)}")
    result: dict[str, str] = {}
    for entry in out.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep and name:
            result[os.fsdecode(name)] = os.fsdecode(value)
    result.pop("_", None)  # bash's last argument
    return result


def op_setup(req: SetupRequest) -> dict[str, Any]:
    """Run the node's ``setup`` commands now, before anything starts anywhere, and keep the
    environment they make for this agent's ``start`` of the same attempt."""
    _prepared[_setup_key(req)] = _run_setup(req.setup or [], req.env or {}, req.cwd, req.setup_timeout)
    return {"ok": True}
