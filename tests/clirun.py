"""``python -m clusterrun ARGS`` as a process of its own, without an interpreter start and the CLI's
imports for each command (0.3-0.5 s of CPU each; the fast tier runs about a hundred).

One server process per test process imports the command line once; for each command it forks a
child that takes the command's stdin, stdout and stderr (passed over a Unix socket), its working
directory and its whole environment, runs ``clusterrun`` as ``python -m`` does (``runpy``: the same
``__main__``, program name and exit status, an uncaught exception printed as a traceback) and ends
as an interpreter does (its threads joined, ``atexit`` run). A command whose environment changes how
an interpreter starts (``PYTHON*``, the locale) runs as a new interpreter instead, as do the tests of
what a command imports or of Ctrl-C, which call ``subprocess`` themselves.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The server: import the command line, then fork a child per request. The child's stdio are the
# descriptors that came with the request; its SystemExit leaves the server's loop and ends the
# interpreter the normal way.
SERVER = r"""
import atexit, io, json, os, runpy, socket, sys, threading, traceback
sys.path.insert(0, sys.argv[2])  # the checkout, as PYTHONPATH=ROOT gives a new interpreter
import clusterrun.cli
for name, _ in clusterrun.cli.COMMANDS.values():
    __import__("clusterrun.cli." + name)
link = socket.socket(fileno=int(sys.argv[1]))
while True:
    try:
        _, fds, _, _ = socket.recv_fds(link, 1, 4)
    except OSError:
        break
    if not fds:
        break
    with os.fdopen(fds.pop(), "rb") as f:
        request = json.loads(f.read())
    child = os.fork()
    if child == 0:
        link.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for fd, name in enumerate(("stdin", "stdout", "stderr")):  # made anew, as the interpreter makes them
            old = getattr(sys, name)
            unbuffered = fd and old.write_through
            binary = open(fd, "rb" if fd == 0 else "wb", buffering=0 if unbuffered else -1, closefd=False)
            new = io.TextIOWrapper(binary, encoding=old.encoding, errors=old.errors, write_through=old.write_through,
                                   line_buffering=old.line_buffering or os.isatty(fd))
            setattr(sys, name, new)
            setattr(sys, "__%s__" % name, new)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["clusterrun", *request["args"]]
        if request["coverage"]:  # the test run measures coverage (--cov): this command's lines count too
            import atexit, coverage
            measured = coverage.Coverage(data_suffix=True, **request["coverage"])
            measured.set_option("run:disable_warnings", ["module-not-measured", "no-data-collected"])
            measured.start()
            atexit.register(lambda: (measured.stop(), measured.save()))
        code = 0
        try:
            runpy.run_module("clusterrun", run_name="__main__", alter_sys=True)
        except SystemExit as exc:  # its status as the interpreter takes it
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        # The interpreter's end that a command can see: its threads joined, atexit run, its streams
        # flushed. Not the teardown of the modules and objects inherited from the server: that cost
        # 0.1 s of CPU a command (their pages copied as they are freed) and shows nothing.
        while [t.join() for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]:
            pass
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed, or its reader gone: the interpreter ignores it too
                pass
        os._exit(code)
    for fd in fds:
        os.close(fd)
    link.sendall(b"%d\n" % child)
    _, status = os.waitpid(child, 0)
    link.sendall(b"%d\n" % status)
