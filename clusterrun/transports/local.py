"""The local transport: the agent runs as a process on this machine, no SSH involved."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import IO, cast

from clusterrun.errors import AgentError
from clusterrun.transports.base import AgentSession, Transport, agent_command, agent_preamble


class LocalTransport(Transport):
    """Runs ``python -S -c BOOTSTRAP`` locally; requests go to its stdin, as over SSH."""

    _stderr_tail = b""

    @property
    def python(self) -> str:
        return self.host.python or sys.executable

    def connect(self) -> None:
        pass

    def session(self) -> AgentSession:
        try:
            proc = subprocess.Popen(agent_command(self.python), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, close_fds=True,
                                    start_new_session=True)  # not in the terminal's group: Ctrl-C is for us
        except OSError as exc:
            raise AgentError(self.name, f"cannot run {self.python!r}: {exc.strerror or exc}",
                             hint="set `python:` for this host to an interpreter that exists") from None
        stdin, stdout, stderr = cast(IO[bytes], proc.stdin), cast(IO[bytes], proc.stdout), cast(IO[bytes], proc.stderr)

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

        send(agent_preamble())

        def close() -> None:
            try:
                stdin.close()
            except BrokenPipeError:
                pass
            if proc.poll() is None:  # waiting for a request, or still streaming: nothing to finish
                proc.kill()
            proc.wait()
            reader.join(timeout=5)
            stdout.close()

        def last_words() -> str:
            reader.join(timeout=1)
            text = self._stderr_tail.decode(errors="replace").strip()
            return f": {text.splitlines()[-1]}" if text else ""

        return AgentSession(self.name, send, iter(stdout.readline, b""), close, last_words=last_words)
