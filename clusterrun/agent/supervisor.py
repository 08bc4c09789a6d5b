"""How an attempt's survivor is started (see the package docstring): forked from the agent, or
through systemd-run with ``SUPERVISE`` in a scope of the user's manager."""

from __future__ import annotations

import os
import sys

from .codec import json_dumps, json_loads
from .monitor import BUSY, IDLE_SCAN_INTERVAL, MERGE_INTERVAL, SCAN_INTERVAL  # noqa: F401 - where tests look
from .survivor import Survivor
from .system import close_fds_from, exit_with

# What systemd-run runs in the user's scope (argv: the attempt's folder, then where this package is
# imported from and its name, ``_importable()``): the job's environment arrives on stdin as JSON
# (it holds secrets: never on disk).
SUPERVISE = (
    "import os,sys;e=sys.stdin.buffer.read();n=os.open(os.devnull,os.O_RDONLY);os.dup2(n,0);os.close(n);"
    'sys.path.insert(0,sys.argv[2]);__import__(sys.argv[3]+".supervisor",fromlist=["_"]).supervise_in_scope(sys.argv[1],e)'
)


def spawn_supervisor(folder: str, scope: list[str] | None = None,
                     env: dict[str, str] | None = None) -> tuple[int, int]:
    """Fork the detached supervisor of ``folder`` (see the module docstring) and return at once
    with the read end of a pipe on which it writes its first state as one JSON line, and the pid
    of a child to reap once that is read (0 if none). With ``scope`` (``user_scope``), the
    supervisor is a new interpreter that systemd-run starts in a scope of the user's manager.
    ``env``: torchrun's whole environment (secrets included), handed over in memory or on the pipe."""
    sys.stdout.flush()
    sys.stderr.flush()
    ready_r, ready_w = os.pipe()
    source_r, source_w = os.pipe() if scope else (-1, -1)
    child = os.fork()
    if child:
        os.close(ready_w)
        if not scope:
            os.waitpid(child, 0)  # the middle process exits at once: the supervisor is nobody's child
            return ready_r, 0
        os.close(source_r)
        try:
            view = memoryview(json_dumps(env).encode())
            while view:
                view = view[os.write(source_w, view):]
        except OSError:
            pass  # systemd-run failed: its message is in supervisor.log, and the ready pipe says so
        finally:
            os.close(source_w)
        return ready_r, child

    def supervise() -> int:
        os.setsid()
        if not scope and os.fork():
            os._exit(0)
        os.chdir(folder)
        log_fd = os.open(os.path.join(folder, "supervisor.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(source_r if scope else os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.dup2(ready_w, 3)
        os.set_inheritable(3, bool(scope))
        close_fds_from(4)  # the SSH channel's pipes among them: the connection may close
        if scope:
            os.execvp(scope[0], [*scope, sys.executable, "-S", "-c", SUPERVISE, folder, *_importable()])
        return Survivor(folder, ready_fd=3, env=env).run()

    exit_with(supervise)


def supervise_in_scope(folder: str, env: bytes) -> None:
    """The supervisor started by systemd-run (``SUPERVISE``), with torchrun's environment as JSON:
    forked once more, so that it is nobody's child, and in the scope all the same."""
    if os.fork():
        os._exit(0)
    os.set_inheritable(3, False)
    exit_with(lambda: Survivor(folder, ready_fd=3, env=json_loads(env or b"null")).run())


def _importable() -> tuple[str, str]:
    """Where this package is imported from (a ``sys.path`` entry: on a host, its cached zip) and
    its name there (``clusterrun_agent`` from the zip, ``clusterrun.agent`` in tests)."""
    package = __package__ or "clusterrun_agent"
    root = os.path.dirname(os.path.abspath(__file__))
    for _ in package.split("."):
        root = os.path.dirname(root)
    return root, package
