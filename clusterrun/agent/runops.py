"""``run``: one command in a node's environment (``clusterrun exec --job-env``), its output streamed.

The command runs as the job's torchrun would: in ``cwd``, with ``env`` on top of the agent's
environment, after the ``setup`` commands (whose environment it then gets, as ``start`` does;
their output is not shown). Its stdout and stderr are one stream, sent as it comes; stdin is at
its end. The command is found on that environment's PATH first: a missing one is ``NAME: command
not found`` and status 127, as a shell says it. If the controller goes away (this agent's stdin
ends) the command's process group is killed.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

from .codec import emit
from .records import AgentFailure
from .setup import find_program, run_setup
from .wire import HEARTBEAT

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .wire import RunRequest

PR_SET_PDEATHSIG = 1


def _die_with_agent() -> None:
    """In the command's child before exec: SIGKILL when this agent dies (a local controller's close
    kills the agent at once, before it could end the command itself). Best effort, Linux only."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (ImportError, OSError, AttributeError):
        pass


def _kill(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:  # it ended already
        pass


def op_run(req: RunRequest) -> dict[str, Any] | None:
    """Run ``req.argv`` and stream ``{t: "out", data}`` lines, ``{t: "beat"}`` every ``HEARTBEAT``
    seconds of silence and ``{t: "end", status}`` (128 + N for a signal N); ``{ok: false, error}``
    when it could not run (setup failed, no such directory)."""
    import subprocess

    argv = list(req.argv or [])
    if not argv:
        raise AgentFailure("no command given")
    env = {**os.environ, **(req.env or {})}
    if req.setup:
        env, _ = run_setup(req.setup, req.env or {}, req.cwd, req.setup_timeout)
    folder = os.path.expanduser(req.cwd) if req.cwd else None
    if folder and not os.path.isdir(folder):
        raise AgentFailure(f"workdir {folder} does not exist on this host")
    program = find_program(argv[0], env)
    if program is None:
        emit({"t": "out", "data": f"{argv[0]}: command not found\n"})
        emit({"t": "end", "status": 127})
        return None
    try:
        proc = subprocess.Popen([program, *argv[1:]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, cwd=folder, start_new_session=True,
                                preexec_fn=_die_with_agent)  # safe: the agent has one thread
    except OSError as exc:
        raise AgentFailure(f"{argv[0]}: {exc.strerror or exc}") from None
    _stream(proc)
    return None


def _stream(proc: Any) -> None:
    """Send ``proc``'s output until it ends, then its status; kill its group if stdin ends first."""
    out, stdin = proc.stdout.fileno(), sys.stdin.fileno()
    watched = [out, stdin]
    last = time.monotonic()
    try:
        while out in watched:
            ready, _, _ = select.select(watched, [], [], max(0.0, HEARTBEAT - (time.monotonic() - last)))
            if stdin in ready and not os.read(stdin, 4096):  # the controller is gone
                _kill(proc.pid)
                watched.remove(stdin)
            if out in ready:
                data = os.read(out, 65536)
                if not data:
                    watched.remove(out)
                    continue
                emit({"t": "out", "data": data.decode("utf-8", "surrogateescape")})
                last = time.monotonic()
            elif time.monotonic() - last >= HEARTBEAT:
                emit({"t": "beat"})
                last = time.monotonic()
    except BrokenPipeError:  # the controller is gone: so is the command
        _kill(proc.pid)
        raise
    finally:
        proc.stdout.close()
    status = proc.wait()
    emit({"t": "end", "status": 128 - status if status < 0 else status})
