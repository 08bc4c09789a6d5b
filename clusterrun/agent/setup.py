"""``setup``: the node's setup commands in bash; the environment they leave and their output, for
``start``; and the job's interpreter as it runs there (what the preflight checks)."""

from __future__ import annotations

import os
import select
import sys
import time

from .codec import json_loads
from .procs import signal
from .records import AgentFailure

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .wire import SetupRequest, StartRequest


SETUP_TIMEOUT = 600.0


class Prepared:
    """What a ``setup`` request made, for the ``start`` (and ``inspect``) of the same attempt in this
    agent: the environment, the commands' output (for the node's log) and the job's interpreter
    there when it runs (``job_python``'s answer). In memory only: it may hold secrets."""

    __slots__ = ("env", "output", "python")

    def __init__(self, env: dict[str, str], output: bytes, python: dict[str, Any] | None = None) -> None:
        self.env, self.output, self.python = env, output, python


# By (job, node, attempt): setup runs once per attempt.
PREPARED: dict[tuple[str, int, int], Prepared] = {}

# The job's interpreter as the job runs it (site on): its Python, torch found (not imported) with
# its version.py and which of the optional torchrun flags (argv) its torch/distributed/run.py has.
JOB_PYTHON = r"""
import importlib.util, json, os, sys
out = {"executable": sys.executable, "python": "%d.%d.%d" % sys.version_info[:3], "version_py": None, "flags": []}
try:
    spec = importlib.util.find_spec("torch")
except (ImportError, ValueError):
    spec = None
if spec is not None and spec.origin:
    folder = os.path.dirname(spec.origin)
    try:
        with open(os.path.join(folder, "version.py")) as f:
            out["version_py"] = f.read()
        with open(os.path.join(folder, "distributed", "run.py")) as f:
            run_py = f.read()
        out["flags"] = [flag for flag in sys.argv[1:] if flag in run_py]
    except OSError:
        out["version_py"] = out["version_py"] or ""
sys.stdout.write(json.dumps(out))
"""


def setup_key(req: SetupRequest | StartRequest) -> tuple[str, int, int]:
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


def run_setup(commands: list[str], env: dict[str, str], cwd: str | None,
              timeout: float | None = None) -> tuple[dict[str, str], bytes]:
    """Run the ``setup`` commands in bash, in ``cwd``, with the job's environment on top of this
    agent's; the environment they leave (what they exported, changed or unset) and their output.
    ``AgentFailure`` with the last lines of their output if one fails: nothing was started then."""
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
    deadline = time.monotonic() + limit
    while True:
        try:
            out, err = proc.communicate(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
            break
        except subprocess.TimeoutExpired:
            gone = _controller_gone()
            if not gone and time.monotonic() < deadline:
                continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, err = proc.communicate()
        if gone:
            raise AgentFailure("the controller went away during setup: its commands were killed; nothing was started")
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
    return result, err


def find_program(name: str, env: dict[str, str]) -> str | None:
    """``name`` as exec finds it on ``env``'s PATH (a path with a slash: itself, if executable)."""
    folders = [""] if "/" in name else (env.get("PATH") or "/usr/bin:/bin").split(os.pathsep)
    for folder in folders:
        path = os.path.join(folder or ".", name) if folder or "/" not in name else name
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def job_python(python: str, env: dict[str, str], cwd: str | None) -> dict[str, Any]:
    """The job's interpreter ``python`` as the job will run it: found on ``env``'s PATH, run with
    ``env`` in ``cwd`` (``JOB_PYTHON``): ``{executable, python, torch, torch_cuda, torchrun_flags}``,
    or ``{error}`` when it cannot be found or run."""
    from .probe import OPTIONAL_TORCHRUN_FLAGS, assigned, version_of
    from .system import capture

    found = find_program(python, env)
    if found is None:
        return {"error": f"{python} is not found on the PATH setup leaves ({env.get('PATH') or 'unset'})"}
    folder = os.path.expanduser(cwd) if cwd else None
    out = capture([found, "-c", JOB_PYTHON, *OPTIONAL_TORCHRUN_FLAGS], timeout=30, env=env,
                  cwd=folder if folder and os.path.isdir(folder) else None)
    try:
        seen = json_loads(out) if out else None
    except ValueError:
        seen = None
    if not isinstance(seen, dict):
        return {"error": f"{found} could not run in the environment setup leaves"}
    text = seen.get("version_py")
    return {"executable": seen.get("executable") or found, "python": seen.get("python") or "",
            "torch": None if text is None else version_of(text), "torch_cuda": assigned(text or "", "cuda"),
            "torchrun_flags": list(seen.get("flags") or [])}


def _controller_gone() -> bool:
    """Whether the controller closed this agent's stdin (a pipe hung up: Ctrl-C of `up` during a
    setup), seen without reading it: the next request must stay there for the request loop."""
    poller = select.poll()
    try:
        poller.register(sys.stdin.fileno(), 0)  # POLLHUP and POLLERR are reported whatever the mask
    except (OSError, ValueError):  # no file behind stdin (an agent run in-process): nobody to lose
        return False
    return any(events & (select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))


def op_setup(req: SetupRequest) -> dict[str, Any]:
    """Run the node's ``setup`` commands now, before anything starts anywhere, and keep the
    environment they make and their output for this agent's ``start`` of the same attempt; with
    ``python``, say how the job's interpreter runs in that environment (``job_python``).
    ``if_cwd`` (a dry run whose sync would make the directory): nothing runs where ``cwd`` is
    missing (``skipped`` says why)."""
    folder = os.path.expanduser(req.cwd) if req.cwd else None
    if req.if_cwd and folder and not os.path.isdir(folder):
        return {"ok": True, "skipped": f"{folder} does not exist yet"}
    env, output = run_setup(req.setup or [], req.env or {}, req.cwd, req.setup_timeout)
    prepared = PREPARED[setup_key(req)] = Prepared(env, output)
    answer: dict[str, Any] = {"ok": True}
    if req.python:
        answer["python"] = job_python(req.python, env, req.cwd)
        prepared.python = None if answer["python"].get("error") else answer["python"]
    return answer