"""

# What changes how an interpreter starts: a command given other values runs as a new interpreter.
STARTUP = ("PYTHON", "LC_", "LANG")

# This process's environment as it started (clirun is imported while the tests are collected): the
# server's, whatever a test that happens to run the first command set for itself.
_START_ENV = dict(os.environ)
# ... and its working directory: a test may leave another (the monitor's code moves to a job's
# directory), and coverage's data file is named relative to this one.
_START_CWD = os.getcwd()
_lock = threading.Lock()
_server: tuple[subprocess.Popen[bytes], socket.socket, dict[str, str]] | None = None


def _started() -> tuple[subprocess.Popen[bytes], socket.socket, dict[str, str]]:
    global _server
    if _server is None or _server[0].poll() is not None:
        if _server is not None:
            _server[1].close()
            _server[0].wait()
        mine, theirs = socket.socketpair()
        env = dict(_START_ENV)
        server = subprocess.Popen([sys.executable, "-c", SERVER, str(theirs.fileno()), str(ROOT)],
                                  pass_fds=[theirs.fileno()], start_new_session=True,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=ROOT, env=env)
        theirs.close()
        _server = (server, mine, env)
    return _server


def _same_start(env: dict[str, str], server: dict[str, str]) -> bool:
    """Whether a new interpreter given ``env`` would start as the server did (the checkout first on sys.path)."""
    def startup(env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k.startswith(STARTUP) and k != "PYTHONPATH"}

    return startup(env) == startup(server) and env.get("PYTHONPATH") in (None, "", str(ROOT), server.get("PYTHONPATH"))


def clusterrun(*args: str | os.PathLike[str], cwd: str | os.PathLike[str] = ROOT, env: dict[str, str] | None = None,
               input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """What ``subprocess.run([sys.executable, "-m", "clusterrun", *args], capture_output=True, text=True)``
    gives (stdin from ``input``, else empty), from a child of the server."""
    argv = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    with _lock:
        server, link, server_env = _started()
        if not _same_start(env, server_env):
            return subprocess.run([sys.executable, "-m", "clusterrun", *argv], capture_output=True, text=True,
                                  input=input or "", timeout=timeout, cwd=cwd, env=env)
        with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as request:
            stdin.write((input or "").encode())
            stdin.seek(0)
            request.write(json.dumps({"args": argv, "cwd": str(cwd), "env": env, "coverage": measured()}).encode())
            request.seek(0)
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            try:
                socket.send_fds(link, [b"r"], [stdin.fileno(), out_w, err_w, request.fileno()])
            finally:
                os.close(out_w)
                os.close(err_w)
            with link.makefile("rb") as replies:
                child = int(replies.readline())
                try:
                    out, err = _read_to_the_end(out_r, err_r, time.monotonic() + timeout)
                except TimeoutError:
                    os.kill(child, signal.SIGKILL)
                    replies.readline()
                    raise subprocess.TimeoutExpired(["clusterrun", *argv], timeout) from None
                status = int(replies.readline())
        return subprocess.CompletedProcess(["clusterrun", *argv], os.waitstatus_to_exitcode(status),
                                           _text(out), _text(err))


def measured() -> dict[str, str] | None:
    """Where this test run's coverage (pytest-cov's) keeps its data and config, if it measures."""
    try:
        import coverage
    except ImportError:
        return None
    current = coverage.Coverage.current()
    if current is None:
        return None
    return {"data_file": os.path.join(_START_CWD, current.config.data_file), "config_file": current.config.config_file}


def _read_to_the_end(out: int, err: int, deadline: float) -> tuple[bytes, bytes]:
    """Both pipes read until every process that holds them closed them (a command's daemon too), as
    ``subprocess.run`` reads them; TimeoutError at ``deadline``."""
    data = {out: b"", err: b""}
    try:
        with selectors.DefaultSelector() as selector:
            for fd in data:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                ready = selector.select(deadline - time.monotonic())
                if not ready:
                    raise TimeoutError
                for key, _ in ready:
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        data[key.fd] += chunk
                    else:
                        selector.unregister(key.fd)
    finally:
        os.close(out)
        os.close(err)
    return data[out], data[err]


def _text(data: bytes) -> str:
    """A stream as ``subprocess.run(..., text=True)`` reads it: the locale's encoding, universal newlines."""
    return io.TextIOWrapper(io.BytesIO(data)).read()


@atexit.register
def _stop() -> None:
    """The server ends at the end of its socket; its exit is waited for."""
    if _server is not None:
        _server[1].close()
        _server[0].wait(30)
