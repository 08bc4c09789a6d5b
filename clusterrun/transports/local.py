"""The local transport: the agent runs as a process on this machine, no SSH involved."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, cast

from clusterrun.config.hostsfile import HostSpec
from clusterrun.core.errors import AgentError
from clusterrun.transports.base import AgentReader, AgentSession, Transport, agent_bundle, agent_command

READ_SIZE = 1 << 18  # at most what one read of the agent's stdout takes: a pipe holds 64 KiB
CLOSE_WAIT = 0.5  # seconds an agent gets to end after its stdin closed (it checks a running setup 5 times a second)


class LocalTransport(Transport):
    """Runs ``python -S -c BOOTSTRAP`` locally; requests go to its stdin, as over SSH."""

    _stderr_tail = b""
    files = "local"

    def __init__(self, host: HostSpec) -> None:
        super().__init__(host)
        self._live: set[subprocess.Popen[bytes]] = set()  # agents running, for close()
        self._groups: set[int] = set()  # process groups of pipe() commands running, for close()
        # close() is final: a probe's thread still starting an agent when Ctrl-C closed the job
        # must not start one that nobody ends (``up`` would wait for that thread at exit)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def python(self) -> str:
        return self.host.python or sys.executable

    def connect(self) -> None:
        pass

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise AgentError(self.name, "the connection was closed (the command was interrupted or ended)")

    def session(self) -> AgentSession:
        with self._lock:  # close() waits for a start under way, then ends it
            self._refuse_if_closed()
            try:
                proc = subprocess.Popen(agent_command(self.python), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, close_fds=True,
                                        start_new_session=True)  # not in the terminal's group: Ctrl-C is for us
            except OSError as exc:
                raise AgentError(self.name, f"cannot run {self.python!r}: {exc.strerror or exc}",
                                 hint="set `python:` for this host to an interpreter that exists") from None
            self._live.add(proc)
        stdin, stderr = cast(IO[bytes], proc.stdin), cast(IO[bytes], proc.stderr)
        stdout = cast(io.BufferedReader, proc.stdout)

        def drain() -> None:
            with stderr:
                self._stderr_tail = stderr.read()[-2000:]

        reader = threading.Thread(target=drain, daemon=True, name=f"agent-stderr-{self.name}")
        reader.start()

        def send(data: bytes) -> None:
            try:
                stdin.write(data)
                stdin.flush()
            except (BrokenPipeError, ValueError):
                pass  # the agent is gone: reading its answer says so, with its last words

        def close() -> None:
            try:
                stdin.close()
            except BrokenPipeError:
                pass
            try:  # an agent that waits for a request ends at once; one in a setup kills the setup first
                proc.wait(timeout=CLOSE_WAIT)
            except subprocess.TimeoutExpired:  # still streaming: nothing to finish
                proc.kill()
                proc.wait()
            self._live.discard(proc)
            reader.join(timeout=5)
            stdout.close()

        def last_words() -> str:
            reader.join(timeout=1)
            text = self._stderr_tail.decode(errors="replace").strip()
            return f": {text.splitlines()[-1]}" if text else ""

        return AgentSession(self.name, send, AgentReader(lambda: stdout.read1(READ_SIZE)), close, last_words=last_words,
                            bundle=agent_bundle(), asides=True)

    def pipe(self, command: str, peer: socket.socket) -> tuple[int, str]:
        """``command`` run by ``sh`` here, as a login shell would run it on a host."""
        with self._lock:
            self._refuse_if_closed()
            try:
                proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=peer.fileno(), stdout=peer.fileno(),
                                        stderr=subprocess.PIPE, close_fds=True, start_new_session=True)
            except OSError as exc:
                raise AgentError(self.name, f"cannot run /bin/sh: {exc.strerror or exc}") from None
            self._groups.add(proc.pid)  # close() ends the command and its children
        try:
            _, stderr = proc.communicate()
        finally:
            self._groups.discard(proc.pid)
        with contextlib.suppress(OSError):
            peer.shutdown(socket.SHUT_WR)  # the end of the output, also for a child left in the background
        return proc.returncode, stderr[-4000:].decode(errors="replace")

    def close(self) -> None:
        """End the agents still running: one that never reads its stdin (an interpreter that
        hangs) would otherwise keep the thread sending it the agent blocked for ever. No agent
        starts after it."""
        with self._lock:
            self._closed = True
            for proc in list(self._live):
                if proc.poll() is None:
                    proc.kill()
            for group in list(self._groups):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
