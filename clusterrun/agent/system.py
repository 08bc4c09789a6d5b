"""What the host offers, asked without subprocess: programs on PATH, a command's output, the
user and their linger, what this Python lacks, closing inherited descriptors."""

from __future__ import annotations

import os
import select
import sys
import time

from .procs import signal

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import NoReturn


def user_name() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def lingers() -> bool:
    """Whether systemd keeps this user's manager after their last logout (``loginctl enable-linger``):
    asked of logind, else its linger file."""
    name = user_name()
    out = capture(["loginctl", "show-user", name, "-p", "Linger"])
    if out and "Linger=" in out:
        return "Linger=yes" in out
    return os.path.exists(f"/var/lib/systemd/linger/{name}")


def which(name: str) -> str | None:
    for folder in (os.environ.get("PATH") or "/usr/bin:/bin").split(os.pathsep):
        path = os.path.join(folder or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def close_fds_from(lowest: int) -> None:
    """Close every descriptor from ``lowest`` up: those /proc lists (a range up to the limit can
    be millions of calls on Pythons without close_range), else up to the limit."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        os.closerange(lowest, limit if 0 < limit < 1 << 16 else 1 << 16)
        return
    for fd in fds:
        if fd >= lowest:
            try:
                os.close(fd)
            except OSError:
                pass  # the descriptor of the listing itself, closed already


def static_fallbacks() -> list[str]:
    """What this host's Python lacks that the supervisor would use (the rest it finds itself)."""
    if hasattr(os, "pidfd_open"):
        return []
    return ["no pidfd (Python {}.{}): processes are signalled by pid after a check of their start time"
            .format(*sys.version_info[:2])]


def read_until(fd: int, deadline: float, line: bool = False) -> bytes:
    """What ``fd`` gives until its end or ``deadline`` (monotonic), or with ``line`` a newline."""
    data = b""
    while not (line and data.endswith(b"\n")) and select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        data += chunk
    return data


def capture(argv: list[str], timeout: float = 5.0, env: dict[str, str] | None = None,
            cwd: str | None = None) -> str | None:
    """The stdout of ``argv`` (found on PATH), or None if it cannot run or fails (no subprocess);
    with ``env``, run with that environment (and found on its PATH), in ``cwd`` if given."""
    return collect(launch(argv, timeout, env, cwd))


class Launched:
    """A command started by ``launch``: its pid, the read end of its stdout, its deadline."""

    __slots__ = ("deadline", "out", "pid")

    def __init__(self, pid: int, out: int, deadline: float) -> None:
        self.pid, self.out, self.deadline = pid, out, deadline


def launch(argv: list[str], timeout: float = 5.0, env: dict[str, str] | None = None,
           cwd: str | None = None) -> Launched | None:
    """``capture``'s first half: ``argv`` started, not waited for (None if it cannot be), so that
    slow commands (nvidia-smi, an import of torch) run side by side; ``collect`` ends it."""
    try:
        out_r, out_w = os.pipe()
        pid = os.fork()
    except OSError:
        return None
    if pid == 0:
        try:
            os.close(out_r)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(out_w, 1)
            os.dup2(null, 2)
            if cwd:
                os.chdir(cwd)
            if env is not None:
                os.execvpe(argv[0], argv, env)
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    os.close(out_w)
    return Launched(pid, out_r, time.monotonic() + timeout)


def collect(launched: Launched | None) -> str | None:
    """``capture``'s second half: the launched command's stdout once it ended with status 0, else
    None (killed at its deadline)."""
    if launched is None:
        return None
    pid, deadline = launched.pid, launched.deadline
    try:
        data = read_until(launched.out, deadline)
    finally:
        os.close(launched.out)
    done, status = os.waitpid(pid, os.WNOHANG)
    while done == 0 and time.monotonic() < deadline:  # its output ended: its exit follows at once
        time.sleep(0.002)
        done, status = os.waitpid(pid, os.WNOHANG)
    if done == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None
    return data.decode("utf-8", "replace") if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else None


def exit_with(run: Callable[[], int]) -> NoReturn:
    """End this (forked) process with what ``run`` returns, 1 if it raised: its traceback, the
    supervisor's last word, goes to its log (stderr)."""
    code = 1
    try:
        code = run()
    except BaseException:  # noqa: BLE001 - the supervisor's last word, in its log
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
